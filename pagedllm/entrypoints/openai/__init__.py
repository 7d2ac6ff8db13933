"""The OpenAI-compatible HTTP API (``pagedllm serve``)."""
