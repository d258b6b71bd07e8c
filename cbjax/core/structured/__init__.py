"""Structured outputs on the host (no JAX): constraints compiled to llguidance grammars and matchers."""
