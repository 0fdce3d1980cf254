"""The number format a run trains in: ``train.precision`` with its recipe (``train.fp8_recipe``,
``train.fp4_recipe``), as one value the simulator prices, the plan carries and Megatron-Core is told.

A format has one name (:attr:`NumberFormat.name`: ``bf16``, ``fp8-delayed``, ``fp8-mxfp8``, ``fp4-nvfp4``, ...),
which is what plan.json and the canonical string hold; which entry of a cluster preset's ``number_formats`` it needs
(:attr:`NumberFormat.needs`: ``fp8``, ``mxfp8``, ``nvfp4``); and the Megatron-Core fields that select it
(:meth:`NumberFormat.megatron_fields`, the Megatron-LM arguments of the same names). Why each recipe is priced as it
is: docs/simulator.md, "Number formats".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cfp_megatron.base.compose import group_presets
from cfp_megatron.base.config import ClusterSpec, Fp4Recipe, Fp8Recipe, Precision, TrainSpec
from cfp_megatron.base.errors import ConfigIssue

_NEEDS: dict[str, str] = {"fp8-delayed": "fp8", "fp8-tensorwise": "fp8", "fp8-blockwise": "fp8",
                          "fp8-mxfp8": "mxfp8", "fp4-nvfp4": "nvfp4", "fp16": "fp16"}
"""The ``cluster.number_formats`` entry each format's GEMMs need (bf16 and fp32 run everywhere)."""

_FP8_FORMAT: dict[Fp8Recipe, str] = {Fp8Recipe.delayed: "hybrid", Fp8Recipe.tensorwise: "hybrid",
                                     Fp8Recipe.mxfp8: "hybrid", Fp8Recipe.blockwise: "e4m3"}
"""Megatron-Core's ``fp8`` (E4M3 forward, E5M2 gradients: ``hybrid``) per recipe, as NVIDIA's recipes
(Megatron-Bridge's ``bf16_with_fp8_*_mixed``) set it; blockwise scaling (DeepSeek-V3's) runs E4M3 throughout."""


