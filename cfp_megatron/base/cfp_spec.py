"""What the planner is asked (Hydra group ``cfp``): pinned knobs, allowed sets, memory headroom, how many plans.

``+cfp=auto`` adds the group to a training job; ``cfp.tp=4`` pins a knob by hand, ``cfp.constraints.tp=[2,4]``
allows a set, ``cfp.constraints.memory_headroom=0.15`` keeps 15% of each GPU's memory free. A pin wins over a set;
a pin outside its set is an error.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from cfp_megatron.base.config import (
    CudaGraphImpl,
    FlexBackend,
    Fp8Recipe,
    FsdpStrategy,
    MlpPartition,
    MoeTokenPolicy,
    Precision,
    Recompute,
    build_spec,
    plain_config,
)
from cfp_megatron.base.errors import ConfigError, ConfigIssue

DEFAULT_PROFILE_BUDGET_S = 240.0
"""Seconds one profiling run may take (``cfp.profile_budget_s``, ``--budget``)."""


TRIALS_AUTO = "auto"
"""``cfp.trials=auto``: trials only where the runner-up is inside the chosen plan's error band."""
AUTO_TRIALS = 3
"""Most plans ``cfp.trials=auto`` measures (the chosen one included)."""


class CfpMode(enum.Enum):
    """What ``launch/train.py`` does with the planner."""

    auto = "auto"
    """Plan at launch (profile, search) and train with the best plan."""
    manual = "manual"
    """Train with a saved plan (``cfp.plan_file`` or the canonical string ``cfp.plan``), else ``parallel`` as given."""
    off = "off"
    """The planner stays out of the way."""


