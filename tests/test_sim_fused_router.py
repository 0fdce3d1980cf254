"""The MoE router under ``moe_router_fusion`` (Transformer Engine's fused top-k and auxiliary-loss kernels): its
bytes and launches as counted from the kernels, the validator's Megatron-Bridge rows priced fused, and the field
reaching Megatron-Core's ``TransformerConfig`` only where Transformer Engine runs it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cfp_megatron.base.config import JobSpec, job_from_config
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.profile.fingerprint import model_key
from cfp_megatron.sim import SimOptions
from cfp_megatron.sim import host_costs as hc
from cfp_megatron.sim.layer_cost import layer_cost
from cfp_megatron.sim.options import options_here
from cfp_megatron.sim.terms.expert_dispatch import (
    fused_router_bytes,
    moe_block_cost,
    unfused_router_bytes,
)
from tests.test_sim_moe import H100, models

SMALL = {"name": "router_test", "num_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "vocab_size": 256,
         "max_position_embeddings": 512, "activation": "swiglu", "num_experts": 16, "moe_router_topk": 2,
         "moe_ffn_hidden_size": 128, "add_bias_linear": False}
TOKENS = 512  # one micro-batch of one 512-token sequence, no TP: the router scores every token


def job(model: dict | None = None, cluster: dict | None = None, **parallel) -> JobSpec:
    train = {"global_batch_size": 8, "micro_batch_size": 1, "seq_length": TOKENS, "precision": "bf16"}
    return job_from_config({"model": {**SMALL, **(model or {})}, "cluster": {**(cluster or H100), "nodes": 1,
                                                                             "gpus_per_node": 1},
                            "parallel": parallel, "train": train})


def bytes_per_pass(j: JobSpec, fused: bool) -> tuple[float, float]:
    """(forward, backward) element-wise HBM bytes per token of ``j``'s MoE block, the router fused or not."""
    layout, kernels, comm = models(j, 1)
    block = moe_block_cost(j, layout, kernels, comm, fused_router=fused)
    moved = block.elements_per_token * kernels.elem
    return (moved + block.unfused_bytes_per_token[0] + block.router_bytes_per_token[0],
            2.0 * moved + block.unfused_bytes_per_token[1] + block.router_bytes_per_token[1])


def test_the_fused_router_moves_its_counted_bytes_below_the_unfused_routers() -> None:
    """Forward: the logits read once, the probabilities and the kept scores written, the routing map's byte (3d + 1
    an entry); backward the same (3d + 1), where the unfused router's PyTorch ops move 6d + 17 forward and 3d back
    (:func:`unfused_router_bytes`): the fused router's forward and its step are cheaper, its backward reads the map."""
    for router_fp32, d in ((True, 4.0), (False, 2.0)):
        j = job({"moe_router_fp32": router_fp32})
        assert fused_router_bytes(j, 2.0) == (3 * d + 1, 3 * d + 1)
        assert unfused_router_bytes(j, 2.0) == (6 * d + 17, 3 * d)
        unfused, fused = bytes_per_pass(j, False), bytes_per_pass(j, True)
        entries = SMALL["num_experts"]  # router entries per token
        for i in (0, 1):
            assert unfused[i] - fused[i] == pytest.approx(entries * (unfused_router_bytes(j, 2.0)[i] - (3 * d + 1)))
        assert fused[0] < unfused[0] and sum(fused) < sum(unfused)


def test_the_fused_auxiliary_loss_adds_its_kernels_bytes_forward_and_backward() -> None:
    """The loss' scores kernel (read the logits, write scores and intermediate), the loss' read, its routing map
    written and summed; backward, the loss' and the scores' kernels and autograd's sum of the logits' gradients."""
    plain, aux = job({"moe_router_fp32": True}), job({"moe_router_fp32": True, "moe_aux_loss_coeff": 0.01})
    assert fused_router_bytes(aux, 2.0)[0] - fused_router_bytes(plain, 2.0)[0] == 4 * 4.0 + 2.0
    assert fused_router_bytes(aux, 2.0)[1] - fused_router_bytes(plain, 2.0)[1] == 7 * 4.0
    # unfused, the loss' PyTorch ops move more: its fp32 scores and its own int32 routing map
    assert sum(fused_router_bytes(aux, 2.0)) < sum(unfused_router_bytes(aux, 2.0))


