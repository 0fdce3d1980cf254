"""Peak FLOP/s per rank for MFU: the cluster preset's figure, or a short matmul measurement on this machine."""

from __future__ import annotations

import time

import torch

from cfp_megatron.base.config import ClusterSpec, Precision


def measure_matmul_tflops(dtype: torch.dtype = torch.float32, size: int | None = None, seconds: float = 0.3) -> float:
    """Achieved TFLOP/s of a square matmul on this rank's device, run for about ``seconds``: ``size`` 8192 on a GPU
    (a smaller one falls far short of the GPU's peak: docs/benchmarks.md, "On a GPU"), 1024 on a CPU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = size or (8192 if device == "cuda" else 1024)
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    a @ b  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    if device == "cuda":
        torch.cuda.synchronize()
    return 2.0 * size**3 * n / (time.perf_counter() - start) / 1e12


def peak_tflops(cluster: ClusterSpec, precision: Precision, *, profiled: float | None = None) -> tuple[float, str]:
    """Peak TFLOP/s per rank for ``precision`` and where the figure came from. A GPU preset's figure on its GPU:
    ``preset``. Otherwise (a CPU, a GPU without a preset, a GPU preset on a machine without a GPU, which the training
    entry refuses) this machine's own figure: ``profiled``, the practical peak its ProfileDB's GEMM round stored
    (:func:`cfp_megatron.profile.cluster.profiled_peak`), so the MFU of every run on this machine is against the same
    peak; without one, a short matmul measured now (it varies from start to start: the source says so)."""
    preset = {Precision.bf16: cluster.peak_tflops_bf16, Precision.fp16: cluster.peak_tflops_bf16,
              Precision.fp32: cluster.peak_tflops_fp32}.get(precision)
    here = not (preset is not None and not cluster.on_cpu and not torch.cuda.is_available())
    if preset is not None and here:
        return preset, "preset"
    if profiled is not None and profiled > 0:
        return profiled, "ProfileDB (the GEMM round's best matmul, measured once on this machine)"
    unprofiled = "; measured at this start: profile this machine once (cfp profile) for an MFU comparable between runs"
    if not here:
        return (measure_matmul_tflops(torch.float32),
                f"measured (fp32 matmul: no {cluster.device_name} here){unprofiled}")
    if not torch.cuda.is_available():
        # CPUs without native half-precision units emulate it far below their fp32 rate, and the model's own
        # half-precision matmuls may take other paths; the fp32 matmul rate is the honest ceiling on a CPU.
        return measure_matmul_tflops(torch.float32), f"measured (fp32 matmul){unprofiled}"
    dtype = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}.get(precision, torch.float32)
    return measure_matmul_tflops(dtype), f"measured{unprofiled}"


def peak_dtype(precision: Precision) -> str:
    """The GEMM table's dtype whose peak :func:`peak_tflops` reads for ``precision``: fp32 on a CPU (see there)."""
    if not torch.cuda.is_available():
        return "fp32"
    return {Precision.bf16: "bf16", Precision.fp16: "fp16"}.get(precision, "fp32")
