"""Lowering the kernels for a GPU on a machine that has none (`cbjax lower`, the lowering tests)."""

from __future__ import annotations

import contextlib

import jax

# Triton's lowering rules depend on the GPU generation; any Hopper part gives the same rules.
DEFAULT_CUDA_TARGET = "NVIDIA H100"


def lowering_target(platform: str, device_kind: str = DEFAULT_CUDA_TARGET) -> contextlib.AbstractContextManager:
    """A context in which `.lower(lowering_platforms=(platform,))` can lower Pallas-Triton kernels.

    From jax 0.11 on, the Triton lowering asks the GPU's kind from the device it runs on, and
    without a GPU it fails ("No supported GPU devices found, please specify an abstract GPU
    device"); an abstract mesh naming the target device answers it. Other platforms, and jax
    versions without abstract devices, need nothing.
    """
    target = _gpu_target(platform, jax.devices(), device_kind)
    if target is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=target))


def lowering_mesh(platform: str, mesh: jax.sharding.Mesh, device_kind: str = DEFAULT_CUDA_TARGET) -> jax.sharding.AbstractMesh | None:
    """The mesh a sharded step is lowered on for `platform`, when its own mesh (this host's CPU
    devices) cannot answer the kernels' question: an abstract mesh of the same axes on the target
    GPU. Inside shard_map the kernels ask the mesh, not the context, so lowering_target alone does
    not reach them (jax 0.11: "No supported GPU devices found"). None where nothing is needed."""
    target = _gpu_target(platform, mesh.devices.flat, device_kind)
    if target is None:
        return None
    return jax.sharding.AbstractMesh(tuple(mesh.axis_sizes), tuple(mesh.axis_names), axis_types=tuple(mesh.axis_types),
                                     abstract_device=target)


def _gpu_target(platform: str, devices, device_kind: str):
    """The abstract GPU to lower for: None for other platforms, where `devices` has a GPU to ask, or on
    jax versions without abstract devices."""
    abstract_device = getattr(jax.sharding, "AbstractDevice", None)
    if platform != "cuda" or abstract_device is None or any(d.platform == "gpu" for d in devices):
        return None
    return abstract_device(device_kind=device_kind, num_cores=None, platform="gpu")
