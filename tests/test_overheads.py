"""The overheads round's records, what the ProfileDB derives from them, and how the simulator uses them (pure: no
process group)."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from cfp_megatron.base.config import Recompute, job_from_config
from cfp_megatron.cluster.measured import Collective, CollectiveFit, NothingMeasured, Span, StepOverheads
from cfp_megatron.profile.db import ProfileDB
from cfp_megatron.profile.fingerprint import Fingerprint
from cfp_megatron.profile.records import (
    CollectiveRecord,
    OverheadRecord,
    SegmentRecord,
    overhead_entry,
    segment_entry,
)
from cfp_megatron.profile.runner import rounds_needed
from cfp_megatron.profile.segments import micro_batches
from cfp_megatron.sim import SimOptions, simulate
from cfp_megatron.validate import load_preset

FP = Fingerprint(device_name="Test CPU", device_count=4, nodes=1, gpus_per_node=4, backend="gloo", torch="2.13.0",
                 megatron_core="0.16.1", cpu_cores=2)
EMB, HEAD, LAYER, EXTRA = 0.001, 0.002, 0.005, 0.0015
"""Embedding and head segments (forward + backward), one layer in the schedule, the schedule's cost per micro-batch."""


def _segments(partition: str = "tp1") -> list[SegmentRecord]:
    rows = []
    for mb in (1, 4):
        for kind, total in (("embedding", EMB), ("dense", 0.002), ("head", HEAD)):
            rows.append(SegmentRecord(model="m", model_name="gpt_tiny", segment=f"{kind}-id", kind=kind,
                                      partition=partition, tp=1, micro_batch=mb, seq_length=64,
                                      forward_s=mb * total / 2, backward_s=mb * total / 2, confirmed=True))
    return rows


def _probe(layers: int, mb: int, partition: str = "tp1", *, base: float = 0.004) -> OverheadRecord:
    per_micro = mb * (EMB + HEAD + layers * LAYER) + EXTRA
    params = 10_000 + layers * 5_000
    return OverheadRecord(model="m", partition=partition, tp=1, layers=layers, params=params, micro_batch=mb,
                          microbatches=4, schedule_s=4 * per_micro, rest_s=base + 1e-7 * params, finalize_s=0.003)


def _db() -> ProfileDB:
    probes = [_probe(layers, mb) for layers in (1, 2) for mb in (1, 4)]
    probes += [_probe(layers, mb, "tp2", base=0.009) for layers in (1, 2) for mb in (1, 4)]
    return ProfileDB(fingerprint=FP).merged(segments=_segments() + _segments("tp2"), overheads=probes)


def test_db_derives_layer_schedule_and_step_costs() -> None:
    ov = _db().step_overheads("tp1", 4)
    assert ov is not None
    assert ov.layer_s == pytest.approx(4 * LAYER)
    assert ov.per_microbatch_s == pytest.approx(EXTRA)
    assert ov.step_per_param_s == pytest.approx(1e-7)  # one slope for every partition
    assert ov.step_base_s == pytest.approx(0.004)
    assert _db().step_overheads("tp2", 1).step_base_s == pytest.approx(0.009)  # each partition its intercept
    between = _db().step_overheads("tp1", 2)  # interpolated between the measured sizes 1 and 4
    assert between.layer_s == pytest.approx(2 * LAYER)
    assert _db().step_overheads("tp4", 1) is None
    assert NothingMeasured().step_overheads("tp1", 1) is None


def test_overheads_round_trip_and_old_files_load() -> None:
    db = _db()
    again = ProfileDB.from_json(db.to_json())
    assert again.overheads == db.overheads
    old = db.to_json()
    del old["overheads"]  # written before the overheads round existed
    assert ProfileDB.from_json(old).overheads == ()
    newer = db.merged(overheads=[dataclasses.replace(_probe(1, 1), schedule_s=1.0)])
    assert len(newer.overheads) == len(db.overheads)  # same key replaced
    assert db.has_overheads("m", 1) and not db.has_overheads("m", 4)


