"""OpenAI-compatible HTTP server (FastAPI): app factory, protocol models, error mapping, SIGTERM drain."""
