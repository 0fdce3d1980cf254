"""What a number format costs: the peak and fitted share its GEMMs run at, the bytes they read, the quantisation
work before each, and the memory it changes (``number_formats.yaml`` beside this module, with sources)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

from cfp_megatron.base.config import ClusterSpec, JobSpec, Precision
from cfp_megatron.base.errors import CfpError, ConfigError, ConfigIssue
from cfp_megatron.base.number_format import NumberFormat, computes, format_issues
from cfp_megatron.sim.calibration import Efficiency

FORMATS_FILE = Path(__file__).with_name("number_formats.yaml")
"""Each format's costs, with their sources."""


class FormatFileError(CfpError, ValueError):
    """A formats file that does not hold what :func:`format_cost` reads; the message names the file."""


@dataclass(frozen=True, kw_only=True)
class FormatCost:
    """What one format costs (the fields of :data:`FORMATS_FILE`)."""

    name: str
    """The format's name (:attr:`~cfp_megatron.base.number_format.NumberFormat.name`)."""
    peak: str
    """The cluster peak its GEMMs run at (``bf16``, ``fp32``, ``fp8``, ``fp4``)."""
    efficiency: str
    """The :class:`~cfp_megatron.sim.calibration.Efficiency` field that is the share of that peak reached."""
    operand_bytes: float
    """HBM bytes per operand element its GEMMs read."""
    cast_bytes: float
    """HBM bytes per element to quantise one GEMM input (0 for 16/32-bit)."""
    saved_input_bytes: float
    """Bytes per element of a linear layer's input kept for its weight gradient."""
    rowwise_weight_bytes: float
    """Bytes per weight element of a linear layer's weight quantised for the forward GEMM (data and scales)."""
    columnwise_weight_bytes: float
    """Bytes per weight element of its column-wise copy for dgrad (the transpose, or scales along the other axis)."""
    source: str
    """Where the figures come from."""
    columnwise_shares_rowwise: bool = False
    """Whether the column-wise usage is the row-wise data itself on GPUs that run FP8 GEMMs in every layout
    (:func:`non_tn_fp8`)."""
    param_gather_bytes: float | None = None
    """With ``parallel.fp8_param_gather``: bytes per parameter element the distributed optimizer's parameter
    all-gather moves; ``None``: the format has no such setting."""
    weight_source: str = ""
    """Where the weight bytes come from."""
    rate_vs_fp8: float | None = None
    """The most its GEMM kernels reach as a multiple of the per-tensor FP8 kernel's rate (measured); ``None``: its own
    peak alone bounds them (:meth:`gemm_tflops`)."""
    weight_cast_bytes: float | None = None
    """HBM bytes per weight element to quantise a linear layer's weight, both usages, once per step; ``None``:
    :attr:`cast_bytes`."""
    expert_row_align: float = 0.0
    """Rows each expert's grouped-GEMM input is padded to a multiple of (Megatron-Core's ``Fp8Padding`` before the
    grouped linears under FP8/FP4); 0: no padding (16/32-bit)."""
    expert_cast_launches: float = 0.0
    """Kernels Transformer Engine launches per local expert to quantise one grouped linear's input (0: one fused
    cast for all experts, delayed scaling's, or none)."""
    expert_scalar_kernels: float = 0.0
    """Of :attr:`expert_cast_launches`, the single-thread kernels whose GPU time is a launch's floor."""

    def gemm_tflops(self, cluster: ClusterSpec, efficiency: Efficiency) -> float:
        """TFLOP/s its large GEMMs reach on ``cluster`` at the fitted shares ``efficiency`` (at the clock the GPUs run
        at): its peak times its share, and no more than :attr:`rate_vs_fp8` times the FP8 peak at that share; 0
        where the cluster states no such peak."""
        share = getattr(efficiency, self.efficiency)
        rate = (cluster.clocked_peak_tflops(self.peak) or 0.0) * share
        if self.rate_vs_fp8 is not None:
            rate = min(rate, self.rate_vs_fp8 * (cluster.clocked_peak_tflops("fp8") or 0.0) * share)
        return rate

    @property
    def step_weight_cast_bytes(self) -> float:
        """HBM bytes per weight element of its once-per-step weight cast (:attr:`weight_cast_bytes`, else
        :attr:`cast_bytes`); zero for 16/32 bits."""
        return (self.cast_bytes if self.weight_cast_bytes is None else self.weight_cast_bytes) if self.low else 0.0

    @property
    def low(self) -> bool:
        """Whether its GEMMs run below 16 bits."""
        return self.cast_bytes > 0

    @property
    def dense_cast_bytes(self) -> float:
        """Bytes per element a dense linear layer's input cast costs beyond what the fitted FP8 share holds
        (delayed scaling's cast, which the rows it was fitted on ran)."""
        return max(self.cast_bytes - _table()["fp8-delayed"].cast_bytes, 0.0) if self.low else 0.0