def test_rounds_needed_asks_for_missing_probes() -> None:
    db = _db()
    one = {"overheads": [overhead_entry("tp1", layers, 1) for layers in (1, 2)]}
    assert "overheads" not in rounds_needed(db, "m", one, force=False)
    more = {"overheads": [*one["overheads"], overhead_entry("tp4", 1, 1), overhead_entry("tp4", 2, 1)]}
    # what a timed-out round kept is reused; only the probes it did not reach are measured
    assert rounds_needed(db, "m", more, force=False)["overheads"] == more["overheads"][2:]
    assert rounds_needed(db, "other", one, force=False)["overheads"] == one["overheads"]
    assert rounds_needed(db, "m", one, force=True)["overheads"] == one["overheads"]
    untimed = db.merged(overheads=[dataclasses.replace(_probe(1, 1), finalize_s=None)])  # written before it was timed
    assert rounds_needed(untimed, "m", one, force=False)["overheads"] == one["overheads"][:1]


def test_rounds_needed_asks_for_the_recomputed_layers_on_their_own() -> None:
    """A DB with the plain segments' memory still lacks the layers under selective and full recomputation: only the
    last round runs again, also where only one of them is stored; once both are, neither."""
    def dense(partition: str) -> SegmentRecord:
        return SegmentRecord(model="m", model_name="gpt_tiny", segment="dense-id", kind="dense", partition=partition,
                             tp=1, micro_batch=1, seq_length=64, forward_s=0.001, backward_s=0.002, confirmed=True,
                             activation_bytes=1e5, transient_bytes=1e4, workspace_bytes=0.0)

    planned = {"segments": [segment_entry("dense", "tp1", 1)],
               "recompute": [segment_entry("dense", "tp1-selective", 1), segment_entry("dense", "tp1-full", 1)]}
    plain = _db().merged(segments=[dense("tp1")])
    need = rounds_needed(plain, "m", planned, force=False)
    assert "recompute" in need and "segments" not in need
    selective = plain.merged(segments=[dense("tp1-selective")])  # a DB written before the full layer was profiled
    assert rounds_needed(selective, "m", planned, force=False)["recompute"] == [segment_entry("dense", "tp1-full", 1)]
    both = selective.merged(segments=[dense("tp1-full")])
    assert not {"segments", "recompute"} & set(rounds_needed(both, "m", planned, force=False))
    assert both.has_segments("m", 1, 1, recompute=Recompute.full)
    assert not both.has_segments("m", 1, 2, recompute=Recompute.selective)


def test_micro_batch_sizes_cover_the_powers_of_two_the_search_tries() -> None:
    assert micro_batches(_tiny(mb=2)) == [1, 2, 4, 8]
    assert micro_batches(_tiny(mb=1, gbs=2)) == [1, 2]


class _Measured(NothingMeasured):
    """Segments and step overheads, as a profiled local cluster has them."""

    def __init__(self, overheads: StepOverheads | None) -> None:
        self.overheads = overheads

    def segment_seconds(self, segment: str, partition: str, micro_batch: int) -> tuple[float, float] | None:
        return {"embedding": (0.001, 0.001), "dense": (0.002, 0.004), "head": (0.002, 0.001)}.get(segment)

    def step_overheads(self, partition: str, micro_batch: int) -> StepOverheads | None:
        return self.overheads


TINY = {"name": "gpt_tiny", "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 256, "num_attention_heads": 4,
        "vocab_size": 257, "max_position_embeddings": 256}


def _tiny(cluster: dict | None = None, **parallel):
    train = {"global_batch_size": parallel.pop("gbs", 16), "micro_batch_size": parallel.pop("mb", 2),
             "seq_length": 64}
    return job_from_config({"model": TINY, "cluster": cluster or {**load_preset("local"), "gpus_per_node": 4},
                            "parallel": parallel, "train": train})