def test_the_layer_prices_the_router_fused_only_where_the_run_fuses_it() -> None:
    unfused, fused = job(), job({"moe_router_fusion": True})
    layout, kernels, comm = models(unfused, 1)
    base = layer_cost(unfused, layout, kernels, comm, SimOptions(), moe=True)
    quick = layer_cost(fused, layout, kernels, comm, SimOptions(), moe=True)
    assert quick.forward.compute_s < base.forward.compute_s  # its backward reads the map the unfused one has not
    assert quick.forward.compute_s + quick.backward.compute_s < base.forward.compute_s + base.backward.compute_s
    d = 4.0  # fp32 router
    saved = SMALL["num_experts"] * TOKENS * (unfused_router_bytes(unfused, 2.0)[0] - (3 * d + 1))
    assert base.forward.compute_s - quick.forward.compute_s == pytest.approx(kernels.memory(saved))
    # Without Transformer Engine where it trains, and in torchtitan's MoE layer, the router is PyTorch's.
    for options in (SimOptions(router_fusion=False), SimOptions(torch_moe_combine=True)):
        assert not options.fused_router(fused.model)
    assert SimOptions().fused_router(fused.model) and not SimOptions().fused_router(unfused.model)
    assert not options_here(dataclasses.replace(fused.cluster, device_name="cpu")).router_fusion
    # The moe recomputation repeats the fused router's forward.
    recompute = {"recompute": "selective", "recompute_modules": "moe"}
    plain, quick = (layer_cost(job(m, **recompute), layout, kernels, comm, SimOptions(), moe=True)
                    for m in (None, {"moe_router_fusion": True}))
    assert base.forward.compute_s - quick.forward.compute_s == pytest.approx(
        plain.recompute.compute_s - quick.recompute.compute_s)


