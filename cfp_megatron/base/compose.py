"""The project's Hydra configs: the schema stored in Hydra's ConfigStore and composition from ``conf/``.

The frozen specs of :mod:`cfp_megatron.base.config` are the source of truth; the schema is their mutable twin plus the
planner's ``cfp`` group (:mod:`cfp_megatron.base.cfp_spec`) and the ``backend`` group
(:mod:`cfp_megatron.base.backend_spec`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

from cfp_megatron.base.backend_spec import BackendSpec
from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import JobSchema, JobSpec, job_from_config, mutable_twin
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.launch_env import run_id


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
    and register the ``cfp_run_id`` resolver used by ``hydra.run.dir``."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="cfp_schema", node=_root_schema())
    if not OmegaConf.has_resolver("cfp_run_id"):
        OmegaConf.register_new_resolver("cfp_run_id", run_id)


CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The project's Hydra config folder."""


def compose_config(overrides: Sequence[str]) -> Any:
    """The project's Hydra config composed with ``overrides`` (an OmegaConf ``DictConfig``), as the command-line
    tools (``analyze``, ``profile``, ``plan``) and the tests compose it. Hydra's errors (an unknown group option or
    key, a value of the wrong type, an override it cannot parse) come back as one :class:`ConfigError` naming the
    key, the value and the choices (:func:`hydra_config_error`)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose("config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise hydra_config_error(err, overrides) from None


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
        fix = (f"remove it or fix the spelling; the keys of {parent} are {known}." if known is not None
               else "remove it or fix the spelling (python -m cfp_megatron.analyze --help lists the groups).")
        return ConfigError(ConfigIssue(key=full_key, value=_override_value(full_key, overrides),
                                       problem="is not a known setting.", fix=fix))
    if isinstance(cause, ValidationError) and full_key:
        msg = str(getattr(cause, "msg", "") or cause).strip().splitlines()[0]
        choices = re.search(r"expected one of \[(.*)\]", msg)
        target = re.search(r"converted to (\w+)", msg)
        if choices:
            fix = f"use one of [{choices.group(1)}]."
        elif target:
            fix = f"give {full_key} a value of type {target.group(1).lower()} (e.g. {full_key}=1)."
        else:
            fix = f"give {full_key} a value of the type its default has."
        return ConfigError(ConfigIssue(key=full_key, value=_override_value(full_key, overrides), problem=f"{msg}.",
                                       fix=fix))
    return ConfigError(ConfigIssue(key=full_key or "<override>", value=_override_value(full_key, overrides)
                                   if full_key else " ".join(overrides), problem=f"Hydra refused it: {first}",
                                   fix="check the override's spelling and type (see docs/configuration.md)."))


def compose_job(overrides: Sequence[str]) -> JobSpec:
    """The job of :func:`compose_config`."""
    return job_from_config(compose_config(overrides))
