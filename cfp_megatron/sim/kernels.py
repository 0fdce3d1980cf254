"""Time of single kernels on one GPU (seconds): GEMMs (roofline with fitted efficiency, or the measured GEMM table),
the attention core, memory-bound element-wise work; and the element sizes (bytes) of a job's precision."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from cfp_megatron.base.config import ClusterSpec, JobSpec, Precision, TrainSpec, resolve_precision
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.cluster.unstated import unstated_rates
from cfp_megatron.sim.calibration import Efficiency
from cfp_megatron.sim.format_costs import format_cost

GROUPED_GEMM_FILE = Path(__file__).with_name("grouped_gemm.json")
"""The tile, launch cost and large-size rate of the grouped expert GEMMs, with their sources."""


@dataclass(frozen=True, kw_only=True)
class GroupedGemmShape:
    """What prices one grouped expert GEMM (:data:`GROUPED_GEMM_FILE`)."""

    tile: tuple[int, int, int]
    """(m, n, k) of one tile: output rows, output columns, reduction step."""
    launch_s: float
    """Fixed seconds of one grouped GEMM whatever its size (its launch and set-up, measured)."""
    plateau_vs_dense: float
    """Its rate on large shapes over the dense GEMM rate (measured on one GPU)."""


@functools.cache
def grouped_gemm_shape() -> GroupedGemmShape:
    """The grouped expert GEMMs' tile, launch cost and large-size rate (:data:`GROUPED_GEMM_FILE`)."""
    data = json.loads(GROUPED_GEMM_FILE.read_text())
    tile = data["tile"]
    return GroupedGemmShape(tile=(int(tile["m"]), int(tile["n"]), int(tile["k"])),
                            launch_s=float(data["launch_s"]), plateau_vs_dense=float(data["plateau_vs_dense"]))


def compute_precision(precision: Precision, cluster: ClusterSpec) -> Precision:
    """The precision the runtime trains in on ``cluster``: ``auto`` is fp32 on a CPU cluster and bf16 on GPUs
    (:func:`cfp_megatron.base.config.resolve_precision`)."""
    return resolve_precision(precision, on_gpu=not cluster.on_cpu)


def target_peak_tflops(job: JobSpec) -> float | None:
    """The peak TFLOP/s of the job's cluster in the precision it trains in (a preset's, or what profiling measured;
    never a benchmark of the planning machine); ``None`` where the cluster states none. The quoted peak, not scaled
    by ``cluster.sm_clock_mhz`` / ``cluster.power_limit_w``: MFU of a capped GPU counts what the cap costs."""
    cluster = job.cluster
    if compute_precision(job.train.precision, cluster) is Precision.fp32:
        return cluster.peak_tflops_fp32
    return cluster.peak_tflops_bf16


def dtype_name(precision: Precision) -> str:
    """``"bf16"``, ``"fp16"`` or ``"fp32"`` for a resolved training precision."""
    return {Precision.fp32: "fp32", Precision.fp16: "fp16"}.get(precision, "bf16")


def bytes_per_element(precision: Precision) -> int:
    """Bytes of one activation/weight element in a resolved compute precision."""
    return 4 if precision is Precision.fp32 else 2


def element_bytes(job: JobSpec) -> int:
    """Bytes of a weight or activation element in the precision the runtime trains ``job`` in on its cluster."""
    return bytes_per_element(compute_precision(job.train.precision, job.cluster))


def grad_element_bytes(job: JobSpec) -> float:
    """Bytes of a gradient element in Megatron's gradient buffers and their data-parallel reduction: fp32 with
    ``parallel.grad_reduce_in_fp32`` (the default), else the compute precision's."""
    return 4.0 if job.parallel.grad_reduce_in_fp32 else float(element_bytes(job))


