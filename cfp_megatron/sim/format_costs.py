"""What a number format costs: the peak and fitted share its GEMMs run at, the bytes they read, the quantisation
work before each, and the memory it changes (``number_formats.yaml`` beside this module, with sources)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

from cfp_megatron.base.config import ClusterSpec, JobSpec, Precision
from cfp_megatron.base.errors import CfpError, ConfigError, ConfigIssue
from cfp_megatron.base.number_format import NumberFormat, computes, format_issues

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
    weight_copy_bytes: float
    """Bytes per weight element of the quantised weight copies cached for the step."""
    source: str
    """Where the figures come from."""

    @property
    def low(self) -> bool:
        """Whether its GEMMs run below 16 bits."""
        return self.cast_bytes > 0

    @property
    def dense_cast_bytes(self) -> float:
        """Bytes per element a dense linear layer's input cast costs beyond what the fitted FP8 share holds
        (delayed scaling's cast, which the rows it was fitted on ran)."""
        return max(self.cast_bytes - _table()["fp8-delayed"].cast_bytes, 0.0) if self.low else 0.0


@functools.cache
def _table(path: Path = FORMATS_FILE) -> dict[str, FormatCost]:
    try:
        data = yaml.safe_load(path.read_text())
        return {name: FormatCost(name=name, **{k: (v if k in ("peak", "efficiency", "source") else float(v))
                                               for k, v in entry.items()})
                for name, entry in data["formats"].items()}
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as err:
        raise FormatFileError(f"{path}: not a number-formats file ({err})") from None


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
