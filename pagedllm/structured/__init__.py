"""Structured output: constraints compiled to grammar matchers, applied as token bitmasks."""
