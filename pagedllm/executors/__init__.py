"""Executor -> Worker -> ModelRunner: one scheduler step becomes one batched forward pass."""