@dataclass(frozen=True, kw_only=True)
class SearchConstraints:
    """Sets of allowed values per knob (``None``: anything valid) and the search's global limits."""

    PREFIX: ClassVar[str] = "cfp.constraints"

    tp: list[int] | None = None
    """Allowed tensor-parallel sizes."""
    pp: list[int] | None = None
    """Allowed pipeline-parallel sizes."""
    vpp: list[int] | None = None
    """Allowed model chunks per pipeline rank (1 = no interleaving)."""
    cp: list[int] | None = None
    """Allowed context-parallel sizes."""
    ep: list[int] | None = None
    """Allowed expert-parallel sizes (MoE)."""
    etp: list[int] | None = None
    """Allowed expert tensor-parallel sizes (MoE)."""
    micro_batch: list[int] | None = None
    """Allowed micro-batch sizes."""
    sp: list[bool] | None = None
    """Allowed sequence-parallel settings."""
    recompute: list[Recompute] | None = None
    """Allowed recompute granularities."""
    distributed_optimizer: list[bool] | None = None
    """Allowed distributed-optimizer settings."""
    mlp: list[MlpPartition] | None = None
    """Allowed partitions of the dense MLP (``megatron``, ``primepar``)."""
    precision: list[Precision] | None = None
    """Number formats the search may choose from (``[bf16,fp8]``; ``fp8`` with each recipe of ``fp8_recipe``,
    ``fp4`` with ``train.fp4_recipe``); the formats the cluster does not compute are left out, said. ``None``: the
    job's ``train.precision``. A ``train.precision`` other than ``auto`` pins it (and must be in the set)."""
    fp8_recipe: list[Fp8Recipe] | None = None
    """The FP8 recipes ``fp8`` in :attr:`precision` stands for (``[tensorwise,mxfp8]``); ``None``: the job's
    ``train.fp8_recipe``."""
    fsdp: list[FsdpStrategy] | None = None
    """Allowed Megatron-FSDP strategies (``none``, ``optim_grads``, ``optim_grads_params``); ``null``: the search
    shards more only where a layout does not fit otherwise (docs/planning.md, "Sharded data parallelism")."""
    cuda_graph_impl: list[CudaGraphImpl] | None = None
    """CUDA graph implementations the search may choose from (``[none,transformer_engine]``), each with the scope
    Megatron-Core captures for the plan's layers (docs/planning.md, "CUDA graphs and the MoE token policy"); those
    that cannot run where the plan trains (a CPU cluster, Transformer Engine missing) are left out, said. ``None``:
    the job's ``parallel.cuda_graph_impl`` (Megatron's default ``none``)."""
    moe_token_policy: list[MoeTokenPolicy] | None = None
    """MoE token policies the search may choose from (``[dropless,drop_pad]``): they change what the model learns,
    so only those listed are tried. ``None``: the model's own (``model.moe_expert_capacity_factor``,
    ``model.moe_pad_expert_input_to_capacity``)."""
    moe_flex_dispatcher_backend: list[FlexBackend] | None = None
    """Flex dispatcher backends the search may choose from (``[deepep,hybridep]``; ``model.moe_token_dispatcher=flex``
    only), each searched whole: HybridEP pays where an EP group spans hosts of one NVLink domain (GB200 NVL72).
    ``None``: the job's ``parallel.moe_flex_dispatcher_backend``."""
    moe_capacity_factor: float | None = None
    """The capacity factor of ``drop`` and ``drop_pad`` in :attr:`moe_token_policy`; ``None``: the model's
    ``model.moe_expert_capacity_factor``."""
    tp_within_node: bool = True
    """Keep each TP group inside one NVLink domain: a node, or ``cluster.nvlink_domain_size`` GPUs (72 on an NVL72
    rack). TP's per-layer collectives are too slow across the network."""
    memory_headroom: float = 0.1
    """Share of each GPU's memory the plan leaves free (allocator fragmentation, NCCL buffers, what the model of
    memory misses): a plan fits when its predicted peak is at most ``(1 - memory_headroom)`` x HBM."""
    max_micro_batch: int = 64
    """Largest micro-batch size tried."""
    uneven_stages: bool = True
    """Also try pipeline splits whose first and/or last stage holds fewer layers than the others (Megatron's
    ``num_layers_in_first/last_pipeline_stage``); false keeps to even splits."""

    def __post_init__(self) -> None:
        issues: list[ConfigIssue] = []
        p = self.PREFIX
        for name in ("tp", "pp", "vpp", "cp", "ep", "etp", "micro_batch"):
            values = getattr(self, name)
            if values is not None and (not values or any(int(v) < 1 for v in values)):
                issues.append(ConfigIssue(key=f"{p}.{name}", value=values, problem="must list positive sizes.",
                                          fix=f"e.g. {p}.{name}=[1,2], or null for any."))
        for name in ("sp", "recompute", "distributed_optimizer", "precision", "fp8_recipe", "fsdp", "cuda_graph_impl",
                     "moe_token_policy", "moe_flex_dispatcher_backend"):
            values = getattr(self, name)
            if values is not None and not values:
                issues.append(ConfigIssue(key=f"{p}.{name}", value=values, problem="allows nothing.",
                                          fix=f"list at least one value, or set {p}.{name}=null."))
        factor = self.moe_capacity_factor
        if factor is not None and not (math.isfinite(factor) and factor > 0):
            issues.append(ConfigIssue(key=f"{p}.moe_capacity_factor", value=factor,
                                      problem="the expert capacity factor must be a positive number.",
                                      fix=f"use e.g. {p}.moe_capacity_factor=1.0, or null for the model's own."))
        if not 0.0 <= self.memory_headroom < 1.0:
            issues.append(ConfigIssue(key=f"{p}.memory_headroom", value=self.memory_headroom,
                                      problem="must be at least 0 and below 1 (a share of the GPU's memory).",
                                      fix="use e.g. 0.1."))
        if self.max_micro_batch < 1:
            issues.append(ConfigIssue(key=f"{p}.max_micro_batch", value=self.max_micro_batch,
                                      problem="must be positive.", fix="use e.g. 64."))
        if issues:
            raise ConfigError(issues)


PINNABLE = ("tp", "pp", "vpp", "cp", "ep", "etp", "micro_batch", "sp", "recompute", "distributed_optimizer", "mlp",
            "fsdp")
"""Knobs ``cfp.<knob>=value`` can pin."""


