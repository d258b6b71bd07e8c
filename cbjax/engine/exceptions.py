"""The errors the engine's front ends raise to their callers (the OpenAI server maps them to HTTP)."""


class EngineDeadError(RuntimeError):
    """The engine-core loop has stopped (crashed or shut down); no request can be served."""
