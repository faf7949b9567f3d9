"""`make bench`: what the fence costs, measured side by side in one run."""
