"""Developer tooling, apart from the product: the fake provider, the chaos run (`make demo`),
the bench (`make bench`) and the local stack (`make run`).

Installed only when DEBUG is on or DEVTOOLS=1 (project/settings.py). Nothing in
`payments/` or `inbox/` imports it (an import-linter contract keeps it so).
"""
