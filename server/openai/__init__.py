"""The OpenAI protocol: request/response schemas, errors, and the chat/completions handlers."""