def test_simulator_uses_the_measured_step() -> None:
    job = _tiny(tp=1, pp=1)
    ov = StepOverheads(partition="tp1", micro_batch=2, layer_s=0.012, per_microbatch_s=0.003, step_base_s=0.005,
                       step_per_param_s=1e-8)
    plain = simulate(job, measurements=_Measured(None), world_size=4)
    measured = simulate(job, measurements=_Measured(ov), world_size=4)
    mbs = plain.num_microbatches
    # each layer costs 12 ms instead of its 6 ms segment, plus 3 ms per micro-batch
    assert measured.time.forward_compute_s + measured.time.backward_compute_s == pytest.approx(
        plain.time.forward_compute_s + plain.time.backward_compute_s + mbs * 4 * 0.006)
    assert measured.time.overhead_s == pytest.approx(plain.time.overhead_s + mbs * 0.003)
    params = 4 * 12 * 64 * 64 + 4 * 13 * 64  # weights of the four layers (and their biases, norms), approximately
    assert measured.time.optimizer_s > 0.005 + 1e-8 * params * 0.9
    # the embedding and head run 2 ms faster per micro-batch in the schedule than alone (their 6 ms scaled)
    faster = simulate(job, measurements=_Measured(dataclasses.replace(ov, ends_s=-0.002)), world_size=4)
    assert faster.step_time_s == pytest.approx(measured.step_time_s - mbs * 0.002)
    # off with use_measured_segments, and presets have nothing measured
    off = simulate(job, measurements=_Measured(ov), world_size=4, options=SimOptions(use_measured_segments=False))
    assert off.step_time_s == pytest.approx(simulate(job, world_size=4,
                                                     options=SimOptions(use_measured_segments=False)).step_time_s)


class _Checkpointed(_Measured):
    """As :class:`_Measured`, with the dense layer also timed under recomputation (``tp1-selective``,
    ``tp1-full``) at three sizes: 25% slower than the plain layer at two of them, seven times as slow at the third
    (one slow timing on a busy machine)."""

    def segment_seconds(self, segment: str, partition: str, micro_batch: int) -> tuple[float, float] | None:
        if not partition.endswith(("-selective", "-full")):
            return super().segment_seconds(segment, partition, micro_batch)
        if segment != "dense":
            return None
        return (0.02, 0.02) if micro_batch == 4 else (0.002, 0.0055)

    def segment_micro_batches(self, segment: str, partition: str) -> tuple[int, ...]:
        return (1, 2, 4) if segment == "dense" else ()


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_costs_what_the_profiled_checkpointed_layer_adds(recompute: str) -> None:
    """Under recomputation each layer's recomputation costs the median share the recompute round's layer took
    beyond the plain one (25%: the slow third size passed over), of the layer as it runs in the schedule (12 ms
    there against its 6 ms segment: 3 ms per layer and micro-batch); without that round's layer, the analytical
    share of the forward pass (selective: the attention core's, a sliver; full: the whole forward, 4 ms)."""
    ov = StepOverheads(partition="tp1", micro_batch=2, layer_s=0.012, per_microbatch_s=0.003, step_base_s=0.005,
                       step_per_param_s=1e-8)
    plain = simulate(_tiny(tp=1, pp=1), measurements=_Checkpointed(ov), world_size=4)
    again = simulate(_tiny(tp=1, pp=1, recompute=recompute), measurements=_Checkpointed(ov), world_size=4)
    mbs = again.num_microbatches
    assert plain.time.recompute_s == 0.0
    assert again.time.recompute_s == pytest.approx(mbs * 4 * 0.25 * 0.012)
    assert again.step_time_s == pytest.approx(plain.step_time_s + mbs * 4 * 0.25 * 0.012)
    unprofiled = simulate(_tiny(tp=1, pp=1, recompute=recompute), measurements=_Measured(ov), world_size=4)
    if recompute == "selective":
        assert 0.0 < unprofiled.time.recompute_s < 0.1 * again.time.recompute_s
    else:  # the forward's third of the 12 ms layer (its 2 ms of the 6 ms segment)
        assert unprofiled.time.recompute_s == pytest.approx(mbs * 4 * 0.004)


class _Alternated(_Checkpointed):
    """As :class:`_Checkpointed`, with the plain layer timed again alternately with the recomputed one at each size:
    5 ms there, against the segments round's 6 ms (the machine's speed drifted between the rounds)."""

    def segment_baseline_seconds(self, segment: str, partition: str, micro_batch: int) -> float | None:
        return 0.005 if segment == "dense" and partition.endswith(("-selective", "-full")) else None


