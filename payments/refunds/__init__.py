"""Refunds: the second operation, built on the engine exactly as a new handler would be."""
