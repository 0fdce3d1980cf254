"""The validator's data files (``frameworks.yaml``, ``model_families.yaml``, ``recipes.yaml``, ``schedules.yaml``,
``precisions.yaml``, ``source_settings.yaml`` beside this module), read into typed entries; each loader takes another
file's path (a test's, a user's) in the same format."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from yaml import YAMLError

from cfp_megatron.base.config import AttentionKernel, CudaGraphImpl, FlexBackend, cuda_graph_scopes
from cfp_megatron.base.errors import CfpError
from cfp_megatron.base.number_format import format_names
from cfp_megatron.sim.options import ApexAdamStates, WeightGradAccumulation
from cfp_megatron.validation.rows import COLUMNS, COUNT_COLUMNS, RowError, count_cell

DATA_DIR = Path(__file__).resolve().parent
FRAMEWORKS_FILE = DATA_DIR / "frameworks.yaml"
FAMILIES_FILE = DATA_DIR / "model_families.yaml"
RECIPES_FILE = DATA_DIR / "recipes.yaml"
SCHEDULES_FILE = DATA_DIR / "schedules.yaml"
PRECISIONS_FILE = DATA_DIR / "precisions.yaml"
SETTINGS_FILE = DATA_DIR / "source_settings.yaml"
VERSION = 1
"""The format version every data file states (``version:``); a file of another version is refused."""
BLANK_COLUMNS = {"sequence_parallel", "zero_or_fsdp", "recompute"}
"""Columns a framework entry may give a blank reading for (``blank:``)."""
FAMILY_COLUMNS = {"vocab": "vocab_size", "kv_heads": "num_query_groups"}
"""Columns a model family may fill where blank (``blank:``), and the model field each sets."""


class ValidationDataError(CfpError, ValueError):
    """A data file of the validator cannot be read; the message names the file, the entry and the fix."""


@dataclass(frozen=True, kw_only=True)
class FrameworkMatch:
    """Which ``framework`` columns an entry covers; every condition given must hold (compared lower-case)."""

    contains: tuple[str, ...] = ()
    """The column holds one of these substrings; empty: any."""
    starts_with: str = ""
    """The column starts with this; empty: any."""
    before_year: int | None = None
    """The column names a year (``20xx``, the first one) before this; ``None``: any year or none."""
    pattern: str = ""
    """The column matches this regular expression somewhere (case-insensitive); empty: any."""

    def matches(self, framework: str) -> bool:
        """Whether the ``framework`` column ``framework`` meets every condition."""
        text = framework.lower()
        if self.contains and not any(part in text for part in self.contains):
            return False
        if self.starts_with and not text.startswith(self.starts_with):
            return False
        if self.pattern and not re.search(self.pattern, text, re.IGNORECASE):
            return False
        if self.before_year is not None:
            year = re.search(r"\b(20\d\d)\b", text)
            return year is not None and int(year.group(1)) < self.before_year
        return True


@dataclass(frozen=True, kw_only=True)
class Framework:
    """What a row of one framework runs where its columns are blank or silent (an entry of ``frameworks.yaml``)."""

    name: str
    """The framework, as a person names it."""
    match: FrameworkMatch
    """The ``framework`` columns it covers."""
    blank: dict[str, str]
    """Column -> the text a blank column of it is read as (:data:`BLANK_COLUMNS`)."""
    attention: AttentionKernel
    """The attention core its rows run."""
    overlap_grad_reduce: bool
    """Data-parallel gradient reduction overlapped with backward."""
    tp_comm_overlap: bool
    """TP communication overlapped with the GEMMs (where sequence parallelism is on)."""
    grad_reduce_in_fp32: bool
    """Gradients accumulated and reduced in fp32 (``False``: bf16)."""
    mtp_layers: tuple[tuple[str, int], ...]
    """(pattern on ``model``, multi-token-prediction layers) of the models its recipes train with MTP."""
    source: str
    """Where this comes from."""
    pipeline_scatter_gather: bool = False
    """The exchange between pipeline stages split over TP and all-gathered after it (Megatron-LM before
    Megatron-Core, :attr:`~cfp_megatron.sim.options.SimOptions.pipeline_scatter_gather`)."""
    blocking_interleaved: bool = False
    """Its interleaved schedule's exchanges block, with both neighbours each step (Megatron-LM before Megatron-Core,
    :attr:`~cfp_megatron.sim.options.SimOptions.blocking_interleaved`)."""
    fp8_param_gather: tuple[str, ...] = ()
    """The number formats (:data:`PRECISION_RUNS` names) whose rows kept the parameters in FP8
    (``parallel.fp8_param_gather``)."""
    overlap_param_gather: bool = False
    """Its distributed optimizer's parameter all-gather overlaps the next forward (``parallel.overlap_param_gather``,
    Megatron-Core's ``overlap_param_gather``)."""
    async_tp_backward: bool = True
    """Its linear layers run the backward's TP/SP collectives beside the gradient GEMMs
    (:attr:`~cfp_megatron.sim.options.SimOptions.async_tp_backward`)."""
    global_memory_buffer: bool = True
    """Its Megatron holds a global memory buffer (:attr:`~cfp_megatron.sim.options.SimOptions.global_memory_buffer`)."""
    wgrad_placeholder: bool = True
    """Its fused linears hand autograd a placeholder weight gradient
    (:attr:`~cfp_megatron.sim.options.SimOptions.wgrad_placeholder`)."""
    te_cross_entropy: bool = False
    """Its loss runs Transformer Engine's fused cross entropy (:attr:`~cfp_megatron.sim.options.SimOptions.
    te_cross_entropy`)."""
    torch_fsdp: bool = False
    """Its sharded weights are PyTorch FSDP's (:attr:`~cfp_megatron.sim.options.SimOptions.torch_fsdp`)."""
    weight_grad_accumulation: WeightGradAccumulation = WeightGradAccumulation.fused
    """How its micro-batches' weight gradients are added to the step's
    (:attr:`~cfp_megatron.sim.options.SimOptions.weight_grad_accumulation`)."""
    rank_batch_micro: bool = False
    """A blank ``micro_batch`` of its rows, with no ``grad_accum`` and no pipeline, is the rank's whole batch
    (``global_batch_seqs`` / DP): it accumulates no gradients unless told."""
    torch_fused_adamw: bool = False
    """Its optimizer steps as PyTorch's fused AdamW (:attr:`~cfp_megatron.sim.options.SimOptions.
    torch_fused_adamw`)."""
    eager_loss: bool = False
    """Its loss runs eagerly (:attr:`~cfp_megatron.sim.options.SimOptions.eager_torch_loss`), except for the models
    of ``compiled_loss``."""
    compiled_loss: tuple[str, ...] = ()
    """Patterns on ``model`` (case-insensitive) whose recipes compile the loss."""
    compiled_model: tuple[str, ...] = ()
    """Patterns on ``model`` (case-insensitive) whose recipes compile the model and the loss (``torch.compile``:
    Inductor fuses the element-wise chains, so :attr:`torch_swiglu`'s SwiGLU runs as one kernel)."""
    compiled_notes: str | None = None
    """A pattern (case-insensitive) on a row's ``notes`` and ``framework`` that says it ran compiled, as
    :attr:`compiled_model` reads; ``None``: no row says so."""
    unfused_rope: tuple[str, ...] = ()
    """Patterns on ``model`` (case-insensitive) whose RoPE it runs unfused (:attr:`~cfp_megatron.sim.options.
    SimOptions.rope_fusion` off)."""
    load_balancing_loss: tuple[tuple[str, float], ...] = ()
    """(pattern on ``model``, ``moe_aux_loss_coeff``) of the MoE models its recipes train with a load-balancing loss
    (:attr:`~cfp_megatron.base.config.ModelSpec.moe_aux_loss_coeff`); the first match applies, none: the model
    family's."""
    router_fusion: tuple[str, ...] = ()
    """Patterns on ``model`` (case-insensitive) whose MoE router it runs as Transformer Engine's fused kernels
    (:attr:`~cfp_megatron.base.config.ModelSpec.moe_router_fusion`)."""
    torch_moe_combine: bool = False
    """Its MoE layer is torchtitan's (:attr:`~cfp_megatron.sim.options.SimOptions.torch_moe_combine`)."""
    torchao_low_precision: bool = False
    """Its FP8/FP4 linears are torchao's (:attr:`~cfp_megatron.sim.options.SimOptions.torchao_low_precision`)."""
    torch_swiglu: bool = False
    """Its SwiGLU MLPs are torchtitan's (:attr:`~cfp_megatron.sim.options.SimOptions.torch_swiglu`)."""
    dtensor_tp: bool = False
    """Its tensor parallelism is torchtitan's DTensor plan (:attr:`~cfp_megatron.sim.options.SimOptions.
    dtensor_tp`)."""
    torch_op_sac: bool = False
    """Its selective recomputation is torchtitan's per-op policy (:attr:`~cfp_megatron.sim.options.SimOptions.
    torch_op_sac`)."""
    moe_layer_syncs: int | None = None
    """Device-to-host synchronisations of its dropless MoE layers' forward (:attr:`~cfp_megatron.sim.options.
    SimOptions.moe_layer_syncs`; ``None``: Megatron-Core's)."""
    apex_adam: tuple[tuple[str, ApexAdamStates], ...] = ()
    """(pattern on ``model``, how its states are kept) where its distributed optimizer is Apex's
    DistributedFusedAdam (:attr:`~cfp_megatron.sim.options.SimOptions.apex_adam`); the first match applies, empty:
    Megatron-Core's."""
    tie_embeddings: bool = False
    """Its models share the word embedding with the output layer (``model.tie_embeddings``), whose gradient is
    all-reduced between the first and the last pipeline stage."""
    deepspeed_engine: bool = False
    """Its data parallelism and optimizer are DeepSpeed's engine's (:attr:`~cfp_megatron.sim.options.SimOptions.
    deepspeed_engine`)."""


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """What a model family fixes that a row leaves blank or no column holds (an entry of ``model_families.yaml``)."""

    name: str
    """The family."""
    pattern: str
    """Regular expression on the row's ``model`` and ``arch_source`` (case-insensitive); empty: any model."""
    blank: dict[str, int]
    """Column (:data:`FAMILY_COLUMNS`) -> value where the row leaves it blank."""
    model: dict[str, Any]
    """Model fields (``conf/model`` keys) no column holds, always set."""
    source: str
    """Where this comes from."""


