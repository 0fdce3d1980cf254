"""Fitted hardware efficiencies: the only tuned numbers of the simulator, a few shares of nominal figures per GPU
generation (never per model, per run or per row). What they are and how they were fitted: docs/simulator.md,
"calibration.py".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cfp_megatron.base.config import ClusterSpec


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Achieved shares of the nominal figures of one GPU generation."""

    gemm: float
    """Share of the dense bf16/fp16 (or TF32 for fp32) peak a large GEMM reaches."""
    gemm_fp8: float
    """Share of the dense FP8 peak a large FP8 GEMM reaches (Transformer Engine, delayed scaling)."""
    attention: float
    """Share of the dense peak the attention core reaches (FLOPs as the kernel runs them)."""
    memory: float
    """Share of HBM bandwidth reached by memory-bound kernels (norms, activations, residuals, optimizer)."""
    layer_overhead_s: float
    """Fixed seconds per transformer layer and pass (forward or backward) on top of the kernels' work."""
    moe_token_elements: float
    """HBM traffic of MoE routing per routed token copy and pass, in units of the hidden size (permute, unpermute,
    probability scaling, padding of the grouped GEMM inputs, router top-k)."""
    optimizer_bytes_per_param: float
    """HBM bytes moved per (local) parameter by the optimizer step: Adam update, gradient-norm and clipping,
    zeroing gradient buffers, copying fp32 master weights back to the compute precision."""
    intra_node_comm: float
    """Share of nominal per-GPU NVLink bandwidth a collective reaches."""
    inter_node_comm: float
    """Share of nominal per-GPU network (NIC rail) bandwidth a collective reaches."""

    def replace(self, **changes: float) -> Efficiency:
        """A copy with some fields changed (used by the fitting script)."""
        return dataclasses.replace(self, **changes)


FITTED: dict[str, Efficiency] = {
    "ampere": Efficiency(gemm=0.799, gemm_fp8=0.6, attention=0.357, memory=0.972, layer_overhead_s=1e-06,
                         moe_token_elements=22.7, optimizer_bytes_per_param=122.0, intra_node_comm=0.806,
                         inter_node_comm=0.75),
    "hopper": Efficiency(gemm=0.562, gemm_fp8=0.558, attention=0.305, memory=0.779, layer_overhead_s=6.75e-06,
                         moe_token_elements=22.7, optimizer_bytes_per_param=200.0, intra_node_comm=1.0,
                         inter_node_comm=1.0),
}
"""Fitted efficiencies per GPU generation (how: docs/simulator.md, "calibration.py")."""

FITTED["blackwell"] = FITTED["hopper"]
FITTED["other"] = FITTED["hopper"]
# AMD Instinct (RCCL): no calibration rows either. CDNA 3 (MI300X, MI325X) and CDNA 4 (MI355X) are generations of their
# own so that rows can be fitted to them later; until then they reuse Hopper's shares of peak and bandwidth, an
# assumption (ROCm's GEMM and attention kernels and RCCL over Infinity Fabric may reach other shares).
FITTED["cdna3"] = FITTED["hopper"]
FITTED["cdna4"] = FITTED["hopper"]

GENERATION_FIELDS: tuple[str, ...] = ("gemm", "gemm_fp8", "attention", "memory", "layer_overhead_s",
                                      "moe_token_elements", "optimizer_bytes_per_param", "intra_node_comm",
                                      "inter_node_comm")
"""Fields the fitting script may tune."""


def generation(cluster: ClusterSpec) -> str:
    """GPU generation of a cluster from its device name: ``ampere`` (A100 40/80 GB, A800, A30), ``hopper`` (H100
    SXM/NVL, H200, H800, H20, GH200), ``blackwell`` (B100, B200, B300, GB200, GB300), ``cdna3`` (MI300X, MI325X),
    ``cdna4`` (MI350X, MI355X) or ``other``."""
    name = cluster.device_name.upper()
    if "A100" in name or "A800" in name or "A30" in name:
        return "ampere"
    if "H100" in name or "H20" in name or "H800" in name:  # "H20" also matches H200 and GH200
        return "hopper"
    if "B200" in name or "B100" in name or "B300" in name:  # also GB200, GB300
        return "blackwell"
    if "MI300" in name or "MI325" in name:
        return "cdna3"
    if "MI350" in name or "MI355" in name:
        return "cdna4"
    return "other"


def efficiency_for(cluster: ClusterSpec) -> Efficiency:
    """The fitted efficiencies that apply to ``cluster`` (its generation's, :func:`generation`)."""
    return FITTED[generation(cluster)]
