"""The OpenAI API without HTTP: request and response models, the endpoints that turn a request
into engine requests and their deltas into an answer (endpoints/, picked per path by
serving.py), chat formatting (chat_format.py), the model's tool-call and reasoning formats
(parsers/), streaming chunks, the error envelope, the daemon's metrics."""
