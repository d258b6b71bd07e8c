"""The front end, no JAX: LLMEngine, AsyncLLM, the engine-core clients and output processing."""
