"""The OpenAI endpoints over one engine: the shared base (`ServingBase`: the engine handle,
the limits, the request checks), one class per endpoint family (chat, completions,
responses, pooling, tokenization) and the record a prepared request is (`Prepared`).
server/openai/serving.py builds them and picks one per path."""
