"""Speculative decoding: proposers (n-gram prompt lookup, draft model) and verification.

``config`` is standard-library only (the engine config and ``core/`` read it); the modules that
run models (``draft``, ``verify``, ``worker``) import torch and are loaded by the worker alone.
"""
