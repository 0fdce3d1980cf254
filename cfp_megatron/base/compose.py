"""The project's Hydra configs: the schema stored in Hydra's ConfigStore and composition from ``conf/``.

The frozen specs of :mod:`cfp_megatron.base.config` are the source of truth; the schema is their mutable twin plus the
planner's ``cfp`` group (:mod:`cfp_megatron.base.cfp_spec`) and the ``backend`` group
(:mod:`cfp_megatron.base.backend_spec`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from collections.abc import Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

from cfp_megatron.base.backend_spec import BackendSpec
from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import (
    Fp4Recipe,
    Fp8Recipe,
    JobSchema,
    JobSpec,
    home_path,
    job_from_config,
    mutable_twin,
)
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.launch_env import run_id


@functools.cache
def _root_schema() -> type:
    """The schema of the whole composed config: :data:`JobSchema`'s groups plus the planner's optional ``cfp`` group
    (``None`` unless a ``cfp`` option such as ``+cfp=auto`` is chosen)."""
    cfp = mutable_twin(CfpSpec, {})
    backend = mutable_twin(BackendSpec, {})
    extra = [(f.name, f.type, field(default_factory=f.default_factory)) for f in dataclasses.fields(JobSchema)]
    return dataclasses.make_dataclass("CfpRootSchema", [*extra, ("cfp", cfp | None, field(default=None)),
                                                        ("backend", backend, field(default_factory=backend))],
                                      kw_only=True)


def register_configs() -> None:
    """Store the schema in Hydra's ConfigStore (``conf/config.yaml`` lists ``cfp_schema`` first in its defaults)
    unless it holds it already (storing converts the schema to a config again, a sixth of a composition), and
    register the ``cfp_run_id`` resolver used by ``hydra.run.dir``."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    if "cfp_schema.yaml" not in store.repo:
        store.store(name="cfp_schema", node=_root_schema())
    if not OmegaConf.has_resolver("cfp_run_id"):
        OmegaConf.register_new_resolver("cfp_run_id", run_id)


CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The project's Hydra config folder."""