@dataclass(frozen=True, kw_only=True)
class Families:
    """``model_families.yaml``: the reading of a blank column for any model, and the families in match order."""

    default: ModelFamily
    """What a blank column means for every model (a family's ``blank`` overrides it)."""
    families: tuple[ModelFamily, ...]
    """The families; the first whose pattern matches applies."""


@dataclass(frozen=True, kw_only=True)
class PerformanceRecipe:
    """The communication settings of one performance preset (MoE, or a dense one that offloads activations), for the
    rows that ran it (a ``recipes.yaml`` entry)."""

    name: str
    """The preset, as a person names it."""
    framework: str
    """The :class:`Framework` whose rows may have run it."""
    releases: tuple[tuple[int, int], tuple[int, int] | None]
    """First and last container (year, month) whose preset files set this; ``None``: up to now."""
    model: str
    """Regular expression the row's ``model`` matches (case-insensitive)."""
    precision: str = ""
    """Regular expression the row's ``precision`` matches (case-insensitive) where the preset differs by precision;
    empty: any."""
    hardware: tuple[str, ...]
    """Hardware presets (``conf/cluster``) of the rows' GPUs."""
    layouts: tuple[tuple[int, int, int, int, int, int], ...]
    """(GPUs, TP, PP, VP, EP, global batch) of the preset: a row with another layout ran another configuration."""
    dispatcher: str
    """``model.moe_token_dispatcher``: ``flex`` or ``alltoall``."""
    flex_backend: str | None = None
    """With ``dispatcher: flex``: ``parallel.moe_flex_dispatcher_backend`` where the preset's source states it
    (``deepep`` or ``hybridep``); ``None``: unstated, priced as
    :attr:`~cfp_megatron.sim.options.SimOptions.flex_backend_unstated` says."""
    a2a_overlap: bool
    """``parallel.moe_a2a_overlap``."""
    tp_comm_overlap: bool = True
    """``parallel.tp_comm_overlap``."""
    overlap_grad_reduce: bool = True
    """``parallel.overlap_grad_reduce``."""
    recompute_modules: str | None = None
    """The preset's selective recomputation (``+``-joined), unless the row states its recomputation; ``None``: none."""
    cuda_graph_impl: str = "none"
    """``parallel.cuda_graph_impl``: the preset's ``cuda_graph_impl`` (``none`` where it sets none)."""
    cuda_graph_scope: str | None = None
    """``parallel.cuda_graph_scope``: the preset's ``cuda_graph_scope`` joined by ``+`` (``None``: the whole layer)."""
    micro_batch: int | None = None
    """The preset's ``micro_batch_size``, read where the row's own micro-batch, gradient accumulation and DP size
    contradict its global batch; ``None``: the row's."""
    cpu_offloading_num_layers: int = 0
    """``parallel.cpu_offloading_num_layers``: the layers whose activations the preset offloads to host memory
    (``cpu_offloading_num_layers``), unless the row states its recomputation; 0: none."""
    fp8_format: str | None = None
    """The number format (:attr:`~cfp_megatron.base.number_format.NumberFormat.name`, ``fp8-tensorwise``) the preset
    ran where the row's precision says FP8 without its recipe; ``None``: the precision column's reading."""
    gradient_accumulation_fusion: bool = True
    """The preset's ``gradient_accumulation_fusion``; ``False``: each weight gradient is a new tensor added into the
    main gradient by a hook (:attr:`~cfp_megatron.sim.options.WeightGradAccumulation.main_grad_hook`), no
    placeholder."""
    fsdp_double_buffer: bool = False
    """The preset's ``ddp.fsdp_double_buffer`` (:attr:`~cfp_megatron.sim.options.SimOptions.fsdp_double_buffer`)."""
    fsdp_unit_size: int | None = None
    """The preset's ``ddp.suggested_communication_unit_size`` (:attr:`~cfp_megatron.sim.options.SimOptions.
    fsdp_unit_size`); ``None``: unset."""
    offload_v1_until: tuple[int, int] | None = None
    """The last container (year, month) whose Transformer Engine offloads with its handler before 2.10
    (:attr:`~cfp_megatron.sim.options.SimOptions.offload_v1` for rows up to it); ``None``: none does."""
    source: str
    """Where this comes from."""


