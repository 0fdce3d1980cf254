"""Host time as a cost term: the counted kernel launches and the host's constants as data, a pass taking the larger of
its GPU time and its launches, the dropless MoE dispatcher's synchronisation per MoE layer, CUDA graphs replacing a
captured region's launches with one, and the plan option that sets them (validated, exported, shown)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cfp_megatron.base.config import CudaGraphImpl, ParallelSpec, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.exports import megatron_lm_args
from cfp_megatron.sim import host_costs as hc
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layer_cost import PassCost, layer_cost
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import collective_costs
from cfp_megatron.sim.simulate import prepare_costs, simulate
from cfp_megatron.sim.terms import TERMS, LaneKind, Placement
from cfp_megatron.sim.terms.host import with_host
from cfp_megatron.validate import load_preset

ROOT = Path(__file__).resolve().parent.parent
H100 = load_preset("dgx_h100")
TINY_MOE = {"name": "moe_host", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "vocab_size": 1024,
            "max_position_embeddings": 512, "activation": "swiglu", "num_experts": 8, "moe_router_topk": 2,
            "moe_ffn_hidden_size": 256, "add_bias_linear": False}
BIG_DENSE = {"name": "dense_big", "num_layers": 4, "hidden_size": 8192, "num_attention_heads": 64,
             "vocab_size": 32000, "max_position_embeddings": 4096}


def job(model: dict, cluster: dict | None = None, *, seq: int = 512, mb: int = 1, **parallel):
    train = {"global_batch_size": 16 * mb, "micro_batch_size": mb, "seq_length": seq, "precision": "bf16"}
    return job_from_config({"model": model, "cluster": {**(cluster or H100), "nodes": 1}, "parallel": parallel,
                            "train": train})


def test_counts_and_constants_are_read_from_their_data_files() -> None:
    counts, constants = hc.launch_counts(), hc.host_constants()
    data = json.loads(hc.COUNTS_FILE.read_text())
    # the parts add up to the counted forward of each layer kind; the backward is shared out as the forward is
    assert sum(p.forward for p in counts.dense.values()) == data["kinds"]["dense"]["forward"]
    assert sum(p.backward for p in counts.dense.values()) == pytest.approx(data["kinds"]["dense"]["backward"])
    moe = data["kinds"]["moe"]
    for side in ("forward", "backward"):  # the parts and the experts' launches per local expert add up
        assert sum(getattr(p, side) for p in counts.moe.values()) \
            + moe["local_experts"] * getattr(counts.per_local_expert, side) == pytest.approx(moe[side])
    assert counts.per_local_expert.forward > 0 and counts.per_local_expert.backward > 0
    assert counts.counted in ("cpu", "gpu") and counts.spec in ("local", "transformer_engine")
    # launches per local expert: the whole MoE layer's difference between 8 and 4 local experts, both passes
    few = data["kinds"]["moe_4_experts"]
    assert counts.per_local_expert.forward == pytest.approx((moe["forward"] - few["forward"]) / 4)
    assert 0 < constants.backward_launch_s <= constants.forward_launch_s < 1e-4 and constants.sync_s > 0


def test_a_pass_takes_the_larger_of_its_gpu_time_and_its_launches() -> None:
    host = hc.HostCosts(dense=(1e-3, 5e-4), moe=(2e-3, 1e-3), embedding=(0.0, 0.0), head=(0.0, 0.0),
                        dense_recompute_s=0.0, moe_recompute_s=0.0, recompute_syncs=False, moe_sync_s=0.0)
    kw = dict(dense=2, moe=0, embedding=False, heads=0, rec_dense=0, rec_moe=0, moe_forward_s=0.0)
    gpu_bound = with_host(host, PassCost(compute_s=5e-3), PassCost(compute_s=8e-3), PassCost(), **kw)
    assert [p.host_s for p in gpu_bound] == [0.0, 0.0]
    host_bound = with_host(host, PassCost(compute_s=5e-4), PassCost(compute_s=4e-4), PassCost(), **kw)
    assert host_bound[0].host_s == pytest.approx(2e-3 - 5e-4)  # two layers' launches less the GPU's time
    assert host_bound[0].total_s == pytest.approx(2e-3)
    assert host_bound[1].total_s == pytest.approx(1e-3)


def test_each_synchronising_moe_layer_exposes_its_sync_even_when_the_gpu_is_the_bottleneck() -> None:
    host = hc.HostCosts(dense=(0.0, 0.0), moe=(1e-3, 5e-4), embedding=(0.0, 0.0), head=(0.0, 0.0),
                        dense_recompute_s=0.0, moe_recompute_s=1e-3, recompute_syncs=True, moe_sync_s=2e-5)
    kw = dict(dense=0, moe=3, embedding=False, heads=0, rec_dense=0, moe_forward_s=4e-3)
    fwd, bwd = with_host(host, PassCost(compute_s=12e-3), PassCost(compute_s=24e-3), PassCost(compute_s=12e-3),
                         rec_moe=3, **kw)
    assert fwd.host_s == pytest.approx(3 * 2e-5)
    assert bwd.host_s == pytest.approx(3 * 2e-5)  # full recomputation runs the dispatcher's forward again
    # a layer whose launches outlast its GPU time pays the difference after its sync, one layer at a time
    fwd, _ = with_host(host, PassCost(compute_s=1.5e-3), PassCost(), PassCost(), rec_moe=0,
                       **{**kw, "moe_forward_s": 5e-4})
    assert fwd.host_s == pytest.approx(3 * (2e-5 + 1e-3 - 5e-4))


@pytest.mark.parametrize(("model", "syncs"), [
    ({}, True),  # dropless, all-to-all: the token counts reach the host
    ({"moe_expert_capacity_factor": 1.0}, True),  # token-drop without padding still copies its counts
    ({"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}, False),  # drop and pad
    ({"moe_token_dispatcher": "allgather", "moe_expert_capacity_factor": 1.0,
      "moe_pad_expert_input_to_capacity": True}, True),  # the all-gather dispatcher always does
])
def test_which_moe_dispatch_synchronises(model: dict, syncs: bool) -> None:
    assert hc.moe_syncs(job({**TINY_MOE, **model})) is syncs


def test_a_dense_model_never_synchronises_in_its_layers() -> None:
    assert not hc.moe_syncs(job(BIG_DENSE))
    assert prepare_costs(job(BIG_DENSE)).host.moe_sync_s == 0.0


def test_a_dropless_moe_layer_waits_at_each_of_its_syncs_as_measured() -> None:
    constants = hc.host_constants()
    assert constants.moe_layer_syncs == 3  # counted on the H200: 4 in the MoE forward, 1 of them the profiler's
    # the measured stall per sync (drain, split sizes, relaunch) is far above a plain .item()'s round trip
    assert constants.moe_sync_stall_s > 10 * constants.sync_s
    assert prepare_costs(job(TINY_MOE)).host.moe_sync_s == pytest.approx(3 * constants.moe_sync_stall_s)


def test_dropless_moe_is_slower_than_drop_and_pad_by_its_syncs_on_a_gpu_cluster() -> None:
    dropless = simulate(job(TINY_MOE))
    padded = simulate(job({**TINY_MOE, "moe_expert_capacity_factor": 1.0,
                           "moe_pad_expert_input_to_capacity": True}))
    sync_s = prepare_costs(job(TINY_MOE)).host.moe_sync_s
    layers, microbatches = TINY_MOE["num_layers"], dropless.num_microbatches
    assert dropless.time.host_s - padded.time.host_s >= layers * microbatches * sync_s * (1 - 1e-9)


def test_the_host_lane_reaches_the_breakdown_and_the_step_adds_up() -> None:
    found = simulate(job(TINY_MOE))  # small layers: bound by the host's launches
    assert found.time.host_s > 0 and found.time.host_step_s > 0
    assert found.time.total_s == pytest.approx(found.step_time_s)
    lanes = {lane.name: lane for lane in TERMS.lanes()}
    assert lanes["host_s"].placement is Placement.in_pass and lanes["host_s"].kind is LaneKind.host
    assert lanes["host_step_s"].placement is Placement.after


def test_the_trace_draws_the_hosts_time_on_its_own_lane() -> None:
    from cfp_megatron.sim.timeline import slices

    found = simulate(job(TINY_MOE, pp=2), with_events=True)
    host = [s for s in slices(found) if s.lane == "host"]
    assert {s.style for s in host} == {"host", "host_step"}
    critical = [s for s in host if s.rank == 0 and s.style == "host"]
    assert sum(s.end_s - s.start_s for s in critical) == pytest.approx(found.time.host_s)


def test_a_large_layer_is_not_bound_by_the_host() -> None:
    found = simulate(job(BIG_DENSE, seq=4096))
    assert found.time.host_s == 0.0


def test_no_host_time_on_a_cpu_cluster() -> None:
    cpu = {**H100, "device_name": "cpu", "generation": "cpu"}
    found = simulate(job(TINY_MOE, cpu))
    assert found.time.host_s == 0.0 and found.time.host_step_s == 0.0
    assert prepare_costs(job(TINY_MOE, cpu)).host is None


def test_cuda_graphs_remove_the_launches_of_what_they_capture() -> None:
    eager = simulate(job(TINY_MOE))
    attn = simulate(job(TINY_MOE, cuda_graph_impl="transformer_engine", cuda_graph_scope="attn"))
    router = simulate(job(TINY_MOE, cuda_graph_impl="transformer_engine",
                          cuda_graph_scope="attn+moe_router+moe_preprocess"))
    assert eager.time.host_s > attn.time.host_s > router.time.host_s
    whole = simulate(job(TINY_MOE, cuda_graph_impl="local", cuda_graph_scope="full_iteration"))
    assert whole.time.host_s == 0.0
    # a dropless MoE block is not captured whole: its experts' launches stay
    layer = prepare_costs(job(TINY_MOE, cuda_graph_impl="transformer_engine")).host
    padded = prepare_costs(job({**TINY_MOE, "moe_expert_capacity_factor": 1.0,
                                "moe_pad_expert_input_to_capacity": True},
                               cuda_graph_impl="transformer_engine")).host
    assert layer.moe[0] > padded.moe[0] == pytest.approx(4 * hc.host_constants().forward_launch_s)


def test_the_hosts_costs_are_shared_by_the_plans_that_agree_on_what_they_read() -> None:
    """The host's costs read the model, the CUDA graphs, whether recomputation is full, whether the MoE layers
    synchronise and the local experts only: plans that differ elsewhere (TP, SP, the micro-batch) share one
    computation, and each thing they read still moves them."""
    base = hc.host_costs(job(TINY_MOE), 8)
    assert hc.host_costs(job(TINY_MOE, tp=2, sp=True, mb=2), 8) is base
    assert hc.host_costs(job(TINY_MOE, recompute="selective"), 8) is base
    full = hc.host_costs(job(TINY_MOE, recompute="full"), 8)
    assert full.moe_recompute_s > 0 and full.recompute_syncs and base.moe_recompute_s == 0
    graphed = hc.host_costs(job(TINY_MOE, cuda_graph_impl="transformer_engine", cuda_graph_scope="attn"), 8)
    assert graphed.dense[0] < base.dense[0]
    assert hc.host_costs(job(TINY_MOE), 2, grouped_gemm=False).moe[0] < hc.host_costs(
        job(TINY_MOE), 8, grouped_gemm=False).moe[0]
    assert hc.host_costs(job(TINY_MOE), 8, moe_layer_syncs=1).moe_sync_s < base.moe_sync_s
    padded = {**TINY_MOE, "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
    assert hc.host_costs(job(padded), 8).moe_sync_s == 0.0 < base.moe_sync_s


def test_the_experts_python_launches_grow_with_the_local_experts_only_without_a_grouped_gemm() -> None:
    looped = SimOptions(grouped_gemm=False)
    few = prepare_costs(job(TINY_MOE, ep=8), options=looped).host
    many = prepare_costs(job(TINY_MOE, ep=1), options=looped).host
    per_expert = hc.launch_counts().per_local_expert.forward * hc.host_constants().forward_launch_s
    assert many.moe[0] - few.moe[0] == pytest.approx(7 * per_expert)
    # Transformer Engine's grouped linears launch a cuBLAS GEMM an expert from C++ (2 forward, 4 backward)
    grouped_few, grouped_many = (prepare_costs(job(TINY_MOE, ep=ep)).host for ep in (8, 1))
    cpp = hc.host_constants().backward_launch_s
    assert grouped_many.moe[0] - grouped_few.moe[0] == pytest.approx(7 * 2 * cpp)
    assert grouped_many.moe[1] - grouped_few.moe[1] == pytest.approx(7 * 4 * cpp)


def test_fp8_current_scaling_quantises_each_expert_in_four_kernels() -> None:
    # Float8CurrentScalingQuantizer::quantize_impl: zero the amax, reduce it, the scale from it, the cast
    assert hc.grouped_linear_launches(16, 4.0) == hc.Launches(forward=16 * (2 + 2 * 4), backward=16 * (4 + 2 * 4))
    assert hc.grouped_linear_launches(16, 0.0) == hc.Launches(forward=32, backward=64)  # delayed: one fused cast
    fp8 = {"precision": "fp8"}
    delayed, current = (job_from_config({"model": TINY_MOE, "cluster": {**H100, "nodes": 1}, "parallel": {},
                                         "train": {"global_batch_size": 16, "micro_batch_size": 1,
                                                   "seq_length": 512, **fp8, "fp8_recipe": recipe}})
                        for recipe in ("delayed", "tensorwise"))
    a, b = prepare_costs(delayed).host, prepare_costs(current).host
    cpp = hc.host_constants().backward_launch_s
    assert b.moe[0] - a.moe[0] == pytest.approx(8 * 2 * 4 * cpp)  # 8 local experts, 2 quantised inputs
    assert b.moe[1] - a.moe[1] == pytest.approx(8 * 2 * 4 * cpp)  # and 2 output gradients
    # two of the four are single-thread kernels, each a launch's floor on the GPU
    floor = hc.host_constants().kernel_floor_s
    assert floor == pytest.approx(0.89e-6)
    assert hc.expert_scalar_kernels_s(8, 2.0) == pytest.approx((2 * 8 * 2 * floor, 2 * 8 * 2 * floor))


@pytest.mark.parametrize(("parallel", "problem"), [
    ({"cuda_graph_scope": "attn"}, "captures none"),
    ({"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": "attn+bogus"}, "bogus is not a CUDA graph scope"),
    ({"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": "full_iteration"}, "alone"),
    ({"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": "moe_preprocess"}, "requires moe_router"),
])
def test_cuda_graph_settings_are_checked(parallel: dict, problem: str) -> None:
    if "cuda_graph_impl" in parallel:
        parallel = {**parallel, "cuda_graph_impl": CudaGraphImpl(parallel["cuda_graph_impl"])}
    with pytest.raises(ConfigError) as err:
        ParallelSpec(**parallel)
    assert problem in str(err.value) and "parallel.cuda_graph_scope" in str(err.value)


def test_cuda_graphs_are_exported_shown_and_parsed_back() -> None:
    graphed = job(TINY_MOE, cuda_graph_impl="transformer_engine", cuda_graph_scope="attn+moe_router")
    plan = Plan.from_job(graphed, world_size=8, prediction=None, inputs_fingerprint="x")
    args = megatron_lm_args(plan)
    assert args[args.index("--cuda-graph-impl") + 1] == "transformer_engine"
    assert args[args.index("--cuda-graph-scope") + 1:args.index("--cuda-graph-scope") + 3] == ["attn", "moe_router"]
    assert "cg=transformer_engine[attn+moe_router]" in plan.describe()
    again = Plan.parse(plan.canonical())
    assert again.parallel.cuda_graph_impl is CudaGraphImpl.transformer_engine
    assert again.parallel.cuda_graph_scope == "attn+moe_router"
    eager = Plan.from_job(job(TINY_MOE), world_size=8, prediction=None, inputs_fingerprint="x")
    assert "--cuda-graph-impl" not in megatron_lm_args(eager) and "cg=" not in eager.canonical()


def test_cuda_graphs_reach_megatrons_config_on_a_gpu_only() -> None:
    from cfp_megatron.base.parallel_dims import ParallelDims
    from cfp_megatron.model.megatron_config import transformer_config

    graphed = job(TINY_MOE, cuda_graph_impl="local", cuda_graph_scope="attn")
    dims = ParallelDims.build(graphed, 8)
    assert transformer_config(graphed, dims, on_gpu=False).cuda_graph_impl == "none"
    if torch.cuda.is_available():
        assert transformer_config(graphed, dims, on_gpu=True).cuda_graph_impl == "local"


def _bench():
    spec = importlib.util.spec_from_file_location("kernel_launches", ROOT / "bench" / "kernel_launches.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_counter_counts_kernels_not_views() -> None:
    counter = _bench().OpCounter()
    x = torch.randn(4, 4)
    with counter:
        y = x.view(16).view(4, 4).t()  # views: no kernel
        (y * 2 + 1).sum()
        x.t().reshape(16)  # a copy: one kernel
    assert sum(counter.kernels.values()) == 4


def test_the_committed_counts_are_the_gpus() -> None:
    data = json.loads(hc.COUNTS_FILE.read_text())
    assert data["counted"] == "gpu" and "H200" in data["device"] and data["spec"] == "local"
    assert data["kinds"]["moe"]["forward_syncs"] > data["kinds"]["dense"]["forward_syncs"]  # the dropless dispatcher


def test_host_timing_times_both_passes_and_falls_back_without_a_gpu() -> None:
    bench = _bench()
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    found = bench.timed_passes(lambda: layer(x), torch.ones(4, 8), on_gpu=False, repeats=3)
    for side in ("forward", "backward"):
        assert found[side]["host_s"] > 0 and found[side]["gpu_s"] is None
    # Three backwards ran: the gradient is three of the one the same matmul gives (a column sum of the weights
    # taken another way rounds differently, and fails allclose's absolute floor where the sum is near zero).
    assert x.grad is not None
    torch.testing.assert_close(x.grad, 3 * (torch.ones(4, 8) @ layer.weight))


@pytest.mark.slow
def test_the_host_timing_mode_writes_its_json_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_launches.py"), "--host-timing", "--cases", "dense",
                    "--seqs", "16", "--repeats", "1", "--out", str(out)],
                   check=True, capture_output=True, timeout=600, cwd=tmp_path)
    run = json.loads(out.read_text())["host_timing"]["cases"]["dense"]["seq"]["16"]
    assert run["eager"]["forward"]["host_s"] > 0 and run["eager"]["backward"]["gpu_s"] is None
    assert run["dispatched"]["forward"] > 0 and "queued" not in run


@pytest.mark.slow
def test_the_bench_writes_counts_the_host_term_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "launches.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_launches.py"), "--repeats", "2", "--out", str(out)],
                   check=True, capture_output=True, timeout=600, cwd=tmp_path)
    monkeypatch.setattr(hc, "COUNTS_FILE", out)
    hc.launch_counts.cache_clear()
    try:
        counts = hc.launch_counts()
        assert counts.dense["attention"].forward > 0 and counts.per_local_expert.forward > 0
    finally:
        hc.launch_counts.cache_clear()
    assert dataclasses.is_dataclass(counts)


def test_a_grouped_gemm_launches_its_experts_from_cpp_a_loop_from_python() -> None:
    """Where the experts run Transformer Engine's grouped linears (``moe_grouped_gemm``) their per-expert launches
    are its C++ loop's (a cuBLAS GEMM an expert, at the C++ launch's cost); Megatron-Core's SequentialMLP launches
    each expert's kernels from Python."""
    moe = job(TINY_MOE)
    per_expert = hc.launch_counts().per_local_expert
    grouped = hc.host_costs(moe, local_experts=8)
    looped = hc.host_costs(moe, local_experts=8, grouped_gemm=False)
    constants = hc.host_constants()
    cpp = constants.backward_launch_s
    few = hc.host_costs(moe, local_experts=2)
    assert (grouped.moe[0] - few.moe[0], grouped.moe[1] - few.moe[1]) == pytest.approx((6 * 2 * cpp, 6 * 4 * cpp))
    assert looped.moe[0] - (grouped.moe[0] - 8 * 2 * cpp) == pytest.approx(
        8 * per_expert.forward * constants.forward_launch_s)
    assert looped.moe[1] - (grouped.moe[1] - 8 * 4 * cpp) == pytest.approx(
        8 * per_expert.backward * constants.backward_launch_s)