def compose_config(overrides: Sequence[str], *, typed: bool = False, runs_hydra: bool = True,
                   keep_hydra: bool = False) -> Any:
    """The project's Hydra config composed with ``overrides`` (an OmegaConf ``DictConfig``), as the command-line
    tools (``analyze``, ``profile``, ``plan``), ``launch/train.py`` (before Hydra runs) and the tests compose it.

    The overrides are checked first (:func:`override_issues`; ``typed``: a person's command line, where a key given
    twice with two values is said on stderr by rank 0, :func:`repeated_overrides`; ``runs_hydra`` false: a command
    that only composes, where Hydra's run settings would be ignored), then every group
    ``conf/config.yaml`` composes must have an option chosen.
    Whatever Hydra or OmegaConf still refuses (a value of the wrong type...) comes back as one :class:`ConfigError`
    naming the key, the value and the choices (:func:`hydra_config_error`); never Hydra's traceback.
    ``keep_hydra``: the config keeps Hydra's own ``hydra`` node (what Hydra's app gives ``HydraConfig``), for a
    caller that sets up Hydra's run itself and takes the job's config from :func:`without_hydra`: one composition
    for both."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import open_dict, read_write
    from omegaconf.errors import OmegaConfBaseException

    issues = override_issues(overrides, runs_hydra=runs_hydra)
    if issues:
        raise ConfigError(issues)
    if typed:
        say_repeats(overrides)
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    except ConfigError:
        raise
    except (HydraException, OmegaConfBaseException) as err:
        raise hydra_config_error(err, overrides) from None
    except (AssertionError, ValueError, TypeError, KeyError) as err:  # Hydra's internal checks on odd input
        raise ConfigError(ConfigIssue(key="<override>", value=" ".join(overrides), problem="Hydra refused it: "
                                      f"{type(err).__name__}: {_first_line(err)}.", fix=_OVERRIDE_FIX)) from None
    choices = cfg.hydra.runtime.choices
    missing = [g for g in default_groups() if choices.get(g) is None]
    if missing:  # whatever removed it (another defaults list...): a job of the schema's built-in values, refused
        raise ConfigError([_group_needed(g, None, "has no option chosen") for g in missing])
    if keep_hydra:
        return cfg
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    return cfg


def without_hydra(cfg: Any) -> Any:
    """A copy of ``cfg`` (a :func:`compose_config` with ``keep_hydra``) less its ``hydra`` node: the config
    :func:`compose_config` gives without ``keep_hydra``; ``cfg`` itself is left as it is."""
    import copy

    from omegaconf import open_dict, read_write

    out = copy.deepcopy(cfg)
    with read_write(out), open_dict(out):
        del out["hydra"]
    return out


_OVERRIDE_FIX = "write each override as key=value, e.g. train.steps=5 (see docs/configuration.md)."
"""The fix of an override Hydra cannot use, where nothing more precise is known."""


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0].rstrip(".") if text else type(err).__name__


@functools.cache
def default_groups(conf_dir: Path = CONF_DIR) -> dict[str, str]:
    """The config groups ``conf/config.yaml`` composes, each with its default option: every job has one option of
    each (the other folders of ``conf/``, such as ``cfp``, are added with ``+group=option``)."""
    from omegaconf import OmegaConf

    config = conf_dir / "config.yaml"
    defaults = OmegaConf.to_container(OmegaConf.load(config)).get("defaults", []) if config.exists() else []
    return {k: v for entry in defaults if isinstance(entry, dict) for k, v in entry.items()
            if isinstance(v, str) and (conf_dir / k).is_dir()}


def _groups() -> set[str]:
    """The config groups: the folders of ``conf/`` that hold options."""
    return {p.name for p in CONF_DIR.iterdir() if p.is_dir() and any(p.glob("*.yaml"))}


def _group_needed(group: str, value: object, problem: str) -> ConfigIssue:
    """The issue of a group every job needs (``model``...) left without an option."""
    options = group_options(group)
    default = default_groups().get(group, options[0] if options else "<option>")
    return ConfigIssue(key=group, value=value, problem=f"{problem}: every job needs one {group} option (without it "
                       f"the job would silently run the schema's built-in {group} values, not a preset).",
                       fix=f"choose one of {options}, e.g. {group}={default}, or leave {group} out for the default.")


def nearest(word: str, choices: Sequence[str]) -> str | None:
    """The choice ``word`` most likely means, ``None`` when none is close. Case and the separators ``-``, ``_`` and
    spaces do not count (``Llama3-8B`` is ``llama3_8b``); then a near-twin in spelling (``train.step``:
    ``train.steps``); then a choice of the same dotted parent whose last part
    holds ``word``'s as whole ``_``-parts or starts with it (``h100`` in ``dgx_h100``, ``mixtral`` of
    ``mixtral_8x7b``, ``train.seq`` of ``train.seq_length``), the closest in spelling of those; else the closest in
    spelling of all (difflib)."""
    def norm(text: str) -> str:
        return re.sub(r"[-_\s]+", "_", text.strip().lower())

    by_norm = {norm(c): c for c in sorted(choices, reverse=True)}  # the first in sorted order wins a tie
    said = norm(word)
    if said in by_norm:
        return by_norm[said]
    typo = difflib.get_close_matches(said, sorted(by_norm), n=1, cutoff=0.9)  # a letter left out or doubled
    if typo:
        return by_norm[typo[0]]
    scope, _, leaf = said.rpartition(".")
    if leaf:
        def holds(choice: str) -> bool:
            its_scope, _, its_leaf = choice.rpartition(".")
            return its_scope == scope and (re.search(rf"(^|_){re.escape(leaf)}($|_)", its_leaf) is not None
                                           or its_leaf.startswith(f"{leaf}_"))

        holding = [n for n in by_norm if holds(n)]
        if holding:
            return by_norm[max(sorted(holding), key=lambda n: difflib.SequenceMatcher(None, said, n).ratio())]
    found = difflib.get_close_matches(said, sorted(by_norm), n=1, cutoff=0.75)
    return by_norm[found[0]] if found else None


@functools.cache
def schema_keys(hydra: bool = False) -> tuple[str, ...]:
    """Every settable key of the schema (``train.steps``, ``cfp.constraints.tp``...), sorted; with ``hydra``, those
    of Hydra's own config (``hydra.run.dir``...) instead."""
    import typing

    found: list[str] = []

    def walk(node: type, prefix: str) -> None:
        hints = typing.get_type_hints(node)
        for f in dataclasses.fields(node):
            inner = _dataclass_of(hints.get(f.name, f.type))
            if inner is None:
                found.append(f"{prefix}{f.name}")
            else:
                walk(inner, f"{prefix}{f.name}.")

    if hydra:
        from hydra.conf import HydraConf

        walk(HydraConf, "hydra.")
    else:
        walk(_root_schema(), "")
    return tuple(sorted(found))


