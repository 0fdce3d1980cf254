"""Two element-wise terms of the attention as Megatron-Core runs it: the unfused RoPE's passes over Q and K
(``SimOptions.rope_fusion`` off: the runtime's build, and a YaRN embedding Transformer Engine's fused kernel cannot
scale) and Qwen3's per-head query and key norms (``qk_layernorm``)."""

from __future__ import annotations

import pytest

from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.sim import SimOptions
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layer_cost import QK_NORM_PASSES, UNFUSED_ROPE_PASSES, layer_cost
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.validate import row_plan
from cfp_megatron.validation.rows import PUBLISHED_RUNS_DIR, read_rows
from tests.test_sim import job

SEQ, TP = 2048, 2
GQA = {"num_attention_heads": 32, "num_query_groups": 8, "kv_channels": 128, "position_embedding": "rope"}


def _cost(options: SimOptions, **model):
    plan = job(model={**GQA, **model}, tp=TP)
    layout = build_layout(plan)
    kernels = KernelModel(plan.cluster, efficiency_for(plan.cluster), plan.train.precision)
    return plan, kernels, layer_cost(plan, layout, kernels, CollectiveCosts(plan.cluster), options, moe=False)


def _qk_pass_s(kernels: KernelModel, passes: float) -> float:
    """``passes`` element passes over one micro-batch's Q and K on one TP rank: (32 + 8) heads of 128, bf16."""
    return kernels.memory(passes * (32 + 8) * 128 / TP * SEQ * 2)


def test_unfused_rope_makes_ten_more_passes_over_q_and_k() -> None:
    # rope_utils._apply_rotary_pos_emb_bshd: neg (1) + cat (2) + 2 x mul (4) + add (3) + cat (2) = 12, fused 2
    assert UNFUSED_ROPE_PASSES == 0.5 + 0.5 + 2 + 2 + 2 + 3 + 2 - 2
    _, kernels, fused = _cost(SimOptions())
    _, _, unfused = _cost(SimOptions(rope_fusion=False))
    extra = _qk_pass_s(kernels, UNFUSED_ROPE_PASSES)
    assert unfused.forward.compute_s - fused.forward.compute_s == pytest.approx(extra)
    # the backward as every element-wise kernel of the layer: twice the forward
    assert unfused.backward.compute_s - fused.backward.compute_s == pytest.approx(2 * extra)
    # nothing else moves, and a model without RoPE has no rotary passes
    assert unfused.forward.attention_core_s == fused.forward.attention_core_s
    _, _, learned = _cost(SimOptions(), position_embedding="learned_absolute")
    _, _, learned_unfused = _cost(SimOptions(rope_fusion=False), position_embedding="learned_absolute")
    assert learned_unfused.forward.compute_s == learned.forward.compute_s


def test_the_qk_norms_make_two_passes_over_q_and_k() -> None:
    _, kernels, plain = _cost(SimOptions())
    plan, _, normed = _cost(SimOptions(), qk_layernorm=True)
    assert plan.model.qk_layernorm
    extra = _qk_pass_s(kernels, QK_NORM_PASSES)
    assert normed.forward.compute_s - plain.forward.compute_s == pytest.approx(extra)
    assert normed.backward.compute_s - plain.backward.compute_s == pytest.approx(2 * extra)


def _row(rid: str) -> dict:
    return next(r for name in ("published_runs.csv", "published_runs_moe.csv")
                for r in read_rows(PUBLISHED_RUNS_DIR / name) if r["id"] == rid)


def test_the_validator_runs_gpt_oss_rope_unfused_and_qwen3_with_its_qk_norms() -> None:
    gpt_oss = row_plan(_row("84"))  # Megatron-Bridge, GPT-OSS 120B: YaRN's mscale 1.35 falls back to unfused RoPE
    assert not gpt_oss.options.rope_fusion and gpt_oss.options.unfused_rope(gpt_oss.job.model)
    qwen = row_plan(_row("80"))  # Megatron-Bridge, Qwen3-30B-A3B: fused RoPE, per-head QK norms
    assert qwen.options.rope_fusion and qwen.job.model.qk_layernorm
    deepseek = row_plan(_row("73"))  # DeepSeek-V3's YaRN runs Megatron-Core's fused MLA RoPE kernels
    assert deepseek.options.rope_fusion and not deepseek.options.unfused_rope(deepseek.job.model)


def test_megatron_bridges_later_fp8_presets_ran_current_scaling() -> None:
    """From 25.11 Megatron-Bridge's performance scripts offer no delayed scaling: a row of a preset whose FP8 is
    current scaling (recipes.yaml fp8_format) that says plain FP8 is priced so; 25.09's presets (delayed by default)
    and a row that names its recipe keep the precision column's reading."""
    for rid in ("86", "90", "91", "93"):
        assert row_plan(_row(rid)).job.train.fp8_recipe.value == "tensorwise", rid
    assert row_plan(_row("74")).job.train.fp8_recipe.value == "delayed"  # 25.09, drop-and-pad
    named = row_plan({**_row("90"), "precision": "FP8 delayed scaling"})
    assert named.job.train.fp8_recipe.value == "delayed" and "fp8-cs" not in named.layout
    assert "fp8-cs" in row_plan(_row("90")).layout