@dataclass(frozen=True, kw_only=True)
class NumberFormat:
    """One number format a run can train in."""

    precision: Precision
    """``train.precision`` (``auto`` is kept: it resolves per machine)."""
    recipe: Fp8Recipe | Fp4Recipe | None = None
    """The scaling recipe of ``fp8`` / ``fp4``; ``None`` for the 16- and 32-bit formats."""

    @classmethod
    def of(cls, train: TrainSpec) -> NumberFormat:
        """The format ``train`` asks for."""
        recipe = {Precision.fp8: train.fp8_recipe, Precision.fp4: train.fp4_recipe}.get(train.precision)
        return cls(precision=train.precision, recipe=recipe)

    @classmethod
    def parse(cls, name: str) -> NumberFormat:
        """The format :attr:`name` names; ``ValueError`` naming the known names for any other text."""
        head, _, tail = str(name).partition("-")
        try:
            precision = Precision(head)
            if precision is Precision.fp8:
                return cls(precision=precision, recipe=Fp8Recipe(tail))
            if precision is Precision.fp4:
                return cls(precision=precision, recipe=Fp4Recipe(tail))
            if not tail:
                return cls(precision=precision)
        except ValueError:
            pass
        raise ValueError(f"{name!r} is not a number format (one of {', '.join(format_names())})")

    @property
    def name(self) -> str:
        """``bf16``, ``fp16``, ``fp32``, ``auto``, or ``<fp8|fp4>-<recipe>``."""
        return self.precision.value + (f"-{self.recipe.value}" if self.recipe is not None else "")

    @property
    def low(self) -> bool:
        """Whether the linear layers' GEMMs run below 16 bits (FP8 or FP4 through Transformer Engine)."""
        return self.recipe is not None

    @property
    def needs(self) -> str | None:
        """The ``cluster.number_formats`` entry its GEMMs need; ``None`` for bf16, fp32 and ``auto``."""
        return _NEEDS.get(self.name)

    def with_train(self) -> dict[str, Any]:
        """The ``train`` fields that select this format (for ``dataclasses.replace``); the other recipe kept."""
        out: dict[str, Any] = {"precision": self.precision}
        if isinstance(self.recipe, Fp8Recipe):
            out["fp8_recipe"] = self.recipe
        elif isinstance(self.recipe, Fp4Recipe):
            out["fp4_recipe"] = self.recipe
        return out

    def train_fields(self) -> dict[str, Any]:
        """Every ``train`` field of the format (for ``dataclasses.replace``): :meth:`with_train`, and the recipe it
        does not read at its default (``train.fp8_recipe`` is refused beside another format)."""
        defaults = {f.name: f.default for f in dataclasses.fields(TrainSpec) if f.name in ("fp8_recipe", "fp4_recipe")}
        return {**defaults, **self.with_train()}

    def megatron_fields(self) -> dict[str, Any]:
        """Megatron-Core ``TransformerConfig`` fields that select it (``fp8``/``fp8_recipe``, ``fp4``/``fp4_recipe``;
        Megatron-LM's ``--fp8-format``, ``--fp8-recipe``, ``--fp4-format``, ``--fp4-recipe``); empty for 16/32 bits."""
        if isinstance(self.recipe, Fp8Recipe):
            return {"fp8": _FP8_FORMAT[self.recipe], "fp8_recipe": self.recipe.value}
        if isinstance(self.recipe, Fp4Recipe):
            return {"fp4": "e2m1", "fp4_recipe": self.recipe.value}
        return {}

    def param_fields(self, fp8_param_gather: bool) -> dict[str, bool]:
        """Megatron-Core's fields that keep the parameters in this format (``parallel.fp8_param_gather``): DDP's and
        the distributed optimizer's ``fp8_param_gather`` and, for MXFP8, ``reuse_grad_buf_for_mxfp8_param_ag`` (its
        parameters are gathered in bf16 through the gradient buffer), as NVIDIA's FP8 recipes set them; the
        ``TransformerConfig`` takes ``fp8_param`` (:meth:`megatron_fields`' companion). False beside another format."""
        on = fp8_param_gather and isinstance(self.recipe, Fp8Recipe)
        return {"fp8_param_gather": on, "reuse_grad_buf_for_mxfp8_param_ag": on and self.recipe is Fp8Recipe.mxfp8}

    def megatron_args(self) -> list[str]:
        """:meth:`megatron_fields` as Megatron-LM arguments."""
        names = {"fp8": "--fp8-format", "fp8_recipe": "--fp8-recipe", "fp4": "--fp4-format",
                 "fp4_recipe": "--fp4-recipe"}
        return [arg for key, value in self.megatron_fields().items() for arg in (names[key], value)]

    def overrides(self) -> list[str]:
        """The Hydra overrides that ask for it (``train.precision=fp8 train.fp8_recipe=mxfp8``)."""
        out = [f"train.precision={self.precision.value}"]
        if isinstance(self.recipe, Fp8Recipe):
            out.append(f"train.fp8_recipe={self.recipe.value}")
        elif isinstance(self.recipe, Fp4Recipe):
            out.append(f"train.fp4_recipe={self.recipe.value}")
        return out


def all_formats() -> tuple[NumberFormat, ...]:
    """Every format, ``auto`` first, then the 32- and 16-bit ones, then each FP8 and FP4 recipe."""
    out = [NumberFormat(precision=p) for p in Precision if p not in (Precision.fp8, Precision.fp4)]
    out += [NumberFormat(precision=Precision.fp8, recipe=r) for r in Fp8Recipe]
    out += [NumberFormat(precision=Precision.fp4, recipe=r) for r in Fp4Recipe]
    return tuple(out)


def format_names() -> list[str]:
    """The names of :func:`all_formats`."""
    return [f.name for f in all_formats()]


def computes(cluster: ClusterSpec, fmt: NumberFormat) -> bool:
    """Whether ``cluster``'s accelerator computes ``fmt``'s GEMMs, as its preset's ``number_formats`` says (a
    cluster that states none is taken at its word: its peaks decide)."""
    return fmt.needs is None or cluster.number_formats is None or fmt.needs in cluster.number_formats


def presets_computing(fmt: NumberFormat) -> list[str]:
    """The cluster presets whose ``number_formats`` list what ``fmt`` needs (``conf/cluster``)."""
    return [name for name, values in group_presets("cluster")
            if fmt.needs is None or fmt.needs in (values.get("number_formats") or ())]