def _dataclass_of(hint: object) -> type | None:
    """The dataclass a schema field holds (its ``X | None`` included), else ``None``."""
    args = [a for a in getattr(hint, "__args__", ()) if a is not type(None)]
    node = args[0] if len(args) == 1 else hint
    return node if isinstance(node, type) and dataclasses.is_dataclass(node) else None


def _key_status(key: str) -> str:
    """``known`` (a setting of the schema), ``group`` (a section of it, such as ``model``), ``unknown``, or ``free``
    (below a field that is not a dataclass, such as a mapping: Hydra decides)."""
    node: Any = _root_schema()
    parts = key.split(".")
    for i, part in enumerate(parts):
        hints = {f.name: f.type for f in dataclasses.fields(node)}
        if part not in hints:
            return "unknown"
        inner = _dataclass_of(hints[part])
        if inner is None:
            return "known" if i == len(parts) - 1 else "free"
        node = inner
    return "group"


HYDRA_COMPOSE_KEYS = ("hydra.searchpath",)
"""Hydra's settings that change what is composed (the others configure the run Hydra starts, which only
``launch/train.py`` does)."""


def override_issues(overrides: Sequence[str], *, sweeps: bool = False, runs_hydra: bool = True) -> list[ConfigIssue]:
    """What is wrong with ``overrides`` before Hydra composes them, one issue per override: one Hydra cannot parse
    (the key named, ``==`` and unclosed quotes said as such), a group left without an option (``~model``,
    ``model=null``, ``model=``), an option that is not one (the nearest named), ``+`` on a group or key that is
    already there or its absence on one that is not (``cfp=auto``, ``cfp.tp=2`` without ``+cfp=...``), an unknown
    key (the nearest schema key named: ``train.steps`` for ``train.step``), a schema key removed with ``~``, a sweep
    outside ``-m`` (``sweeps``: allowed, each job is composed on its own), a group added twice. ``hydra.*``
    overrides are Hydra's own and left to it, except where no Hydra run follows (``runs_hydra`` false: the planner's,
    analyser's and profiler's command lines only compose), which would ignore all but :data:`HYDRA_COMPOSE_KEYS`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    issues: list[ConfigIssue] = []
    parsed = []
    for text in overrides:
        try:
            parsed.append(parser.parse_override(text))
        except HydraException as err:  # OverrideParseException and the grammar's own
            issues.append(_parse_issue(text, err))
    groups, required = _groups(), default_groups()
    added = {o.key_or_group for o in parsed if o.key_or_group in groups and not o.is_delete()}
    seen: set[tuple[str, str | None]] = set()
    searched = any(o.key_or_group == "hydra.searchpath" for o in parsed)  # more options: Hydra checks them
    for o in parsed:
        key, text = o.key_or_group, o.input_line or ""
        given = _given(text)
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            if o.is_sweep_override() and not sweeps:
                issues.append(_sweep_issue(key, given))
            elif not runs_hydra and key not in HYDRA_COMPOSE_KEYS:
                issues.append(ConfigIssue(key=key, value=given, problem="configures the run Hydra starts for "
                                          "launch/train.py; this command only composes the config and would ignore "
                                          "it.", fix=f"drop {text} (this command's own flags say where it writes: "
                                          "--help)."))
            continue
        if key in groups and o.is_add() and (key, o.package) in seen:
            issues.append(ConfigIssue(key=key, value=given, problem=f"adds the {key} group a second time ({text}).",
                                      fix=f"add it once: +{key}=<one of {group_options(key)}>."))
        if o.is_add():
            seen.add((key, o.package))
        if o.is_sweep_override() and not sweeps:
            issues.append(_sweep_issue(key, given))
        elif key in groups:
            issues += _group_issues(o, key, key in required, searched=searched)
        else:
            issues += _key_issues(o, key, added, groups)
    issues += [ConfigIssue(key=o.key_or_group, value=None, problem=f"{o.input_line} removes the {o.key_or_group} "
                           "group, which the command did not add.", fix=f"drop {o.input_line}.")
               for o in parsed if o.is_delete() and o.key_or_group in groups - set(required) - added]
    return issues


def _sweep_issue(key: str, given: str | None) -> ConfigIssue:
    """The issue of a sweep (``a,b``) outside ``-m``."""
    return ConfigIssue(key=key, value=given, problem="is a sweep (several values), and one job takes one value.",
                       fix="choose one value, add -m (multirun) to run one job per value, or quote a comma that is "
                           f"part of the value: \"{key}='{given}'\".")


def repeated_overrides(overrides: Sequence[str]) -> list[str]:
    """One line for each key (or group) ``overrides`` give twice with two values, naming the one Hydra uses (the
    last): a wrapper script may append an override to change one, so it is said, not refused."""
    last: dict[str, list[str]] = {}
    for text in overrides:
        name, sep, _ = text.partition("=")
        key = name.lstrip("+~").strip()
        if key and not key.startswith(("hydra.", "hydra/")) and (sep or text.startswith("~")):
            last.setdefault(key, [])
            if text not in last[key]:
                last[key].append(text)
    return [f"{key} is given {len(texts)} times ({', '.join(texts)}): Hydra uses the last, {texts[-1]}"
            for key, texts in last.items() if len(texts) > 1]


def say_repeats(overrides: Sequence[str]) -> None:
    """Say :func:`repeated_overrides` on stderr, on rank 0 only (every rank composes the same overrides)."""
    import os
    import sys

    if os.environ.get("RANK", "0") == "0":
        for line in repeated_overrides(overrides):
            print(f"cfp: {line}", file=sys.stderr, flush=True)


def _given(text: str) -> str | None:
    """The value an override's text gives (``None`` for ``~key`` without one)."""
    name, sep, value = text.partition("=")
    return value if sep else None


