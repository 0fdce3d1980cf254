"""Time of single kernels on one GPU (seconds): GEMMs (roofline with fitted efficiency, or the measured GEMM table),
the attention core, memory-bound element-wise work; and the element sizes (bytes) of a job's precision."""

from __future__ import annotations

from cfp_megatron.base.config import ClusterSpec, JobSpec, Precision, resolve_precision
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.sim.calibration import Efficiency

_FALLBACK_PEAK_TFLOPS = 1.0
"""Peak TFLOP/s assumed for a cluster that states none."""
_FALLBACK_HBM_GBPS = 50.0
"""Memory bandwidth in GB/s assumed for a cluster that states none."""


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

    def __init__(self, cluster: ClusterSpec, efficiency: Efficiency, precision: Precision, *, fp8: bool,
                 measurements: Measurements | None = None) -> None:
        """Rates of ``cluster`` in ``precision`` (resolved by :func:`compute_precision`) at the achieved shares
        ``efficiency``; ``fp8`` runs the linear layers' GEMMs in FP8; measured peaks and GEMMs in ``measurements``
        win over the nominal figures, which are scaled to the clock the GPUs run at
        (:meth:`~cfp_megatron.base.config.ClusterSpec.clocked_peak_tflops`). Raises :class:`ConfigError` for FP8 on
        a cluster without an FP8 peak."""
        precision = compute_precision(precision, cluster)
        self.dtype = dtype_name(precision)
        self.elem = bytes_per_element(precision)
        self.eff = efficiency
        self.measurements = measurements
        measured_peak = measurements.peak_tflops(self.dtype) if measurements else None
        # The peaks at the clock the GPUs run at (cluster.sm_clock_mhz / cluster.power_limit_w scale them).
        nominal = cluster.clocked_peak_tflops("fp32" if self.dtype == "fp32" else "bf16")
        if fp8 and cluster.peak_tflops_fp8 is None:
            raise ConfigError(ConfigIssue(key="cluster.peak_tflops_fp8", value=None,
                                          problem=f"FP8 was asked for but {cluster.device_name} has no FP8 peak.",
                                          fix="run without FP8, or set cluster.peak_tflops_fp8."))
        if measured_peak:
            self.gemm_flops_per_s = measured_peak * 1e12
            self.attn_flops_per_s = measured_peak * 1e12 * efficiency.attention / efficiency.gemm
        else:
            peak = (nominal or _FALLBACK_PEAK_TFLOPS) * 1e12
            self.gemm_flops_per_s = peak * efficiency.gemm
            self.attn_flops_per_s = peak * efficiency.attention
        self.fp8 = fp8
        self.fp8_flops_per_s = (cluster.clocked_peak_tflops("fp8") or 0.0) * 1e12 * efficiency.gemm_fp8
        self.mem_bytes_per_s = (cluster.hbm_bandwidth_gbps or _FALLBACK_HBM_GBPS) * 1e9 * efficiency.memory
        self._cache: dict[tuple[int, int, int, bool], float] = {}

    def gemm(self, m: float, n: float, k: float, *, low_precision: bool = True) -> float:
        """Seconds of one ``(m x k) @ (k x n)`` GEMM: FLOPs at the achieved rate plus operand traffic at HBM speed
        (so small or skinny GEMMs lose efficiency); a measured GEMM table wins. ``low_precision=False`` keeps it out
        of FP8 (the MoE router)."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        key = (int(m), int(n), int(k), low_precision)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        flops = 2.0 * m * n * k
        use_fp8 = self.fp8 and low_precision
        measured = (self.measurements.gemm_tflops(int(m), int(n), int(k), self.dtype)
                    if self.measurements is not None and not use_fp8 else None)
        if measured:
            seconds = flops / (measured * 1e12)
        else:
            rate = self.fp8_flops_per_s if use_fp8 else self.gemm_flops_per_s
            operand_bytes = (1 if use_fp8 else self.elem) * (m * k + k * n) + self.elem * m * n
            seconds = flops / rate + operand_bytes / self.mem_bytes_per_s
        self._cache[key] = seconds
        return seconds

    def attention(self, flops: float) -> float:
        """Seconds of the attention core (scores, softmax, weighted sum) of ``flops`` FLOPs."""
        return flops / self.attn_flops_per_s

    def memory(self, nbytes: float) -> float:
        """Seconds of memory-bound work moving ``nbytes`` bytes through HBM."""
        return nbytes / self.mem_bytes_per_s
