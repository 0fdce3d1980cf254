"""torchtitan's GPT-OSS experts priced as its ``GptOssGroupedExperts`` runs them (issue N; docs/validation.md,
"torchtitan's FeedForward and DTensor's gathered inputs"): their forward's lines (pytorch/torchtitan b5bcd76c,
models/gpt_oss/moe.py, copied; the DTensor and spmd_types branches left out, ``ScaleBiasForward`` at TP 1 a cast)
run on CPU, every aten op counted by a ``TorchDispatchMode`` and every tensor autograd saves by
``saved_tensors_hooks``, against the bytes, tensors and launches the simulator prices. Counted at two numbers of
rows, whose difference leaves the biases' per-expert tensors out. The step times of the made-up rows are
placeholders."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch.utils._pytree import tree_flatten

from cfp_megatron.sim import host_costs as hc
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.layer_cost import layer_passes
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.memory import TORCH_GPT_OSS_SAVED_FFN, layer_activation_bytes, torch_swiglu_kept_bytes
from cfp_megatron.sim.pass_costs import collective_costs
from cfp_megatron.sim.simulate import prepare_costs
from cfp_megatron.sim.terms.expert_dispatch import (
    clamp_bytes,
    expert_bias_bytes,
    probability_bytes,
    torch_gpt_oss_bytes,
)
from cfp_megatron.validate import row_plan
from tests.test_sim_expert_ops_counted import SMALL
from tests.test_torchtitan_experts_counted import ElementwiseBytes, OpCount, passes, saved_bytes
from tests.test_torchtitan_moe_ops import DSV3_16B, block

HIDDEN, FFN, EXPERTS = 48, 40, 4
GPT_OSS_120B = {**DSV3_16B, "id": "oss", "model": "GPT-OSS 120B", "layers": "36", "hidden": "2880",
                "ffn_hidden": "2880", "heads": "64", "kv_heads": "8", "vocab": "201088", "moe_experts": "128",
                "moe_topk": "4", "moe_expert_ffn": "2880", "num_gpus": "64", "micro_batch": "2",
                "global_batch_seqs": "128", "recompute": "none", "step_time_s": "2.0"}
"""A made-up torchtitan row of GPT-OSS 120B's shape (its preset: clamped quick GEGLU, biases) at EP 8."""


