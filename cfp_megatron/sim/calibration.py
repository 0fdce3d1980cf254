"""Fitted hardware efficiencies: the only tuned numbers of the simulator, a few shares of nominal figures per GPU
generation (never per model, per run or per row). The numbers are data, ``efficiencies.json`` beside this module,
which the fitting bench writes (``python bench/validate.py --fit --write``); a cluster's generation is what its preset
states (``cluster.generation``), never guessed from its name. What they are and how they were fitted:
docs/simulator.md, "calibration.py".
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfp_megatron.base.config import ClusterSpec
from cfp_megatron.base.errors import CfpError

EFFICIENCIES_FILE = Path(__file__).with_name("efficiencies.json")
"""The fitted efficiencies, their sources and which generations borrow another's (written by bench/validate.py)."""
UNKNOWN = "unknown"
"""The generation :func:`generation` names for a cluster that states none."""


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


GENERATION_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Efficiency))
"""Fields the fitting script may tune (every field of :class:`Efficiency`)."""


class EfficiencyFileError(CfpError, ValueError):
    """An efficiencies file that does not hold what :class:`EfficiencyTable` reads; the message names the file."""


@dataclass(frozen=True, kw_only=True)
class FitSource:
    """Where one generation's fitted efficiencies come from."""

    written_by: str
    """The command that fitted them."""
    date: str
    """When it ran (ISO date)."""
    data: str
    """The published runs they were fitted on."""
    rows: int | None = None
    """How many of those runs were of this generation; ``None``: not recorded."""
    note: str = ""
    """Anything else a reader of the file should know."""


@dataclass(frozen=True, kw_only=True)
class Borrowed:
    """A generation without fitted efficiencies of its own, and whose it uses."""

    uses: str
    """The fitted generation whose efficiencies it uses."""
    why: str
    """Why that one (the assumption made)."""


@dataclass(frozen=True, kw_only=True)
class EfficiencyTable:
    """The content of an efficiencies file (:data:`EFFICIENCIES_FILE`)."""

    fitted: dict[str, Efficiency]
    """Fitted efficiencies per generation."""
    sources: dict[str, FitSource]
    """Where each fitted generation's come from (the same keys as ``fitted``)."""
    borrowed: dict[str, Borrowed]
    """Generations that use a fitted generation's efficiencies."""
    fallback: str
    """The fitted generation a cluster whose generation is missing or unknown is priced with (with a warning)."""

    def by_generation(self) -> dict[str, Efficiency]:
        """Generation -> its efficiencies, a borrowing generation sharing the object of the one it uses."""
        table = dict(self.fitted)
        table.update({gen: self.fitted[b.uses] for gen, b in self.borrowed.items()})
        return table

    def to_json(self) -> dict[str, Any]:
        """The file's content (:meth:`from_json` reads it back)."""
        return {
            "about": "Fitted hardware efficiencies per GPU generation, shares of each device's nominal figures "
                     "(cfp_megatron/sim/calibration.py; what they mean and how they are fitted: docs/simulator.md, "
                     "\"calibration.py\"). Written by python bench/validate.py --fit --write: do not edit by hand.",
            "fallback": self.fallback,
            "fitted": {gen: {"source": dataclasses.asdict(self.sources[gen]),
                             "efficiency": dataclasses.asdict(eff)} for gen, eff in self.fitted.items()},
            "borrowed": {gen: dataclasses.asdict(b) for gen, b in self.borrowed.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], *, where: str = "efficiencies") -> EfficiencyTable:
        """The table of :meth:`to_json`'s content; :class:`EfficiencyFileError` naming ``where`` and what is wrong
        (a missing or unknown field, a borrowing or fallback generation that is not fitted)."""
        try:
            fitted = {gen: Efficiency(**entry["efficiency"]) for gen, entry in data["fitted"].items()}
            sources = {gen: FitSource(**entry["source"]) for gen, entry in data["fitted"].items()}
            borrowed = {gen: Borrowed(**entry) for gen, entry in data.get("borrowed", {}).items()}
            fallback = str(data["fallback"])
        except (KeyError, TypeError, AttributeError) as err:
            raise EfficiencyFileError(f"{where}: not an efficiencies file ({type(err).__name__}: {err}); write it "
                                      "with python bench/validate.py --fit --write") from None
        missing = sorted({b.uses for b in borrowed.values()} - set(fitted) | ({fallback} - set(fitted)))
        if missing:
            raise EfficiencyFileError(f"{where}: {', '.join(missing)} is borrowed or the fallback but not fitted")
        return cls(fitted=fitted, sources=sources, borrowed=borrowed, fallback=fallback)


def efficiencies_text(table: EfficiencyTable) -> str:
    """The efficiencies file's text for ``table`` (what :func:`read_efficiencies` reads)."""
    return json.dumps(table.to_json(), indent=2) + "\n"


def read_efficiencies(path: Path = EFFICIENCIES_FILE) -> EfficiencyTable:
    """The efficiencies file at ``path``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise EfficiencyFileError(f"{path}: cannot be read as JSON ({err})") from None
    return EfficiencyTable.from_json(data, where=str(path))


TABLE = read_efficiencies()
"""The shipped efficiencies (:data:`EFFICIENCIES_FILE`)."""
FITTED: dict[str, Efficiency] = TABLE.by_generation()
"""Efficiencies per GPU generation, fitted or borrowed (how: docs/simulator.md, "calibration.py")."""


def generation(cluster: ClusterSpec) -> str:
    """The GPU generation ``cluster`` states (``cluster.generation``: ``ampere``, ``hopper``, ``blackwell``,
    ``cdna3``, ``cdna4``, ``cpu``...), or :data:`UNKNOWN` where it states none."""
    return cluster.generation or UNKNOWN


def efficiency_for(cluster: ClusterSpec) -> Efficiency:
    """The efficiencies that apply to ``cluster``: its generation's (:func:`generation`), else the file's fallback
    generation's, which :func:`identity_warnings` says in the plan's output."""
    return FITTED.get(generation(cluster)) or FITTED[TABLE.fallback]


def identity_warnings(cluster: ClusterSpec) -> list[str]:
    """What the plan's output warns about a cluster that does not say what it is: a generation missing or without
    efficiencies (the fallback's are used instead), and on GPUs no word on TP communication overlap (left off)."""
    notes = []
    gen = cluster.generation
    if gen is None or gen not in FITTED:
        said = "states no cluster.generation" if gen is None else f"states cluster.generation={gen}, which has no " \
                                                                   "fitted efficiencies"
        notes.append(f"warning: cluster {cluster.name} ({cluster.device_name}) {said}: the simulator prices it with "
                     f"{TABLE.fallback}'s efficiencies instead (cfp_megatron/sim/efficiencies.json), a guess; set "
                     f"cluster.generation to one of {', '.join(sorted(FITTED))}")
    if cluster.supports_tp_overlap is None and not cluster.on_cpu:
        notes.append(f"warning: cluster {cluster.name} does not state cluster.supports_tp_overlap: no plan overlaps "
                     "its TP communication; set it (true on Hopper and later)")
    return notes
