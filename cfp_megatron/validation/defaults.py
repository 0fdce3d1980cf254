"""What a row runs where its columns are blank or silent: what its source states outside its tables
(``source_settings.yaml``), its framework's reading (``frameworks.yaml``), its model family's
(``model_families.yaml``), the performance preset its framework ran at its release (``recipes.yaml``), all read by
:mod:`.data`, and the architecture of a model preset of its shape (``conf/model``)."""

from __future__ import annotations

import copy
import dataclasses
import re

from cfp_megatron.base.compose import group_presets
from cfp_megatron.sim.options import ApexAdamStates
from cfp_megatron.validation.data import FAMILY_COLUMNS, Framework, PerformanceRecipe, SourceSetting, ValidationData
from cfp_megatron.validation.rows import count_cell


def source_setting(row: dict, data: ValidationData) -> SourceSetting | None:
    """The first entry of ``source_settings.yaml`` whose match ``row`` meets; ``None``: none does."""
    return next((setting for setting in data.settings if setting.matches(row)), None)


def stated_row(row: dict, setting: SourceSetting | None) -> dict:
    """``row`` with the blank cells ``setting`` (its :func:`source_setting`) states filled, a copy of the same type
    (a stated cell wins); ``row`` itself where nothing is filled."""
    cells = {column: text for column, text in (setting.blank.items() if setting else ())
             if not (row.get(column) or "").strip()}
    if not cells:
        return row
    filled = copy.copy(row)
    filled.update(cells)
    return filled


RELEASE = r"\b(\d\d)\.(\d\d)"
"""A container release (``YY.MM``, as NeMo's containers are named) in a row's ``source_detail``, else in its
``framework``."""


def framework_of(row: dict, data: ValidationData) -> Framework:
    """The first framework entry whose match the row's ``framework`` column meets (the last entry meets any)."""
    text = row.get("framework") or ""
    return next((framework for framework in data.frameworks if framework.match.matches(text)), data.frameworks[-1])


def row_framework(row: dict, data: ValidationData, setting: SourceSetting | None) -> Framework:
    """What the row's framework runs (:func:`framework_of`), with what ``setting`` (its :func:`source_setting`)
    states it ran instead (:attr:`~cfp_megatron.validation.data.SourceSetting.runs`)."""
    framework = framework_of(row, data)
    return dataclasses.replace(framework, **setting.runs) if setting and setting.runs else framework


def blank_reading(row: dict, column: str, framework: Framework) -> str:
    """The row's ``column``, or where it is blank what ``framework`` reads a blank one as (empty: no reading)."""
    return (row.get(column) or "").strip() or framework.blank.get(column, "")


LAYER_AC_DEFAULT_EVERY = 2
"""The block frequency of layer-wise selective checkpointing a row names without a number: torchtitan's
``selective_ac_option`` default ("2", torchtitan/config/configs.py before 114151ad, which removed the option)."""


def layer_checkpoint_every(recompute: str) -> int | None:
    """Every how many blocks a ``recompute`` cell's layer-wise selective checkpointing wraps one whole (torchtitan's
    ``selective_ac_option`` N: blocks N, 2N, ... fully checkpointed, the others keep their activations): a cell
    starting "selective" that names layers, "every" or the option; ``None``: not layer-wise."""
    text = recompute.lower()
    if not text.startswith("selective") or not re.search(r"layer|every|ac_option", text):
        return None
    number = re.search(r"(\d+)", text)
    return int(number.group(1)) if number else LAYER_AC_DEFAULT_EVERY


def apex_adam_states(row: dict, framework: Framework) -> ApexAdamStates | None:
    """How ``framework``'s Apex DistributedFusedAdam keeps the row's ``model``'s optimizer states (``None``: its
    distributed optimizer is Megatron-Core's)."""
    model = row.get("model") or ""
    return next((states for pattern, states in framework.apex_adam if re.search(pattern, model, re.IGNORECASE)),
                None)


