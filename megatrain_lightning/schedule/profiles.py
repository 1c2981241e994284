"""Device profiles for the schedule model: what each lane of a machine does per second.

Every rate has its public spec figure beside it; achieved rates are the spec times an efficiency stated
once below, except the matmul and attention rates, which are separate fields because how far a GEMM or
a flash-attention kernel gets from the datasheet peak depends on the card (clocks under power limits,
FP32-accumulate rate on GeForce parts) more than any one factor could say.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

HBM_EFFICIENCY = 0.8
"""Share of the HBM/GDDR spec a large memory-bound kernel reaches (elementwise ops, norms, casts)."""
LINK_EFFICIENCY = 0.85
"""Share of the PCIe / NVLink-C2C spec one direction of pinned DMA reaches (PCIe 5.0 x16: about 54 of 63 GB/s)."""
PEER_EFFICIENCY = 0.8
"""Share of the NVLink spec (each way) a ring all-gather or reduce-scatter of a block reaches (assumed: the
same order as the DMA's share of PCIe; not measured here)."""
HOST_EFFICIENCY = 0.75
"""Share of the host DRAM spec a streaming kernel reaches (STREAM triad on DDR5 servers: 70-80 %)."""
ADAM_BYTES_PER_PARAM = 28
"""The native AdamW kernel's traffic: master, m, v read and written (24), bf16 gradient in, bf16 copy out
(docs/benchmarks.md, "CPU optimizer step"). The recorder counts each step's bytes from its buffers."""


@dataclass(frozen=True)
class Profile:
    """One GPU in its usual host. Rates in TFLOP/s and GB/s (10^9 bytes/s), each direction of the link."""

    name: str
    bf16_peak_tflops: float
    """Dense bf16 tensor-core peak from the datasheet: the MFU denominator."""
    matmul_tflops: float
    """What large bf16 GEMMs achieve (cuBLAS, sustained under the card's power limit)."""
    attention_tflops: float
    """What the flash-attention kernels behind SDPA achieve, forward and backward, in causal FLOPs."""
    hbm_gbps: float
    link_gbps: float
    host_gbps: float
    """DRAM bandwidth of the host socket the worker thread runs on."""
    gpu_mem_gib: float
    host_adam_gparams: float | None = None
    """Adam steps per second (10^9 params) when given or measured; None: 28 B/param over host bandwidth."""
    nvlink_gbps: float | None = None
    """NVLink to the other GPUs of the node, GB/s each way (half the datasheet's bidirectional total); None:
    the card has none, its peers are reached over PCIe."""
    peer_gbps: float = 0.0
    """The link a data-parallel rank's collectives use (ranks.py sets it); 0: no peers."""
    host_efficiency: float = HOST_EFFICIENCY
    """Share of ``host_gbps`` the worker's streaming work (accumulation, norms) achieves: 1 where ``host_gbps``
    is a rate measured on a machine rather than its socket's spec (:meth:`with_host`)."""

    def matmul_flops(self) -> float:
        return self.matmul_tflops * 1e12

    def attention_flops(self) -> float:
        return self.attention_tflops * 1e12

    def hbm_bytes(self) -> float:
        return self.hbm_gbps * 1e9 * HBM_EFFICIENCY

    def link_bytes(self) -> float:
        return self.link_gbps * 1e9 * LINK_EFFICIENCY

    def peer_bytes(self) -> float:
        return self.peer_gbps * 1e9 * PEER_EFFICIENCY

    def host_bytes(self) -> float:
        return self.host_gbps * 1e9 * self.host_efficiency

    @property
    def host_given(self) -> bool:
        return self.host_efficiency == 1.0

    def adam_params(self) -> float:
        """Parameters the host steps per second."""
        if self.host_adam_gparams is not None:
            return self.host_adam_gparams * 1e9
        return self.host_bytes() / ADAM_BYTES_PER_PARAM

    def with_host_adam(self, gparams: float) -> Profile:
        return dataclasses.replace(self, host_adam_gparams=gparams)

    def with_host(self, gbps: float | None = None, adam_gparams: float | None = None) -> Profile:
        """This GPU in a host whose worker achieves `gbps` (GB/s, accumulation and norms) and steps Adam at
        `adam_gparams` (10^9 params/s), each as measured there; None keeps the profile's."""
        for name, value in (("host_gbps", gbps), ("host_adam_gparams", adam_gparams)):
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value!r}: give the rate measured on the machine, a positive number")
        out = self if gbps is None else dataclasses.replace(self, host_gbps=gbps, host_efficiency=1.0)
        return out if adam_gparams is None else out.with_host_adam(adam_gparams)


