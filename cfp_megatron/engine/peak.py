"""Peak FLOP/s per rank for MFU: the cluster preset's figure, or a short matmul measurement on this machine."""

from __future__ import annotations

import time

import torch

from cfp_megatron.base.config import ClusterSpec, Precision


def measure_matmul_tflops(dtype: torch.dtype = torch.float32, size: int | None = None, seconds: float = 0.3) -> float:
    """Achieved TFLOP/s of a square matmul on this rank's device, run for about ``seconds``: ``size`` 8192 on a GPU
    (a 1024 one measured 218 of the 770 TFLOP/s an H200 reaches at 8192), 1024 on a CPU."""
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


def peak_tflops(cluster: ClusterSpec, precision: Precision) -> tuple[float, str]:
    """Peak TFLOP/s per rank for ``precision`` and where the figure came from ('preset' or 'measured ...'). A GPU
    preset's figure on a machine without a GPU (which the training entry refuses) is not this machine's: measured."""
    preset = {Precision.bf16: cluster.peak_tflops_bf16, Precision.fp16: cluster.peak_tflops_bf16,
              Precision.fp32: cluster.peak_tflops_fp32}.get(precision)
    if preset is not None and not cluster.on_cpu and not torch.cuda.is_available():
        return measure_matmul_tflops(torch.float32), f"measured (fp32 matmul: no {cluster.device_name} here)"
    if preset is not None:
        return preset, "preset"
    if not torch.cuda.is_available():
        # CPUs without native half-precision units emulate it far below their fp32 rate, and the model's own
        # half-precision matmuls may take other paths; the fp32 matmul rate is the honest ceiling on a CPU.
        return measure_matmul_tflops(torch.float32), "measured (fp32 matmul)"
    dtype = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}.get(precision, torch.float32)
    return measure_matmul_tflops(dtype), "measured"
