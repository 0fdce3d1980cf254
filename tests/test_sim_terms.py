"""The cost terms' registry: every lane and memory category owned once, a new term reaching the breakdown, the
timeline, the plan check, the memory breakdown and the fit check without editing them, each term's lower bound below
its simulated share and its memory what the simulator reports."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest

from cfp_megatron.backends.megatron.report import explain
from cfp_megatron.base.config import job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.plan.check import breakdown
from cfp_megatron.sim import simulate
from cfp_megatron.sim.bounds import group_costs, group_costs_pair
from cfp_megatron.sim.memory import Stage
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import PassCosts
from cfp_megatron.sim.prediction import GIB, MemoryBreakdown, TimeBreakdown
from cfp_megatron.sim.simulate import memory_stages, predict_memory, prepare_costs
from cfp_megatron.sim.terms import TERMS, CostTerm, Lane, LaneKind, MemoryCategory, Overlaps, Placement, StepInputs
from cfp_megatron.sim.timeline import chrome_trace, slices
from cfp_megatron.validate import load_preset

H100 = load_preset("dgx_h100")
DENSE = {"name": "gpt_test", "num_layers": 8, "hidden_size": 2048, "num_attention_heads": 16, "vocab_size": 51200,
         "max_position_embeddings": 4096}
MOE = {**DENSE, "name": "moe_test", "activation": "swiglu", "num_experts": 16, "moe_router_topk": 2,
       "moe_ffn_hidden_size": 1024, "add_bias_linear": False}


def job(model: dict, nodes: int = 2, mb: int = 1, **parallel):
    train = {"global_batch_size": 64, "micro_batch_size": mb, "seq_length": 4096, "precision": "bf16"}
    return job_from_config({"model": model, "cluster": {**H100, "nodes": nodes}, "parallel": parallel,
                            "train": train})


class FixedTerm(CostTerm):
    """A term that costs a fixed half second after the schedule on every rank."""

    name = "fixed"
    lanes = (Lane(name="fixed_s", label="fixed cost", part="fixed part", kind=LaneKind.compute,
                  placement=Placement.after, key="fixed", trace="fixed lane",
                  style=("a fixed cost", "#000000", "black")),)

    def after_s(self, inputs: StepInputs) -> dict[str, list[float]]:
        return {"fixed_s": [0.5] * inputs.layout.dims.pp}


def test_the_registry_owns_every_lane_of_the_breakdown_once() -> None:
    lanes = [lane.name for lane in TERMS.lanes()]
    fields = [f.name for f in dataclasses.fields(TimeBreakdown) if f.name != "extra"]
    assert sorted(lanes) == sorted(fields)
    assert len(set(lanes)) == len(lanes)
    assert len({term.name for term in TERMS}) == len(TERMS)
    keys = [lane.key for lane in TERMS.lanes() if lane.key]
    assert len(set(keys)) == len(keys)


def test_a_registered_term_reaches_the_breakdown_timeline_and_plan_check() -> None:
    plan = job(DENSE, tp=2, pp=2)
    before = simulate(plan, with_events=True)
    with TERMS.added(FixedTerm()):
        after = simulate(plan, with_events=True)
        parts = dict(breakdown(after)[0])
        trace = chrome_trace(after)
        lanes = {piece.lane for piece in slices(after)}
        why = explain(_ranked(after, plan), _ranked(before, plan))
    assert after.step_time_s == pytest.approx(before.step_time_s + 0.5)
    assert after.time.seconds("fixed_s") == 0.5 and after.time.total_s == pytest.approx(after.step_time_s)
    assert parts["fixed part"] == 0.5 and sum(parts.values()) == pytest.approx(after.step_time_s)
    assert "fixed lane" in lanes
    assert any(e.get("args", {}).get("name") == "fixed lane" for e in trace["traceEvents"])
    assert any(e["ph"] == "X" and e["args"]["kind"] == "fixed" for e in trace["traceEvents"])
    assert any(line.startswith("  fixed cost: +0.5") for line in why)
    # gone with the term
    assert simulate(plan).step_time_s == pytest.approx(before.step_time_s)


class _SameKnobs:
    """A candidate whose every knob is 0 (two of them differ in none)."""

    def __getattr__(self, name: str) -> int:
        return 0


def _ranked(prediction, plan) -> SimpleNamespace:
    """A stand-in for a ranked plan, enough for the explanation (its job: the number format it names)."""
    return SimpleNamespace(candidate=_SameKnobs(), prediction=prediction, job=plan)


def _layouts(rng: random.Random, count: int) -> list[tuple[dict, dict, Overlaps]]:
    """Random plans (model, parallel settings) and the overlaps their search group may turn on."""
    out = []
    while len(out) < count:
        moe = rng.random() < 0.5
        tp = rng.choice((1, 2, 4))
        parallel = {"tp": tp, "sp": tp > 1 and rng.random() < 0.5, "pp": rng.choice((1, 2, 4)),
                    "cp": rng.choice((1, 1, 2)), "recompute": rng.choice(("none", "selective", "full")),
                    "distributed_optimizer": rng.random() < 0.5,
                    "cp_comm_type": rng.choice(("p2p", "all_gather", "a2a"))}
        if moe:
            parallel["ep"] = rng.choice((1, 2, 4))
        tp_overlap = tp > 1 and parallel["sp"] and rng.random() < 0.5
        a2a = moe and parallel["ep"] > 1 and parallel["recompute"] == "none" and rng.random() < 0.7
        if a2a and parallel["pp"] > 1:
            parallel["vpp"] = 2  # the expert overlap needs the interleaved schedule
        out.append((MOE if moe else DENSE, parallel, Overlaps(tp=tp, tp_comm=tp_overlap, expert_a2a=a2a)))
    return out


def _floor(term: CostTerm, parts: PassCosts, moe: bool, overlaps: Overlaps) -> float:
    """A term's bound on one layer of a kind: its lanes in the layer's cost and what it adds per chunk."""
    return term.lower_bound(parts.moe if moe else parts.dense, overlaps) + sum(term.chunk_floor(parts, moe, overlaps))


def _check_bounds(model: dict, parallel: dict, overlaps: Overlaps, options: SimOptions | None = None
                  ) -> tuple[dict[str, float], PassCosts] | None:
    """Each term's bound on a rank's layers against its simulated share (the slowest rank's), and the group's
    per-layer bound against the terms' added up; the terms' per-layer floors and the pass costs, or ``None`` where
    the plan is refused."""
    try:
        plain = job(model, **parallel)
        overlapped = job(model, **parallel, tp_comm_overlap=overlaps.tp_comm, moe_a2a_overlap=overlaps.expert_a2a)
        parts = prepare_costs(plain, options=options)
        found = simulate(overlapped, options=options)
    except ConfigError:
        return None
    layers = model["num_layers"] // parallel["pp"]  # every stage holds as many (even split)
    m = found.num_microbatches
    if "num_experts" not in model:
        kinds = (False,)
    elif model.get("moe_first_dense_layers"):
        kinds = (False, True)  # a rank's layers cost at least the cheaper kind's
    else:
        kinds = (True,)
    floors = {term.name: min(_floor(term, parts, moe, overlaps) for moe in kinds) for term in TERMS}
    for term in TERMS:
        share = sum(found.time.seconds(lane.name) for lane in term.lanes if lane.placement is Placement.in_pass)
        assert m * layers * floors[term.name] <= share * (1 + 1e-9) + 1e-12, (term.name, model, parallel, overlaps)
    # the group's per-layer bound is the terms' bounds added up
    costs = group_costs(parts, overlaps, hidden=model["hidden_size"], shared_cores=False)
    assert costs.layer_s == pytest.approx(min(sum(_floor(term, parts, moe, overlaps) for term in TERMS)
                                              for moe in (False, True)))
    return floors, parts


def test_each_terms_lower_bound_stays_below_its_simulated_share() -> None:
    rng = random.Random(7)
    checked, seen, overlapped_any = 0, set(), False
    for model, parallel, overlaps in _layouts(rng, 24):
        found = _check_bounds(model, parallel, overlaps)
        if found is None:
            continue
        checked += 1
        overlapped_any |= overlaps.tp_comm or overlaps.expert_a2a
        seen.update(name for name, floor in found[0].items() if floor > 0)
    assert checked >= 12 and overlapped_any
    # the bounds that are not zero by construction were exercised
    assert {"compute", "recompute", "tensor_parallel", "context_parallel", "expert_dispatch", "host"} <= seen


def _host_cases(rng: random.Random, count: int) -> list[tuple[dict, dict, Overlaps, SimOptions, set[str]]]:
    """Random MoE plans of the host term's cases (model, parallel settings, overlaps, options, what they exercise):
    dropless, token-drop, drop-and-pad and all-gather dispatch, dense first layers, the combined 1F1B schedule of
    the expert overlap in a pipeline, CUDA graphs, grouped GEMM on and off, full recomputation, offloading."""
    out = []
    while len(out) < count:
        tags: set[str] = set()
        model = dict(MOE)
        dispatch = rng.choice(("dropless", "drop", "pad", "allgather"))
        tags.add(dispatch)
        if dispatch in ("drop", "pad"):
            model["moe_expert_capacity_factor"] = 1.0
            model["moe_pad_expert_input_to_capacity"] = dispatch == "pad"
        elif dispatch == "allgather":
            model["moe_token_dispatcher"] = "allgather"
        if rng.random() < 0.3:
            model["moe_first_dense_layers"] = 2
            tags.add("dense_layers")
        tp, pp = rng.choice((1, 2)), rng.choice((1, 2, 2))
        parallel = {"tp": tp, "sp": tp > 1, "pp": pp, "ep": rng.choice((2, 4)),
                    "recompute": rng.choice(("none", "none", "full", "selective"))}
        a2a = parallel["recompute"] == "none" and dispatch != "allgather" and rng.random() < 0.5
        if a2a and pp > 1:
            parallel["vpp"] = 2  # the combined 1F1B schedule over an interleaved pipeline
            tags.add("combined_1f1b")
        graphs = rng.choice(((None, None), ("transformer_engine", None), ("transformer_engine", "attn+moe_router"),
                             ("local", "full_iteration")))
        if graphs[0] is not None:
            parallel.update(cuda_graph_impl=graphs[0], cuda_graph_scope=graphs[1])
            tags.add("graphs")
        elif pp == 1 and parallel["recompute"] == "none" and rng.random() < 0.4:
            parallel["cpu_offloading_num_layers"] = 2
            tags.add("offload")
        grouped = rng.random() < 0.5
        tags.add("grouped_gemm" if grouped else "looped_experts")
        tags.add(f"recompute_{parallel['recompute']}")
        out.append((model, parallel, Overlaps(tp=tp, tp_comm=tp > 1 and rng.random() < 0.5, expert_a2a=a2a),
                    SimOptions(grouped_gemm=grouped), tags))
    return out


def test_the_host_terms_bound_stays_below_its_share_in_every_moe_case() -> None:
    """The host term's floor (each synchronising MoE layer's stretch, its recomputation's syncs) is at most what
    the simulator charges, whatever the dispatch, the schedule (the combined 1F1B one included: no schedule hides a
    sync), CUDA graphs, grouped GEMM or offloading; positive exactly where the layers synchronise."""
    host_term = next(term for term in TERMS if term.name == "host")
    covered: set[str] = set()
    for model, parallel, overlaps, options, tags in _host_cases(random.Random(11), 60):
        found = _check_bounds(model, parallel, overlaps, options)
        if found is None:
            continue
        host = found[1].host
        syncs = host.moe_sync_s > 0
        assert syncs == ("pad" not in tags and parallel.get("cuda_graph_scope") != "full_iteration")
        fb, rec = host_term.chunk_floor(found[1], True, overlaps)
        assert (fb >= host.moe_sync_s) if syncs else fb == 0.0
        assert rec == (host.moe_sync_s if syncs and parallel["recompute"] == "full" else 0.0)
        # a dense layer's launches share one maximum with its chunk's other layers: nothing per layer
        assert host_term.chunk_floor(found[1], False, overlaps) == (0.0, 0.0)
        covered |= tags | ({"syncs"} if syncs else set()) | ({"stretch_launches"} if fb > host.moe_sync_s else set())
        covered |= {"recompute_syncs"} if rec else set()
        covered |= {"combined_1f1b_syncs"} if syncs and "combined_1f1b" in tags else set()
    assert {"dropless", "drop", "pad", "allgather", "dense_layers", "combined_1f1b_syncs", "graphs", "offload",
            "grouped_gemm", "looped_experts", "syncs", "stretch_launches", "recompute_syncs"} <= covered, covered


def test_the_pair_of_bound_terms_is_each_overlap_settings_own() -> None:
    """A group that may overlap the expert all-to-all gets its bound terms with and without that overlap from one
    pass over its layer kinds (the terms that read no expert overlap counted once): each equals the bound terms of
    its own setting, to the bit, with the host's syncs (which read both overlaps)."""
    rng = random.Random(3)
    paired = 0
    for model, parallel, overlaps in _layouts(rng, 120):
        try:
            parts = prepare_costs(job(model, **parallel))
        except ConfigError:
            continue
        for tp_comm in (False, True):
            may = dataclasses.replace(overlaps, tp_comm=tp_comm and overlaps.tp > 1)
            with_a2a, without = group_costs_pair(parts, may, hidden=model["hidden_size"], shared_cores=False,
                                                 fixed_s=0.25)
            assert with_a2a == group_costs(parts, may, hidden=model["hidden_size"], shared_cores=False, fixed_s=0.25)
            if not may.expert_a2a:
                assert without is None
                continue
            plain = dataclasses.replace(may, expert_a2a=False)
            assert without == group_costs(parts, plain, hidden=model["hidden_size"], shared_cores=False,
                                          fixed_s=0.25)
            assert without.layer_s >= with_a2a.layer_s and without.kind_s[1] > with_a2a.kind_s[1]
            paired += 1
    assert paired >= 8


MEMORY_FIELDS = ("parameters", "gradients", "optimizer_states", "activations", "comm_buffers")


class FixedMemory(CostTerm):
    """A term that keeps a fixed number of bytes on every rank, in a category of its own or in a breakdown field."""

    name = "fixed_memory"

    def __init__(self, size: float, field: str = "") -> None:
        self.size = size
        self.stores = (MemoryCategory(name="fixed_bytes", label="fixed bytes", field=field),)

    def memory(self, stage: Stage) -> dict[str, float]:
        return {"fixed_bytes": self.size}


def test_every_memory_category_is_owned_by_exactly_one_term() -> None:
    owners: dict[str, list[str]] = {}
    for term in TERMS:
        for store in term.stores:
            owners.setdefault(store.name, []).append(term.name)
            assert store.field in MEMORY_FIELDS, (term.name, store)
    assert all(len(names) == 1 for names in owners.values()), owners
    # every field of the breakdown is made of the terms' categories
    assert {store.field for store in TERMS.stores()} == set(MEMORY_FIELDS)
    assert [f.name for f in dataclasses.fields(MemoryBreakdown)][:5] == list(MEMORY_FIELDS)
    # each concern owns its categories
    owner = {name: names[0] for name, names in owners.items()}
    assert owner["weights"] == owner["gradients"] == owner["optimizer_states"] == owner["fsdp_buffers"] == \
        "data_parallel"
    assert (owner["layer_activations"], owner["logits"]) == ("recompute", "compute")
    assert (owner["tp_buffers"], owner["cp_buffers"], owner["ep_buffers"], owner["pp_buffers"]) == (
        "tensor_parallel", "context_parallel", "expert_dispatch", "pipeline")


def test_a_registered_term_reaches_the_memory_breakdown_and_the_fit_check() -> None:
    plan = job(DENSE, tp=2, pp=2)
    before = simulate(plan)
    assert before.fits
    with TERMS.added(FixedMemory(3 * GIB)):
        memory = predict_memory(plan)
        found = simulate(plan)
    assert memory.other == 3 * GIB and dict(memory.parts)["fixed_bytes"] == 3 * GIB
    assert memory.total == pytest.approx(before.memory.total + 3 * GIB)
    assert found.memory.total == pytest.approx(memory.total)
    with TERMS.added(FixedMemory(1000 * GIB, field="activations")):  # more than an H100 holds
        over = simulate(plan)
    assert not over.fits
    assert over.memory.activations == pytest.approx(before.memory.activations + 1000 * GIB)
    # gone with the term
    assert simulate(plan).fits and "fixed_bytes" not in dict(predict_memory(plan).parts)


def test_each_terms_memory_is_what_the_simulator_reports_for_its_categories() -> None:
    rng = random.Random(5)
    checked, seen = 0, set()
    for model, parallel, overlaps in _layouts(rng, 30):
        draw = rng.random()
        options = SimOptions()
        if draw < 0.3:  # Megatron-FSDP: ZeRO-3 or ZeRO-2, stepped by the distributed optimizer
            parallel = {**parallel, "distributed_optimizer": True,
                        "fsdp": "optim_grads_params" if draw < 0.15 else "optim_grads"}
        try:
            plan = job(model, mb=rng.choice((1, 2)), **parallel, tp_comm_overlap=overlaps.tp_comm)
            found = simulate(plan, options=options)
            stages = memory_stages(plan, options=options)
        except ConfigError:
            continue
        checked += 1
        reported = found.memory
        parts = dict(reported.parts)
        peak = next(stage for stage in stages if stage.rank == reported.stage)
        for term in TERMS:
            own = term.memory(peak)
            assert set(own) == {store.name for store in term.stores}, term.name
            assert own == {store.name: parts[store.name] for store in term.stores}, (term.name, parallel)
            seen.update(name for name, size in own.items() if size > 0)
        # the fields are the categories added up, the peak the largest rank's
        for field in MEMORY_FIELDS:
            assert getattr(reported, field) == pytest.approx(
                sum(parts[store.name] for store in TERMS.stores() if store.field == field))
        assert reported.total == max(TERMS.memory(stage).total for stage in stages)
    assert checked >= 15
    assert {"weights", "gradients", "optimizer_states", "layer_activations", "logits", "tp_buffers", "cp_buffers",
            "ep_buffers", "pp_buffers", "fsdp_buffers"} <= seen
