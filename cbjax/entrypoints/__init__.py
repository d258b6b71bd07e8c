"""Front ends that talk to engines: the OpenAI-compatible server."""
