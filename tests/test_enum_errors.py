"""Every enumerated setting of the schema (issue O, deliverable 4): a value outside it is one error naming the key
and listing every option, as the preflight prints it (rich read the list ``[auto, fp32, ...]`` as markup and printed
"expected one of ." before)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from typing import Any

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from cfp_megatron.base.compose import _root_schema, hydra_config_error
from cfp_megatron.planner.plan_cli import main as plan_main


def _enum_of(hint: object) -> tuple[type[enum.Enum], bool] | None:
    """(the enum, whether the setting is a list of it) of a field's type hint; ``None`` for another type."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    for arg in args:
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            return arg, False
        inner = typing.get_args(arg)
        if typing.get_origin(arg) is list and inner and isinstance(inner[0], type) and issubclass(inner[0], enum.Enum):
            return inner[0], True
    return None


def enum_settings(schema: type, prefix: str = "") -> list[tuple[str, type[enum.Enum], bool]]:
    """Every enum-typed key of the composed config's schema (nested groups walked), with its enum and list-ness."""
    out = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        nested = [a for a in (*typing.get_args(hint), hint) if dataclasses.is_dataclass(a)]
        if nested:
            out += enum_settings(nested[0], f"{prefix}{f.name}.")
            continue
        found = _enum_of(hint)
        if found is not None:
            out.append((f"{prefix}{f.name}", *found))
    return out


SETTINGS = enum_settings(_root_schema())


def test_the_walk_finds_the_enumerated_settings() -> None:
    keys = {key for key, _, _ in SETTINGS}
    assert {"train.precision", "train.fp8_recipe", "train.fp4_recipe", "cfp.constraints.precision",
            "parallel.moe_flex_dispatcher_backend", "cfp.constraints.moe_flex_dispatcher_backend",
            "cfp.constraints.cuda_graph_impl", "cfp.constraints.moe_token_policy",
            "cfp.recompute", "parallel.recompute", "model.activation", "backend.name"} <= keys
    assert len(keys) >= 20


@functools.cache
def _schema() -> Any:
    """The composed config's schema as OmegaConf checks an override against it (the ``cfp`` group chosen)."""
    root = _root_schema()
    cfp = next(a for a in typing.get_args(typing.get_type_hints(root)["cfp"]) if a is not type(None))
    return OmegaConf.structured(root(cfp=cfp()))


def _listed(said: str, kind: type[enum.Enum]) -> list[str]:
    """The options of ``kind`` missing from the error text after its bad value (the names: what Hydra accepts)."""
    options = said[said.index("not_an_option"):]
    return [m.name for m in kind if m.name not in options]


@pytest.mark.parametrize(("key", "kind", "listed"), SETTINGS, ids=[key for key, _, _ in SETTINGS])
def test_a_value_outside_an_enum_is_refused_listing_every_option(key: str, kind: type[enum.Enum],
                                                                 listed: bool) -> None:
    value: Any = ["not_an_option"] if listed else "not_an_option"
    with pytest.raises(ValidationError) as info:
        OmegaConf.update(_schema(), key, value)
    said = str(hydra_config_error(info.value, [f"{key}={value}"]))
    assert key in said and not _listed(said, kind), said


@pytest.mark.parametrize("override", ["train.precision=not_an_option", "cfp.constraints.fp8_recipe=[not_an_option]"])
def test_the_preflight_prints_the_options(override: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["+cfp=auto", override]) == 2
    said = " ".join(capsys.readouterr().out.split())
    kind = {key: k for key, k, _ in SETTINGS}[override.partition("=")[0]]
    assert "not_an_option" in said and not _listed(said, kind), said


@pytest.mark.parametrize(("override", "hint"), [
    ("train.precision=nvfp4", "nvfp4 is train.precision=fp4 train.fp4_recipe=nvfp4"),
    ("train.precision=mxfp8", "mxfp8 is train.precision=fp8 train.fp8_recipe=mxfp8"),
    ("train.precision=fp8-tensorwise", "fp8-tensorwise is train.precision=fp8 train.fp8_recipe=tensorwise"),
    ("cfp.constraints.precision=[bf16,mxfp8]", "mxfp8 is fp8 with cfp.constraints.fp8_recipe=[mxfp8]"),
])
def test_a_format_or_recipe_given_as_the_precision_says_how_to_ask_for_it(
        override: str, hint: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["+cfp=auto", override]) == 2
    said = " ".join(capsys.readouterr().out.split())
    assert hint in said and "[auto, fp32, bf16, fp16, fp8, fp4]" in said, said


def test_no_recipe_hint_for_other_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["+cfp=auto", "train.precision=int4"]) == 2
    assert " is train.precision=" not in " ".join(capsys.readouterr().out.split())
