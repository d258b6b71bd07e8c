"""The engine core's host policy, no JAX: the schedule -> execute -> update loop, request state, scheduling and KV blocks."""