def gpt_oss_experts(rows: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """``GptOssGroupedExperts.forward`` and ``swiglu`` on ``[rows, HIDDEN]`` bf16 rows split evenly over
    ``EXPERTS``, their lines copied, with the input and the weights and biases."""
    x_RD = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    mlp1_weight_EGD = torch.randn(EXPERTS, 2 * FFN, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    mlp1_bias_EG = torch.randn(EXPERTS, 2 * FFN, dtype=torch.bfloat16, requires_grad=True)
    mlp2_weight_EDF = torch.randn(EXPERTS, HIDDEN, FFN, dtype=torch.bfloat16, requires_grad=True)
    mlp2_bias_ED = torch.randn(EXPERTS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    num_tokens_per_expert_E = torch.full((EXPERTS,), rows // EXPERTS)

    def swiglu(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
        x_glu, x_linear = x[..., ::2], x[..., 1::2]
        x_glu = x_glu.clamp(min=None, max=limit)
        x_linear = x_linear.clamp(min=-limit, max=limit)
        out_glu = x_glu * torch.sigmoid(alpha * x_glu)
        return torch.addcmul(out_glu, out_glu, x_linear)

    def forward(x_RD: torch.Tensor) -> torch.Tensor:
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        tail_slack = (x_RD.shape[0] - offsets_E[-1]).unsqueeze(0).to(num_tokens_per_expert_E.dtype)
        num_tokens_per_expert_long = torch.cat([num_tokens_per_expert_E, tail_slack]).long()
        h_RG = torch._grouped_mm(x_RD.bfloat16(), mlp1_weight_EGD.transpose(-2, -1).bfloat16(), offs=offsets_E)
        b1 = torch.cat([mlp1_bias_EG, mlp1_bias_EG.new_zeros(1, mlp1_bias_EG.shape[-1])])
        b1_RG = b1.repeat_interleave(num_tokens_per_expert_long, dim=0, output_size=x_RD.shape[0])
        h_RG = h_RG + b1_RG.to(h_RG.dtype)
        h_RF = swiglu(h_RG)
        h_RD = torch._grouped_mm(h_RF, mlp2_weight_EDF.transpose(-2, -1).bfloat16(), offs=offsets_E)
        b2 = torch.cat([mlp2_bias_ED, mlp2_bias_ED.new_zeros(1, mlp2_bias_ED.shape[-1])])
        b2_RD = b2.repeat_interleave(num_tokens_per_expert_long, dim=0, output_size=x_RD.shape[0])
        return h_RD + b2_RD.to(h_RD.dtype)

    return forward, x_RD, [mlp1_weight_EGD, mlp1_bias_EG, mlp2_weight_EDF, mlp2_bias_ED]


class RowBytes(ElementwiseBytes):
    """:class:`ElementwiseBytes`, ``new_zeros`` counted by what it writes alone (its ``self`` names the dtype and
    device, nothing is read)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "new_zeros":
            out = func(*args, **(kwargs or {}))
            self.bytes += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                              if isinstance(t, torch.Tensor) and t.numel() >= SMALL)
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)


def per_row(count: Callable[[int], tuple[float, ...]]) -> tuple[float, ...]:
    """What ``count(rows)`` adds a row, from 64 and 128 rows."""
    few, many = count(64), count(128)
    return tuple((b - a) / 64 for a, b in zip(few, many, strict=True))


def test_torchtitans_gpt_oss_experts_move_the_counted_bytes() -> None:
    def count(rows: int) -> tuple[float, float]:
        forward, backward = passes(RowBytes, lambda: gpt_oss_experts(rows))
        return forward.bytes, backward.bytes

    assert per_row(count) == torch_gpt_oss_bytes(2.0).per_row(FFN, HIDDEN)
    assert torch_gpt_oss_bytes(2.0).per_row(FFN, HIDDEN) == (46 * FFN + 8 * HIDDEN, 104 * FFN + 2 * HIDDEN)


def test_torchtitans_gpt_oss_experts_launch_the_counted_kernels() -> None:
    forward, backward = passes(OpCount, lambda: gpt_oss_experts(64))
    assert (forward.ops, backward.ops) == (hc.TORCH_GPT_OSS_EXPERT_OPS.forward, hc.TORCH_GPT_OSS_EXPERT_OPS.backward)
    assert (forward.grouped, backward.grouped) == hc.TORCH_GPT_OSS_GROUPED_MMS


def test_torchtitans_gpt_oss_experts_keep_the_counted_tensors() -> None:
    """The input once and seven tensors of the FFN width (mlp1's biased output counting two)."""
    kept = per_row(lambda rows: (saved_bytes(*gpt_oss_experts(rows)),))[0]
    assert kept == 2 * HIDDEN + FFN * torch_swiglu_kept_bytes(2.0, 2.0, saved=TORCH_GPT_OSS_SAVED_FFN)
    assert kept == 2 * HIDDEN + 14 * FFN


def test_a_torchtitan_gpt_oss_rows_plan_prices_its_experts_so() -> None:
    """The row's options reach the MoE block, the host term and the memory (``SimOptions.torch_gpt_oss_experts``):
    the counted bytes in place of Megatron-Core's fused activation, clamp and fc2 bias, and the kept tensors in
    place of its ten bytes an FFN element."""
    plan = row_plan(GPT_OSS_120B)
    job, options = plan.job, plan.options
    assert options.torch_gpt_oss_experts(job.model) and not options.torch_swiglu_experts(job.model)
    _, layout, kernels, titan = block(GPT_OSS_120B, torch_swiglu=False, torch_gpt_oss=True)
    _, _, _, fused = block(GPT_OSS_120B, torch_swiglu=False)
    topk, ffn, hidden = job.model.moe_router_topk, job.model.moe_ffn_hidden_size, job.model.hidden_size
    assert titan.activation_elements_per_token == 0.0 < fused.activation_elements_per_token
    bias = expert_bias_bytes(2.0, probability_bytes(job, 2.0), grouped_gemm=True)
    for i, counted in enumerate(torch_gpt_oss_bytes(2.0).per_row(ffn, hidden)):
        megatron = 2 * ffn * clamp_bytes(2.0)[i] + hidden * bias[i]  # the clamp and fc2 bias it replaces
        assert titan.unfused_bytes_per_token[i] - fused.unfused_bytes_per_token[i] == pytest.approx(
            topk * (counted - megatron))
    costs = collective_costs(job.cluster, None, efficiency_for(job.cluster))
    layer_block = layer_passes(job, layout, kernels, costs, options, moe=True).moe_block
    assert layer_block.unfused_bytes_per_token == titan.unfused_bytes_per_token
    host = prepare_costs(job, options=options).host
    assert host.moe == hc.host_costs(job, 128 // layout.dims.ep, te_experts=False, torch_gpt_oss=True,
                                     torch_mlp=False, moe_layer_syncs=options.moe_layer_syncs).moe
    kept = [layer_activation_bytes(job, build_layout(job), o, moe=True)[0]
            for o in (options, dataclasses.replace(options, torch_swiglu=False))]
    tokens = layout.micro_batch * layout.seq_length
    assert kept[0] - kept[1] == pytest.approx(topk * tokens * ffn * (2 * TORCH_GPT_OSS_SAVED_FFN - 10))
