"""The step-time and memory simulator: behaviour, not figures."""

from __future__ import annotations

import json

import pytest

from cfp_megatron.base import parallel_dims
from cfp_megatron.base.config import AttentionKernel, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.flops import attended_keys, causal_score_share
from cfp_megatron.cluster.costs import CollectiveCosts, group_placement
from cfp_megatron.cluster.measured import Collective, CollectiveFit, NothingMeasured, Span
from cfp_megatron.sim import SimOptions, simulate
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layer_cost import layer_cost
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.memory import in_flight
from cfp_megatron.sim.timeline import chrome_trace, write_chrome_trace, write_png
from cfp_megatron.validate import load_preset

A100 = load_preset("dgx_a100")
H100 = load_preset("dgx_h100")


def job(nodes: int = 1, cluster: dict | None = None, model: dict | None = None, **parallel):
    train = {"global_batch_size": parallel.pop("gbs", 32), "micro_batch_size": parallel.pop("mb", 1),
             "seq_length": parallel.pop("seq", 2048), "precision": parallel.pop("precision", "bf16")}
    if "fp8_recipe" in parallel:
        train["fp8_recipe"] = parallel.pop("fp8_recipe")
    base_model = {"name": "gpt_test", "num_layers": 16, "hidden_size": 4096, "num_attention_heads": 32,
                  "vocab_size": 51200, "max_position_embeddings": 4096}
    base_model.update(model or {})
    return job_from_config({"model": base_model, "cluster": {**(cluster or A100), "nodes": nodes},
                            "parallel": parallel, "train": train})


def test_breakdown_adds_up_to_step_time() -> None:
    pred = simulate(job(nodes=2, tp=2, pp=2, sp=True, distributed_optimizer=True, overlap_grad_reduce=True))
    assert pred.time.total_s == pytest.approx(pred.step_time_s)
    assert pred.step_time_s > 0 and pred.tokens_per_s_per_gpu > 0 and pred.model_tflops_per_gpu > 0
    assert pred.time.tp_comm_s > 0 and pred.time.pp_bubble_s > 0


def test_full_recompute_costs_an_extra_forward() -> None:
    none = simulate(job(tp=8))
    full = simulate(job(tp=8, recompute="full"))
    sel = simulate(job(tp=8, recompute="selective"))
    assert full.step_time_s > sel.step_time_s > none.step_time_s
    # The recomputed work is the layers' forward (everything but the embedding and the logits).
    assert 0.8 * none.time.forward_compute_s < full.time.recompute_s <= none.time.forward_compute_s
    assert full.time.backward_compute_s == pytest.approx(none.time.backward_compute_s)


def test_interleaving_shrinks_the_bubble() -> None:
    plain = simulate(job(nodes=1, tp=1, pp=8, gbs=64))
    inter = simulate(job(nodes=1, tp=1, pp=8, vpp=2, gbs=64))
    assert inter.bubble_fraction < plain.bubble_fraction
    assert inter.step_time_s < plain.step_time_s


def test_more_microbatches_shrink_the_bubble() -> None:
    small = simulate(job(nodes=1, pp=8, gbs=8))
    large = simulate(job(nodes=1, pp=8, gbs=64))
    assert large.bubble_fraction < small.bubble_fraction


def test_memory_falls_with_tp_pp_and_distributed_optimizer() -> None:
    base = simulate(job(nodes=1, gbs=64)).memory.total
    assert simulate(job(nodes=1, tp=2, gbs=64)).memory.total < base
    assert simulate(job(nodes=1, pp=2, gbs=64)).memory.total < base
    dist = simulate(job(nodes=1, distributed_optimizer=True, gbs=64)).memory
    assert dist.total < base
    assert dist.optimizer_states == pytest.approx(simulate(job(nodes=1, gbs=64)).memory.optimizer_states / 8)