@dataclass(frozen=True, kw_only=True)
class CfpSpec:
    """The planner's settings (Hydra group ``cfp``)."""

    PREFIX: ClassVar[str] = "cfp"

    mode: CfpMode = CfpMode.auto
    """auto: plan and train with the plan; manual: train ``parallel`` as given; off: no planner."""
    tp: int | None = None
    """Pin the tensor-parallel size."""
    pp: int | None = None
    """Pin the pipeline-parallel size."""
    vpp: int | None = None
    """Pin the model chunks per pipeline rank."""
    cp: int | None = None
    """Pin the context-parallel size."""
    ep: int | None = None
    """Pin the expert-parallel size."""
    etp: int | None = None
    """Pin the expert tensor-parallel size."""
    micro_batch: int | None = None
    """Pin the micro-batch size."""
    sp: bool | None = None
    """Pin sequence parallelism."""
    recompute: Recompute | None = None
    """Pin the recompute granularity."""
    distributed_optimizer: bool | None = None
    """Pin the distributed optimizer."""
    mlp: MlpPartition | None = None
    """Pin the partition of the dense MLP."""
    fsdp: FsdpStrategy | None = None
    """Pin Megatron-FSDP's sharding strategy (``none``: Megatron-Core's DDP and distributed optimizer)."""
    overlap: bool | None = None
    """The communication overlaps NVIDIA's recipes run on GPUs: data-parallel gradient reduce and parameter gather
    (``parallel.overlap_grad_reduce`` / ``overlap_param_gather``), Transformer Engine's TP overlap
    (``parallel.tp_comm_overlap``) and the expert all-to-all overlap (``parallel.moe_a2a_overlap``). ``null``: on
    for GPU clusters, the last two where Megatron-Core runs them and their memory fits, off on CPU; ``false``: as
    ``parallel`` says; ``true``: on wherever they run, whatever their memory."""
    constraints: SearchConstraints = field(default_factory=SearchConstraints)
    """Allowed sets and global limits."""
    top_k: int = 5
    """Plans shown (and kept) in the ranking."""
    plan_file: str | None = None
    """auto: where ``plan.json`` is also written (an existing file is never overwritten); manual: the plan to apply."""
    plan: str | None = None
    """manual: a plan's canonical string to apply (``python -m cfp_megatron.plan`` prints it)."""
    profile_budget_s: float = DEFAULT_PROFILE_BUDGET_S
    """auto: seconds the profiling rounds at launch may take (all of them together)."""
    profile_repeats: int | None = None
    """auto: the timed repeats of every profiling probe (segments, overheads, collectives, GEMMs) instead of each
    probe's own count (segments 7 on CPU and 5 on GPU, overheads 4, collectives 2-10 and GEMMs 2-50 by size);
    ``null`` keeps those. A low count (the tests' launches use 1) profiles sooner and noisier; the same entries are
    measured. ``python -m cfp_megatron.profile --repeats N`` is the same setting."""
    trials: str = TRIALS_AUTO
    """auto: after profiling and the search, train each of the top plans for a few steps on this cluster (same seed,
    nothing saved) and train the measured fastest, the trials counted in ``profile_budget_s``: ``auto`` measures the
    plans inside the chosen plan's error band (at most 3, :data:`AUTO_TRIALS`), only when the runner-up is inside it
    (never where no band is known, as on CPU clusters); ``K`` the top K distinct plans whatever the band; ``0``: none
    (docs/planning.md, "Trials at launch")."""
    check_after_steps: int = 12
    """auto/manual with a plan: after this many steps (or the run's last, when it trains fewer), compare the
    measured step time (the median of the steps after the ``check_warmup_steps`` first, without the one memory is
    measured on) and memory with the prediction (a warning beyond 10%) and store the comparison in the ProfileDB;
    0 turns the check off. Eight timed steps keep the median steady on a shared machine (three timed steps moved it
    by up to 8% between runs)."""
    check_warmup_steps: int = 3
    """The first steps of a launch the plan check does not time (at least the first, which builds and compiles):
    a fresh process runs its first steps slower (allocator, gloo buffers, lazy initialisation). Where the run
    checks fewer steps than this leaves, the steps after the first are timed."""

    def __post_init__(self) -> None:
        issues: list[ConfigIssue] = []
        if self.profile_budget_s <= 0:
            issues.append(ConfigIssue(key="cfp.profile_budget_s", value=self.profile_budget_s,
                                      problem="must be positive (seconds).", fix="use e.g. 60."))
        if self.profile_repeats is not None and self.profile_repeats < 1:
            issues.append(ConfigIssue(key="cfp.profile_repeats", value=self.profile_repeats,
                                      problem="must be 1 or more (timed repeats of each probe).",
                                      fix="use e.g. 1 for a quick profile, or null for each probe's own count."))
        if self.check_after_steps < 0:
            issues.append(ConfigIssue(key="cfp.check_after_steps", value=self.check_after_steps,
                                      problem="must be 0 (off) or more.", fix="use e.g. 12."))
        if self.check_warmup_steps < 1:
            issues.append(ConfigIssue(key="cfp.check_warmup_steps", value=self.check_warmup_steps,
                                      problem="must be 1 or more (the first step builds and compiles).",
                                      fix="use e.g. 3."))
        if self.plan is not None and self.plan_file is not None and self.mode is CfpMode.manual:
            issues.append(ConfigIssue(key="cfp.plan", value=self.plan, problem="and cfp.plan_file are both set; "
                                      "a run applies one plan.", fix="keep one of them."))
        if self.plan is not None and self.mode is CfpMode.auto:
            issues.append(ConfigIssue(key="cfp.plan", value=self.plan,
                                      problem="is a plan to apply, and +cfp=auto searches a plan of its own: it would "
                                              "be ignored.",
                                      fix="apply it with +cfp=manual cfp.plan=..., or drop cfp.plan to search."))
        if self.top_k < 1:
            issues.append(ConfigIssue(key="cfp.top_k", value=self.top_k, problem="must be positive.",
                                      fix="use e.g. 5."))
        trials = str(self.trials).strip().lower()
        if trials != TRIALS_AUTO and not trials.isdigit():
            issues.append(ConfigIssue(key="cfp.trials", value=self.trials,
                                      problem="must be auto or a count of plans to measure at launch (0: none).",
                                      fix="use e.g. cfp.trials=2, or cfp.trials=auto."))
        for name in PINNABLE:
            pin = getattr(self, name)
            allowed = getattr(self.constraints, name)
            if pin is None:
                continue
            if isinstance(pin, int) and not isinstance(pin, bool) and pin < 1:
                issues.append(ConfigIssue(key=f"cfp.{name}", value=pin, problem="must be positive.",
                                          fix=f"use a positive size, or cfp.{name}=null to search it."))
            if allowed is not None and pin not in allowed:
                issues.append(ConfigIssue(key=f"cfp.{name}", value=pin.value if isinstance(pin, enum.Enum) else pin,
                                          problem=f"is outside cfp.constraints.{name}={_show(allowed)}.",
                                          fix=f"pin a value from that set, or widen cfp.constraints.{name}."))
        if issues:
            raise ConfigError(issues)

    def trials_issue(self) -> ConfigIssue | None:
        """``cfp.trials`` asking for more plans than ``cfp.top_k`` keeps (:func:`cfp_from_config` refuses it)."""
        count = self.trial_count
        if count is None or count <= self.top_k:
            return None
        return ConfigIssue(key="cfp.trials", value=self.trials,
                           problem=f"asks for more plans than the search keeps (cfp.top_k={self.top_k}).",
                           fix=f"raise cfp.top_k to {count}, or ask for at most {self.top_k} trials.")

    @property
    def trial_count(self) -> int | None:
        """The plans ``cfp.trials`` asks to measure at launch; ``None`` for ``auto`` (decided by the band)."""
        trials = str(self.trials).strip().lower()
        return None if trials == TRIALS_AUTO else int(trials)

    def allowed(self, name: str) -> list[Any] | None:
        """The values knob ``name`` may take: the pin alone, else the constraint's set, else ``None`` (any)."""
        pin = getattr(self, name)
        if pin is not None:
            return [pin]
        values = getattr(self.constraints, name)
        return list(values) if values is not None else None


