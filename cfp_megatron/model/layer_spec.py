"""A custom decoder layer given through Megatron-Core's ``ModuleSpec`` (``model.spec=package.module:name``).

``name`` is either the spec itself (a ``ModuleSpec`` of a transformer layer, or a ``TransformerBlockSubmodules``:
what Megatron-LM's ``--spec <module> <name>`` imports and passes as the layer spec) or a function of the model's
``TransformerConfig`` that returns one (Megatron-Bridge's ``transformer_layer_spec`` callable: called as
``fn(config)``, or ``fn(config, vp_stage=...)`` where it takes ``vp_stage``). The builder trains it
(:mod:`cfp_megatron.engine.model`), the capture records it (:func:`~cfp_megatron.model.capture.capture_job`), and
:func:`spec_identity` (the path and a hash of the spec's structure and of its modules' source) enters every key
that depends on the layers: the capture and derivation caches, the profile's model key, the launch's plan key.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

from cfp_megatron.base.config import JobSpec, ModelSpec
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.jsonio import json_plain

SETTING = "model.spec"
"""The Hydra key."""
_FORM = ("package.module:name, naming a module-level ModuleSpec of the decoder layer or a function of the "
         "TransformerConfig that returns one")


def _issue(value: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(ConfigIssue(key=SETTING, value=value, problem=problem, fix=fix))


def load_target(value: str) -> Any:
    """The object ``model.spec`` names (its module imported); a :class:`ConfigError` naming the key where the module
    does not import or lacks the name."""
    module, _, name = value.partition(":")
    try:
        found = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a user's module: any failure while importing it is theirs
        raise _issue(value, f"module {module!r} does not import ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:200] if str(exc) else '-'}).",
                     f"put the module on PYTHONPATH (every rank imports it; torchrun runs from the launch's working "
                     f"folder), or correct the path: {_FORM}.") from None
    try:
        return getattr(found, name)
    except AttributeError:
        raise _issue(value, f"module {module!r} has no {name!r}.",
                     f"name an object the module defines: {_FORM}.") from None


def _spec_types() -> tuple[type, ...]:
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    return ModuleSpec, TransformerBlockSubmodules


def is_spec(value: Any) -> bool:
    """Whether ``value`` is a layer or block spec GPTModel takes."""
    return isinstance(value, _spec_types())


def _target(value: str) -> Any:
    """What ``value`` names, where it is a spec or callable (else the :class:`ConfigError`)."""
    target = load_target(value)
    if not is_spec(target) and not callable(target):
        raise _issue(value, f"it names {type(target).__name__} {target!r:.80}, neither a ModuleSpec nor callable.",
                     f"write {_FORM}.")
    return target


def block_spec(model: ModelSpec, config: Any, *, vp_stage: int | None = None) -> Any:
    """The ``ModuleSpec`` (or ``TransformerBlockSubmodules``) ``model.spec`` gives for ``config``; a
    :class:`ConfigError` naming the key where it is not callable, fails, or returns something else."""
    value = str(model.spec)
    target = _target(value)
    if is_spec(target):
        return _a_layer(value, target)
    try:
        takes_vp = "vp_stage" in inspect.signature(target).parameters
    except (TypeError, ValueError):
        takes_vp = False
    try:
        spec = target(config, vp_stage=vp_stage) if takes_vp else target(config)
    except Exception as exc:  # noqa: BLE001 - a user's function: its failure is reported as the setting's
        raise _issue(value, f"calling it with the model's TransformerConfig raised {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:200] if str(exc) else '-'}.",
                     "make it a function of the TransformerConfig (and optionally vp_stage) that returns the "
                     "layer's ModuleSpec.") from None
    if not is_spec(spec):
        raise _issue(value, f"it returned {type(spec).__name__}, not a ModuleSpec.",
                     "return Megatron-Core's ModuleSpec of the decoder layer (or a TransformerBlockSubmodules).")
    return _stage_layers(value, _a_layer(value, spec), config, vp_stage)


def _stage_layers(value: str, spec: Any, config: Any, vp_stage: int | None) -> Any:
    """``spec`` where a block spec holds as many layers as this pipeline stage builds (GPTModel builds every layer a
    block spec lists: more or fewer would train another model without a word); else the error."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if isinstance(spec, TransformerBlockSubmodules):
        want = get_num_layers_to_build(config, vp_stage=vp_stage)
        if len(spec.layer_specs) != want:
            raise _issue(value, f"it gives a block of {len(spec.layer_specs)} layer specs where this pipeline stage "
                                f"builds {want} (model.num_layers={config.num_layers}).",
                         "build the block for the config it is given (Megatron-Core's get_gpt_decoder_block_spec("
                         "config, ..., vp_stage=vp_stage) gives this stage's layers), or return one layer's "
                         "ModuleSpec.")
    return spec