def test_the_experts_single_thread_quantisation_kernels_cost_the_gpu_a_launch_floor_each() -> None:
    current = job_from_config({"model": TINY_MOE, "cluster": {**H100, "nodes": 1}, "parallel": {"ep": 2},
                               "train": {"global_batch_size": 16, "micro_batch_size": 1, "seq_length": 512,
                                         "precision": "fp8", "fp8_recipe": "tensorwise"}})
    layout, costs = build_layout(current), collective_costs(current.cluster, None)
    kernels = KernelModel(current.cluster, efficiency_for(current.cluster), NumberFormat.of(current.train))
    assert kernels.format.expert_scalar_kernels == 2.0
    priced = layer_cost(current, layout, kernels, costs, SimOptions(), moe=True)
    kernels.format = dataclasses.replace(kernels.format, expert_scalar_kernels=0.0)
    without = layer_cost(current, layout, kernels, costs, SimOptions(), moe=True)
    each = 4 * 2 * 2 * hc.host_constants().kernel_floor_s  # 4 local experts, 2 kernels, 2 tensors a pass
    assert priced.forward.compute_s - without.forward.compute_s == pytest.approx(each)
    assert priced.backward.compute_s - without.backward.compute_s == pytest.approx(each)


def test_torchtitans_experts_pay_none_of_transformer_engines_per_expert_kernels() -> None:
    # SimOptions.te_grouped_experts: torchtitan's GroupedExperts run one torch._grouped_mm a linear, quantised by
    # torchao, so neither the host's per-expert launches nor the single-thread kernels' GPU floor apply
    current = job_from_config({"model": TINY_MOE, "cluster": {**H100, "nodes": 1}, "parallel": {},
                               "train": {"global_batch_size": 16, "micro_batch_size": 1, "seq_length": 512,
                                         "precision": "fp8", "fp8_recipe": "tensorwise"}})
    assert SimOptions().te_grouped_experts and not SimOptions(torch_moe_combine=True).te_grouped_experts
    assert not SimOptions(grouped_gemm=False).te_grouped_experts
    te, titan = (prepare_costs(current, options=SimOptions(torch_moe_combine=titan, torch_swiglu=titan)).host
                 for titan in (False, True))
    constants, experts = hc.host_constants(), hc.launch_counts().moe["experts"]
    cpp = constants.backward_launch_s
    loops = hc.grouped_linear_launches(8, 4.0)  # 8 local experts, current scaling's 4 kernels a quantised tensor
    # torchtitan's own: its GroupedExperts' operators in place of the counted experts', and each grouped GEMM's
    # preparation kernel (tests/test_torchtitan_experts_counted.py)
    own = ((hc.TORCH_EXPERT_OPS.forward - experts.forward) * constants.forward_launch_s
           + hc.TORCH_GROUPED_MMS[0] * cpp,
           (hc.TORCH_EXPERT_OPS.backward - experts.backward) * cpp + hc.TORCH_GROUPED_MMS[1] * cpp)
    assert te.moe[0] - titan.moe[0] == pytest.approx(loops.forward * cpp - own[0])
    assert te.moe[1] - titan.moe[1] == pytest.approx(loops.backward * cpp - own[1])
    layout, costs = build_layout(current), collective_costs(current.cluster, None)
    kernels = KernelModel(current.cluster, efficiency_for(current.cluster), NumberFormat.of(current.train))
    titan_options = SimOptions(torch_moe_combine=True, torch_swiglu=True)
    titan_layer = layer_cost(current, layout, kernels, costs, titan_options, moe=True)
    kernels.format = dataclasses.replace(kernels.format, expert_scalar_kernels=0.0)
    unfloored = layer_cost(current, layout, kernels, costs, titan_options, moe=True)
    assert titan_layer.forward.compute_s == unfloored.forward.compute_s
