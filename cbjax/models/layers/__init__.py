"""Layers shared by the model families: attention dispatch, rotary embeddings."""