QUOTES = "'\""
"""The quotes Hydra's grammar reads."""


def _parse_issue(text: str, err: Exception) -> ConfigIssue:
    """The issue of an override Hydra's grammar refuses, naming its key and the likely slip."""
    name, sep, value = text.partition("=")
    key = name.lstrip("+~").strip() or "<override>"
    if text != text.strip() and text.strip():
        return ConfigIssue(key=key, value=value, problem=f"'{text}' has spaces around it, which Hydra cannot parse.",
                           fix=f"write {text.strip()}.")
    if not sep:
        known = key in _groups() or _key_status(key) != "unknown"
        fix = (f"give it a value: {key}=<value>." if known else
               "write it as key=value; quote a value with spaces for Hydra and the shell, e.g. \"data.path='a b'\".")
        return ConfigIssue(key=key, value=text, problem="is not an override (no '=').", fix=fix)
    if value.startswith("="):
        return ConfigIssue(key=key, value=value, problem=f"{text} has '==' where one '=' is meant.",
                           fix=f"write {name}={value.lstrip('=')}.")
    if value.startswith("~"):
        return ConfigIssue(key=key, value=value, problem=f"{text} starts its value with '~', which Hydra cannot parse "
                           "(and the shell does not expand after key=).", fix=f"write the full path: "
                           f"{name}={home_path(value)}.")
    if value.count("'") % 2 or value.count('"') % 2:
        return ConfigIssue(key=key, value=value, problem=f"{text} opens a quote it does not close.",
                           fix=f"close it, or quote the override for the shell: \"{name}='{value.strip(QUOTES)}'\".")
    if value.count("[") != value.count("]") or value.count("{") != value.count("}") or value.count("(") != \
            value.count(")"):
        return ConfigIssue(key=key, value=value, problem=f"{text} has brackets that do not pair up.",
                           fix=f"close them, e.g. {name}=[a,b]; quote it for the shell.")
    return ConfigIssue(key=key, value=value, problem=f"Hydra cannot parse {text} ({_first_line(err)}).",
                       fix="quote a value with spaces, commas, brackets or '=' for Hydra and the shell, "
                           "e.g. \"data.path='a,b'\".")


