"""Recomputation in the simulator: block recomputation (the first N layers of each pipeline chunk recomputed, the
others kept) and selective recomputation's submodules (``parallel.recompute_modules``).

N = 0 is no recomputation and N = the chunk's layers is the uniform method; in between, each extra recomputed layer
costs time and saves activation memory, so block plans lie between the two on both axes. A recomputed submodule costs
its forward work again and keeps none of its activations.
"""

from __future__ import annotations

import pytest

from cfp_megatron.base.config import AttentionKernel, Recompute
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import partition_name, partition_recompute
from cfp_megatron.search.search import _layer_kept_bytes
from cfp_megatron.search.space import Candidate, GroupHead
from cfp_megatron.sim import SimOptions, simulate
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layer_cost import layer_cost
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.memory import layer_activation_bytes, recomputed_layers
from cfp_megatron.sim.prediction import Prediction
from tests.test_sim import job

LAYOUT = {"tp": 2, "pp": 2, "vpp": 2, "gbs": 32}
"""16 layers over 2 x 2 pipeline chunks: 4 layers per chunk."""
PER_CHUNK = 4


def _block(n: int, options: SimOptions | None = None, **layout) -> Prediction:
    """Block recomputation of the first ``n`` layers per chunk (``n = 0``: none)."""
    layout = {**LAYOUT, **layout}
    if n == 0:
        return simulate(job(**layout), options=options)
    return simulate(job(**layout, recompute="full", recompute_method="block", recompute_num_layers=n),
                    options=options)


@pytest.mark.parametrize("kernel", list(AttentionKernel), ids=[k.value for k in AttentionKernel])
def test_block_lies_between_none_and_uniform_full(kernel: AttentionKernel) -> None:
    options = SimOptions(attention=kernel)
    preds = [_block(n, options) for n in range(PER_CHUNK + 1)]
    uniform = simulate(job(**LAYOUT, recompute="full"), options=options)
    times = [p.step_time_s for p in preds]
    recompute = [p.time.recompute_s for p in preds]
    memory = [p.memory.activations for p in preds]
    assert recompute[0] == 0.0
    # More recomputed layers: more time, less activation memory.
    assert all(a < b for a, b in zip(times, times[1:], strict=False)), times
    assert all(a < b for a, b in zip(recompute, recompute[1:], strict=False)), recompute
    assert all(a > b for a, b in zip(memory, memory[1:], strict=False)), memory
    # Each recomputed layer per chunk costs the same (dense model): the recompute time grows linearly.
    assert recompute[2] - recompute[1] == pytest.approx(recompute[1])
    # Every layer of the chunk: the uniform method.
    assert preds[-1].step_time_s == pytest.approx(uniform.step_time_s)
    assert preds[-1].time.recompute_s == pytest.approx(uniform.time.recompute_s)
    assert preds[-1].memory.activations == pytest.approx(uniform.memory.activations)
    # Block with one layer per chunk keeps the other layers' activations as without recomputation (with the
    # attention scores when the attention core is not fused): more than half of what no recomputation keeps.
    assert memory[1] > 0.5 * memory[0]


def test_block_recomputes_the_leading_dense_layers_first() -> None:
    moe = {"num_experts": 8, "moe_router_topk": 2, "activation": "swiglu", "moe_ffn_hidden_size": 2048,
           "num_layers": 4, "moe_first_dense_layers": 1}
    preds = [simulate(job(model=moe, tp=8, sp=True, gbs=8, **({"recompute": "full", "recompute_method": "block",
                                                      "recompute_num_layers": n} if n else {})))
             for n in range(5)]
    rec = [p.time.recompute_s for p in preds]
    dense, moe_layer = rec[1] - rec[0], rec[2] - rec[1]
    assert rec[3] - rec[2] == pytest.approx(moe_layer) and rec[4] - rec[3] == pytest.approx(moe_layer)
    assert dense != pytest.approx(moe_layer)  # the first recomputed layer is the dense one
    uniform = simulate(job(model=moe, tp=8, sp=True, gbs=8, recompute="full"))
    assert rec[4] == pytest.approx(uniform.time.recompute_s)


def test_recomputed_layers_per_rank() -> None:
    moe = {"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 2048, "num_layers": 8,
           "moe_first_dense_layers": 3}
    plan = job(model=moe, tp=2, pp=2, vpp=2, gbs=32, recompute="full", recompute_method="block",
               recompute_num_layers=1)
    # Chunks of 2 layers: rank 0 holds layers 0-1 and 4-5, rank 1 holds 2-3 and 6-7; layers 0-2 are dense.
    assert recomputed_layers(plan, rank=0) == (1, 1)  # layers 0 (dense) and 4 (MoE)
    assert recomputed_layers(plan, rank=1) == (1, 1)  # layers 2 (dense) and 6 (MoE)
    uniform = job(model=moe, tp=2, pp=2, vpp=2, gbs=32, recompute="full")
    assert recomputed_layers(uniform, rank=0) == (2, 2)
    assert recomputed_layers(uniform, rank=1) == (1, 3)
    assert recomputed_layers(job(model=moe, tp=2, pp=2, vpp=2, gbs=32), rank=0) == (0, 0)


