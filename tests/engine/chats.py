"""Chat prompts for tests on the trained default model: a question, a creative request, a
system message, a multi-turn conversation."""

from __future__ import annotations

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three primary colours."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Explain in one sentence what a CPU does."},
    ],
]