def _group_issues(o: Any, group: str, required: bool, *, searched: bool = False) -> list[ConfigIssue]:
    """The issues of an override of config group ``group`` (``model=...``, ``+cfp=...``, ``~model``); ``searched``:
    ``hydra.searchpath`` adds folders of options, which Hydra checks."""
    text, value = o.input_line or "", None if o.is_delete() or o.is_sweep_override() else o.value()
    given = _given(text)
    options = group_options(group)
    if o.is_delete():
        return [_group_needed(group, given, f"{text} removes the {group} group")] if required else []
    if o.is_sweep_override():
        return []  # multirun: each job's option is checked as that job is composed
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            return [_group_needed(group, value, "is empty" if value is not None else "is null")]
        return [ConfigIssue(key=group, value=value, problem="is not an option.",
                            fix=f"use one of {options} (+{group}=<option>), or leave it out.")]
    if not isinstance(value, str):
        return [ConfigIssue(key=group, value=value, problem="a job takes one option of the group, not a list.",
                            fix=f"choose one of {options}, e.g. {group}={options[0]}.")]
    plus, default = ("", default_groups()[group]) if required else ("+", options[0])
    nested = (".." not in Path(value).parts and not Path(value).is_absolute()
              and (CONF_DIR / group / f"{value}.yaml").is_file())  # an option in a subfolder: group=sub/option
    if value not in options and not nested and not searched:
        near = nearest(Path(value).name.removesuffix(".yaml"), options)
        return [ConfigIssue(key=group, value=value, problem=f"is not an option of config group '{group}' (the YAML "
                            f"files of {CONF_DIR / group})" + (f"; did you mean {near}?" if near else "."),
                            fix=f"write {plus}{group}={near}." if near
                            else f"use one of {options}, e.g. {plus}{group}={default}.")]
    if required and (o.is_add() or o.is_force_add()):
        return [ConfigIssue(key=group, value=given, problem=f"adds {group}, which conf/config.yaml composes already.",
                            fix=f"drop the +: {group}={value}.")]
    if not required and not (o.is_add() or o.is_force_add()):
        return [ConfigIssue(key=group, value=given, problem=f"changes {group}, which is not in the config: the "
                            f"{group} group is added with a +.", fix=f"write +{group}={value}.")]
    if not required and o.is_force_add():
        return [ConfigIssue(key=group, value=given, problem="adds the group with ++, which Hydra refuses for groups.",
                            fix=f"write +{group}={value}.")]
    return []