def test_the_share_is_taken_against_the_plain_layer_timed_beside_it() -> None:
    """The recompute round's own plain timing of each size, not the segments round's, is the base of the share:
    7.5 ms over 5 ms is 50% (25% against the segments round's 6 ms); the seven-fold size still passed over."""
    from cfp_megatron.sim.measured_segments import recompute_share

    assert recompute_share(_Checkpointed(None), "dense", "tp1", "tp1-full") == pytest.approx(0.25)
    assert recompute_share(_Alternated(None), "dense", "tp1", "tp1-full") == pytest.approx(0.5)
    assert recompute_share(NothingMeasured(), "dense", "tp1", "tp1-full") is None


def test_the_schedule_cost_per_micro_batch_falls_on_the_pipeline_ends() -> None:
    """The probes' cost per micro-batch beyond the segments is charged to the stages with the embedding and the
    head: over four stages the step grows by about the micro-batches times it, not by (micro-batches + 3) times
    it as it would if every stage paid it."""
    job = _tiny(tp=1, pp=4)
    ov = StepOverheads(partition="tp1", micro_batch=2, layer_s=0.006, per_microbatch_s=0.0, step_base_s=0.0,
                       step_per_param_s=0.0)
    extra = 0.010
    base = simulate(job, measurements=_Measured(ov), world_size=4)
    more = simulate(job, measurements=_Measured(dataclasses.replace(ov, per_microbatch_s=extra)), world_size=4)
    m = base.num_microbatches
    grown = more.step_time_s - base.step_time_s
    assert m * extra - 1e-9 <= grown <= (m + 1) * extra + 1e-9 < (m + 3) * extra
    assert more.time.overhead_s == pytest.approx(m * extra)  # the critical (an end) stage's share


def test_pipeline_adds_the_tied_embedding_all_reduce() -> None:
    ov = StepOverheads(partition="tp1", micro_batch=2, layer_s=0.006, per_microbatch_s=0.0, step_base_s=0.0,
                       step_per_param_s=0.0)
    with_pp = simulate(_tiny(tp=1, pp=2), measurements=_Measured(ov), world_size=4)
    without = simulate(_tiny(tp=1, pp=2), measurements=_Measured(None), world_size=4)
    # each on its own lane: the tied embedding's all-reduce always, the token count's syncs on a profiled cluster
    assert with_pp.time.embedding_sync_s > 0 and without.time.embedding_sync_s > 0
    assert with_pp.time.token_sync_s > 0 == without.time.token_sync_s
    assert with_pp.time.dp_comm_s == without.time.dp_comm_s


def test_presets_are_untouched() -> None:
    preset = _tiny(cluster={**load_preset("dgx_h100"), "gpus_per_node": 4})
    assert simulate(preset, measurements=NothingMeasured(), world_size=4).step_time_s == pytest.approx(
        simulate(preset, world_size=4).step_time_s)


def test_the_host_is_charged_unless_measured_layer_times_hold_it() -> None:
    """A probe's timing holds the host's launches (sim/terms/host): measured layer times leave them out, while
    measurements that time no layer of the plan (a preset's) leave them charged."""
    preset = _tiny(cluster={**load_preset("dgx_h100"), "gpus_per_node": 4})
    assert simulate(preset, measurements=NothingMeasured(), world_size=4).time.host_s > 0
    assert simulate(preset, measurements=_db(), world_size=4).time.host_s == 0.0


def test_measured_segments_use_the_sizes_profiling_timed() -> None:
    """Profiling times the job's own micro-batch (and twice it): a DB measured at 5 and 10 interpolates 7."""
    from cfp_megatron.sim.measured_segments import measured_pass

    rows = [SegmentRecord(model="m", model_name="gpt_tiny", segment="dense-id", kind="dense", partition="tp1", tp=1,
                          micro_batch=mb, seq_length=64, forward_s=0.001 * mb, backward_s=0.002 * mb, confirmed=True)
            for mb in (5, 10)]
    db = ProfileDB(fingerprint=FP).merged(segments=rows)
    assert db.segment_micro_batches("dense", "tp1") == (5, 10)
    assert measured_pass(db, "dense", "tp1", 7) == pytest.approx((0.007, 0.014))