class KernelModel:
    """Seconds of the kernels of one pass on one GPU."""

    def __init__(self, cluster: ClusterSpec, efficiency: Efficiency, number_format: NumberFormat | Precision, *,
                 measurements: Measurements | None = None) -> None:
        """Rates of ``cluster`` in ``number_format`` (a job's :meth:`NumberFormat.of`, or a bare precision: FP8 and
        FP4 with Megatron-Core's default recipes) at the achieved shares ``efficiency``: the linear layers' GEMMs at
        the format's peak and fitted share, with its operand bytes and quantisation work
        (:func:`~cfp_megatron.sim.format_costs.format_cost`), the rest in the compute precision (bf16 under FP8 and
        FP4); measured peaks and GEMMs in ``measurements`` win over the nominal figures of the compute precision,
        which are scaled to the clock the GPUs run at
        (:meth:`~cfp_megatron.base.config.ClusterSpec.clocked_peak_tflops`). Raises :class:`ConfigError` for a format
        the cluster does not compute or states no peak for."""
        fmt = number_format if isinstance(number_format, NumberFormat) else NumberFormat.of(
            TrainSpec(precision=number_format))
        precision = compute_precision(fmt.precision, cluster)
        self.dtype = dtype_name(precision)
        self.elem = bytes_per_element(precision)
        self.eff = efficiency
        self.measurements = measurements
        measured_peak = measurements.peak_tflops(self.dtype) if measurements else None
        # The peaks at the clock the GPUs run at (cluster.sm_clock_mhz / cluster.power_limit_w scale them).
        nominal = cluster.clocked_peak_tflops("fp32" if self.dtype == "fp32" else "bf16")
        self.format = format_cost(fmt, cluster)
        if measured_peak:
            self.gemm_flops_per_s = measured_peak * 1e12
            self.attn_flops_per_s = measured_peak * 1e12 * efficiency.attention / efficiency.gemm
        else:
            peak = (nominal or unstated_rates().peak_tflops) * 1e12
            self.gemm_flops_per_s = peak * efficiency.gemm
            self.attn_flops_per_s = peak * efficiency.attention
        self.low = self.format.low
        self.low_flops_per_s = (self.format.gemm_tflops(cluster, efficiency) * 1e12 if self.low
                                else self.gemm_flops_per_s)
        memory_gbps = cluster.hbm_bandwidth_gbps or unstated_rates().hbm_bandwidth_gbps  # cluster/unstated.yaml
        self.mem_bytes_per_s = memory_gbps * 1e9 * efficiency.memory
        self.sm_count = cluster.sm_count
        self.on_cpu = cluster.on_cpu
        self._grouped_cache: dict[tuple[int, float, float, float, bool, float | None], float] = {}
        self._cache: dict[tuple[int, int, int, bool], float] = {}

    def gemm(self, m: float, n: float, k: float, *, low_precision: bool = True) -> float:
        """Seconds of one ``(m x k) @ (k x n)`` GEMM: FLOPs at the achieved rate plus operand traffic at HBM speed
        (so small or skinny GEMMs lose efficiency); a measured GEMM table wins. A linear layer's GEMM runs in the
        job's number format (its rate and operand bytes, and the cast of its input beyond what the fitted share
        holds, :attr:`~cfp_megatron.sim.format_costs.FormatCost.dense_cast_bytes`); ``low_precision=False`` keeps
        it in the compute precision (the MoE router, the logits, PrimePar's layers: not Transformer Engine's)."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        key = (int(m), int(n), int(k), low_precision)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        flops = 2.0 * m * n * k
        use_low = self.low and low_precision
        measured = (self.measurements.gemm_tflops(int(m), int(n), int(k), self.dtype)
                    if self.measurements is not None and not use_low else None)
        if measured:
            seconds = flops / (measured * 1e12)
        elif use_low:
            fmt = self.format
            operand_bytes = fmt.operand_bytes * (m * k + k * n) + self.elem * m * n
            moved = operand_bytes + fmt.dense_cast_bytes * m * k
            seconds = flops / self.low_flops_per_s + moved / self.mem_bytes_per_s
        else:
            operand_bytes = self.elem * (m * k + k * n) + self.elem * m * n
            seconds = flops / self.gemm_flops_per_s + operand_bytes / self.mem_bytes_per_s
        self._cache[key] = seconds
        return seconds

    def grouped_gemm(self, groups: int, m: float, n: float, k: float, *, low_precision: bool = True,
                     out_bytes: float | None = None) -> float:
        """Seconds of ``groups`` GEMMs ``(m x k) @ (k x n)`` run as one grouped GEMM (one per local expert, ``m`` its
        rows), from the kernel's shape rather than a fitted curve (:func:`grouped_gemm_shape`): a fixed launch cost,
        then the longer of the arithmetic and the operand traffic at HBM speed (the kernel streams one under the
        other). Each output is cut into tiles (a partial tile costs a whole one, and so does a partial step of
        ``k``), the tiles of all groups run in waves of one per SM (``cluster.sm_count``; the last wave costs a whole
        one), each at the measured share of the dense GEMM rate; each expert's weights are read once whatever its
        rows (what bounds the GEMM at small ``m``). ``out_bytes``: bytes per output
        element moved (default: the compute precision's, written once; a weight gradient accumulated into fp32 main
        gradients reads and writes 4 + 4). A measured GEMM table wins, GEMM by GEMM; on a CPU cluster (no tiles, no
        SMs: Megatron-Core's ``SequentialMLP`` loops over the experts) each expert is one :meth:`gemm`."""
        if groups <= 0 or m <= 0 or n <= 0 or k <= 0:
            return 0.0
        key = (groups, m, n, k, low_precision, out_bytes)
        hit = self._grouped_cache.get(key)
        if hit is not None:
            return hit
        use_low = self.low and low_precision
        if self.on_cpu or (self.measurements is not None and not use_low and self.measurements.gemm_tflops(
                int(m), int(n), int(k), self.dtype)):
            seconds = groups * self.gemm(m, n, k, low_precision=low_precision)
        else:
            shape = grouped_gemm_shape()
            tile_m, tile_n, tile_k = shape.tile
            tiles = groups * math.ceil(m / tile_m) * math.ceil(n / tile_n)
            if self.sm_count:
                tiles = math.ceil(tiles / self.sm_count) * self.sm_count
            flops = 2.0 * tiles * tile_m * tile_n * math.ceil(k / tile_k) * tile_k
            rate = (self.low_flops_per_s if use_low else self.gemm_flops_per_s) * shape.plateau_vs_dense
            operand_bytes = groups * ((self.format.operand_bytes if use_low else self.elem) * (m * k + k * n)
                                      + (self.elem if out_bytes is None else out_bytes) * m * n)
            seconds = shape.launch_s + max(flops / rate, operand_bytes / self.mem_bytes_per_s)
        self._grouped_cache[key] = seconds
        return seconds

    def attention(self, flops: float) -> float:
        """Seconds of the attention core (scores, softmax, weighted sum) of ``flops`` FLOPs."""
        return flops / self.attn_flops_per_s

    def memory(self, nbytes: float) -> float:
        """Seconds of memory-bound work moving ``nbytes`` bytes through HBM."""
        return nbytes / self.mem_bytes_per_s
