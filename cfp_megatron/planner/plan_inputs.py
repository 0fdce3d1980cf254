"""What the user typed against what a plan sets: a typed setting either holds under the plan or is refused, never
dropped; a plan applies only to the job it was made for.

A plan (``+cfp=auto``'s search, ``cfp.plan_file``, ``cfp.plan``) sets the whole ``parallel`` section and
``train.micro_batch_size``, ``train.global_batch_size``, ``train.seq_length`` and ``train.precision`` (a plan's
``auto`` leaves the job's): :func:`plan_settings`. Rules, checked before any process group or profiling:

- ``+cfp=auto``: a typed ``parallel.<knob>`` the search chooses is refused, naming its pin (``cfp.tp=...``) and the
  pin it contradicts where both are typed (:func:`check_typed_before_plan`); so is ``train.micro_batch_size``
  (``cfp.micro_batch``). ``+cfp=manual`` without a plan trains ``parallel`` as given: a ``cfp`` pin that differs
  from it is refused.
- a plan file or string: a typed ``parallel.*``, ``train.*`` or ``cfp`` pin whose value differs from the plan's is
  refused (:func:`plan_conflicts`), as is a model, optimizer or cluster other than the plan's; an untyped
  ``train.*`` value the plan replaces is said in one note line (:func:`plan_notes`).
- whatever the mode, once the plan is known a typed key it would change is refused (the same
  :func:`plan_conflicts`), so no rule above can go stale silently.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from cfp_megatron.base.cfp_spec import CfpMode, CfpSpec
from cfp_megatron.base.config import JobSpec, ParallelSpec, Precision, Recompute, layout_keys
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.plan.artifact import Plan, job_mismatches

PLAN_TRAIN_KEYS: tuple[str, ...] = ("train.micro_batch_size", "train.global_batch_size", "train.seq_length",
                                    "train.precision")
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
    if plan.precision != Precision.auto.value:
        out["train.precision"] = Precision(plan.precision)
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
                        "parallel section as given with +cfp=off."))
            else:
                issues.append(ConfigIssue(
                    key=key, value=_shown(value),
                    problem="is chosen by the search under +cfp=auto (it has no cfp pin), which would replace it.",
                    fix=f"drop {key} and let the search choose it, or train the parallel section as given with "
                        "+cfp=off."))
    elif cfp.mode is CfpMode.manual and cfp.plan is None and cfp.plan_file is None:
        for key, pin in pins.items():
            pinned = getattr(cfp, pin.split(".", 1)[1])
            if pin in typed and pinned is not None and not _same(key, _value(job, key), pinned):
                issues.append(ConfigIssue(
                    key=pin, value=_shown(pinned),
                    problem=f"contradicts {key}={_text(_value(job, key))}: +cfp=manual trains the parallel section "
                            "as given (cfp pins steer the search of +cfp=auto).",
                    fix=f"drop {pin}, or set {key}={_text(pinned)}, or search with +cfp=auto {pin}={_text(pinned)}."))
    if issues:
        raise ConfigError(issues)


def plan_conflicts(plan: Plan, job: JobSpec, typed: tuple[str, ...], *, source: str,
                   cfp: CfpSpec | None = None) -> list[ConfigIssue]:
    """Why ``plan`` (described by ``source``, e.g. ``the plan of cfp.plan_file=plan.json``) cannot train ``job``:
    a model or optimizer other than the plan was made for (:func:`~cfp_megatron.plan.artifact.job_mismatches`),
    another cluster preset, a typed setting the plan would change, a typed ``cfp`` pin (of ``cfp``) the plan does
    not have."""
    issues: list[ConfigIssue] = []
    if plan.model != job.model.name:
        issues.append(ConfigIssue(key="model", value=job.model.name,
                                  problem=f"{source} was made for model={plan.model}.",
                                  fix=f"run it with model={plan.model}, or plan again for this model (+cfp=auto)."))
    else:
        issues += job_mismatches(plan, job, source=source)
    if plan.cluster != job.cluster.name:
        issues.append(ConfigIssue(key="cluster", value=job.cluster.name,
                                  problem=f"{source} was made for cluster={plan.cluster}.",
                                  fix=f"run it with cluster={plan.cluster}, or plan again for this cluster "
                                      "(+cfp=auto)."))
    sets = plan_settings(plan)
    if plan.parallel.recompute is not Recompute.selective:  # the modules recomputed have no effect then
        sets.pop("parallel.recompute_modules")
    for key in typed:
        if key in sets and not _same(key, _value(job, key), sets[key]):
            issues.append(ConfigIssue(
                key=key, value=_shown(_value(job, key)),
                problem=f"was typed, but {source} sets {key}={_text(sets[key])}.",
                fix=f"drop {key} (or set it to {_text(sets[key])}) to train the plan, or train without the plan "
                    "(+cfp=off, or +cfp=auto to plan for this value)."))
    for key, pin in pinned_knobs().items() if cfp is not None else ():
        pinned = getattr(cfp, pin.split(".", 1)[1])
        if pin in typed and pinned is not None and key in sets and not _same(key, pinned, sets[key]):
            issues.append(ConfigIssue(
                key=pin, value=_shown(pinned), problem=f"pins another value than {source} has ({key}="
                                                      f"{_text(sets[key])}); a plan is applied as it is.",
                fix=f"drop {pin} to train the plan, or search with +cfp=auto {pin}={_text(pinned)}."))
    return issues


def plan_notes(plan: Plan, job: JobSpec, typed: tuple[str, ...], *, source: str) -> list[str]:
    """One line per ``train`` setting the user did not type whose value ``plan`` replaces (the config's default
    or preset value): said, not silent."""
    sets = plan_settings(plan)
    return [f"{source} sets {key}={_text(sets[key])} (the config had {_text(_value(job, key))})"
            for key in PLAN_TRAIN_KEYS if key in sets and key not in typed and not _same(key, _value(job, key),
                                                                                          sets[key])]


def check_plan_applies(plan: Plan, job: JobSpec, *, source: str, cfp: CfpSpec | None = None,
                       typed: tuple[str, ...] | None = None, console: Any = None) -> None:
    """Raise one :class:`ConfigError` with every :func:`plan_conflicts` of ``plan`` and ``job`` (``typed``: the
    keys typed, :func:`typed_keys` by default); else print the :func:`plan_notes` on ``console`` (rank 0's)."""
    typed = typed_keys() if typed is None else typed
    issues = plan_conflicts(plan, job, typed, source=source, cfp=cfp)
    if issues:
        raise ConfigError(issues)
    if console is not None:
        for line in plan_notes(plan, job, typed, source=source):
            console.print(f"cfp: {line}", markup=False)
