"""KV-cache blocks on the host: the pool's reference counts, the prefix cache and the pool's sizing."""
