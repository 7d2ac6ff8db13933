"""The gpu backend."""
