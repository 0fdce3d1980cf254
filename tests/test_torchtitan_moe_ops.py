"""torchtitan's MoE layers priced as its code runs them (issue N, docs/simulator.md, "torchtitan's MoE layer"): the
models' missing biases, its dispatcher's element-wise work counted forward and backward, and its experts' weight
gradients written in bf16. Hand-computed on small made-up rows; the step times are placeholders."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.sim import layer_cost
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.pass_costs import collective_costs
from cfp_megatron.sim.terms.expert_dispatch import (
    MAIN_GRAD_BYTES,
    expert_bias_bytes,
    moe_block_cost,
    probability_bytes,
    torch_dispatch_bytes,
)
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
        **{"torch_combine": options.torch_moe_combine, "grouped_gemm": options.grouped_gemm,
           "torch_swiglu": options.torch_swiglu_experts(job.model), **change})


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


T, K, D, E = 64, 4, 256, 8
"""A small case: tokens, top-k, hidden size (rows of D elements are what is counted), experts."""


class RowBytes(TorchDispatchMode):
    """HBM bytes of the ``[rows, D]`` tensors each aten op reads and writes, as the CUDA kernels move them: a gather
    (``index``, ``gather``) reads one source row per row it writes; ``index_put`` writes the rows it is given (with
    ``accumulate``, reads and writes them: autograd's ``index_backward`` runs ``_index_put_impl_`` in place outside a
    dispatch mode, functional inside one); the out-of-place ``scatter_add`` copies its input, reads its source
    and reads and writes the rows it adds into; a factory writes its output (``new_empty`` nothing); any other op
    reads its inputs and writes its outputs. Index and score columns are left out."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__

        def rows(*tensors: object) -> int:
            return sum(t.numel() * t.element_size() for t in tree_flatten(tensors)[0]
                       if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == D)

        if name in ("index", "gather"):
            self.bytes += 2 * rows(out)
        elif name in ("index_put", "index_put_"):
            accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
            self.bytes += (3 if accumulate else 2) * rows(args[2])
        elif name == "scatter_add":
            self.bytes += 2 * rows(args[0]) + 3 * rows(args[3])
        elif name in ("zeros_like", "new_zeros", "ones_like"):
            self.bytes += rows(out)
        elif name not in ("view", "_unsafe_view", "expand", "reshape", "new_empty", "empty_like", "detach", "t",
                          "alias", "select", "slice", "unsqueeze", "squeeze", "lift_fresh"):
            self.bytes += rows(args, kwargs, out)
        return out


def torchtitan_dispatch(x_TD: torch.Tensor, topk_scores_TK: torch.Tensor, topk_expert_ids_TK: torch.Tensor,
                        permuted_indices: torch.Tensor, ep: bool) -> torch.Tensor:
    """torchtitan's ``AllToAllTokenDispatcher`` around the experts (models/common/token_dispatcher.py at b5bcd76c:
    ``_local_reorder``, ``_permute``'s gather, ``_unpermute`` and ``combine``, their lines copied), the all-to-alls
    and the experts left out (identities here); ``deterministic_scatter_add`` is ``scatter_add``
    (ops/scatter_add.py), whose backward is the ``gather`` autograd gives it."""
    token_indices_experts_sorted_N = torch.argsort(topk_expert_ids_TK.view(-1), stable=True)
    topk_scores_experts_sorted_N = topk_scores_TK.view(-1)[token_indices_experts_sorted_N]
    token_indices_experts_sorted_N = token_indices_experts_sorted_N // K
    routed_input_ND = x_TD[token_indices_experts_sorted_N]
    routed_output_RD = routed_input_ND
    if ep:
        routed_input_RD = routed_input_ND[permuted_indices, :]  # _permute
        out_unpermuted_RD = routed_input_RD.new_empty(routed_input_ND.shape)  # _unpermute
        out_unpermuted_RD[permuted_indices, :] = routed_input_RD
        routed_output_RD = out_unpermuted_RD
    out_TD = torch.zeros_like(x_TD)
    routed_output_RD = (routed_output_RD.to(torch.float32)
                        * topk_scores_experts_sorted_N.reshape(-1, 1)).to(routed_output_RD.dtype)
    return out_TD.scatter_add(0, token_indices_experts_sorted_N.reshape(-1, 1).expand(-1, D), routed_output_RD)


