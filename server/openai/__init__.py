"""The OpenAI API without HTTP: request and response models, the serving layer that turns a
completion or chat request into engine requests and their deltas into an answer, streaming
chunks, the error envelope, the daemon's metrics."""