# PCIe 5.0 x16: 32 GT/s x 16 lanes x 128/130 / 8 = 63 GB/s each way; PCIe 4.0 x16: 31.5 GB/s.
# Hosts: one Xeon Sapphire Rapids socket, 8 channels DDR5-4800 = 307 GB/s; one EPYC 7742 socket,
# 8 channels DDR4-3200 = 205 GB/s; a desktop, 2 channels DDR5-5600 = 90 GB/s (DDR5-6000: 96 GB/s).
# Attention rates: FlashAttention-2 (what PyTorch SDPA runs) reaches about 350 TFLOP/s on H100 at head_dim
# 128 (FlashAttention-3 paper, its FA2 baseline), 50-70 % of peak on A100 (FlashAttention-2 paper); on
# GeForce cards about 60 % of the FP32-accumulate peak is assumed.
PROFILES: dict[str, Profile] = {
    # H100 SXM5 datasheet: 989 TFLOPS dense bf16, HBM3 3.35 TB/s, 80 GB; PCIe 5.0 host link; NVLink 900 GB/s
    # (bidirectional, 18 links of 4th generation, through NVSwitch in HGX boards) = 450 GB/s each way.
    "h100-sxm": Profile("h100-sxm", 989, 700, 350, 3350, 63, 307, 80, nvlink_gbps=450),
    # H100 PCIe datasheet: 756 TFLOPS dense bf16, HBM2e 2.0 TB/s, 80 GB (350 W: lower sustained clocks);
    # NVLink bridge 600 GB/s (bidirectional, pairs of cards) = 300 GB/s each way.
    "h100-pcie": Profile("h100-pcie", 756, 520, 270, 2000, 63, 307, 80, nvlink_gbps=300),
    # H200 SXM datasheet: 989 TFLOPS dense bf16, HBM3e 4.8 TB/s, 141 GB; PCIe 5.0 host link; NVLink 900 GB/s.
    "h200": Profile("h200", 989, 720, 360, 4800, 63, 307, 141, nvlink_gbps=450),
    # GH200 datasheet: 989 TFLOPS dense bf16 (H100-class GPU), HBM3 4 TB/s, 96 GB; NVLink-C2C 900 GB/s
    # total = 450 GB/s each way; Grace LPDDR5X up to 512 GB/s; NVLink 900 GB/s to the other GPUs.
    "gh200": Profile("gh200", 989, 720, 360, 4000, 450, 512, 96, nvlink_gbps=450),
    # A100 SXM 80GB datasheet: 312 TFLOPS dense bf16, HBM2e 2.04 TB/s; PCIe 4.0 host link; EPYC 7742 host;
    # NVLink 600 GB/s (bidirectional, 3rd generation) = 300 GB/s each way.
    "a100": Profile("a100", 312, 250, 180, 2039, 31.5, 205, 80, nvlink_gbps=300),
    # RTX 4090 (Ada whitepaper): 165.2 TFLOPS dense bf16 with FP32 accumulate, GDDR6X 1008 GB/s, 24 GB; PCIe 4.0.
    "rtx4090": Profile("rtx4090", 165.2, 140, 100, 1008, 31.5, 90, 24),
    # RTX 5090 (Blackwell GeForce whitepaper): 209.5 TFLOPS dense bf16 with FP32 accumulate, GDDR7
    # 1792 GB/s, 32 GB; PCIe 5.0 x16.
    "rtx5090": Profile("rtx5090", 209.5, 180, 125, 1792, 63, 96, 32),
}


def profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"device {name!r}: choose one of {', '.join(PROFILES)}")
    return PROFILES[name]


def measure_host_adam(numel: int = 16 * 2**20, reps: int = 3) -> float:
    """Adam steps per second (10^9 params) of ``kernels.adam_step_`` on this machine: fp32 master, m, v, a
    bf16 gradient in and a bf16 copy out (256 MiB at the default size, beyond any cache); the best of `reps`."""
    from megatrain_lightning.optim import kernels
    from megatrain_lightning.optim.kernels import AdamHyper

    master, m, v = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
    grad, copy = torch.full((numel,), 1e-3, dtype=torch.bfloat16), torch.empty(numel, dtype=torch.bfloat16)
    hyper = AdamHyper(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True)
    best = float("inf")
    for step in range(1, reps + 2):  # the first touches every page: not timed
        t0 = time.perf_counter()
        kernels.adam_step_(master, m, v, grad, copy, hyper, step)
        best = min(best, time.perf_counter() - t0) if step > 1 else best
    return numel / best / 1e9
