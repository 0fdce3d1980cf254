"""What the stated columns beyond the model and the layout read as: the fabric (``interconnect``), the pipeline
schedule (``pp_schedule``), the precision variant (``precision``) and a power limit, each into what the simulator
prices and, where it prices a column only approximately or cannot read it, a sentence saying so (the row keeps its
place in the figures; the report lists the sentence). The words each column is read by are data with sources:
``cfp_megatron/cluster/fabrics.yaml``, and ``schedules.yaml`` and ``precisions.yaml`` beside this module (loaded by
:mod:`.data`)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from cfp_megatron.base.config import Precision
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.cluster.fabrics import Fabric, Fabrics, load_fabrics
from cfp_megatron.sim.options import PipelineSchedule
from cfp_megatron.validation.data import ColumnEntry, load_precisions, load_schedules
from cfp_megatron.validation.rows import power_limit

SCALE_UP_WORDS = r"nvlink|nvswitch|nvl\d+|intra[\s-]*node|infinity\s*fabric|xgmi|pcie|ualink"
"""Words of an ``interconnect`` clause about the scale-up fabric inside a node or rack, not the network."""


def _first(entries: tuple[ColumnEntry, ...], text: str) -> ColumnEntry | None:
    return next((entry for entry in entries if re.search(entry.words, text, re.IGNORECASE)), None)


@dataclass(frozen=True, kw_only=True)
class Reading:
    """What one stated column reads as."""

    cluster: dict[str, Any] = field(default_factory=dict)
    """Cluster keys it sets (the row's fabric, power limit)."""
    tag: str = ""
    """What the layout column shows of it (empty: nothing)."""
    approximation: str = ""
    """What of it the simulator does not price as it ran, or could not read (empty: nothing)."""


# ---------------------------------------------------------------------------------------------------------------
# interconnect


_RATE = r"(\d+(?:\.\d+)?)\s*([GT])(?:\s*(b|B))?(?:ps|/s|its?/s|E\b|\b)"
"""A rate: ``200Gb/s``, ``1.6 Tbps``, ``400G``, ``100GbE``, ``25 GB/s`` (bytes: x 8)."""


def _gbps(value: str, prefix: str, unit: str | None) -> float:
    return float(value) * (1000.0 if prefix.upper() == "T" else 1.0) * (8.0 if unit == "B" else 1.0)


_NODE_WORDS = r"per\s+node|node[\s-]*(?:to[\s-]*)?node|/\s*node|aggregate|total|per\s+(?:server|host|system)"
"""Words that make a rate the node's (``1600 Gbps ... node-node``, ``400 Gb/s per node``, ``aggregate``)."""


def _links_and_rate(text: str, fabric: Fabric) -> tuple[int | None, float | None, float | None]:
    """(links per node, Gb/s per link, Gb/s per node) that ``text`` states, each ``None`` where it does not. A count
    times a rate is links of that rate (``4 x 100 Gb/s``, ``100 Gb/s x4``); a count of links said apart from the rate
    (``4x OPA 100Gb/s``, ``4 Omni-Path 100 Gb/s NICs per node``, ``100 Gb/s (4 per node)``) makes the rate one
    link's, unless "per node" follows the rate itself and each link could carry its share (``4 OPA links, 400 Gb/s
    per node``; ``4x OPA 100Gb/s per node`` is 4 links of 100: no Omni-Path link runs at 25). Without a count, a
    rate said to be the node's is the node's; a bare rate above any link of ``fabric`` (EFA's 100 Gb/s, InfiniBand's
    800) is the node's, below, one link's."""
    found = re.search(rf"(\d+)\s*[x×*]\s*{_RATE}", text)
    if found:
        return int(found.group(1)), _gbps(*found.group(2, 3, 4)), None
    found = re.search(rf"{_RATE}\s*[x×*]\s*(\d+)\b", text)
    if found:
        return int(found.group(4)), _gbps(*found.group(1, 2, 3)), None
    count = (re.search(r"(\d+)\s*[x×]\s*(?=[A-Za-z])", text)
             or re.search(r"(\d+)\s+(?:[\w/-]+\s+){0,3}?(?:links?|nics?|hcas?|ports?|adapters?|rails?|cards?)\b",
                          text, re.IGNORECASE)
             or re.search(r"\b(\d+)\s*(?:per|/|each)\s*(?:node|server|host)\b", text, re.IGNORECASE))
    links = int(count.group(1)) if count else None
    rate = re.search(_RATE, text)
    if rate is None:
        return links, None, None
    gbps = _gbps(*rate.group(1, 2, 3))
    after = text[rate.end():rate.end() + 40].lower()
    if re.match(r"\W*(per|a|each|/)\s*(gpu|accelerator)", after):
        return links, None, -gbps  # per GPU: the caller multiplies by the GPUs of a node
    rates = [*fabric.link_gbps.values(), *([fabric.default_link_gbps] if fabric.default_link_gbps else [])]
    node_said = re.match(rf"\W*(?:{_NODE_WORDS})", after) or re.search(
        r"aggregate|total|node[\s-]*(?:to[\s-]*)?node", text, re.IGNORECASE)
    if links:
        if node_said and gbps / links >= min(rates, default=0.0):
            return links, None, gbps
        return links, gbps, None
    if node_said or re.search(_NODE_WORDS, text, re.IGNORECASE):
        return None, None, gbps
    if re.match(r"\W*(per|a|each)\s*(link|port|nic|hca|adapter|rail)", after):
        return None, gbps, None
    return (None, None, gbps) if gbps > max(rates, default=800.0) else (None, gbps, None)


def interconnect_reading(row: dict, cluster: dict[str, Any], fabrics: Fabrics | None = None) -> Reading:
    """The row's ``interconnect`` as its cluster's scale-out network (``cluster``: its preset's YAML, as
    ``validate.row_plan`` builds it): the fabric it names (``fabrics.yaml``'s words: InfiniBand HDR/NDR/XDR, RoCE,
    Omni-Path, EFA, Slingshot, Ethernet), its links per node and Gb/s per link (``8x200Gb/s``, ``4 Omni-Path links``
    at the fabric's 100 Gb/s, ``1600 Gbps ... node-node`` over the preset's links) into ``cluster.network``,
    ``nics_per_node`` and ``nic_gbps``. A blank column, or one about the NVLink domain alone, keeps the preset's
    network (its datasheet, in its header). Text that names no fabric keeps it too, and says so with the text."""
    text = " ".join((row.get("interconnect") or "").split())
    if not text:
        return Reading()
    fabrics = fabrics or load_fabrics()
    clauses = [part for part in re.split(r"[;,(+]|\bplus\b|\band\b", text)
               if part.strip() and not re.search(SCALE_UP_WORDS, part, re.IGNORECASE)]
    scale_out = " ".join(clauses)
    fabric = fabrics.named_in(scale_out) if scale_out else None
    preset_links = cluster.get("rails_per_node") or cluster.get("gpus_per_node") or 1
    gpus = cluster.get("gpus_per_node") or 1
    preset_gbps = (cluster.get("inter_node_bandwidth_gbps") or 0.0) * 8.0 * gpus / preset_links
    said = f"{preset_links} x {preset_gbps:g} Gb/s {cluster.get('network') or 'infiniband'}"
    if fabric is None:
        if not scale_out.strip():
            return Reading()  # the scale-up fabric only: nothing about the network, the preset's
        return Reading(tag="net?", approximation=(
            f"interconnect {text!r} names no fabric validate knows (cfp_megatron/cluster/fabrics.yaml lists "
            f"{', '.join(f.network.value for f in fabrics.fabrics)}): priced on the {cluster.get('name')} preset's "
            f"network ({said} a node)"))
    links, per_link, per_node = _links_and_rate(scale_out, fabric)
    if per_node is not None and per_node < 0:
        per_node = -per_node * gpus
    generation = fabric.generation(scale_out)
    if per_link is None and per_node is not None:
        per_link = per_node / (links or preset_links)
    if per_link is None:
        per_link = fabric.link_gbps[generation] if generation else fabric.default_link_gbps
    overrides: dict[str, Any] = {"network": fabric.network.value}
    if links is not None or per_link is not None:
        overrides["nics_per_node"] = links or preset_links
        overrides["nic_gbps"] = per_link if per_link is not None else preset_gbps
    per_gpu = overrides.get("nics_per_node", preset_links) * overrides.get("nic_gbps", preset_gbps) / gpus
    same = abs(per_gpu - preset_gbps * preset_links / gpus) < 1e-6
    links_said, rate_said = overrides.get("nics_per_node", preset_links), overrides.get("nic_gbps", preset_gbps)
    tag = "" if same and fabric.network.value == (cluster.get("network") or "infiniband") else (
        f"{fabric.network.value} {links_said}x{rate_said:g}G")
    approximation = "" if fabric.bus_share is not None else (
        f"interconnect {fabric.network.value}: no measured share of line rate for it (cfp_megatron/cluster/"
        "fabrics.yaml), priced at InfiniBand's")
    return Reading(cluster=overrides, tag=tag, approximation=approximation)


# ---------------------------------------------------------------------------------------------------------------
# pp_schedule


@dataclass(frozen=True, kw_only=True)
class ScheduleReading(Reading):
    """The pipeline schedule a row states, as the model chunks per rank the simulator runs it with."""

    vp: int = 1
    """Model chunks per pipeline rank (1: non-interleaved 1F1B)."""
    schedule: PipelineSchedule = PipelineSchedule.megatron
    """The schedule the simulator prices it with (GPipe and the zero-bubble ones: one chunk a rank)."""


def schedule_reading(row: dict, pp: int, vp: int | None, entries: tuple[ColumnEntry, ...] | None = None
                     ) -> ScheduleReading:
    """The row's ``pp_schedule`` with its ``vp`` column (``vp``: ``None`` where blank) and pipeline size: Megatron's
    1F1B (one chunk a rank), interleaved 1F1B over the ``vp`` column's chunks or, where it is blank, the chunks the
    text states (``interleaved 1F1B (3 stages per rank)``); a schedule the simulator does not model (GPipe,
    zero-bubble, DualPipe, ...) priced as the nearest one it does, and said (``schedules.yaml``)."""
    text = " ".join((row.get("pp_schedule") or "").split())
    chunks = vp or 1
    if not text or pp <= 1:
        return ScheduleReading(vp=chunks)
    entry = _first(entries if entries is not None else load_schedules(), text)
    if entry is None:
        return ScheduleReading(vp=chunks, tag="sched?", approximation=(
            f"pp_schedule {text!r} names no schedule validate knows (cfp_megatron/validation/schedules.yaml): priced "
            f"as Megatron's {'interleaved 1F1B' if chunks > 1 else '1F1B'}"))
    stated = re.search(r"(\d+)\s*(?:virtual\s+)?(?:stages?|chunks?|model\s+chunks?)\s*(?:per|/|a)\s*"
                       r"(?:rank|device|gpu|stage)|\bv(?:pp?)?\s*=\s*(\d+)", text, re.IGNORECASE)
    said = int(stated.group(1) or stated.group(2)) if stated else None
    notes = [entry.approximation] if entry.approximation else []
    if entry.runs == "interleaved":
        if vp is None and said:
            chunks = said
        elif vp is not None and said and said != vp:
            notes.append(f"pp_schedule states {said} chunks a rank, the vp column {vp}: priced with the vp column's")
        if chunks <= 1:
            notes.append(f"pp_schedule {text!r} is interleaved but neither it nor the vp column states the chunks "
                         "a rank: priced as 1F1B (the bubble of interleaving not credited)")
    elif entry.runs == "1f1b" and chunks > 1:
        notes.append(f"pp_schedule {text!r} is not interleaved but the vp column says {chunks} chunks a rank: priced "
                     "as interleaved 1F1B over the vp column's chunks")
    elif entry.runs not in ("1f1b", "interleaved", "default"):  # GPipe, ZB-H1 / ZB-H2: one chunk a rank
        if chunks > 1:
            notes.append(f"pp_schedule {text!r} runs one model chunk a rank but the vp column says {chunks}: priced "
                         "as interleaved 1F1B over the vp column's chunks")
            return ScheduleReading(vp=chunks, tag=entry.tag, approximation="; ".join(notes))
        return ScheduleReading(vp=1, tag=entry.tag, schedule=PipelineSchedule(entry.runs),
                               approximation="; ".join(notes))
    return ScheduleReading(vp=chunks, tag=entry.tag, approximation="; ".join(notes))


# ---------------------------------------------------------------------------------------------------------------
# precision


@dataclass(frozen=True, kw_only=True)
class PrecisionReading(Reading):
    """The precision a row states, as the simulator prices it."""

    number_format: str = "bf16"
    """The number format it is priced in (:attr:`~cfp_megatron.base.number_format.NumberFormat.name`: ``bf16``,
    ``fp8-delayed``, ``fp4-nvfp4``, ...), through the same format model as a plan's."""
    variant: str = ""
    """The variant read (``precisions.yaml``'s entry name: ``FP8 current scaling``, ``NVFP4``, ...)."""


def precision_reading(row: dict, cluster: dict[str, Any], entries: tuple[tuple[ColumnEntry, ...], ColumnEntry]
                      | None = None) -> PrecisionReading:
    """The row's ``precision`` (``precisions.yaml``): its variant, what the simulator prices it as, and what of it
    is approximated (a format the row's GPU does not compute, as its preset's ``number_formats`` says, priced as
    bf16)."""
    text = " ".join((row.get("precision") or "").split())
    listed, blank = entries if entries is not None else load_precisions()
    entry = _first(listed, text) if text else blank
    notes = []
    if entry is None:
        entry = blank
        notes.append(f"precision {text!r} names no variant validate knows (cfp_megatron/validation/precisions.yaml):"
                     " priced as bf16")
    elif entry.approximation:
        notes.append(entry.approximation)
    fmt = NumberFormat.parse(entry.runs)
    formats = cluster.get("number_formats")
    if fmt.needs is not None and formats is not None and fmt.needs not in formats:
        notes.append(f"precision {entry.name} on a GPU without {fmt.needs} tensor cores ({cluster.get('name')} lists "
                     f"{', '.join(formats)}): priced at its bf16 rate")
        fmt = NumberFormat(precision=Precision.bf16)
    tag = entry.tag or ("fp8" if fmt.precision is Precision.fp8 else "")
    return PrecisionReading(number_format=fmt.name, variant=entry.name, tag=tag, approximation="; ".join(notes))


PLAIN_FP8 = "FP8"
"""``precisions.yaml``'s entry for an FP8 that names no scaling recipe."""


def preset_precision(reading: PrecisionReading, fp8_format: str | None,
                     entries: tuple[tuple[ColumnEntry, ...], ColumnEntry] | None = None) -> PrecisionReading:
    """``reading`` where the row's performance preset ran its plain FP8 (:data:`PLAIN_FP8`) in ``fp8_format``
    (``recipes.yaml``): that format, named and tagged as the ``precisions.yaml`` entry that runs it; any other
    reading (a recipe the row names, no preset's format, FP8 priced as bf16 on a GPU without it) as it is."""
    if fp8_format is None or reading.variant != PLAIN_FP8 or not reading.number_format.startswith("fp8-"):
        return reading
    listed, _ = entries if entries is not None else load_precisions()
    entry = next((e for e in listed if e.runs == fp8_format), None)
    return dataclasses.replace(reading, number_format=fp8_format, variant=entry.name if entry else fp8_format,
                               tag=(entry.tag if entry else "") or "fp8")


# ---------------------------------------------------------------------------------------------------------------
# power


_GPU_MEMORY = r"(?<![\w.])(\d+(?:\.\d+)?)\s*GB(?![\w])"
"""A memory size in the ``gpu`` column: ``96GB``, ``94 GB``, ``H100-SXM5-80GB`` (not ``GB200``)."""


def memory_reading(row: dict, cluster: dict[str, Any]) -> Reading:
    """The GPU memory the row's ``gpu`` column states (``H100 96GB HBM2e``) where it is not its preset's, as
    ``cluster.hbm_gib`` (the presets hold the datasheet's GB figure there): the memory a run fit in, against which
    validate's memory failures are judged. A figure of the whole node (``DGX A100 320GB``: the preset's memory times
    its GPUs per node) or none keeps the preset's."""
    found = re.findall(_GPU_MEMORY, row.get("gpu") or "")
    hbm, gpus = cluster.get("hbm_gib"), cluster.get("gpus_per_node") or 1
    if len(found) != 1 or not hbm:
        return Reading()
    stated = float(found[0])
    if abs(stated - hbm) < 1.0 or abs(stated - hbm * gpus) < 1.0:
        return Reading()
    return Reading(cluster={"hbm_gib": stated}, tag=f"{stated:g}GB")


def power_reading(row: dict, cluster: dict[str, Any]) -> Reading:
    """A power limit the row states (:func:`~cfp_megatron.validation.rows.power_limit`) below its preset's TDP, as
    ``cluster.power_limit_w``: the compute peaks scale by ``(P / TDP)^(1/3)`` (``ClusterSpec.clock_scale``), the
    clock the cap allows where dynamic power goes as ``f V^2`` and voltage with the clock: an upper bound, said as an
    approximation. At or above the TDP nothing changes; a preset without a TDP records it and says so."""
    watts = power_limit(row)
    if watts is None:
        return Reading()
    tdp = cluster.get("tdp_w")
    if not tdp:
        return Reading(tag=f"{watts:g}W?", approximation=(
            f"power limit {watts:g} W stated, not priced: the {cluster.get('name')} preset states no TDP"))
    if watts >= tdp:
        return Reading()
    scale = (watts / tdp) ** (1.0 / 3.0)
    return Reading(cluster={"power_limit_w": watts}, tag=f"{watts:g}W", approximation=(
        f"power limit {watts:g} W of {tdp:g} W: compute peaks x{scale:.2f} by (P/TDP)^(1/3), an upper bound of the "
        "clock the cap allows (static power ignored; the one operation-level measurement found, cuBLAS GEMM on a "
        "GB300 at 500 of 1,400 W, ran at 0.28-0.39 of its full-power rate where the bound says 0.71)"))