def test_a_rest_falling_below_zero_goes_to_the_embedding_and_head() -> None:
    """Where the probes' schedule beyond their layers falls short of the isolated embedding and head (here by
    1 ms per sequence past 1.5 ms), the line through the sizes keeps its sign: the schedule's own cost per
    micro-batch stays at zero or above and the shortfall comes off the embedding and head, so the probe's own
    micro-batch is reproduced, and a stage without them is not charged a negative cost."""
    sizes = (1, 2, 4)

    def rest(mb: int) -> float:
        return EXTRA - 0.001 * mb

    segments = [SegmentRecord(model="m", model_name="gpt_tiny", segment=f"{kind}-id", kind=kind, partition="tp1",
                              tp=1, micro_batch=mb, seq_length=64, forward_s=mb * total / 2,
                              backward_s=mb * total / 2, confirmed=True)
                for mb in sizes for kind, total in (("embedding", EMB), ("dense", 0.002), ("head", HEAD))]
    probes = [OverheadRecord(model="m", partition="tp1", tp=1, layers=layers, params=10_000, micro_batch=mb,
                             microbatches=4, schedule_s=4 * (mb * (EMB + HEAD + layers * LAYER) + rest(mb)),
                             rest_s=0.004) for layers in (1, 3) for mb in sizes]
    db = ProfileDB(fingerprint=FP).merged(segments=segments, overheads=probes)
    low, high = db.step_overheads("tp1", 1), db.step_overheads("tp1", 4)
    assert low.per_microbatch_s == pytest.approx(rest(1)) and low.ends_s == 0.0
    assert high.per_microbatch_s == 0.0 and high.ends_s == pytest.approx(rest(4))
    assert 4 * (EMB + HEAD) + high.ends_s + 3 * high.layer_s + high.per_microbatch_s == pytest.approx(
        4 * (EMB + HEAD + 3 * LAYER) + rest(4))


