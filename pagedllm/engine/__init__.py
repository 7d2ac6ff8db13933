"""The orchestrator: tokenizer, scheduler and executor, stepped together."""