_TEXT = ("peak", "efficiency", "source", "weight_source")
"""The text fields of a format's entry (the others are numbers, :attr:`FormatCost.columnwise_shares_rowwise` a
switch)."""


def _field(key: str, value: object) -> object:
    if key in _TEXT:
        return value
    if key == "columnwise_shares_rowwise":
        if not isinstance(value, bool):
            raise TypeError(f"{key}={value!r} is not true or false")
        return value
    return float(value)  # type: ignore[arg-type]


@functools.cache
def _file(path: Path = FORMATS_FILE) -> tuple[dict[str, FormatCost], frozenset[str]]:
    try:
        data = yaml.safe_load(path.read_text())
        table = {name: FormatCost(name=name, **{k: _field(k, v) for k, v in entry.items()})
                 for name, entry in data["formats"].items()}
        return table, frozenset(str(g) for g in data["non_tn_fp8_generations"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as err:
        raise FormatFileError(f"{path}: not a number-formats file ({err})") from None


def _table() -> dict[str, FormatCost]:
    return _file()[0]


def non_tn_fp8(cluster: ClusterSpec) -> bool:
    """Whether ``cluster``'s GPUs run FP8 GEMMs in every operand layout, so that Transformer Engine's per-tensor FP8
    weights keep no transpose (:data:`FORMATS_FILE`'s ``non_tn_fp8_generations``)."""
    return cluster.generation in _file()[1]


def format_cost(fmt: NumberFormat, cluster: ClusterSpec) -> FormatCost:
    """The costs of ``fmt`` on ``cluster`` (``auto`` resolved: bf16 on GPUs, fp32 on CPU). Raises
    :class:`ConfigError` naming the key where the cluster does not compute it (:func:`format_issues`) or states no
    peak for it."""
    if fmt.precision is Precision.auto:
        fmt = NumberFormat(precision=Precision.fp32 if cluster.on_cpu else Precision.bf16)
    issues = format_issues(cluster, fmt)
    if issues:
        raise ConfigError(issues)
    cost = _table()[fmt.name]
    if cost.low and computes(cluster, fmt) and cluster.clocked_peak_tflops(cost.peak) is None:
        raise ConfigError(ConfigIssue(key=f"cluster.peak_tflops_{cost.peak}", value=None,
                                      problem=f"{fmt.name} was asked for but {cluster.device_name} states no "
                                              f"{cost.peak} peak.",
                                      fix=f"train in bf16 (train.precision=bf16), or set "
                                          f"cluster.peak_tflops_{cost.peak}."))
    return cost


_LOW = (Precision.fp8, Precision.fp4)
"""The precisions whose GEMMs run in a low format (the others cost nothing beyond their element size)."""


def low_format_cost(job: JobSpec) -> FormatCost | None:
    """The costs of ``job``'s FP8/FP4 format on its cluster (:func:`format_cost`); ``None`` for the 16/32-bit formats,
    without building anything (the memory model asks for every rank of every plan a search prices)."""
    if job.train.precision not in _LOW:
        return None
    return format_cost(NumberFormat.of(job.train), job.cluster)


def quantised_weight_bytes(job: JobSpec) -> float:
    """Bytes per linear-layer weight element of ``job``'s weights in its FP8/FP4 format, row-wise and column-wise
    (the column-wise copy left out where it is the row-wise data, :func:`non_tn_fp8`); zero for 16/32 bits."""
    low = low_format_cost(job)
    if low is None:
        return 0.0
    shared = low.columnwise_shares_rowwise and non_tn_fp8(job.cluster)
    return low.rowwise_weight_bytes + (0.0 if shared else low.columnwise_weight_bytes)


def weight_element_bytes(job: JobSpec, elem: float) -> float:
    """Bytes per parameter of the weights a rank keeps, for ``elem``-byte compute-precision weights: the weights,
    plus under FP8/FP4 the quantised copies Transformer Engine keeps for the whole run; with
    ``parallel.fp8_param_gather`` the quantised weights alone (docs/simulator.md, "Number formats")."""
    quantised = quantised_weight_bytes(job)
    return quantised if _fp8_params(job) is not None else elem + quantised


def param_gather_element_bytes(job: JobSpec, elem: float) -> float:
    """Bytes per parameter element the parameter all-gather moves: ``elem`` (the compute precision), or with
    ``parallel.fp8_param_gather`` the format's ``param_gather_bytes``."""
    low = _fp8_params(job)
    return elem if low is None or low.param_gather_bytes is None else low.param_gather_bytes


def _fp8_params(job: JobSpec) -> FormatCost | None:
    """The costs of ``job``'s format where it keeps its parameters in it (``parallel.fp8_param_gather`` with a
    format that has the setting, FP8's recipes); ``None`` elsewhere (``auto`` that resolves to 16 bits)."""
    if not job.parallel.fp8_param_gather:
        return None
    low = low_format_cost(job)
    return low if low is not None and low.param_gather_bytes is not None else None


FP32_BYTES = 4.0
"""Bytes of an fp32 element: master weights (which the distributed optimizer reads to quantise into FP8
parameters), main gradients, optimizer moments."""


def step_weight_cast_bytes(job: JobSpec, layer_params: float, shard_params: float) -> float:
    """HBM bytes of the once-per-step quantisation of a rank's linear-layer weights (``layer_params`` of them,
    ``shard_params`` in its optimizer shard) in ``job``'s FP8/FP4 format: Transformer Engine's refresh of every
    cached quantised weight on the step's first micro-batch (:attr:`FormatCost.step_weight_cast_bytes` each), or,
    with FP8 parameters gathered quantised (``parallel.fp8_param_gather``), the distributed optimizer's cast of its
    fp32 shard into them (MXFP8's, gathered in bf16, are quantised whole after the gather); less what the fitted
    ``gemm_fp8`` share holds of it (delayed scaling's refresh of every weight, which the rows it was fitted on ran:
    :attr:`FormatCost.dense_cast_bytes`' convention), never below zero; zero for 16/32 bits."""
    low = low_format_cost(job)
    if low is None:
        return 0.0
    params = _fp8_params(job)
    if params is not None and params.param_gather_bytes is not None and params.param_gather_bytes < 2.0:
        cast = shard_params * (FP32_BYTES + quantised_weight_bytes(job))
    else:
        cast = layer_params * low.step_weight_cast_bytes
    return max(cast - layer_params * _table()["fp8-delayed"].step_weight_cast_bytes, 0.0)


def bf16_twin(job: JobSpec) -> JobSpec:
    """``job`` in bf16 throughout: what its layers at the stack's ends cost (``parallel.num_layers_at_start_in_bf16``
    / ``_end_in_bf16``; their weights are not kept in FP8, so no FP8 parameters)."""
    parallel = dataclasses.replace(job.parallel, fp8_param_gather=False, num_layers_at_start_in_bf16=0,
                                   num_layers_at_end_in_bf16=0)
    bf16 = NumberFormat(precision=Precision.bf16).train_fields()
    return dataclasses.replace(job, parallel=parallel, train=dataclasses.replace(job.train, **bf16))
