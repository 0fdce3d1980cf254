"""The ``--help`` text of the command-line tools: the Hydra config groups and their options, read from ``conf/`` at
run time, and the keys most jobs set, one line each, described by the docstrings of the spec fields they fill."""

from __future__ import annotations

import ast
import functools
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

from cfp_megatron.base.backend_spec import BackendSpec
from cfp_megatron.base.cfp_spec import CfpSpec, SearchConstraints
from cfp_megatron.base.compose import CONF_DIR, default_groups
from cfp_megatron.base.config import ClusterSpec, ParallelSpec, TrainSpec


@dataclass(frozen=True)
class KeyGroup:
    """Common keys that share a prefix and a spec class."""

    prefix: str
    """The Hydra prefix (``train``, ``cfp.constraints``...)."""
    spec: type
    """The frozen spec whose field docstrings describe the keys."""
    fields: tuple[str, ...]
    """The field names shown, in order."""
    defaults_file: str | None = None
    """The YAML under ``conf/`` whose values are the defaults shown (``None``: the spec's own defaults)."""


COMMON_KEYS: tuple[KeyGroup, ...] = (
    KeyGroup("cluster", ClusterSpec, ("nodes", "gpus_per_node")),
    KeyGroup("parallel", ParallelSpec, ("tp", "sp", "pp", "vpp", "cp", "ep", "etp", "distributed_optimizer",
                                        "recompute"), "parallel/manual.yaml"),
    KeyGroup("train", TrainSpec, ("global_batch_size", "micro_batch_size", "seq_length", "steps", "precision", "lr",
                                  "checkpoint_dir", "save_interval", "resume"), "train/default.yaml"),
    KeyGroup("cfp", CfpSpec, ("top_k", "overlap", "plan_file", "plan", "profile_budget_s", "trials"), "cfp/auto.yaml"),
    KeyGroup("cfp.constraints", SearchConstraints, ("memory_headroom", "max_micro_batch", "tp_within_node"),
             "cfp/auto.yaml"),
    KeyGroup("backend", BackendSpec, ("name",), "backend/megatron.yaml"),
)
"""The keys ``--help`` lists (any field of a group can be overridden; docs/configuration.md lists them all)."""

_PIN_KNOBS = "tp pp vpp cp ep etp micro_batch sp recompute distributed_optimizer mlp fsdp"
"""The plan's knobs ``cfp.<knob>`` pins and ``cfp.constraints.<knob>`` restricts."""


def config_groups(conf_dir: Path = CONF_DIR) -> dict[str, tuple[list[str], str | None]]:
    """Each config group of ``conf_dir``: its options (the YAML files of its folder) and the default option
    ``config.yaml`` composes (``None`` for a group added with ``+group=option``)."""
    defaults = default_groups(conf_dir)
    groups = {}
    for folder in sorted(p for p in conf_dir.iterdir() if p.is_dir()):
        options = sorted(p.stem for p in folder.glob("*.yaml"))
        if options:
            groups[folder.name] = (options, defaults.get(folder.name))
    return groups


@functools.cache
def field_docs(spec: type) -> dict[str, str]:
    """The first sentence of each field's docstring (the string literal under the field in the class body)."""
    tree = ast.parse(inspect.getsource(inspect.getmodule(spec)))
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ClassDef) and node.name == spec.__name__):
            continue
        for field, doc in zip(node.body, node.body[1:], strict=False):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                    and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)):
                text = re.sub(r"\bNone\b", "null", " ".join(doc.value.value.split()).replace("``", ""))
                first = re.split(r"(?<=\.)\s", text, maxsplit=1)[0].rstrip(".")
                found[field.target.id] = first if len(first) <= 160 else first[:157].rstrip() + "..."
    return found


def _defaults(group: KeyGroup, conf_dir: Path) -> dict[str, object]:
    """The values the group's default YAML gives (empty where there is none)."""
    if group.defaults_file is None or not (conf_dir / group.defaults_file).exists():
        return {}
    from omegaconf import OmegaConf

    loaded = OmegaConf.to_container(OmegaConf.load(conf_dir / group.defaults_file))
    for part in group.prefix.split(".")[1:]:
        loaded = loaded.get(part, {}) if isinstance(loaded, dict) else {}
    return loaded if isinstance(loaded, dict) else {}


def _shown(value: object) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def config_help(conf_dir: Path = CONF_DIR, *, width: int = 118) -> str:
    """The help text: the config groups with their options, then the common keys with one line each."""
    lines = ["Hydra config groups (conf/; choose one with group=option, * marks the default):"]
    groups = config_groups(conf_dir)
    name_width = max((len(g) for g in groups), default=0)
    for group, (options, default) in groups.items():
        shown = ", ".join(f"{o}*" if o == default else o for o in options)
        if default is None:  # not in conf/config.yaml's defaults (cfp)
            shown += f"  (added with +{group}=<option>)"
        lines.append(_wrapped(f"  {group:<{name_width}}  ", shown, width))
    lines += ["", "Common keys (key=value; every field of a group can be set, see docs/configuration.md):"]
    rows: list[tuple[str, str]] = []
    for group in COMMON_KEYS:
        docs, defaults = field_docs(group.spec), _defaults(group, conf_dir)
        for name in group.fields:
            default = f" [default {_shown(defaults[name])}]" if name in defaults else ""
            rows.append((f"{group.prefix}.{name}", docs.get(name, "") + default))
        if group.prefix == "cfp":
            rows.append(("cfp.<knob>", f"Pin a knob of the plan, one of: {_PIN_KNOBS} [default null: search it]"))
        if group.prefix == "cfp.constraints":
            rows.append(("cfp.constraints.<knob>", "Allow only these values of a knob, e.g. cfp.constraints.tp=[2,4]"))
    key_width = max(len(k) for k, _ in rows)
    lines += [_wrapped(f"  {key:<{key_width}}  ", text, width) for key, text in rows]
    return "\n".join(lines)


def _wrapped(head: str, text: str, width: int) -> str:
    """``head`` then ``text``, wrapped at ``width`` with continuation lines indented under the text."""
    import textwrap

    return textwrap.fill(text, width=width, initial_indent=head, subsequent_indent=" " * len(head),
                         break_on_hyphens=False)
