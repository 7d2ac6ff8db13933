"""The cpu backend."""
