"""User-facing entry points: the CLI, the OpenAI-compatible server and the demo."""
