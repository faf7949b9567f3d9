"""The JSON API's plumbing (`base`) and its generic views; business views build on it."""