def format_key(fmt: NumberFormat) -> str:
    """The Hydra key that chose ``fmt``'s recipe (``train.fp8_recipe`` for MXFP8 and FP8's recipes,
    ``train.fp4_recipe``), else ``train.precision``."""
    if fmt.recipe is Fp8Recipe.mxfp8:
        return "train.fp8_recipe"
    return "train.precision"


def format_issues(cluster: ClusterSpec, fmt: NumberFormat) -> list[ConfigIssue]:
    """``fmt`` on ``cluster``: refused where the accelerator does not compute it (its preset's ``number_formats``),
    naming the key, the value, what the GPU computes and the presets that compute it."""
    if computes(cluster, fmt):
        return []
    listed = [f for f in all_formats() if f.precision is not Precision.auto and computes(cluster, f)]
    others = presets_computing(fmt)
    key = format_key(fmt)
    value = fmt.recipe.value if key == "train.fp8_recipe" and fmt.recipe is not None else fmt.precision.value
    gen = cluster.generation or "generation not stated"
    computed = ", ".join(cluster.number_formats or ())
    recipes = [f.name for f in listed if f.low]
    fix = ("train.precision=bf16" + (f", or train.precision=fp8 with train.fp8_recipe="
                                     f"{'|'.join(r.split('-', 1)[1] for r in recipes if r.startswith('fp8-'))}"
                                     if recipes else ""))
    return [ConfigIssue(
        key=key, value=value,
        problem=f"{fmt.name} needs {fmt.needs} tensor cores, and {cluster.device_name} ({gen}) computes {computed} "
                f"(cluster {cluster.name}'s number_formats).",
        fix=f"train in a format it computes ({fix}), or plan on a cluster that computes {fmt.needs} "
            f"({', '.join(f'cluster={o}' for o in others) if others else 'none of the presets does'}).")]


def fp8_params_issues(fp8_param_gather: bool, fmt: NumberFormat) -> list[ConfigIssue]:
    """FP8 parameters (``parallel.fp8_param_gather``) asked for where the run trains in ``fmt`` (``auto``
    resolved): refused unless ``fmt`` is FP8, which they would be ignored beside."""
    if not fp8_param_gather or fmt.precision is Precision.fp8:
        return []
    return [ConfigIssue(key="parallel.fp8_param_gather", value=True,
                        problem=f"keeps the parameters in FP8, and the run trains in {fmt.name} "
                                "(train.precision=auto resolves to it here): they would be ignored.",
                        fix="add train.precision=fp8 (with its train.fp8_recipe), let the search choose FP8 "
                            "(cfp.constraints.precision=[bf16,fp8]), or set parallel.fp8_param_gather=false.")]


def bf16_ends_issues(start: int, end: int, fmt: NumberFormat) -> list[ConfigIssue]:
    """bf16 layers at the stack's ends (``parallel.num_layers_at_start_in_bf16`` / ``_end_in_bf16``) asked for where
    the run trains in ``fmt`` (``auto`` resolved): refused unless ``fmt`` runs its GEMMs in FP8 or FP4, and beside
    delayed scaling (Megatron-Core's ``TransformerConfig`` refuses ``first_last_layers_bf16`` with it)."""
    if not (start or end):
        return []
    if not fmt.low:
        return [ConfigIssue(key="parallel.num_layers_at_start_in_bf16", value=start,
                            problem=f"keeps the stack's first/last layers (and parallel.num_layers_at_end_in_bf16="
                                    f"{end}) in bf16, and the run trains in {fmt.name} (train.precision=auto "
                                    "resolves to it here): every layer already runs in it.",
                            fix="add train.precision=fp8 (a recipe other than delayed) or train.precision=fp4, let "
                                "the search choose one (cfp.constraints.precision=[bf16,fp4]), or set both counts "
                                "to 0.")]
    if fmt.recipe is Fp8Recipe.delayed:
        return [ConfigIssue(key="train.fp8_recipe", value=Fp8Recipe.delayed.value,
                            problem="delayed scaling does not support bf16 layers at the stack's ends (Megatron-Core's "
                                    "TransformerConfig refuses first_last_layers_bf16 with it).",
                            fix="use train.fp8_recipe=tensorwise|blockwise|mxfp8, or set "
                                "parallel.num_layers_at_start_in_bf16=0 and parallel.num_layers_at_end_in_bf16=0.")]
    return []
