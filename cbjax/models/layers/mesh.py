"""The device mesh's axis names, shared by the model's layers, the sharding of weights and the sampler.

Tensor parallelism uses one axis: heads, MLP columns, the KV pool and (where it divides) the
vocabulary are split over MODEL_AXIS; a multi-host mesh is the same axis over every process's devices.
"""

MODEL_AXIS = "model"
