"""`cbjax serve`: an OpenAI-compatible HTTP server over AsyncLLM."""
