"""What the user typed against what a plan sets: a typed setting either holds under the plan or is refused, never
dropped; a plan applies only to the job it was made for.

A plan (``+cfp=auto``'s search, ``cfp.plan_file``, ``cfp.plan``) sets the whole ``parallel`` section and
``train.micro_batch_size``, ``train.global_batch_size``, ``train.seq_length`` and ``train.precision`` (a plan's
``auto`` leaves the job's): :func:`plan_settings`. Rules, checked before any process group or profiling:

- ``+cfp=auto``: a typed ``parallel.<knob>`` the search chooses is refused, naming its pin (``cfp.tp=...``) and the
  pin it contradicts where both are typed (:func:`check_typed_before_plan`); so is ``train.micro_batch_size``
  (``cfp.micro_batch``). ``+cfp=manual`` without a plan trains ``parallel`` as given: a typed ``cfp`` pin or knob
  set (``cfp.constraints.tp=[2]``) it does not meet is refused (:func:`knob_limits`), and so, whatever the plan, is
  a typed ``cfp`` setting only the search reads (:data:`MANUAL_READS`: ``cfp.top_k``, ``cfp.profile_budget_s``,
  ``cfp.constraints.memory_headroom`` ...), which would do nothing.
- a plan file or string: a typed ``parallel.*``, ``train.*`` or ``cfp`` pin or knob set the plan's value does not
  meet is refused (:func:`plan_conflicts`), as is a model, optimizer, cluster preset or shape (``cluster.nodes``,
  ``cluster.gpus_per_node``) or backend other than the plan's, and for a DeepSpeed plan a ``backend`` knob
  (``backend.zero_stage``, ...) other than its ZeRO options; an untyped ``train.*`` value the plan replaces is said
  in one note line, as is a plan that records no model settings to compare (:func:`plan_notes`).
- whatever the mode, once the plan is known a typed key it would change is refused (the same
  :func:`plan_conflicts`), so no rule above can go stale silently.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from cfp_megatron.base.backend_spec import BackendSpec
from cfp_megatron.base.cfp_spec import CfpMode, CfpSpec
from cfp_megatron.base.config import JobSpec, ParallelSpec, Precision, Recompute, layout_keys
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.plan.artifact import Plan, job_mismatches

PLAN_TRAIN_KEYS: tuple[str, ...] = ("train.micro_batch_size", "train.global_batch_size", "train.seq_length",
                                    "train.precision", "train.fp8_recipe", "train.fp4_recipe")
"""The ``train`` settings a plan sets (:meth:`~cfp_megatron.plan.artifact.Plan.apply`)."""

SEARCHED_WITHOUT_PIN: tuple[str, ...] = (
    "first_stage_layers", "last_stage_layers", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split", "pipeline_model_parallel_layout", "primepar_layers", "recompute_method",
    "recompute_num_layers")
"""``parallel`` fields the search sets on every plan (``Candidate.parallel``) that have no ``cfp`` pin. The fields
with a pin are those ``CfpSpec`` and ``ParallelSpec`` share (:func:`pinned_knobs`); the others (``order``,
``cp_comm_type``, the overlaps under ``cfp.overlap=false`` ...) are kept from the job, and a plan that changed one
anyway is caught once known (:func:`plan_conflicts`)."""


OVERLAP_FIELDS: tuple[str, ...] = ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "moe_a2a_overlap")
"""``parallel`` fields ``cfp.overlap`` governs: the search chooses them unless ``cfp.overlap=false`` (then it keeps
the job's, :attr:`~cfp_megatron.base.cfp_spec.CfpSpec.overlap`)."""


MANUAL_READS: tuple[str, ...] = ("cfp.mode", "cfp.plan", "cfp.plan_file", "cfp.check_after_steps",
                                 "cfp.check_warmup_steps")
"""The ``cfp`` settings ``+cfp=manual`` reads itself. Its pins and knob sets are checked against the layout it
trains (:func:`knob_limits`); any other typed ``cfp`` setting is the search's and would do nothing: refused."""


@dataclass(frozen=True, kw_only=True)
class KnobLimit:
    """A typed ``cfp`` pin, knob set or micro-batch limit, and the setting of the job it limits."""

    setting: str
    """The ``cfp`` key typed: ``cfp.tp``, ``cfp.constraints.tp``, ``cfp.constraints.max_micro_batch``."""
    key: str
    """The job's key it limits: ``parallel.tp``, ``train.micro_batch_size``."""
    allowed: tuple[Any, ...] | None = None
    """The values it allows (a pin: one), or ``None`` for a limit by :attr:`at_most`."""
    at_most: int | None = None
    """The largest value it allows (``cfp.constraints.max_micro_batch``)."""

    def holds(self, value: Any) -> bool:
        """Whether ``value`` of :attr:`key` meets the limit (``None`` and the size it stands for alike)."""
        if self.allowed is None:
            return self.at_most is None or value <= self.at_most
        return any(_same(self.key, value, a) for a in self.allowed)

    @property
    def value(self) -> Any:
        """The value typed, as an issue shows it (a pin's value, a set's list, the limit's number)."""
        if self.allowed is None:
            return self.at_most
        if self.setting.startswith("cfp.constraints."):
            return [_shown(a) for a in self.allowed]
        return _shown(self.allowed[0])

    def remedy(self) -> str:
        """How to meet it by hand: ``parallel.tp=2``, or ``parallel.tp to one of [2,4]``."""
        if self.allowed is None:
            return f"{self.key} to at most {self.at_most}"
        if len(self.allowed) == 1:
            return f"{self.key}={_text(self.allowed[0])}"
        return f"{self.key} to one of [{','.join(_text(a) for a in self.allowed)}]"

    def said(self) -> str:
        """The setting as typed: ``cfp.tp=2``, ``cfp.constraints.tp=[2,4]``, ``cfp.constraints.max_micro_batch=8``."""
        if self.allowed is None:
            return f"{self.setting}={self.at_most}"
        if self.setting.startswith("cfp.constraints."):
            return f"{self.setting}=[{','.join(_text(a) for a in self.allowed)}]"
        return f"{self.setting}={_text(self.allowed[0])}"


def knob_limits(cfp: CfpSpec, typed: tuple[str, ...]) -> list[KnobLimit]:
    """The pins (``cfp.tp=2``), knob sets (``cfp.constraints.tp=[2,4]``) and micro-batch limit
    (``cfp.constraints.max_micro_batch``) among the ``typed`` keys, each with the job key it limits."""
    limits = []
    for key, pin in pinned_knobs().items():
        name = pin.split(".", 1)[1]
        pinned, allowed = getattr(cfp, name), getattr(cfp.constraints, name)
        if pin in typed and pinned is not None:
            limits.append(KnobLimit(setting=pin, key=key, allowed=(pinned,)))
        if f"cfp.constraints.{name}" in typed and allowed is not None:
            limits.append(KnobLimit(setting=f"cfp.constraints.{name}", key=key, allowed=tuple(allowed)))
    if "cfp.constraints.max_micro_batch" in typed:
        limits.append(KnobLimit(setting="cfp.constraints.max_micro_batch", key="train.micro_batch_size",
                                at_most=cfp.constraints.max_micro_batch))
    return limits


def pinned_knobs() -> dict[str, str]:
    """``parallel.<knob>`` -> ``cfp.<knob>`` for each knob the search chooses that has a pin, plus
    ``train.micro_batch_size`` -> ``cfp.micro_batch``."""
    cfp = {f.name for f in dataclasses.fields(CfpSpec)}
    knobs = {f"parallel.{f.name}": f"cfp.{f.name}" for f in dataclasses.fields(ParallelSpec) if f.name in cfp}
    return {**knobs, "train.micro_batch_size": "cfp.micro_batch"}


def typed_keys() -> tuple[str, ...]:
    """The dotted keys set on the command line (Hydra's task overrides: ``parallel.tp`` for ``parallel.tp=2`` or
    ``+parallel.tp=2``); config group choices (``model=llama_tiny``) and deletions (``~key``) are left out. Empty
    outside a Hydra application (tests, the planner's CLI)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return ()
    keys = []
    for item in HydraConfig.get().overrides.task:
        if item.startswith("~"):
            continue
        key = item.lstrip("+").split("=", 1)[0]
        if "." in key:
            keys.append(key)
    return tuple(dict.fromkeys(keys))


def _value(obj: Any, key: str) -> Any:
    """The value of the dotted ``key`` (``parallel.tp``) in ``obj`` (a JobSpec or a CfpSpec without its prefix)."""
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _text(value: Any) -> str:
    """``value`` as typed on the command line."""
    if isinstance(value, enum.Enum):
        value = value.value
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _shown(value: Any) -> Any:
    """``value`` as an issue shows it (an enum by its value)."""
    return value.value if isinstance(value, enum.Enum) else value


def plan_settings(plan: Plan) -> dict[str, Any]:
    """What applying ``plan`` sets, by Hydra key: every ``parallel.*`` field and :data:`PLAN_TRAIN_KEYS` (the
    precision only where the plan has one other than ``auto``)."""
    out = {f"parallel.{f.name}": getattr(plan.parallel, f.name) for f in dataclasses.fields(ParallelSpec)}
    out.update({"train.micro_batch_size": plan.micro_batch_size, "train.global_batch_size": plan.global_batch_size,
                "train.seq_length": plan.seq_length})
    fmt = plan.number_format
    if fmt.precision is not Precision.auto:
        out.update({f"train.{key}": value for key, value in fmt.with_train().items()})
    return out


def _same(key: str, typed: Any, planned: Any) -> bool:
    """Whether the job's ``typed`` value of ``key`` holds under the plan's ``planned`` one: equal, ``None`` and the
    size it stands for (``parallel.vpp``/``etp``: 1) alike, and a ``train.precision=auto`` accepts the plan's."""
    if key == "train.precision" and typed is Precision.auto:
        return True
    section, _, name = key.partition(".")
    one = layout_keys()[name].none_means if section == "parallel" and name in layout_keys() else None
    if one is not None:
        typed, planned = (one if v is None else v for v in (typed, planned))
    return typed == planned


def check_typed_before_plan(job: JobSpec, cfp: CfpSpec, typed: tuple[str, ...]) -> None:
    """Refuse, before any profiling, a typed setting the mode would drop: under ``+cfp=auto`` a ``parallel.<knob>``
    the search chooses (and ``train.micro_batch_size``), under ``+cfp=manual`` without a plan a ``cfp`` pin that
    contradicts ``parallel``. ``typed``: :func:`typed_keys`."""
    issues: list[ConfigIssue] = []
    pins = pinned_knobs()
    if cfp.mode is CfpMode.auto:
        for key in typed:
            pin = pins.get(key)
            name = key.partition(".")[2] if key.startswith("parallel.") else ""
            overlap = name in OVERLAP_FIELDS and cfp.overlap is not False
            if pin is None and name not in SEARCHED_WITHOUT_PIN and not overlap:
                continue
            value = _value(job, key)
            if overlap:
                issues.append(ConfigIssue(
                    key=key, value=_shown(value),
                    problem=f"is chosen by the search under +cfp=auto with cfp.overlap={_text(cfp.overlap)}, which "
                            "would replace it.",
                    fix=f"add cfp.overlap=false to keep {key} and the other overlaps as given, or drop {key}."))
            elif pin is not None:
                pinned = getattr(cfp, pin.split(".", 1)[1])
                if pinned is not None and _same(key, value, pinned):
                    continue  # the pin asks for the same: the plan keeps it
                clash = f" and {pin}={_text(pinned)} pins another value (keep one of the two)" if pinned is not None \
                    else ""
                issues.append(ConfigIssue(
                    key=key, value=_shown(value),
                    problem=f"is chosen by the search under +cfp=auto, which would replace it{clash}.",
                    fix=f"pin it with {pin}={_text(value)} instead of {key} (the search keeps pins), or train the "
                        "parallel section as given without +cfp=auto."))
            else:
                issues.append(ConfigIssue(
                    key=key, value=_shown(value),
                    problem="is chosen by the search under +cfp=auto (it has no cfp pin), which would replace it.",
                    fix=f"drop {key} and let the search choose it, or train the parallel section as given without "
                        "+cfp=auto."))
    elif cfp.mode is CfpMode.manual:
        limits = knob_limits(cfp, typed)
        knobs = [pin.split(".", 1)[1] for pin in pinned_knobs().values()]
        checked = {*MANUAL_READS, "cfp.constraints.max_micro_batch", *(f"cfp.{k}" for k in knobs),
                   *(f"cfp.constraints.{k}" for k in knobs)}  # a pin or set: held to the layout (null asks nothing)
        for key in typed:
            if key.startswith("cfp.") and key not in checked:
                issues.append(ConfigIssue(
                    key=key, value=_shown(_value(cfp, key.removeprefix("cfp."))),
                    problem="is read by the search of +cfp=auto only: +cfp=manual trains "
                            + ("the plan given as it is" if cfp.plan is not None or cfp.plan_file is not None
                               else "the parallel section as given") + ", so it would do nothing.",
                    fix=f"drop {key}, or search with +cfp=auto {key}=..."))
        for limit in limits if cfp.plan is None and cfp.plan_file is None else ():
            value = _value(job, limit.key)
            if not limit.holds(value):
                issues.append(ConfigIssue(
                    key=limit.setting, value=limit.value,
                    problem=f"contradicts {limit.key}={_text(value)}: +cfp=manual trains the parallel section as "
                            "given (cfp pins and sets steer the search of +cfp=auto).",
                    fix=f"drop {limit.setting}, or set {limit.remedy()}, or search with +cfp=auto {limit.said()}."))
    if issues:
        raise ConfigError(issues)


def plan_conflicts(plan: Plan, job: JobSpec, typed: tuple[str, ...], *, source: str,
                   cfp: CfpSpec | None = None, backend: BackendSpec | None = None) -> list[ConfigIssue]:
    """Why ``plan`` (described by ``source``, e.g. ``the plan of cfp.plan_file=plan.json``) cannot train ``job``:
    a model or optimizer other than the plan was made for (:func:`~cfp_megatron.plan.artifact.job_mismatches`),
    another cluster preset or shape, another backend or (a DeepSpeed plan) other ZeRO knobs in ``backend``
    (:func:`backend_conflicts`), a typed setting the plan would change, a typed ``cfp`` pin or knob set (of ``cfp``,
    :func:`knob_limits`) the plan does not meet."""
    issues: list[ConfigIssue] = []
    if plan.model != job.model.name:
        issues.append(ConfigIssue(key="model", value=job.model.name,
                                  problem=f"{source} was made for model={plan.model}.",
                                  fix=f"run it with model={plan.model}, or plan again for this model (+cfp=auto)."))
    else:
        issues += job_mismatches(plan, job, source=source)
    c = job.cluster
    if plan.cluster != c.name:
        issues.append(ConfigIssue(key="cluster", value=c.name,
                                  problem=f"{source} was made for cluster={plan.cluster}.",
                                  fix=f"run it with cluster={plan.cluster}, or plan again for this cluster "
                                      "(+cfp=auto)."))
    shape = (("cluster.nodes", c.nodes, plan.nodes), ("cluster.gpus_per_node", c.gpus_per_node, plan.gpus_per_node))
    for key, mine, planned in ((k, m, p) for k, m, p in shape if m is not None and m != p):
        issues.append(ConfigIssue(key=key, value=mine,
                                  problem=f"{source} was made for {plan.nodes} node(s) of {plan.gpus_per_node} "
                                          f"rank(s) ({key}={planned}): its layout and prediction assume that "
                                          "network.",
                                  fix=f"run it with {key}={planned} on such a cluster, or plan again for this one "
                                      "(+cfp=auto)."))
    if backend is not None:
        issues += backend_conflicts(plan, backend, typed, source=source)
    sets = plan_settings(plan)
    if plan.parallel.recompute is not Recompute.selective:  # the modules recomputed have no effect then
        sets.pop("parallel.recompute_modules")
    for key in typed:
        if key in sets and not _same(key, _value(job, key), sets[key]):
            issues.append(ConfigIssue(
                key=key, value=_shown(_value(job, key)),
                problem=f"was typed, but {source} sets {key}={_text(sets[key])}.",
                fix=f"drop {key} (or set it to {_text(sets[key])}) to train the plan, or train without the plan "
                    "(drop +cfp=manual, or use +cfp=auto to plan for this value)."))
    for limit in knob_limits(cfp, typed) if cfp is not None else ():
        if limit.key in sets and not limit.holds(sets[limit.key]):
            what = "pins another value than" if limit.setting in pinned_knobs().values() else \
                "allows other values than"
            issues.append(ConfigIssue(
                key=limit.setting, value=limit.value,
                problem=f"{what} {source} has ({limit.key}={_text(sets[limit.key])}); a plan is applied as it is.",
                fix=f"drop {limit.setting} to train the plan, or search with +cfp=auto {limit.said()}."))
    return issues


def backend_conflicts(plan: Plan, backend: BackendSpec, typed: tuple[str, ...], *, source: str) -> list[ConfigIssue]:
    """Why ``plan`` cannot train under ``backend``: another engine (a Megatron plan under ``backend=deepspeed``,
    a DeepSpeed plan under Megatron-Core), or for a DeepSpeed plan a ZeRO knob fixed by hand (``backend.zero_stage``
    and the other :meth:`~cfp_megatron.base.backend_spec.BackendSpec.pins`, a typed ``backend.bucket_elements``)
    other than the plan's."""
    if plan.backend is not backend.name:
        return [ConfigIssue(key="backend", value=backend.name.value,
                            problem=f"{source} is a plan for backend={plan.backend.value}: its "
                                    + ("ZeRO options" if plan.zero is not None else "layout") + " would not be run "
                                    f"as planned by backend={backend.name.value}.",
                            fix=f"run it with backend={plan.backend.value}, or plan again for "
                                f"backend={backend.name.value} (+cfp=auto).")]
    if plan.zero is None:
        return []
    planned = {"zero_stage": plan.zero.stage, "activation_checkpointing": plan.activation_checkpointing,
               "offload_optimizer": plan.offload_optimizer, "offload_param": plan.offload_param,
               "micro_batch": plan.micro_batch_size}
    fixed = backend.pins()
    if "backend.bucket_elements" in typed:
        fixed["bucket_elements"] = backend.bucket_elements
        planned["bucket_elements"] = plan.zero.bucket_elements
    issues = []
    for name, value in fixed.items():
        if name in planned and value != planned[name]:
            key = f"backend.{name}" if f"backend.{name}" in typed else "backend.config_file"
            issues.append(ConfigIssue(
                key=key, value=value if key != "backend.config_file" else backend.config_file,
                problem=f"sets {name}={_text(value)}, but {source} has {name}={_text(planned[name])}; a plan is "
                        "applied as it is.",
                fix=f"drop {key} (or make it {_text(planned[name])}) to train the plan, or plan again with it "
                    "(+cfp=auto)."))
    return issues


def plan_notes(plan: Plan, job: JobSpec, typed: tuple[str, ...], *, source: str) -> list[str]:
    """One line per ``train`` setting the user did not type whose value ``plan`` replaces (the config's default
    or preset value), and one where the plan records no model settings to compare (a plan string, a schema-1
    plan.json): said, not silent."""
    sets = plan_settings(plan)
    lines = [f"{source} sets {key}={_text(sets[key])} (the config had {_text(_value(job, key))})"
             for key in PLAN_TRAIN_KEYS if key in sets and key not in typed and not _same(key, _value(job, key),
                                                                                           sets[key])]
    if not plan.job_inputs:
        what = "a plan string carries none" if plan.schema_version >= 2 else \
            f"a plan.json of schema_version {plan.schema_version}, from before they were recorded"
        lines.append(f"{source} records no model settings ({what}): only model={plan.model} is compared, so check "
                     "that the model is the one it was made for (a current plan.json records every model.* setting)")
    return lines


def check_plan_applies(plan: Plan, job: JobSpec, *, source: str, cfp: CfpSpec | None = None,
                       backend: BackendSpec | None = None, typed: tuple[str, ...] | None = None,
                       console: Any = None) -> None:
    """Raise one :class:`ConfigError` with every :func:`plan_conflicts` of ``plan`` and ``job`` (``typed``: the
    keys typed, :func:`typed_keys` by default); else print the :func:`plan_notes` on ``console`` (rank 0's)."""
    typed = typed_keys() if typed is None else typed
    issues = plan_conflicts(plan, job, typed, source=source, cfp=cfp, backend=backend)
    if issues:
        raise ConfigError(issues)
    if console is not None:
        for line in plan_notes(plan, job, typed, source=source):
            console.print(f"cfp: {line}", markup=False)
