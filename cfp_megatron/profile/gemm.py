"""The GEMM round: achieved matmul throughput over a grid of shapes in the job's dtypes."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from cfp_megatron.profile.control import Step, StepResult, timed
from cfp_megatron.profile.records import GemmRecord, gemm_entry

CPU_DIMS = (64, 256, 1024)
"""m, n and k values timed on CPU."""
GPU_DIMS = (256, 1024, 4096, 8192)
"""m, n and k values timed on GPU."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Short dtype names, as :class:`~cfp_megatron.cluster.measured.Measurements` uses them."""


def gemm_shapes(dims: Sequence[int]) -> list[tuple[int, int, int]]:
    """Every (m, n, k) of ``dims``: the cubes first (smallest to largest), then the rest by FLOPs."""
    cubes = [(d, d, d) for d in dims]
    rest = sorted((s for s in itertools.product(dims, repeat=3) if s not in cubes), key=lambda s: (s[0] * s[1] * s[2],
                                                                                                   s))
    return cubes + rest


def repeats_for(m: int, n: int, k: int, *, on_gpu: bool) -> int:
    """Timed matmuls per shape: about a fixed amount of work (deterministic, so every rank agrees)."""
    target = 2e12 if on_gpu else 1e9
    return max(2, min(50, int(target / (2.0 * m * n * k))))


def gemm_steps(dtypes: Sequence[str], *, on_gpu: bool, device: torch.device,
               repeats: int | None = None) -> tuple[list[Step], dict[str, tuple]]:
    """One step per (dtype, shape) and what each measures, by label; ``repeats`` timed matmuls per shape
    (``cfp.profile_repeats``; ``None``: :func:`repeats_for`'s)."""
    dims = GPU_DIMS if on_gpu else CPU_DIMS
    steps: list[Step] = []
    meaning: dict[str, tuple] = {}
    for dtype in dtypes:
        for m, n, k in gemm_shapes(dims):
            label = gemm_entry(m, n, k, dtype)

            def measure(m: int = m, n: int = n, k: int = k, dtype: str = dtype) -> list[float]:
                a = torch.randn(m, k, dtype=DTYPES[dtype], device=device)
                b = torch.randn(k, n, dtype=DTYPES[dtype], device=device)
                count = repeats or repeats_for(m, n, k, on_gpu=on_gpu)
                return [timed(lambda: torch.matmul(a, b), repeats=count, warmup=1)]

            steps.append(Step(label=label, run=measure, entry=label))
            meaning[label] = (m, n, k, dtype)
    return steps, meaning


def gemm_records(results: Sequence[StepResult], meaning: dict[str, tuple]) -> list[GemmRecord]:
    """The table rows of the finished steps."""
    rows = []
    for res in results:
        m, n, k, dtype = meaning[res.label]
        seconds = res.values[0]
        rows.append(GemmRecord(m=m, n=n, k=k, dtype=dtype, seconds=seconds, tflops=2.0 * m * n * k / seconds / 1e12))
    return rows