@pytest.mark.parametrize("router_fp32", [True, False])
@pytest.mark.parametrize("aux", [False, True])
def test_the_unfused_routers_bytes_are_those_megatron_cores_ops_move(router_fp32: bool, aux: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`unfused_router_bytes` counted again: Megatron-Core 0.16.1's router functions (softmax top-2, with and
    without the load-balancing loss, fp32 or bf16 logits) under ``TorchDispatchMode``, each op's ``[tokens,
    experts]`` tensors it reads and writes: views move nothing, an allocation only writes, a broadcast input (stride
    0) and a ``gather``'s source are read only where indexed (the top-k's ``[tokens, topk]``, left out)."""
    import torch
    from megatron.core.transformer.moe import moe_utils as mu
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from tests.test_sim_expert_ops_counted import MOVES_NOTHING

    tokens, experts, topk = 256, 64, 2
    writes_only = {"zeros_like", "new_zeros", "zeros", "ones_like"}

    class Moved(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in MOVES_NOTHING:
                return out
            reads = [] if name in writes_only or name == "gather" else tree_flatten((args, kwargs))[0]
            for t in [*reads, *tree_flatten(out)[0]]:
                if isinstance(t, torch.Tensor) and t.numel() == tokens * experts and 0 not in t.stride():
                    self.bytes += t.numel() * t.element_size()
            return out

    monkeypatch.setattr(mu.MoEAuxLossAutoScaler, "main_loss_backward_scale", torch.ones(()))
    logits = torch.randn(tokens, experts, dtype=torch.float32 if router_fp32 else torch.bfloat16,
                         requires_grad=True)
    with Moved() as forward:
        probs, _ = mu.topk_routing_with_score_function(logits, topk, score_function="softmax")
        if aux:
            aux_map, scores = mu.compute_routing_scores_for_aux_loss(logits, topk, "softmax")
            loss = mu.switch_load_balancing_loss_func(scores, aux_map.sum(dim=0), tokens, topk, experts, 0.01)
            probs = mu.MoEAuxLossAutoScaler.apply(probs, loss * tokens)
    grad = torch.randn_like(probs)
    with Moved() as backward:
        torch.autograd.grad(probs, [logits], grad)
    j = job({"moe_router_fp32": router_fp32, "moe_aux_loss_coeff": 0.01 if aux else 0.0})
    entries = tokens * experts
    assert (forward.bytes / entries, backward.bytes / entries) == unfused_router_bytes(j, 2.0)


def test_the_unfused_routers_operators_are_those_megatron_core_dispatches(monkeypatch: pytest.MonkeyPatch) -> None:
    """:data:`~cfp_megatron.sim.host_costs.UNFUSED_ROUTER_OPS` counted again: Megatron-Core 0.16.1's router
    functions (fp32 softmax top-2 with the load-balancing loss, as ``TopKRouter.routing`` and
    ``attach_and_log_load_balancing_loss`` call them at TP 1) under ``TorchDispatchMode``, views left out; the
    forward's are ``kernel_launches.json``'s router part."""
    import torch
    from megatron.core.transformer.moe import moe_utils as mu
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {"view", "t", "transpose", "expand", "unsqueeze", "squeeze", "alias", "detach", "_unsafe_view",
             "select", "slice", "as_strided"}

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func._schema.name.split("::")[1] not in views:
                self.ops.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(mu, "te_general_gemm", None, raising=False)  # Megatron-Core's path without TE
    monkeypatch.setattr(mu.MoEAuxLossAutoScaler, "main_loss_backward_scale", torch.ones(()))  # the schedule sets it
    tokens, hidden, experts, topk, coeff = 64, 32, 8, 2, 0.01
    x = torch.randn(tokens, 1, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(experts, hidden, dtype=torch.bfloat16, requires_grad=True)
    mu.clear_aux_losses_tracker()
    mu.save_to_aux_losses_tracker("load_balancing_loss", torch.zeros(()), 1, 1)  # the tracker's buffer exists
    with Count() as forward:
        logits = mu.router_gating_linear(x, w, None, torch.float32).view(-1, experts)
        probs, _ = mu.topk_routing_with_score_function(logits, topk, score_function="softmax")
        aux_map, scores = mu.compute_routing_scores_for_aux_loss(logits, topk, "softmax")
        loss = mu.switch_load_balancing_loss_func(scores, aux_map.sum(dim=0), tokens, topk, experts, coeff)
        mu.save_to_aux_losses_tracker("load_balancing_loss", loss / coeff, 1, 1)
        probs = mu.MoEAuxLossAutoScaler.apply(probs, loss * tokens)  # calculate_per_token_loss
    grad = torch.randn_like(probs)
    with Count() as backward:
        probs.backward(grad)
    mu.clear_aux_losses_tracker()
    assert (len(forward.ops), len(backward.ops)) == (hc.UNFUSED_ROUTER_OPS.forward, hc.UNFUSED_ROUTER_OPS.backward)
    moe = json.loads(hc.COUNTS_FILE.read_text())["kinds"]["moe"]
    assert moe["forward_parts"]["router"] == hc.UNFUSED_ROUTER_OPS.forward


def test_the_fused_router_launches_its_counted_operators_on_the_host() -> None:
    """The router's share of the counted layer's launches, scaled per pass by the operators counted from the code:
    26 -> 11 forward, 17 -> 13 backward."""
    j = job()
    counted = hc.launch_counts().moe["router"]
    unfused, fused = hc.host_costs(j, 16), hc.host_costs(j, 16, fused_router=True)
    constants = hc.host_constants()
    assert unfused.moe[0] - fused.moe[0] == pytest.approx(counted.forward * 15 / 26 * constants.forward_launch_s)
    assert unfused.moe[1] - fused.moe[1] == pytest.approx(counted.backward * 4 / 17 * constants.backward_launch_s)
    assert unfused.dense == fused.dense


def test_the_validators_megatron_bridge_moe_rows_run_the_router_fused_and_qwen3s_in_bf16() -> None:
    """frameworks.yaml's router_fusion (the Bridge performance configs' moe_router_fusion = True) and
    model_families.yaml's Qwen3 router in bf16 (no moe_router_dtype in its provider or bridge)."""
    from cfp_megatron.validate import read_rows, row_plan
    from cfp_megatron.validation.rows import PUBLISHED_RUNS

    rows = {r["id"]: r for path in PUBLISHED_RUNS for r in read_rows(path)}
    for rid, fp32 in (("73", True), ("74", False), ("79", False), ("80", False), ("91", False)):
        plan = row_plan(rows[rid])
        assert plan.job.model.moe_router_fusion and plan.options.fused_router(plan.job.model), rid
        assert plan.job.model.moe_router_fp32 is fp32, rid
    dense = row_plan(rows["1"]).job.model
    assert not dense.is_moe and not dense.moe_router_fusion


