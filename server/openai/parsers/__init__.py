"""A model's own formats read out of its answer: tool calls (`tool_calls.TOOL_PARSERS`, one
reader per format) and reasoning (`reasoning.REASONING_PARSERS`), each a registry by the
name vLLM's `--tool-call-parser` / `--reasoning-parser` give it."""
