"""The processes the tools start on 127.0.0.1: `stack` the project's own (fake provider, API
server, workers, recovery: `make run`, the chaos run, the bench), `servers` those past one
host (PostgreSQL cluster, PgBouncer, Redis with Sentinel: `--topology ha`, tests/topology)."""
