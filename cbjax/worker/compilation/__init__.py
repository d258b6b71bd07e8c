"""The steps' compilation: buckets, the persistent caches, precompilation and lowering."""