@pytest.mark.parametrize("ep", [True, False], ids=["ep", "no-ep"])
def test_torchtitans_dispatcher_moves_the_counted_bytes_forward_and_backward(ep: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, dtype=torch.bfloat16, requires_grad=True)
    scores = torch.rand(T, K, generator=generator, requires_grad=True)
    ids = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)])
    permuted = torch.randperm(T * K, generator=generator)
    forward, backward = RowBytes(), RowBytes()
    with forward:
        out = torchtitan_dispatch(x, scores, ids, permuted, ep)
    grad = torch.ones_like(out)
    with backward:
        torch.autograd.grad(out, [x, scores], grad)
    counted = torch_dispatch_bytes(2.0)
    for moved, i in ((forward.bytes, 0), (backward.bytes, 1)):
        expected = T * K * D * (counted.sent[i] + (counted.received[i] if ep else 0.0)) + T * D * counted.token[i]
        assert moved == expected
    assert (counted.sent, counted.received, counted.token) == ((30.0, 46.0), (8.0, 12.0), (6.0, 2.0))


def test_torchtitans_dispatcher_is_priced_with_its_counted_backward_not_twice_its_forward() -> None:
    """DeepSeek-V3 16B's block on 8 H100 at EP 8 (6 copies a token, one rank's tokens all local): the permutations
    leave the elements priced twice in the backward; the counted bytes take their place."""
    job, _, _, titan = block(DSV3_16B, torch_swiglu=False)  # the experts' SwiGLU apart (below)
    _, _, _, megatron = block(DSV3_16B, torch_combine=False, torch_swiglu=False)
    hidden, topk = job.model.hidden_size, job.model.moe_router_topk
    # Megatron-Core's permutation 1 and unpermutation, and the sort by local expert and its inverse: 2 rows each
    assert megatron.elements_per_token - titan.elements_per_token == pytest.approx(4 * 2 * topk * hidden)
    # per token: 6 copies sent, 6 received, and the token itself
    assert titan.unfused_bytes_per_token == pytest.approx((hidden * (6 * 30 + 6 * 8 + 6),
                                                           hidden * (6 * 46 + 6 * 12 + 2)))
    assert megatron.unfused_bytes_per_token == (0.0, 0.0)


def test_torchtitans_experts_write_their_weight_gradients_once_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch._grouped_mm``'s weight gradient is a fresh bf16 tensor (FSDP2 casts and reduces it after the
    backward); Megatron-Core's ``TEGroupedLinear`` accumulates into the fp32 ``main_grad`` (8 bytes)."""
    seen: dict[bool, list[float | None]] = {}
    for titan in (True, False):
        calls: list[float | None] = []
        original = KernelModel.grouped_gemm

        def record(self, *args, out_bytes=None, _calls=calls, _original=original, **kwargs):
            _calls.append(out_bytes)
            return _original(self, *args, out_bytes=out_bytes, **kwargs)

        monkeypatch.setattr(KernelModel, "grouped_gemm", record)
        block(DSV3_16B, torch_combine=titan)
        monkeypatch.setattr(KernelModel, "grouped_gemm", original)
        seen[titan] = calls
    assert seen[True] == [None] * 6
    assert seen[False] == [None, None, None, MAIN_GRAD_BYTES, None, MAIN_GRAD_BYTES]


@pytest.mark.parametrize(("precision", "padding_rows"), [("BF16", 0), ("FP8", 4)])
def test_torchtitans_fp8_experts_pad_in_their_permutation_without_transformer_engines_copies(
        precision: str, padding_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under FP8 Megatron-Core's ``TEGroupedMLP`` copies the experts' rows into a padded buffer and back (2 rows each
    way a copy) and runs its per-expert quantisation kernels; torchtitan's ``TorchAOTokenDispatcher`` pads inside
    its permutation and torchao quantises the grouped operands whole: neither is priced for it."""
    row = {**DSV3_16B, "precision": precision}
    job, _, _, titan = block(row, torch_swiglu=False)
    _, _, _, megatron = block(row, torch_combine=False, torch_swiglu=False)
    hidden, topk = job.model.hidden_size, job.model.moe_router_topk
    assert megatron.elements_per_token - titan.elements_per_token == pytest.approx(
        (8 + padding_rows) * topk * hidden)
    scalar_calls: list[int] = []
    monkeypatch.setattr(layer_cost, "expert_scalar_kernels_s",
                        lambda experts, kernels: scalar_calls.append(experts) or (0.0, 0.0))
    plan = row_plan(row)
    layout = build_layout(plan.job)
    eff = efficiency_for(plan.job.cluster)
    kernels = KernelModel(plan.job.cluster, eff, NumberFormat.of(plan.job.train))
    costs = collective_costs(plan.job.cluster, None, eff)
    layer_cost.layer_passes(plan.job, layout, kernels, costs, plan.options, moe=True)
    assert scalar_calls == []
    layer_cost.layer_passes(plan.job, layout, kernels, costs, dataclasses.replace(plan.options,
                                                                                  torch_moe_combine=False), moe=True)
    assert scalar_calls == [8]