def test_unfused_attention_keeps_its_scores_by_kernel() -> None:
    """Megatron-Core's unfused core keeps per score the bf16 probabilities (fused softmax kernel) or also PyTorch's
    fp32 softmax output (no Transformer Engine, no Apex: 6 bytes), and holds their gradients for one layer's
    backward (4 or 8 bytes, beyond the loss's logits, freed before it); the flash kernel keeps none."""
    plain = job(tp=2, mb=2, gbs=32)  # gpt_test: 32 heads, seq 2048, 16 layers on one rank (pp=1)
    scores = 2 * 32 * 2048 * 2048 / 2  # per micro-batch on a rank
    mem = {k: simulate(plain, options=SimOptions(attention=k)).memory.activations for k in AttentionKernel}
    flash = mem[AttentionKernel.flash]
    # The backward's working set comes after the loss's logits are freed: it counts beyond them.
    logits = dict(simulate(plain).memory.parts)["logits"]
    assert mem[AttentionKernel.fused_softmax] - flash == pytest.approx(scores * 16 * 2 + max(scores * 4 - logits, 0))
    # PyTorch's masked_fill also keeps the boolean causal mask, one [s, s] byte tensor a layer, not split over TP.
    mask = 16 * 2048 * 2048
    assert mem[AttentionKernel.torch_softmax] - flash == pytest.approx(scores * 16 * 6 + mask
                                                                       + max(scores * 8 - logits, 0))
    # Recomputing the core keeps no scores; its backward holds the recomputed ones and their gradients.
    sel = job(tp=2, mb=2, gbs=32, recompute="selective")
    sel_mem = {k: simulate(sel, options=SimOptions(attention=k)).memory.activations for k in AttentionKernel}
    assert (sel_mem[AttentionKernel.torch_softmax] - sel_mem[AttentionKernel.flash]
            == pytest.approx(max(scores * 14 - logits, 0)))


def test_the_attention_kernel_here_follows_what_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    found: set[str] = set()
    monkeypatch.setattr(parallel_dims.importlib.util, "find_spec", lambda name: object() if name in found else None)
    assert parallel_dims.attention_kernel_here(on_gpu=True) is AttentionKernel.torch_softmax
    found.add("scaled_masked_softmax_cuda")
    assert parallel_dims.attention_kernel_here(on_gpu=True) is AttentionKernel.fused_softmax
    found.add("transformer_engine")
    assert parallel_dims.attention_kernel_here(on_gpu=True) is AttentionKernel.flash


def test_activation_memory_follows_recompute_and_sequence_parallel() -> None:
    unfused = SimOptions(attention=AttentionKernel.fused_softmax)
    none = simulate(job(tp=8, mb=2, gbs=32), options=unfused).memory.activations
    sel = simulate(job(tp=8, mb=2, gbs=32, recompute="selective"), options=unfused).memory.activations
    full = simulate(job(tp=8, mb=2, gbs=32, recompute="full")).memory.activations
    sp = simulate(job(tp=8, mb=2, gbs=32, sp=True, recompute="selective")).memory.activations
    assert none > sel > sp > full


def test_first_stage_holds_pp_microbatches() -> None:
    assert in_flight(0, 4, 1, 16) == 4
    assert in_flight(3, 4, 1, 16) == 1
    assert in_flight(0, 4, 2, 16) > 4  # interleaving holds more chunk micro-batches on stage 0


def test_fsdp_shards_model_states() -> None:
    ddp = simulate(job(nodes=1, gbs=64)).memory
    fsdp = simulate(job(nodes=1, gbs=64, distributed_optimizer=True, fsdp="optim_grads_params")).memory
    assert fsdp.parameters < ddp.parameters / 4 and fsdp.optimizer_states < ddp.optimizer_states / 4


def test_fp8_is_faster_on_hopper_and_refused_without_fp8_tensor_cores() -> None:
    bf16 = simulate(job(cluster=H100, tp=1, gbs=64))
    fp8 = simulate(job(cluster=H100, tp=1, gbs=64, precision="fp8"))
    assert fp8.step_time_s < bf16.step_time_s
    with pytest.raises(ConfigError) as info:
        simulate(job(gbs=64, precision="fp8"))  # A100: no FP8 tensor cores
    assert info.value.issues[0].key == "train.precision" and "fp8" in info.value.issues[0].problem


def test_fp8_keeps_the_linear_layers_inputs_in_one_byte() -> None:
    """Transformer Engine's FP8 linear layers keep the FP8 copies of their inputs: per token and layer, the QKV, fc1
    and fc2 inputs lose one byte an element (h, h and the FFN width, split over TP under SP); under delayed scaling
    (the default recipe) the projection's FP8 copy sits beside the fused core's bf16 output, one byte more; PrimePar's
    MLP runs in bf16, so there only the QKV input shrinks, by what the projection adds."""
    from cfp_megatron.sim.memory import layer_activation_bytes

    h, ffn, t, mb, seq = 4096, 4 * 4096, 4, 2, 2048
    tokens = mb * seq
    for mlp, saved in (("megatron", (2 * h + ffn - h) / t), ("primepar", (h - h) / t)):
        j = job(cluster=H100, tp=t, sp=True, mb=mb, gbs=32, mlp=mlp)
        layout = build_layout(j)
        bf16 = layer_activation_bytes(j, layout, SimOptions(), moe=False)[0]
        j8 = job(cluster=H100, tp=t, sp=True, mb=mb, gbs=32, mlp=mlp, precision="fp8")
        fp8 = layer_activation_bytes(j8, layout, SimOptions(), moe=False)[0]
        assert bf16 - fp8 == pytest.approx(tokens * saved)