def _show(values: list[Any]) -> str:
    return "[" + ",".join(str(v.value if isinstance(v, enum.Enum) else v).lower() for v in values) + "]"


def cfp_from_config(cfg: Any) -> CfpSpec:
    """The ``cfp`` group of a composed config; ``mode=off`` when no ``cfp`` option was chosen."""
    from omegaconf import DictConfig

    raw = plain_config(cfg) if isinstance(cfg, DictConfig) else dict(cfg or {})
    if raw.get("cfp") is None:
        return CfpSpec(mode=CfpMode.off)
    section = dict(raw["cfp"])
    constraints = dict(section.pop("constraints", None) or {})
    issues: list[ConfigIssue] = []
    built_constraints = SearchConstraints()
    try:
        if "recompute" in constraints and constraints["recompute"] is not None:
            constraints["recompute"] = [_recompute(v, "cfp.constraints.recompute") for v in constraints["recompute"]]
        built_constraints = build_spec(SearchConstraints, constraints)
    except ConfigError as err:
        issues.extend(err.issues)
    if section.get("recompute") is not None:
        try:
            section["recompute"] = _recompute(section["recompute"], "cfp.recompute")
        except ConfigError as err:
            issues.extend(err.issues)
            section.pop("recompute")
    known = {f.name for f in fields(CfpSpec)}
    for key in sorted(set(section) - known):
        issues.append(ConfigIssue(key=f"cfp.{key}", value=section.pop(key), problem="is not a known setting.",
                                  fix=f"remove it; known keys are {sorted(known)}."))
    if issues:
        raise ConfigError(issues)
    spec = build_spec(CfpSpec, {**section, "constraints": built_constraints})
    if spec.trials_issue() is not None:  # here, not in the checks: the planner's own searches narrow top_k
        raise ConfigError(spec.trials_issue())
    return spec


def _recompute(value: Any, key: str) -> Recompute:
    if isinstance(value, Recompute):
        return value
    try:
        return Recompute(str(value))
    except ValueError:
        raise ConfigError(ConfigIssue(key=key, value=value, problem="is not a recompute granularity.",
                                      fix=f"use one of {[r.value for r in Recompute]}.")) from None