def _key_issues(o: Any, key: str, added: set[str], groups: set[str]) -> list[ConfigIssue]:
    """The issues of an override of a key (``train.steps=5``, ``+model.foo=1``, ``~model.num_layers``)."""
    text = o.input_line or ""
    given, top = _given(text), key.split(".")[0]
    if top in groups and top not in default_groups() and top not in added:
        options = group_options(top)
        return [ConfigIssue(key=key, value=given, problem=f"sets a key of the {top} group, which the command did not "
                            f"add (it is added with +{top}=<option>, one of {options}).",
                            fix=f"add +{top}={options[0]} before it: +{top}={options[0]} {text}.")]
    status = _key_status(key)
    if status == "unknown":
        parent = key.rpartition(".")[0]
        siblings = _known_keys(key)
        listed = f" The keys of {parent or 'the config'} are {siblings}." if siblings is not None else ""
        same_leaf = [k for k in schema_keys() if k.rpartition(".")[2] == key.rpartition(".")[2]]
        near = same_leaf[0] if len(same_leaf) == 1 else nearest(key, schema_keys())
        if near is not None:
            return [ConfigIssue(key=key, value=given, problem=f"is not a known setting; did you mean {near}?",
                                fix=f"write {near}={given}." if given is not None else f"use {near}.")]
        return [ConfigIssue(key=key, value=given, problem="is not a known setting.",
                            fix=f"fix the spelling or remove it.{listed}")]
    if status not in ("known", "group"):
        return []
    if o.is_add():
        return [ConfigIssue(key=key, value=given, problem="adds a key the config has already.",
                            fix=f"drop the +: {text.lstrip('+')}.")]
    if o.is_delete():
        return [ConfigIssue(key=key, value=given, problem=f"{text} removes a setting the schema defines, which Hydra "
                            "cannot.", fix=f"set it ({key}=<value>), or leave it out for its default.")]
    if status == "group" and not o.is_sweep_override() and o.value() is None:
        return [_group_needed(key, None, "is null")] if key in default_groups() else []
    return []


@functools.cache
def group_presets(group: str) -> tuple[tuple[str, dict[str, Any]], ...]:
    """Every option of config group ``group`` as (name, its YAML as a plain dict), sorted by name and read once per
    process (the dicts are shared: read them, do not change them)."""
    from omegaconf import OmegaConf

    return tuple((path.stem, OmegaConf.to_container(OmegaConf.load(path), resolve=True))
                 for path in sorted((CONF_DIR / group).glob("*.yaml")))


