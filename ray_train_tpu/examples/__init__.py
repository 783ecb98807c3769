"""Small, offline data for the examples and notebooks (nothing is downloaded)."""
