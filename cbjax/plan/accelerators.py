"""Published memory and memory bandwidth of the accelerators `cbjax plan` knows.

Capacities are read as GiB: HBM comes in binary sizes, and what the driver reports is within
about 1% of it (an H100 80GB shows 81559 MiB in nvidia-smi); gpu_memory_utilization covers the
rest. Bandwidths are the datasheets' decimal bytes per second.
"""

from __future__ import annotations

import dataclasses

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    description: str


ACCELERATORS = {
    a.name: a
    for a in (
        # NVIDIA H100 Tensor Core GPU datasheet: H100 SXM 80 GB HBM3, 3.35 TB/s; H100 PCIe 80 GB HBM2e, 2 TB/s.
        Accelerator("h100", 80 * GiB, 3.35e12, "NVIDIA H100 SXM 80GB"),
        Accelerator("h100-pcie", 80 * GiB, 2.0e12, "NVIDIA H100 PCIe 80GB"),
        # NVIDIA H200 Tensor Core GPU datasheet: H200 SXM 141 GB HBM3e, 4.8 TB/s.
        Accelerator("h200", 141 * GiB, 4.8e12, "NVIDIA H200 SXM 141GB"),
        # NVIDIA A100 Tensor Core GPU datasheet: 80GB SXM HBM2e 2,039 GB/s; 40GB SXM HBM2 1,555 GB/s.
        Accelerator("a100-80g", 80 * GiB, 2.039e12, "NVIDIA A100 SXM 80GB"),
        Accelerator("a100-40g", 40 * GiB, 1.555e12, "NVIDIA A100 SXM 40GB"),
        # NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s.
        Accelerator("l40s", 48 * GiB, 0.864e12, "NVIDIA L40S 48GB"),
        # NVIDIA DGX B200 datasheet: 1,440 GB HBM3e and 64 TB/s over 8 GPUs, i.e. 180 GB and 8 TB/s each.
        Accelerator("b200", 180 * GiB, 8.0e12, "NVIDIA B200 180GB"),
        # AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s.
        Accelerator("mi300x", 192 * GiB, 5.3e12, "AMD Instinct MI300X"),
        # Google Cloud TPU docs, system architecture: v5e 16 GiB HBM 819 GB/s; v5p 95 GiB 2,765 GB/s;
        # v6e (Trillium) 32 GiB 1,640 GB/s.
        Accelerator("tpu-v5e", 16 * GiB, 0.819e12, "Google TPU v5e"),
        Accelerator("tpu-v5p", 95 * GiB, 2.765e12, "Google TPU v5p"),
        Accelerator("tpu-v6e", 32 * GiB, 1.64e12, "Google TPU v6e (Trillium)"),
    )
}


def accelerator(name: str) -> Accelerator:
    if name not in ACCELERATORS:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(ACCELERATORS)}")
    return ACCELERATORS[name]