# Selective recomputation's submodules (parallel.recompute_modules).


def test_recompute_modules_cost_their_forward_and_keep_none_of_their_activations() -> None:
    options = SimOptions()
    none = job(tp=2)
    layout = build_layout(none)
    tokens, hidden, ffn = 2048, 4096, 4 * 4096
    kept = layer_activation_bytes(none, layout, options, moe=False)[0]
    by_module = {}
    for modules in ("core_attn", "layernorm", "mlp", "layernorm+mlp"):
        plan = job(tp=2, recompute="selective", recompute_modules=modules)
        by_module[modules] = (simulate(plan), layer_activation_bytes(plan, layout, options, moe=False)[0])
    # bf16 without SP: the norms' two outputs (QKV's and fc1's inputs), 2 bytes per element, replicated over TP.
    assert kept - by_module["layernorm"][1] == tokens * 2 * 2 * hidden
    # The MLP keeps only its input: fc1's output and the activation's output (GELU), split over TP.
    assert kept - by_module["mlp"][1] == tokens * (2 * ffn + 2 * ffn) / 2
    assert by_module["core_attn"][1] == kept  # flash attention keeps no scores to drop
    assert by_module["layernorm+mlp"][1] == by_module["layernorm"][1] + by_module["mlp"][1] - kept
    # Time: the recomputed forward work, the MLP's GEMMs far above two norms' element-wise passes.
    rec = {m: p.time.recompute_s for m, (p, _) in by_module.items()}
    assert rec["mlp"] > 10 * rec["layernorm"] > 0 and rec["core_attn"] > 0
    assert rec["layernorm+mlp"] == pytest.approx(rec["layernorm"] + rec["mlp"])
    assert by_module["mlp"][0].time.recompute_s < simulate(job(tp=2, recompute="full")).time.recompute_s
    # One layer's: the two norms read and write the hidden state (bf16, replicated over TP without SP).
    plan = job(tp=2, recompute="selective", recompute_modules="layernorm")
    kernels = KernelModel(plan.cluster, efficiency_for(plan.cluster), plan.train.precision)
    cost = layer_cost(plan, layout, kernels, CollectiveCosts(plan.cluster), options, moe=False)
    assert cost.recompute.total_s == pytest.approx(kernels.memory(4 * hidden * tokens * 2))


def test_recompute_modules_of_a_moe_layer() -> None:
    moe = {"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 2048, "num_layers": 8}
    base = {"tp": 1, "ep": 8, "model": moe}
    none = simulate(job(**base))
    act = simulate(job(**base, recompute="selective", recompute_modules="moe_act"))
    whole = simulate(job(**base, recompute="selective", recompute_modules="moe"))
    assert none.memory.activations > act.memory.activations > whole.memory.activations
    assert 0 < act.time.recompute_s < whole.time.recompute_s
    # Recomputing the whole MoE block sends its tokens again.
    assert whole.time.ep_comm_s > none.time.ep_comm_s and act.time.ep_comm_s == pytest.approx(none.time.ep_comm_s)


def test_a_search_keeps_the_users_modules_for_selective_candidates_only() -> None:
    pinned = job(tp=2, recompute="selective", recompute_modules="layernorm+mlp").parallel
    fields = dict(tp=2, sp=False, pp=1, vpp=1, cp=1, ep=1, etp=1, micro_batch=1, distributed_optimizer=False,
                  mlp="megatron")
    for recompute, modules in (("selective", "layernorm+mlp"), ("none", None), ("full", None)):
        candidate = Candidate(**fields, recompute=recompute)
        assert candidate.parallel(pinned).recompute_modules == modules


def test_recompute_modules_have_a_partition_of_their_own_that_profiling_does_not_measure() -> None:
    selective = Recompute.selective
    assert partition_name(2, sp=True, recompute=selective, recompute_modules="layernorm+mlp") == \
        "tp2-sp-layernorm+mlp-selective"
    assert partition_name(2, sp=True, recompute=selective, recompute_modules="core_attn") == "tp2-sp-selective"
    assert partition_name(2, sp=True, recompute=selective) == "tp2-sp-selective"
    assert partition_recompute("tp2-sp-layernorm+mlp-selective") is selective


def test_the_searchs_memory_bound_counts_the_users_modules() -> None:
    """The search prunes on the activations a layer keeps at least: for its selective candidates, under the modules
    the user pinned (else the bound would exceed the plan's own prediction and prune a plan that fits)."""
    pinned = job(tp=2, recompute="selective", recompute_modules="layernorm+mlp")
    layout = build_layout(pinned)
    head = GroupHead(tp=2, cp=1, pp=1, ep=1, etp=1, sp=False, micro_batch=1, recompute="selective", mlp="megatron")
    bound = _layer_kept_bytes(head, layout, pinned, None, SimOptions())
    assert bound == (layer_activation_bytes(pinned, layout, SimOptions(), moe=False)[0],) * 2  # a dense model's
    assert bound[0] < _layer_kept_bytes(head, layout, job(tp=2), None, SimOptions())[0]  # core attention: keeps more
