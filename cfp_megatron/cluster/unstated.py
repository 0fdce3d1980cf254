"""What the simulator prices a hardware figure at where the cluster states none and no profile measured one:
``unstated.yaml`` beside this module, each figure with its source (placeholders for CPU ranks of the ``local``
preset; every GPU preset states its own)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

from cfp_megatron.base.errors import CfpError

UNSTATED_FILE = Path(__file__).resolve().parent / "unstated.yaml"
VERSION = 1
"""The format version ``unstated.yaml`` states."""


class UnstatedDataError(CfpError, ValueError):
    """``unstated.yaml`` cannot be read; the message names the file, the figure and the fix."""


@dataclass(frozen=True, kw_only=True)
class UnstatedRates:
    """The figures of ``unstated.yaml``."""

    peak_tflops: float
    """Peak TFLOP/s of a cluster that states none in the compute precision."""
    hbm_bandwidth_gbps: float
    """Memory bandwidth per rank in GB/s of a cluster that states none."""
    intra_node_bandwidth_gbps: float
    """Unidirectional bandwidth per rank inside a node in GB/s of a cluster that states none."""
    inter_node_bandwidth_gbps: float
    """Unidirectional network bandwidth per rank between nodes in GB/s of a cluster that states none."""
    latency_us: float
    """Latency of one collective step in microseconds, inside or between nodes, of a cluster that states none."""


@functools.cache
def unstated_rates(path: Path = UNSTATED_FILE) -> UnstatedRates:
    """The figures of ``path`` (:data:`UNSTATED_FILE`). Raises :class:`UnstatedDataError` naming the file and the
    figure where one is missing, not a positive number or without its source."""
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise UnstatedDataError(f"{path}: not a version-{VERSION} file of unstated figures; restore it from the "
                                "package.")
    values: dict[str, float] = {}
    for field in dataclasses.fields(UnstatedRates):
        entry = data.get(field.name)
        value = entry.get("value") if isinstance(entry, dict) else None
        if (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0
                or not str(entry.get("source") or "").strip()):
            raise UnstatedDataError(f"{path}: {field.name} needs a positive value and its source; write "
                                    f"{field.name}: {{value: <number>, source: <where it comes from>}}.")
        values[field.name] = float(value)
    return UnstatedRates(**values)
