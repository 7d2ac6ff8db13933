"""Pluggable device backends; see ``base.py`` for the contract and ``registry.py`` for lookup."""
