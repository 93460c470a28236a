"""Ferry's HTTP front end: the OpenAI-compatible API, the engine process it drives, and the `ferry` CLI."""