def test_moe_expert_parallel_and_context_parallel() -> None:
    moe = {"num_experts": 8, "moe_router_topk": 2, "activation": "swiglu", "moe_ffn_hidden_size": 2048}
    pred = simulate(job(cluster=H100, model=moe, ep=8, gbs=64))
    assert pred.time.ep_comm_s > 0
    cp = simulate(job(cluster=H100, cp=2, seq=8192, gbs=16, model={"max_position_embeddings": 8192}))
    assert cp.step_time_s > 0 and cp.memory.activations > 0


def test_invalid_plan_raises_config_error() -> None:
    with pytest.raises(ConfigError):
        simulate(job(tp=3))
    with pytest.raises(ConfigError):
        simulate(job(gbs=12))


def test_measured_collective_wins_over_the_model() -> None:
    class Slow(NothingMeasured):
        def collective(self, op, group_size, span):
            return CollectiveFit(op=op, group_size=group_size, span=span, latency_s=1e-3,
                                 bandwidth_bytes_per_s=1e9)

    fast = simulate(job(tp=8))
    slow = simulate(job(tp=8), measurements=Slow())
    assert slow.time.tp_comm_s > 5 * fast.time.tp_comm_s
    assert fast.step_time_s == pytest.approx(simulate(job(tp=8), measurements=NothingMeasured()).step_time_s)


def test_collective_costs() -> None:
    from cfp_megatron.base.config import ClusterSpec

    cluster = ClusterSpec(**{**A100, "nodes": 4})
    costs = CollectiveCosts(cluster, intra_efficiency=0.8, inter_efficiency=0.8)
    mb = 256e6
    intra = costs.seconds(Collective.all_reduce, mb, 8)
    across = costs.seconds(Collective.all_reduce, mb, 32)
    spread = costs.seconds(Collective.all_reduce, mb, 4, ranks_per_node=1)
    assert 0 < intra < across and intra < spread
    assert costs.seconds(Collective.all_gather, mb, 8) == pytest.approx(
        costs.seconds(Collective.reduce_scatter, mb, 8))
    assert costs.seconds(Collective.all_reduce, mb, 1) == 0.0
    assert group_placement(8, 1, 8) == 8
    assert group_placement(4, 8, 8) == 1
    assert group_placement(8, 2, 8) == 4
    fit = CollectiveFit(op=Collective.all_gather, group_size=8, span=Span.intra_node, latency_s=0.0,
                        bandwidth_bytes_per_s=1e10)

    class One(NothingMeasured):
        def collective(self, op, group_size, span):
            return fit if (op, group_size, span) == (fit.op, fit.group_size, fit.span) else None

    measured = CollectiveCosts(cluster, One())
    assert measured.seconds(Collective.all_gather, mb, 8) == pytest.approx(mb / 1e10)
    with pytest.raises(ConfigError):
        CollectiveCosts(cluster, intra_efficiency=0.0)


def test_timeline_exports(tmp_path) -> None:
    pred = simulate(job(nodes=1, pp=4, vpp=2, gbs=8, tp=2), with_events=True)
    trace = chrome_trace(pred)
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1, 2, 3}
    assert {e["cat"] for e in slices} == {"compute", "comm", "idle"}
    assert sum(1 for e in slices if e["name"].startswith("F")) == 4 * 2 * pred.num_microbatches
    path = write_chrome_trace(pred, tmp_path / "trace.json")
    assert json.loads(path.read_text())["traceEvents"]
    png = write_png(pred, tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ConfigError):
        chrome_trace(simulate(job(nodes=1, pp=4, gbs=8)))


def test_measured_gemm_table_wins_over_the_preset() -> None:
    class SlowGemms(NothingMeasured):
        def gemm_tflops(self, m, n, k, dtype):
            return 10.0

    preset = simulate(job(tp=8))
    measured = simulate(job(tp=8), measurements=SlowGemms())
    assert measured.time.forward_compute_s > 5 * preset.time.forward_compute_s


def test_layer_only_measurement_has_no_step_costs() -> None:
    pred = simulate(job(tp=8, mb=4, gbs=4), options=SimOptions(measured_layer_only=True))
    assert pred.time.optimizer_s == 0 and pred.time.dp_comm_s == 0
    assert pred.step_time_s < simulate(job(tp=8, mb=4, gbs=4)).step_time_s