def mtp_layers(row: dict, framework: Framework) -> int:
    """The multi-token-prediction layers ``framework``'s recipes train the row's ``model`` with (0: none)."""
    model = row.get("model") or ""
    return next((layers for pattern, layers in framework.mtp_layers if re.search(pattern, model, re.IGNORECASE)), 0)


def family_fields(row: dict, data: ValidationData) -> dict[str, object]:
    """The model fields the row's family fixes (the first of ``model_families.yaml`` whose pattern its ``model`` or
    ``arch_source`` matches): the columns it leaves blank (vocabulary, KV heads; the default entry's where the family
    says nothing) and the fields no column holds."""
    text = f"{row.get('model') or ''} {row.get('arch_source') or ''}"
    family = next((f for f in data.families.families if re.search(f.pattern, text, re.IGNORECASE)), None)
    blank = {**data.families.default.blank, **(family.blank if family else {})}
    return {**(family.model if family else {}),
            **{FAMILY_COLUMNS[column]: value for column, value in blank.items() if count_cell(row, column) is None}}


def row_release(row: dict) -> tuple[int, int] | None:
    """The container release (year, month) a row names (:data:`RELEASE`), or None."""
    found = re.search(RELEASE, row.get("source_detail") or row.get("framework") or "")
    return None if found is None else (int(found.group(1)), int(found.group(2)))


def performance_recipe(row: dict, framework: Framework, preset: str, layout: tuple[int, int, int, int, int, int],
                       data: ValidationData) -> PerformanceRecipe | None:
    """The performance preset a row ran (MoE, or dense with offloaded activations), or None: the first of
    ``recipes.yaml`` of the row's framework whose releases hold the row's container release (:data:`RELEASE`) and
    whose model, hardware preset, layout (GPUs, TP, PP, VP, EP, global batch) and precision pattern are the row's."""
    release = row_release(row)
    if release is None:
        return None
    for recipe in data.recipes:
        first, last = recipe.releases
        if (recipe.framework == framework.name and preset in recipe.hardware and layout in recipe.layouts
                and first <= release and (last is None or release <= last)
                and re.search(recipe.model, row.get("model") or "", re.IGNORECASE)
                and re.search(recipe.precision, row.get("precision") or "", re.IGNORECASE)):
            return recipe
    return None


ARCHITECTURE_FIELDS = ("kv_channels", "attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                       "v_head_dim", "moe_shared_expert_intermediate_size", "moe_first_dense_layers",
                       "moe_router_score", "window_size", "window_attn_skip_freq", "activation", "activation_clamp",
                       "add_bias_linear", "moe_router_fp32")
"""Model fields the CSV schema has no column for, taken from a model preset of the same shape
(:func:`preset_architecture`)."""
SHAPE_FIELDS = (("layers", "num_layers"), ("hidden", "hidden_size"), ("heads", "num_attention_heads"),
                ("vocab", "vocab_size"), ("moe_experts", "num_experts"), ("moe_topk", "moe_router_topk"),
                ("moe_expert_ffn", "moe_ffn_hidden_size"))
"""(CSV column, model preset key) pairs that must all be equal for a preset's architecture to apply."""


def preset_architecture(row: dict) -> tuple[str, dict]:
    """The name and :data:`ARCHITECTURE_FIELDS` of the model preset (``conf/model``) whose shape
    (:data:`SHAPE_FIELDS`) is the row's, or ``("", {})``: DeepSeek-V3's multi-head latent attention, shared expert,
    dense first layers, sigmoid router and bias-free linears, GPT-OSS's 64-channel heads (4096 wide on a 2880 hidden
    size), clamped quick GEGLU, biases and bf16 router, which their rows name in ``arch_source`` but no column
    states."""
    for name, preset in group_presets("model"):
        if all(count_cell(row, column) == preset.get(key) for column, key in SHAPE_FIELDS):
            return name, {key: preset[key] for key in ARCHITECTURE_FIELDS if key in preset}
    return "", {}
