"""Several devices and processes: the mesh, weight and pool sharding, multi-host SPMD."""
