"""torchtitan's MoE layers priced as its code runs them (issue N, docs/simulator.md, "torchtitan's MoE layer"): the
models' missing biases, its dispatcher's element-wise work counted forward and backward, and its experts' weight
gradients written in bf16. Hand-computed on small made-up rows; the step times are placeholders."""

from __future__ import annotations

import dataclasses

import pytest

from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.pass_costs import collective_costs
from cfp_megatron.sim.terms.expert_dispatch import expert_bias_bytes, moe_block_cost, probability_bytes
from cfp_megatron.validate import row_plan

DSV3_16B = {"id": "t16", "model": "DeepSeek-V3 16B", "arch_type": "moe", "layers": "27", "hidden": "2048",
            "ffn_hidden": "10944", "heads": "16", "kv_heads": "16", "vocab": "102400", "seq_len": "4096",
            "moe_experts": "64", "moe_topk": "6", "moe_expert_ffn": "1408", "gpu": "H100-SXM5-80GB",
            "num_gpus": "8", "framework": "torchtitan", "tp": "1", "pp": "1", "ep": "8", "zero_or_fsdp": "FSDP",
            "micro_batch": "4", "global_batch_seqs": "32", "recompute": "selective", "precision": "BF16",
            "step_time_s": "1.0"}
"""A made-up torchtitan row of DeepSeek-V3 16B's shape (which no conf/model preset has)."""
SCOUT = {**DSV3_16B, "id": "t4", "model": "Llama 4 Scout", "layers": "48", "hidden": "5120", "ffn_hidden": "8192",
         "heads": "40", "kv_heads": "", "vocab": "", "seq_len": "8192", "moe_experts": "16", "moe_topk": "1",
         "moe_expert_ffn": "8192", "num_gpus": "64", "micro_batch": "1", "global_batch_seqs": "64",
         "recompute": "full"}
"""The same for Llama 4 Scout, its vocabulary and KV heads left blank."""


def block(row: dict, model_change: dict | None = None, **change):
    """The job, layout, kernel model and MoE block cost of ``row``'s plan under its options (``model_change``: model
    fields to set; ``change``: options of ``moe_block_cost`` to set)."""
    plan = row_plan(row)
    job, options = plan.job, plan.options
    if model_change:
        job = dataclasses.replace(job, model=dataclasses.replace(job.model, **model_change))
    cluster = job.cluster
    eff = efficiency_for(cluster)
    kernels = KernelModel(cluster, eff, NumberFormat.of(job.train))
    layout = build_layout(job)
    return job, layout, kernels, moe_block_cost(
        job, layout, kernels, collective_costs(cluster, None, eff), imbalance=options.moe_routing_imbalance,
        **{"torch_combine": options.torch_moe_combine, "grouped_gemm": options.grouped_gemm, **change})


@pytest.mark.parametrize("row", [DSV3_16B, SCOUT], ids=["deepseek-v3-16b", "llama-4-scout"])
def test_deepseek_v3_and_llama_4_rows_have_no_biases_so_no_expert_bias_is_priced(row: dict) -> None:
    """Neither model has a bias (their configs; torchtitan's GroupedExperts hold w1, w2, w3 alone): no fc2 bias per
    expert (Megatron-Core's ``TEGroupedMLP._apply_bias``) is priced for their experts, which a shape without a
    preset used to take from ``ModelSpec``'s GPT default."""
    job, _, kernels, moe = block(row)
    assert job.model.add_bias_linear is False
    _, _, _, biased = block(row, {"add_bias_linear": True})  # the reading before
    bias = expert_bias_bytes(2.0, probability_bytes(job, 2.0), grouped_gemm=True)
    copies = job.model.moe_router_topk * job.model.hidden_size  # fc2 output elements per token (balanced)
    for pass_ in (0, 1):
        extra = biased.unfused_bytes_per_token[pass_] - moe.unfused_bytes_per_token[pass_]
        assert extra == pytest.approx(copies * bias[pass_])


def test_llama_4s_blank_vocabulary_and_kv_heads_are_its_configs() -> None:
    model = row_plan(SCOUT).job.model
    assert (model.vocab_size, model.num_query_groups) == (202048, 8)
