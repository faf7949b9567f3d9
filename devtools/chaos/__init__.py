"""The chaos run (`make demo`, `manage.py demo`): `run` drives it, `webhooks` its signed events,
`reckless` its operator, `ha` the run past one host (`--topology ha`), `report` renders it."""