def test_the_bridge_rows_train_with_their_providers_load_balancing_loss() -> None:
    """frameworks.yaml's load_balancing_loss: Megatron-Bridge's Qwen3 (aux_loss) and DeepSeek-V3 (seq_aux_loss)
    providers train with one, GPT-OSS's sets none; a torchtitan row of the same model keeps its family's (none)."""
    from cfp_megatron.validate import read_rows, row_plan
    from cfp_megatron.validation.rows import PUBLISHED_RUNS

    rows = {r["id"]: r for path in PUBLISHED_RUNS for r in read_rows(path)}
    for rid, coefficient in (("73", 0.001), ("74", 0.001), ("91", 0.001), ("79", 0.0)):
        assert row_plan(rows[rid]).job.model.moe_aux_loss_coeff == coefficient, rid
    titan = {**rows["73"], "framework": "torchtitan", "source": "", "source_detail": "", "notes": ""}
    assert row_plan(titan).job.model.moe_aux_loss_coeff == 0.0


def test_the_field_reaches_megatron_core_only_with_transformer_engine_and_is_noted_on_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from cfp_megatron.model import megatron_config
    from cfp_megatron.model.megatron_config import cpu_notes, transformer_config

    fused = job({"moe_router_fusion": True})
    dims = ParallelDims.build(fused, 1, te_available=False)
    assert transformer_config(fused, dims, on_gpu=False).moe_router_fusion is False  # no TE: Megatron-Core raises
    (note,) = cpu_notes(fused)
    assert "model.moe_router_fusion=true" in note and "ignored on CPU" in note and "\n" not in note
    assert cpu_notes(job()) == []
    seen: dict = {}
    monkeypatch.setattr(megatron_config, "TransformerConfig", lambda **kwargs: seen.update(kwargs))
    for te, expected in ((True, True), (False, False)):
        monkeypatch.setattr(megatron_config, "router_fusion_here", lambda *, on_gpu, te=te: on_gpu and te)
        transformer_config(fused, dims, on_gpu=True)
        assert seen["moe_router_fusion"] is expected
        transformer_config(job(), dims, on_gpu=True)
        assert seen["moe_router_fusion"] is False


def test_the_field_enters_the_profile_key_only_when_set() -> None:
    base = job()
    assert model_key(base, on_gpu=False) == model_key(job({"moe_router_fusion": False}), on_gpu=False)
    assert model_key(base, on_gpu=False) != model_key(job({"moe_router_fusion": True}), on_gpu=False)