def _a_layer(value: str, spec: Any) -> Any:
    """``spec`` where it is a block or a layer's spec (what GPTModel's decoder builds from); else the error."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer

    module = spec.module if isinstance(spec, ModuleSpec) else None
    if isinstance(module, type) and not issubclass(module, BaseTransformerLayer | TransformerBlock):
        raise _issue(value, f"it gives a ModuleSpec of {module.__name__}, not of a transformer layer.",
                     "return the decoder layer's spec (ModuleSpec(module=TransformerLayer, submodules="
                     "TransformerLayerSubmodules(..., mlp=<your spec>))), e.g. Megatron-Core's layer spec with the "
                     "part replaced.")
    return spec


def check(model: ModelSpec) -> None:
    """Import and build ``model.spec`` once for the capture's config (on Megatron's world-1 state on the ``fake``
    group, none left behind): the :class:`ConfigError` of :func:`block_spec` where it does not give a layer spec.
    Nothing for a model without one. Under a process group without Megatron's parallel state (a script that keeps one
    between runs) it is imported but not built: the builder's call reports the same error."""
    if model.spec is None:
        return
    import torch.distributed as dist
    from megatron.core import parallel_state

    from cfp_megatron.model.capture import capture_job_config
    from cfp_megatron.model.meta_env import megatron_meta_env

    _target(model.spec)
    if dist.is_initialized() and not parallel_state.model_parallel_is_initialized():
        return
    with megatron_meta_env():
        block_spec(model, capture_job_config(JobSpec(model=model)))


def keyed_model(model: ModelSpec) -> dict[str, Any]:
    """``model`` as the keys that depend on it hash it (JSON): ``spec`` replaced by :func:`spec_identity` where set,
    left out where not (so every key made before the field existed holds)."""
    plain = json_plain(model)
    plain.pop("spec")
    if model.spec is not None:
        plain["spec"] = spec_identity(model)
    return plain


@functools.cache
def spec_identity(model: ModelSpec) -> dict[str, str] | None:
    """``{"path": model.spec, "structure": <hash>}``, ``None`` for a model without one. The hash covers what the
    layers are built from besides the model's fields (which every key holds already): a spec object's structure (its
    repr, addresses dropped) or a function's name, and the source files of the module that defines it, of the user
    modules it imports names from and of the classes the spec holds (not the installed packages': their versions
    are in the keys). Read without building the spec, so it is the same before and under any process group."""
    if model.spec is None:
        return None
    target = _target(model.spec)
    shown = repr(target) if is_spec(target) else json_plain(target)  # a callable by its qualified name
    digest = hashlib.sha256(re.sub(r" at 0x[0-9a-fA-F]+", "", shown).encode())
    for path in sorted(_user_sources(target, model.spec.partition(":")[0])):
        digest.update(path.read_bytes())
    return {"path": model.spec, "structure": digest.hexdigest()[:16]}


def _user_file(value: Any) -> Path | None:
    """The source file of the module ``value`` is (or is defined in), where it is a user's (not the standard
    library's or an installed package's)."""
    import sysconfig

    module = value if inspect.ismodule(value) else inspect.getmodule(value)
    file = getattr(module, "__file__", None)
    if not file:
        return None
    path = Path(file).resolve()
    installed = {Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "purelib", "platlib")}
    return None if any(path.is_relative_to(root) for root in installed) else path


def _user_sources(target: Any, module_name: str) -> set[Path]:
    """The user source files :func:`spec_identity` hashes: the defining module's, those of the classes, functions
    and modules it holds at module level, and those of every class and function a spec object holds."""
    import dataclasses
    import sys

    module = sys.modules[module_name]
    found = {p for p in (_user_file(module),) if p is not None}
    for value in vars(module).values():
        if inspect.ismodule(value) or isinstance(value, type) or inspect.isfunction(value):
            path = _user_file(value)
            if path is not None:
                found.add(path)
    seen: set[int] = set()

    def visit(value: Any) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, type) or inspect.isfunction(value):
            path = _user_file(value)
            if path is not None:
                found.add(path)
        elif dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                visit(getattr(value, f.name))
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, list | tuple):
            for v in value:
                visit(v)

    visit(target)
    return found