def test_tp_comm_overlap_hides_tp_communication_and_holds_buffers() -> None:
    plain = simulate(job(cluster=H100, tp=8, sp=True))
    overlap = simulate(job(cluster=H100, tp=8, sp=True, tp_comm_overlap=True))
    assert overlap.time.tp_comm_s < plain.time.tp_comm_s
    assert overlap.memory.comm_buffers > plain.memory.comm_buffers
    with pytest.raises(ConfigError, match="parallel.tp_comm_overlap"):
        simulate(job(cluster=H100, tp=8, tp_comm_overlap=True))  # needs sequence parallelism
    with pytest.raises(ConfigError, match="parallel.tp_comm_overlap"):
        simulate(job(cluster={"name": "local", "device_name": "cpu", "gpus_per_node": 8}, tp=8, sp=True,
                     tp_comm_overlap=True))


def _rank_busy_s(pred, rank: int) -> float:
    return sum(e.end_s - e.start_s for e in pred.events if e.rank == rank and e.kind.value in ("forward", "backward",
                                                                                                 "comm"))


def test_a_layout_puts_the_layers_and_the_mtp_layer_where_it_says() -> None:
    """A per-stage layout moves decoder layers between ranks; an MTP layer costs a decoder layer, its projection
    and another pass of the head, on the rank whose chunk holds the ``m`` (the head pass on the loss rank), and its
    rank holds its weights and an embedding table of its own."""
    common = {"nodes": 1, "pp": 2, "vpp": 2, "tp": 1, "gbs": 8, "seq": 1024}
    model = {"num_layers": 8, "hidden_size": 1024, "num_attention_heads": 8}
    even = simulate(job(**common, model=model), with_events=True)
    moved = simulate(job(**common, model=model, pipeline_model_parallel_layout="Ettt|t|ttt|tL"), with_events=True)
    assert _rank_busy_s(moved, 0) > _rank_busy_s(even, 0) and _rank_busy_s(moved, 1) < _rank_busy_s(even, 1)
    model = {**model, "num_layers": 6}
    mtp = {**model, "mtp_num_layers": 1, "position_embedding": "rope"}  # MTP under PP needs rotary positions
    with_loss = simulate(job(**common, model=mtp, pipeline_model_parallel_layout="Ett|tt|tt|mL"), with_events=True)
    on_rank0 = simulate(job(**common, model=mtp, pipeline_model_parallel_layout="Ett|tt|ttm|L"), with_events=True)
    plain = simulate(job(**common, model=model, pipeline_model_parallel_layout="Ett|tt|tt|L"), with_events=True)
    assert _rank_busy_s(with_loss, 0) == pytest.approx(_rank_busy_s(plain, 0))
    assert _rank_busy_s(with_loss, 1) > _rank_busy_s(plain, 1)
    assert _rank_busy_s(on_rank0, 0) > _rank_busy_s(plain, 0)
    assert _rank_busy_s(on_rank0, 1) > _rank_busy_s(plain, 1)  # the MTP head and loss stay with the loss
    assert _rank_busy_s(on_rank0, 1) < _rank_busy_s(with_loss, 1)
    assert with_loss.memory.total > plain.memory.total


def test_a_sliding_window_prices_the_attention_tiles_it_reaches() -> None:
    """GPT-OSS's pattern: 128-token windows on every other layer. A fused kernel computes the window's tiles and the
    diagonal one (2 of 32 at 4,096 tokens) instead of half the scores; an unfused one computes every score anyway;
    the model FLOPs count a windowed layer's 129 keys."""
    full = job(seq=4096)
    windowed = job(seq=4096, model={"window_size": 128, "window_attn_skip_freq": 2})
    m = windowed.model
    assert m.windowed_layers == 8 and job(seq=4096, model={"window_size": 128}).model.windowed_layers == 16
    assert causal_score_share(m, 4096) == pytest.approx((8 * 0.5 + 8 * 256 / 4096) / 16)
    assert attended_keys(m, 4096) == 8 * 4096 + 8 * 129 and attended_keys(full.model, 4096) == 16 * 4096
    cores = {}
    for name, plan in (("full", full), ("windowed", windowed)):
        kernels = KernelModel(plan.cluster, efficiency_for(plan.cluster), plan.train.precision)
        layout = build_layout(plan)
        for flash in (True, False):
            options = SimOptions(attention=AttentionKernel.flash if flash else AttentionKernel.fused_softmax)
            cost = layer_cost(plan, layout, kernels, CollectiveCosts(plan.cluster), options, moe=False)
            cores[name, flash] = cost.forward.attention_core_s
    assert cores["windowed", True] == pytest.approx(cores["full", True] * causal_score_share(m, 4096) / 0.5)
    assert cores["windowed", False] == pytest.approx(cores["full", False])
    assert simulate(windowed).step_time_s < simulate(full).step_time_s