def test_the_per_token_losss_token_count_collectives_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the per-token loss Megatron's finalize_model_grads broadcasts the step's token count over the pipeline
    group and all-reduces it over DP x CP; the probes time finalize_model_grads out of their schedule, so the
    simulator adds both (one number each: their latency) on a profiled cluster."""
    from cfp_megatron.sim.layout import build_layout
    from cfp_megatron.sim.pass_costs import collective_costs
    from cfp_megatron.sim.terms.data_parallel import token_count_sync as _token_count_sync

    ov = StepOverheads(partition="tp1", micro_batch=2, layer_s=0.006, per_microbatch_s=0.0, step_base_s=0.0,
                       step_per_param_s=0.0)
    dp4, dp2_pp2, tp4 = _tiny(tp=1, pp=1), _tiny(tp=1, pp=2), _tiny(tp=4, pp=1)
    costs = collective_costs(dp4.cluster, _Measured(ov))
    reduce4 = _token_count_sync(costs, build_layout(dp4, 4))
    assert reduce4 > 0
    assert _token_count_sync(costs, build_layout(tp4, 4)) == 0.0  # one data-parallel rank, one stage: nothing
    assert _token_count_sync(costs, build_layout(dp2_pp2, 4)) > _token_count_sync(costs, build_layout(
        _tiny(tp=2, pp=1), 4))  # the pipeline's broadcast on top of the DP=2 all-reduce
    measured = simulate(dp4, measurements=_Measured(ov), world_size=4)
    monkeypatch.setattr(sys.modules["cfp_megatron.sim.terms.data_parallel"], "token_count_sync",
                        lambda costs, layout: 0.0)
    without = simulate(dp4, measurements=_Measured(ov), world_size=4)
    assert measured.step_time_s - without.step_time_s == pytest.approx(reduce4)  # on the step, once
    assert measured.time.token_sync_s - without.time.token_sync_s == pytest.approx(reduce4)


def test_the_gradient_finalisation_is_scaled_as_the_probes_timed_it() -> None:
    """The probes time finalize_model_grads inside their steps: twice what the DB's all-reduce fit gives for the same
    messages (their fp32 gradients and the token count over DP=4) is a share of 2, which doubles the plan's gradient
    sync; without timed probes or without a fit the share is 1."""
    fit = CollectiveFit(op=Collective.all_reduce, group_size=4, span=Span.intra_node, latency_s=1e-3,
                        bandwidth_bytes_per_s=1e8)
    timed = [dataclasses.replace(r, finalize_s=2 * (fit.seconds(4.0 * r.params) + fit.seconds(4.0)))
             for r in _db().overheads]
    with_fit = _db().merged(collectives=[CollectiveRecord(fit=fit, samples=(), pattern="contiguous")])
    assert with_fit.merged(overheads=timed).step_overheads("tp1", 4).finalize_share == pytest.approx(2.0)
    assert _db().merged(overheads=timed).step_overheads("tp1", 4).finalize_share == 1.0  # no fit to compare with
    untimed = [dataclasses.replace(r, finalize_s=None) for r in _db().overheads]
    assert with_fit.merged(overheads=untimed).step_overheads("tp1", 4).finalize_share == 1.0

    job = _tiny(tp=1, pp=1)
    ov = StepOverheads(partition="tp1", micro_batch=2, layer_s=0.006, per_microbatch_s=0.0, step_base_s=0.0,
                       step_per_param_s=0.0)
    base = simulate(job, measurements=_Measured(ov), world_size=4).time.dp_comm_s
    doubled = simulate(job, measurements=_Measured(dataclasses.replace(ov, finalize_share=2.0)),
                       world_size=4).time.dp_comm_s
    assert base > 0 and doubled == pytest.approx(2 * base)


class _MeasuredMoe(_Measured):
    """:class:`_Measured` for a MoE model: its decoder layers are ``moe`` segments (timed without EP)."""

    def segment_seconds(self, segment: str, partition: str, micro_batch: int) -> tuple[float, float] | None:
        return super().segment_seconds("dense" if segment == "moe" else segment, partition, micro_batch)


def test_a_moe_model_uses_the_measured_step_with_its_expert_exchange_beside_it() -> None:
    """A MoE model of one layer kind runs its layers at the probes' in-schedule time, as a dense model does; with
    EP the token exchange (which the probes, without EP, did not run) is added from the model, on top of the same
    measured layer; a model with dense layers first (two kinds, one probe time) keeps its segments."""
    moe = {**TINY, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 128, "add_bias_linear": False}

    def job(ep: int = 1, etp: int = 1, **model):
        return job_from_config({"model": {**moe, **model}, "cluster": {**load_preset("local"), "gpus_per_node": 4},
                                "parallel": {"ep": ep, "etp": etp},
                                "train": {"global_batch_size": 16, "micro_batch_size": 2, "seq_length": 64}})

    ov = StepOverheads(partition="tp1", micro_batch=2, layer_s=0.012, per_microbatch_s=0.003, step_base_s=0.005,
                       step_per_param_s=1e-8)
    plain = simulate(job(), measurements=_MeasuredMoe(None), world_size=4)
    measured = simulate(job(), measurements=_MeasuredMoe(ov), world_size=4)
    mbs = plain.num_microbatches
    assert measured.time.forward_compute_s + measured.time.backward_compute_s == pytest.approx(
        plain.time.forward_compute_s + plain.time.backward_compute_s + mbs * 4 * 0.006)
    assert measured.time.ep_comm_s == 0
    ep2 = simulate(job(ep=2), measurements=_MeasuredMoe(ov), world_size=4)
    assert ep2.time.forward_compute_s == pytest.approx(measured.time.forward_compute_s)
    assert ep2.time.ep_comm_s > 0
    assert ep2.time.ep_comm_s == pytest.approx(simulate(job(ep=2), measurements=_MeasuredMoe(None),
                                                        world_size=4).time.ep_comm_s)
    # Expert TP without EP: its gathers and the count exchange are none of the probes' time either.
    assert simulate(job(etp=2), measurements=_MeasuredMoe(ov), world_size=4).time.ep_comm_s > 0
    mixed = {"moe_first_dense_layers": 1}
    assert simulate(job(**mixed), measurements=_MeasuredMoe(ov), world_size=4).step_time_s == pytest.approx(
        simulate(job(**mixed), measurements=_MeasuredMoe(None), world_size=4).step_time_s)
