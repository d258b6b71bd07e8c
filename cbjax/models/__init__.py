"""The model families in flax.nnx, behind one registry; importing this package imports no JAX."""