def _read(path: Path) -> dict[str, Any]:
    """The YAML file ``path`` as a dict of its format :data:`VERSION`."""
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (OSError, YAMLError, OmegaConfBaseException) as err:
        raise ValidationDataError(f"{path}: cannot be read as YAML ({err}). Fix: correct the file.") from None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise ValidationDataError(f"{path}: states no 'version: {VERSION}'. Fix: write the format this validator "
                                  "reads (see cfp_megatron/validation/data.py).")
    return data


class _Entry:
    """One entry of a data file, read key by key; an unknown or missing key is a :class:`ValidationDataError`."""

    def __init__(self, path: Path, index: int | None, raw: object, keys: set[str]) -> None:
        self.where = f"{path}: " + ("the default entry" if index is None else f"entry {index + 1}") + (
            f" ({raw.get('name')!r})" if isinstance(raw, dict) else "")
        if not isinstance(raw, dict):
            self.fail(f"is {raw!r}, not a mapping of keys")
        unknown = sorted(set(raw) - keys - {"name", "source"})
        if unknown:
            self.fail(f"has unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(keys | {'name'}))})")
        self.raw = raw
        if not isinstance(raw.get("name"), str) or not raw["name"].strip():
            self.fail("has no name")
        if not isinstance(raw.get("source"), str) or not raw["source"].strip():
            self.fail("names no source (the document or repository file, and its version, it comes from)")

    def fail(self, problem: str) -> None:
        raise ValidationDataError(f"{self.where} {problem}. Fix: correct the entry.")

    def get(self, key: str, kind: type | tuple[type, ...], default: object = ...) -> Any:
        if key not in self.raw:
            if default is ...:
                self.fail(f"has no {key}")
            return default
        value = self.raw[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            self.fail(f"has {key}={value!r}, not a {getattr(kind, '__name__', kind)}")
        return value

    def pattern(self, key: str, default: object = ...) -> str:
        return self.regex(key, self.get(key, str, default))

    def regex(self, what: str, value: object) -> str:
        """``value``, refused unless it is a regular expression (``what`` names it in the message)."""
        try:
            re.compile(value)
        except (re.error, TypeError) as err:
            self.fail(f"has {what}={value!r}, not a regular expression ({err})")
        return value


def _model_patterns(entry: _Entry, runs: dict[str, Any], key: str) -> tuple[str, ...]:
    """The model patterns (regular expressions) a framework entry's ``runs.<key>`` lists."""
    patterns = runs.get(key) or []
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        entry.fail(f"has {key}={patterns!r}; it lists model patterns")
    for model_pattern in patterns:
        try:
            re.compile(model_pattern)
        except re.error as err:
            entry.fail(f"has {key} pattern {model_pattern!r}, not a regular expression ({err})")
    return tuple(patterns)


def _entries(path: Path, data: dict[str, Any], key: str) -> list[Any]:
    entries = data.get(key)
    if not isinstance(entries, list) or not entries:
        raise ValidationDataError(f"{path}: no '{key}:' list. Fix: list the entries under '{key}:'.")
    return entries


@lru_cache(maxsize=8)
def load_frameworks(path: Path = FRAMEWORKS_FILE) -> tuple[Framework, ...]:
    """The framework entries of ``path`` in match order (read once per path)."""
    path = Path(path)
    frameworks = []
    for index, raw in enumerate(_entries(path, _read(path), "frameworks")):
        entry = _Entry(path, index, raw, {"match", "blank", "runs", "approximation"})
        match = entry.get("match", dict)
        if (set(match) - {"contains", "starts_with", "before_year", "pattern"}
                or not isinstance(match.get("contains", []), list) or not isinstance(match.get("starts_with", ""), str)
                or not isinstance(match.get("before_year", 0), int)):
            entry.fail(f"has match={match!r}; it gives contains (a list of substrings), starts_with (a prefix), "
                       "before_year (a year), pattern (a regular expression)")
        pattern = match.get("pattern", "")
        try:
            re.compile(pattern)
        except (re.error, TypeError) as err:
            entry.fail(f"has match pattern={pattern!r}, not a regular expression ({err})")
        blank = entry.get("blank", dict, {})
        if set(blank) - BLANK_COLUMNS or not all(isinstance(v, str) for v in blank.values()):
            entry.fail(f"has blank={blank!r}; it maps {' or '.join(sorted(BLANK_COLUMNS))} to the text a blank "
                       "column is read as")
        runs = entry.get("runs", dict)
        optional = {"mtp_layers", "pipeline_scatter_gather", "fp8_param_gather", "te_cross_entropy", "torch_fsdp",
                    "apex_distributed_adam", "overlap_param_gather", "weight_grad_accumulation", "torch_fused_adamw",
                    "moe_layer_syncs", "rank_batch_micro", "tie_embeddings", "deepspeed_engine", "torch_op_sac",
                    "torch_moe_combine", "eager_loss", "compiled_loss", "unfused_rope", "async_tp_backward",
                    "blocking_interleaved", "global_memory_buffer", "wgrad_placeholder", "torchao_low_precision",
                    "router_fusion", "torch_swiglu", "dtensor_tp", "compiled_model", "compiled_notes",
                    "load_balancing_loss"}
        known = {"attention", "overlap_grad_reduce", "tp_comm_overlap", "grad_reduce_in_fp32"} | optional
        if set(runs) - known or not known - optional <= set(runs):
            entry.fail(f"has runs keys {sorted(runs)}; it states {', '.join(sorted(known - optional))} "
                       "(and mtp_layers where its recipes train MTP layers, pipeline_scatter_gather where its "
                       "pipeline exchange is split over TP)")
        try:
            attention = AttentionKernel(runs["attention"])
        except ValueError:
            entry.fail(f"has attention={runs['attention']!r}; one of {[a.value for a in AttentionKernel]}")
        fp8_params = runs.get("fp8_param_gather") or []
        if not isinstance(fp8_params, list) or not set(fp8_params) <= set(PRECISION_RUNS):
            entry.fail(f"has fp8_param_gather={fp8_params!r}; it lists number formats of {list(PRECISION_RUNS)}")
        mtp = runs.get("mtp_layers") or {}
        if not isinstance(mtp, dict) or not all(isinstance(n, int) and n >= 0 for n in mtp.values()):
            entry.fail(f"has mtp_layers={mtp!r}; it maps a model pattern to a number of layers")
        balancing = runs.get("load_balancing_loss") or {}
        if not isinstance(balancing, dict) or not all(
                isinstance(c, int | float) and not isinstance(c, bool) and c > 0 for c in balancing.values()):
            entry.fail(f"has load_balancing_loss={balancing!r}; it maps a model pattern to a coefficient above 0")
        apex = runs.get("apex_distributed_adam") or {}
        states = {state.value for state in ApexAdamStates}
        if not isinstance(apex, dict) or not all(isinstance(v, str) and v in states for v in apex.values()):
            entry.fail(f"has apex_distributed_adam={apex!r}; it maps a model pattern to one of {sorted(states)}")
        accumulation = runs.get("weight_grad_accumulation", WeightGradAccumulation.fused.value)
        if accumulation not in {how.value for how in WeightGradAccumulation}:
            entry.fail(f"has weight_grad_accumulation={accumulation!r}; one of "
                       f"{[how.value for how in WeightGradAccumulation]}")
        syncs = runs.get("moe_layer_syncs")
        if syncs is not None and (not isinstance(syncs, int) or isinstance(syncs, bool) or syncs < 0):
            entry.fail(f"has moe_layer_syncs={syncs!r}; it counts a MoE layer's synchronisations (0 or more)")
        compiled = _model_patterns(entry, runs, "compiled_loss")
        compiled_model = _model_patterns(entry, runs, "compiled_model")
        compiled_notes = runs.get("compiled_notes")
        if compiled_notes is not None:
            if not isinstance(compiled_notes, str):
                entry.fail(f"has compiled_notes={compiled_notes!r}; it is one regular expression")
            try:
                re.compile(compiled_notes)
            except re.error as err:
                entry.fail(f"has compiled_notes {compiled_notes!r}, not a regular expression ({err})")
        unfused_rope = _model_patterns(entry, runs, "unfused_rope")
        router_fusion = _model_patterns(entry, runs, "router_fusion")
        contains = match.get("contains", [])
        frameworks.append(Framework(
            name=raw["name"], source=raw["source"], blank=dict(blank), attention=attention,
            match=FrameworkMatch(contains=tuple(str(c).lower() for c in contains),
                                 starts_with=str(match.get("starts_with", "")).lower(),
                                 before_year=match.get("before_year"), pattern=pattern),
            overlap_grad_reduce=bool(runs["overlap_grad_reduce"]), tp_comm_overlap=bool(runs["tp_comm_overlap"]),
            grad_reduce_in_fp32=bool(runs["grad_reduce_in_fp32"]), mtp_layers=tuple(mtp.items()),
            pipeline_scatter_gather=bool(runs.get("pipeline_scatter_gather", False)),
            blocking_interleaved=bool(runs.get("blocking_interleaved", False)),
            fp8_param_gather=tuple(fp8_params), te_cross_entropy=bool(runs.get("te_cross_entropy", False)),
            async_tp_backward=bool(runs.get("async_tp_backward", True)),
            global_memory_buffer=bool(runs.get("global_memory_buffer", True)),
            wgrad_placeholder=bool(runs.get("wgrad_placeholder", True)),
            torch_fsdp=bool(runs.get("torch_fsdp", False)), tie_embeddings=bool(runs.get("tie_embeddings", False)),
            deepspeed_engine=bool(runs.get("deepspeed_engine", False)),
            overlap_param_gather=bool(runs.get("overlap_param_gather", False)),
            weight_grad_accumulation=WeightGradAccumulation(accumulation),
            torch_fused_adamw=bool(runs.get("torch_fused_adamw", False)), moe_layer_syncs=syncs,
            torch_op_sac=bool(runs.get("torch_op_sac", False)),
            torch_moe_combine=bool(runs.get("torch_moe_combine", False)),
            torchao_low_precision=bool(runs.get("torchao_low_precision", False)),
            torch_swiglu=bool(runs.get("torch_swiglu", False)), dtensor_tp=bool(runs.get("dtensor_tp", False)),
            eager_loss=bool(runs.get("eager_loss", False)), compiled_loss=compiled, unfused_rope=unfused_rope,
            compiled_model=compiled_model, compiled_notes=compiled_notes, router_fusion=router_fusion,
            load_balancing_loss=tuple((str(pattern), float(c)) for pattern, c in balancing.items()),
            rank_batch_micro=bool(runs.get("rank_batch_micro", False)),
            apex_adam=tuple((str(pattern), ApexAdamStates(state)) for pattern, state in apex.items())))
    if frameworks[-1].match != FrameworkMatch():
        raise ValidationDataError(f"{path}: the last entry ({frameworks[-1].name!r}) has conditions, so a row of "
                                  "another framework has no reading. Fix: end with an entry of 'match: {}'.")
    return tuple(frameworks)


def _family(path: Path, index: int | None, raw: object) -> ModelFamily:
    """Entry ``index`` of the families of ``path`` (``None``: its ``default`` entry, which has no pattern)."""
    default = index is None
    entry = _Entry(path, index, raw, {"blank", "model"} | (set() if default else {"pattern"}))
    blank = entry.get("blank", dict, {})
    if set(blank) - set(FAMILY_COLUMNS) or not all(isinstance(v, int) and v > 0 for v in blank.values()):
        entry.fail(f"has blank={blank!r}; it maps {' or '.join(FAMILY_COLUMNS)} to a count")
    return ModelFamily(name=raw["name"], source=raw["source"], pattern="" if default else entry.pattern("pattern"),
                       blank=dict(blank), model=dict(entry.get("model", dict, {})))


@lru_cache(maxsize=8)
def load_families(path: Path = FAMILIES_FILE) -> Families:
    """The model families of ``path``: its ``default`` entry and its families in match order (read once per path)."""
    path = Path(path)
    data = _read(path)
    return Families(default=_family(path, None, data.get("default")),
                    families=tuple(_family(path, index, raw)
                                   for index, raw in enumerate(_entries(path, data, "families"))))


def _release(entry: _Entry, value: object) -> tuple[int, int]:
    found = re.fullmatch(r"(\d\d)\.(\d\d)", value) if isinstance(value, str) else None
    if found is None:
        entry.fail(f"has release {value!r}, not a container release YY.MM in quotes")
    return int(found.group(1)), int(found.group(2))


LAYOUT_KEYS = ("gpus", "tp", "pp", "vp", "ep", "global_batch")
"""The keys of a recipe's layout, in :attr:`PerformanceRecipe.layouts` order."""


@lru_cache(maxsize=8)
def load_recipes(path: Path = RECIPES_FILE) -> tuple[PerformanceRecipe, ...]:
    """The performance presets of ``path`` in match order (read once per path)."""
    path = Path(path)
    data = _read(path)
    framework = data.get("framework")
    if not isinstance(framework, str):
        raise ValidationDataError(f"{path}: names no 'framework:' (a frameworks.yaml entry) whose rows ran these "
                                  "presets. Fix: add it.")
    keys = {"releases", "model", "precision", "hardware", "layouts", "dispatcher", "a2a_overlap", "tp_comm_overlap",
            "overlap_grad_reduce", "recompute_modules", "cuda_graph_impl", "cuda_graph_scope", "micro_batch",
            "cpu_offloading_num_layers", "flex_backend", "fp8_format", "gradient_accumulation_fusion",
            "fsdp_double_buffer", "fsdp_unit_size", "offload_v1_until"}
    recipes = []
    for index, raw in enumerate(_entries(path, data, "recipes")):
        entry = _Entry(path, index, raw, keys)
        releases = entry.get("releases", list)
        if len(releases) != 2:
            entry.fail(f"has releases={releases!r}; give the first and last, [\"26.01\", null]")
        layouts = entry.get("layouts", list)
        if not layouts or not all(isinstance(lay, dict) and sorted(lay) == sorted(LAYOUT_KEYS)
                                  and all(isinstance(lay[k], int) and lay[k] > 0 for k in LAYOUT_KEYS)
                                  for lay in layouts):
            entry.fail(f"has layouts={layouts!r}; each states {', '.join(LAYOUT_KEYS)} as positive counts")
        hardware = entry.get("hardware", list)
        if not hardware or not all(isinstance(name, str) for name in hardware):
            entry.fail(f"has hardware={hardware!r}; list the hardware presets (conf/cluster names)")
        dispatcher = entry.get("dispatcher", str)
        if dispatcher not in ("alltoall", "flex"):
            entry.fail(f"has dispatcher={dispatcher!r}; alltoall or flex")
        backend = entry.get("flex_backend", (str, type(None)), None)
        if backend is not None and (dispatcher != "flex" or backend not in {b.value for b in FlexBackend}):
            entry.fail(f"has flex_backend={backend!r}; with dispatcher: flex, one of "
                       f"{', '.join(b.value for b in FlexBackend)}")
        modules = entry.get("recompute_modules", (str, type(None)), None)
        graphs = entry.get("cuda_graph_impl", str, "none")
        if graphs not in {impl.value for impl in CudaGraphImpl}:
            entry.fail(f"has cuda_graph_impl={graphs!r}; one of {', '.join(impl.value for impl in CudaGraphImpl)}")
        scope = entry.get("cuda_graph_scope", (str, type(None)), None)
        try:
            cuda_graph_scopes(scope)
        except ValueError as err:
            entry.fail(f"has cuda_graph_scope={scope!r}: {err}")
        if scope is not None and graphs == "none":
            entry.fail(f"has cuda_graph_scope={scope!r} without a cuda_graph_impl")
        micro_batch = entry.get("micro_batch", (int, type(None)), None)
        if micro_batch is not None and (isinstance(micro_batch, bool) or micro_batch < 1):
            entry.fail(f"has micro_batch={micro_batch!r}; a positive count (the preset's micro_batch_size)")
        offloaded = entry.get("cpu_offloading_num_layers", int, 0)
        if offloaded < 0:
            entry.fail(f"has cpu_offloading_num_layers={offloaded!r}; a count of layers (0: none)")
        fp8_format = entry.get("fp8_format", (str, type(None)), None)
        if fp8_format is not None and (not fp8_format.startswith("fp8-") or fp8_format not in format_names()):
            entry.fail(f"has fp8_format={fp8_format!r}; an FP8 number format, one of "
                       f"{', '.join(n for n in format_names() if n.startswith('fp8-'))}")
        unit = entry.get("fsdp_unit_size", (int, type(None)), None)
        if unit is not None and (isinstance(unit, bool) or unit < 1):
            entry.fail(f"has fsdp_unit_size={unit!r}; a positive count of parameters "
                       "(suggested_communication_unit_size)")
        recipes.append(PerformanceRecipe(
            name=raw["name"], source=raw["source"], framework=framework, model=entry.pattern("model"),
            releases=(_release(entry, releases[0]), None if releases[1] is None else _release(entry, releases[1])),
            precision=entry.pattern("precision", ""), hardware=tuple(hardware),
            layouts=tuple(tuple(lay[k] for k in LAYOUT_KEYS) for lay in layouts), dispatcher=dispatcher,
            flex_backend=backend,
            a2a_overlap=entry.get("a2a_overlap", bool), tp_comm_overlap=entry.get("tp_comm_overlap", bool, True),
            overlap_grad_reduce=entry.get("overlap_grad_reduce", bool, True), recompute_modules=modules,
            cuda_graph_impl=graphs, cuda_graph_scope=scope, micro_batch=micro_batch,
            cpu_offloading_num_layers=offloaded, fp8_format=fp8_format,
            gradient_accumulation_fusion=entry.get("gradient_accumulation_fusion", bool, True),
            fsdp_double_buffer=entry.get("fsdp_double_buffer", bool, False), fsdp_unit_size=unit,
            offload_v1_until=(_release(entry, raw["offload_v1_until"]) if raw.get("offload_v1_until") is not None
                              else None)))
    return tuple(recipes)


SCHEDULE_RUNS = ("1f1b", "interleaved", "default", "gpipe", "zb_h1", "zb_h2")
"""What a ``schedules.yaml`` entry may run as."""
PRECISION_RUNS = tuple(name for name in format_names() if name != "auto")
"""What a ``precisions.yaml`` entry may run as: a number format (:mod:`cfp_megatron.base.number_format`)."""
@dataclass(frozen=True, kw_only=True)
class ColumnEntry:
    """One entry of ``schedules.yaml`` or ``precisions.yaml``: how a column's text reads."""

    name: str
    """The variant, as a person names it."""
    words: str
    """A regular expression (case-insensitive) the column's text matches."""
    runs: str
    """What the simulator prices it as (:data:`SCHEDULE_RUNS`, :data:`PRECISION_RUNS`)."""
    approximation: str
    """What the simulator does not model of it; empty: modelled as it runs."""
    tag: str
    """What the layout column shows for it; empty: nothing."""
    source: str
    """Where this comes from."""


def _column_entries(path: Path, key: str, runs: tuple[str, ...]) -> tuple[ColumnEntry, ...]:
    data = _read(path)
    found = []
    for index, raw in enumerate(_entries(path, data, key)):
        entry = _Entry(path, index, raw, {"words", "runs", "approximation", "tag"})
        run = entry.get("runs", str)
        if run not in runs:
            entry.fail(f"has runs={run!r}, not one of {', '.join(runs)}")
        found.append(ColumnEntry(name=entry.get("name", str), words=entry.pattern("words"), runs=run,
                                 approximation=" ".join(entry.get("approximation", str, "").split()),
                                 tag=entry.get("tag", str, ""),
                                 source=entry.get("source", str)))
    return tuple(found)


@lru_cache(maxsize=4)
def load_schedules(path: Path = SCHEDULES_FILE) -> tuple[ColumnEntry, ...]:
    """``schedules.yaml`` (or another file in its format); :class:`ValidationDataError` names a malformed entry."""
    return _column_entries(Path(path), "schedules", SCHEDULE_RUNS)


@lru_cache(maxsize=4)
def load_precisions(path: Path = PRECISIONS_FILE) -> tuple[tuple[ColumnEntry, ...], ColumnEntry]:
    """``precisions.yaml``: its entries and the one a blank column reads as (``blank:``, an entry's name)."""
    entries = _column_entries(Path(path), "precisions", PRECISION_RUNS)
    blank = next((entry for entry in entries if entry.name == _read(Path(path)).get("blank")), None)
    if blank is None:
        raise ValidationDataError(f"{path}: 'blank:' names no entry of the file. Fix: name the entry a blank "
                                  "precision column reads as.")
    return entries, blank


@dataclass(frozen=True, kw_only=True)
class SourceSetting:
    """What the rows of one source state outside their tables (an entry of ``source_settings.yaml``)."""

    name: str
    """What the entry covers, as a person names it."""
    match: tuple[tuple[str, str], ...]
    """The rows it covers: (column of the runs schema, regular expression its text matches somewhere,
    case-insensitive) pairs, every one of which holds (:meth:`matches`)."""
    blank: dict[str, str]
    """Column -> the text a blank cell of it reads as (the row is read as if it stated it)."""
    runs: dict[str, bool]
    """:data:`SETTING_RUNS` field -> what the rows ran where no column says, in place of their framework's reading."""
    approximation: str
    """What the simulator does not model of what they ran (said for each row it covers); empty: modelled."""
    source: str
    """Where this comes from."""

    def matches(self, row: dict) -> bool:
        """Whether every column :attr:`match` names of ``row`` matches its pattern (a missing column reads as
        blank)."""
        return all(re.search(pattern, (row.get(column) or "").strip(), re.IGNORECASE) for column, pattern in self.match)


def _row_match(entry: _Entry) -> tuple[tuple[str, str], ...]:
    match = entry.get("match", dict)
    if not match or set(match) - set(COLUMNS):
        entry.fail(f"has match={match!r}; it maps columns of the runs schema ({', '.join(COLUMNS)}) to regular "
                   "expressions, at least one")
    return tuple((column, entry.regex(f"match {column}", pattern)) for column, pattern in match.items())


def _blank_cells(entry: _Entry) -> dict[str, str]:
    blank = entry.get("blank", dict, {})
    if set(blank) - set(COLUMNS):
        entry.fail(f"has blank={blank!r}; it maps columns of the runs schema ({', '.join(COLUMNS)}) to what a blank "
                   "cell reads as")
    cells = {}
    for column, value in blank.items():
        if isinstance(value, bool) or not isinstance(value, int | str) or not str(value).strip():
            entry.fail(f"has blank {column}={value!r}; a count or the column's text")
        if column in COUNT_COLUMNS:
            try:
                count_cell({column: str(value)}, column)
            except RowError as err:
                entry.fail(f"has blank {column}={value!r}: {err}")
        cells[column] = str(value).strip()
    return cells


SETTING_RUNS = tuple(field.name for field in fields(Framework) if field.type == "bool")
"""The :class:`Framework` readings a source setting may state for its rows (``runs:``), each a yes or no."""


def _setting_runs(entry: _Entry) -> dict[str, bool]:
    runs = entry.get("runs", dict, {})
    if set(runs) - set(SETTING_RUNS) or not all(isinstance(value, bool) for value in runs.values()):
        entry.fail(f"has runs={runs!r}; it maps {', '.join(SETTING_RUNS)} to true or false")
    return dict(runs)


@lru_cache(maxsize=4)
def load_source_settings(path: Path = SETTINGS_FILE) -> tuple[SourceSetting, ...]:
    """``source_settings.yaml`` (or another file in its format) in match order; :class:`ValidationDataError` names a
    malformed entry."""
    path = Path(path)
    found = []
    for index, raw in enumerate(_entries(path, _read(path), "settings")):
        entry = _Entry(path, index, raw, {"match", "blank", "runs", "approximation"})
        blank, runs = _blank_cells(entry), _setting_runs(entry)
        if not blank and not runs:
            entry.fail("states neither blank cells nor runs")
        found.append(SourceSetting(name=raw["name"], match=_row_match(entry), blank=blank, runs=runs,
                                   approximation=" ".join(entry.get("approximation", str, "").split()),
                                   source=" ".join(raw["source"].split())))
    return tuple(found)


@dataclass(frozen=True, kw_only=True)
class ValidationData:
    """Everything the validator reads a row with beyond its columns: its data files, loaded."""

    frameworks: tuple[Framework, ...]
    """``frameworks.yaml``."""
    families: Families
    """``model_families.yaml``."""
    recipes: tuple[PerformanceRecipe, ...]
    """``recipes.yaml``."""
    schedules: tuple[ColumnEntry, ...]
    """``schedules.yaml``: how a ``pp_schedule`` column reads."""
    precisions: tuple[tuple[ColumnEntry, ...], ColumnEntry]
    """``precisions.yaml``: how a ``precision`` column reads, and the entry a blank one reads as."""
    settings: tuple[SourceSetting, ...]
    """``source_settings.yaml``: what rows' sources state outside their tables."""


@lru_cache(maxsize=8)
def load_data(*, frameworks: Path = FRAMEWORKS_FILE, families: Path = FAMILIES_FILE, recipes: Path = RECIPES_FILE,
              schedules: Path = SCHEDULES_FILE, precisions: Path = PRECISIONS_FILE,
              settings: Path = SETTINGS_FILE) -> ValidationData:
    """The data files (the shipped ones unless others are named); a recipe of a framework no entry names is a
    :class:`ValidationDataError`."""
    data = ValidationData(frameworks=load_frameworks(Path(frameworks)), families=load_families(Path(families)),
                          recipes=load_recipes(Path(recipes)), schedules=load_schedules(Path(schedules)),
                          precisions=load_precisions(Path(precisions)),
                          settings=load_source_settings(Path(settings)))
    names = {framework.name for framework in data.frameworks}
    for recipe in data.recipes:
        if recipe.framework not in names:
            raise ValidationDataError(f"{recipes}: its presets are of framework {recipe.framework!r}, which "
                                      f"{frameworks} does not name (it names {', '.join(sorted(names))}). Fix: name "
                                      "one of those.")
    return data