def group_options(group: str) -> list[str]:
    """The options of config group ``group`` (the ``conf/<group>/*.yaml`` names), sorted."""
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def _known_keys(key: str) -> list[str] | None:
    """The settings next to ``key`` in the schema (the fields of its parent group), or ``None`` if unknown."""
    node: Any = _root_schema()
    for part in key.split(".")[:-1]:
        hints = {f.name: f.type for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        node = hints.get(part)
        args = [a for a in getattr(node, "__args__", ()) if a is not type(None)]
        node = args[0] if args else node
        if node is None or not dataclasses.is_dataclass(node):
            return None
    return sorted(f.name for f in dataclasses.fields(node))


def _override_value(key: str, overrides: Sequence[str]) -> object:
    """The value ``overrides`` gave ``key`` (the last one; the whole override where it set a key below ``key``), or
    ``None``."""
    found: object = None
    for override in overrides:
        name, sep, value = override.lstrip("+~").partition("=")
        if sep and name == key:
            found = value
        elif sep and name.startswith(f"{key}."):
            found = override
    return found


def _recipe_hint(full_key: str, overrides: Sequence[str]) -> str:
    """For a ``train.precision`` (or ``cfp.constraints.precision``) value that names a scaling recipe or a format
    (``mxfp8``, ``nvfp4``, ``fp8-tensorwise``): how to ask for it; else empty."""
    if full_key != "train.precision" and not full_key.startswith("cfp.constraints.precision"):
        return ""
    given = _override_value(re.sub(r"\[\d+\]$", "", full_key), overrides)
    values = [str(v).strip() for v in (given if isinstance(given, list) else str(given).strip("[]").split(","))]
    hints = []
    for value in values:
        recipe = value.partition("-")[2] if value.partition("-")[0] in ("fp8", "fp4") else value
        in_set = full_key.startswith("cfp")
        if recipe in {r.value for r in Fp8Recipe}:
            hints.append(f"{value} is fp8 with cfp.constraints.fp8_recipe=[{recipe}]" if in_set
                         else f"{value} is train.precision=fp8 train.fp8_recipe={recipe}")
        elif recipe in {r.value for r in Fp4Recipe}:
            hints.append(f"{value} is fp4 with train.fp4_recipe={recipe}" if in_set
                         else f"{value} is train.precision=fp4 train.fp4_recipe={recipe}")
    return f" ({'; '.join(hints)})" if hints else ""


def hydra_config_error(err: Exception, overrides: Sequence[str]) -> ConfigError:
    """One :class:`ConfigError` for an error Hydra or OmegaConf raised while composing ``overrides``: the key, the
    value the user gave, what is wrong and the choices (the group's options, the group's keys, the enum's values)."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause = err.__cause__ if isinstance(err.__cause__, Exception) else err
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, MissingConfigException):
        missing = err.missing_cfg_file or ""
        group, _, option = missing.rpartition("/")
        if group and (CONF_DIR / group).is_dir():
            options = group_options(group)
            return ConfigError(ConfigIssue(key=group, value=option, problem=f"is not an option of config group "
                                           f"'{group}'.", fix=f"use one of {options}, e.g. {group}={options[0]}."))
        if group.startswith("hydra/"):
            return ConfigError(ConfigIssue(key=group, value=option, problem="is not an option Hydra has here (its "
                                           "options come with installed plugins).", fix="use one that is installed "
                                           "(launch/train.py --hydra-help lists them), or install its plugin."))
        return ConfigError(ConfigIssue(key="<config>", value=missing or None, problem=first,
                                       fix=f"choose an option from {CONF_DIR}."))
    if isinstance(err, OverrideParseException):
        bad = [o for o in overrides if o.count("[") != o.count("]") or o.count("'") % 2 or o.count('"') % 2
               or "=" not in o]
        return ConfigError(ConfigIssue(key="<override>", value=bad[0] if bad else " ".join(overrides),
                                       problem=f"Hydra cannot parse it ({first}).",
                                       fix="write each override as key=value; quote a value with brackets, commas or "
                                           "spaces, e.g. 'data.path=[a,b]'."))
    full_key = getattr(cause, "full_key", None) or ""
    if isinstance(cause, ConfigKeyError | ConfigAttributeError) and full_key:
        known = _known_keys(full_key)
        parent = full_key.rpartition(".")[0] or "the config"
        value = _override_value(full_key, overrides)
        near = nearest(full_key, schema_keys(hydra=full_key.startswith("hydra.")))
        if near is not None:
            return ConfigError(ConfigIssue(key=full_key, value=value, problem=f"is not a known setting; did you "
                                           f"mean {near}?", fix=f"write {near}={value}."))
        fix = (f"remove it or fix the spelling; the keys of {parent} are {known}." if known is not None
               else "remove it or fix the spelling (python -m cfp_megatron.analyze --help lists the groups).")
        return ConfigError(ConfigIssue(key=full_key, value=value, problem="is not a known setting.", fix=fix))
    if isinstance(cause, ValidationError) and full_key:
        msg = str(getattr(cause, "msg", "") or cause).strip().splitlines()[0]
        choices = re.search(r"expected one of \[(.*)\]", msg)
        target = re.search(r"converted to (\w+)", msg)
        if choices:
            fix = f"use one of [{choices.group(1)}]{_recipe_hint(full_key, overrides)}."
        elif "is not a ListConfig" in msg:
            fix = f"give {full_key} a list, e.g. {full_key}=[{_override_value(full_key, overrides) or 'a'}]."
        elif target:
            fix = f"give {full_key} a value of type {target.group(1).lower()} (e.g. {full_key}=1)."
        else:
            fix = f"give {full_key} a value of the type its default has."
        listed = re.sub(r"\[\d+\]$", "", full_key)  # an element of a list setting: the list as given
        return ConfigError(ConfigIssue(key=full_key, value=_override_value(listed, overrides),
                                       problem=f"{msg.rstrip('.')}.", fix=fix))
    return ConfigError(ConfigIssue(key=full_key or "<override>", value=_override_value(full_key, overrides)
                                   if full_key else " ".join(overrides), problem=f"Hydra refused it: {first}",
                                   fix="check the override's spelling and type (see docs/configuration.md)."))


def compose_job(overrides: Sequence[str], *, typed: bool = False, runs_hydra: bool = True) -> JobSpec:
    """The job of :func:`compose_config`."""
    return job_from_config(compose_config(overrides, typed=typed, runs_hydra=runs_hydra))
