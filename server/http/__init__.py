"""The daemon's HTTP layer: the FastAPI app and its routes, middleware, the served OpenAPI
schema, the settings, and `nanoflex serve`."""
