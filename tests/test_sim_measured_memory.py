"""Activation memory from profiled segments (CFP): interpolation, the stage's peak under the schedule, the pipeline's
buffers, the ProfileDB round trip, and the static parts of the memory model. Pure: no process group."""

from __future__ import annotations

import dataclasses

import pytest

from cfp_megatron.base.config import job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.cluster.measured import NothingMeasured, SegmentMemory
from cfp_megatron.profile.db import ProfileDB
from cfp_megatron.profile.fingerprint import Fingerprint
from cfp_megatron.profile.records import SegmentRecord
from cfp_megatron.sim import simulate
from cfp_megatron.sim.measured_memory import (
    interpolate,
    measured_memory,
    peak_activation_bytes,
    pipeline_buffers,
)
from cfp_megatron.sim.memory import in_flight
from cfp_megatron.sim.options import options_here
from cfp_megatron.validate import load_preset

FP = Fingerprint(device_name="Test CPU", device_count=4, nodes=1, gpus_per_node=4, backend="gloo", torch="2.13.0",
                 megatron_core="0.16.1", cpu_cores=2)


def mem(a: float, t: float = 0.0, w: float = 0.0) -> SegmentMemory:
    return SegmentMemory(activation_bytes=a, transient_bytes=t, workspace_bytes=w)


def test_interpolates_between_and_beyond_measured_sizes() -> None:
    points = [(1, mem(100, 10, 4)), (4, mem(400, 40, 16))]
    assert interpolate(points, 4) == points[1][1]
    mid = interpolate(points, 2)
    assert (mid.activation_bytes, mid.transient_bytes, mid.workspace_bytes) == pytest.approx((200, 20, 8))
    far = interpolate(points, 8)  # extrapolated from the two largest
    assert far.activation_bytes == pytest.approx(800)
    one = interpolate([(2, mem(50, 6, 2))], 4)  # one size: proportional
    assert (one.activation_bytes, one.transient_bytes, one.workspace_bytes) == pytest.approx((100, 12, 4))
    falling = interpolate([(2, mem(10)), (4, mem(100))], 1)  # never below zero
    assert falling.activation_bytes == 0.0
    with pytest.raises(ConfigError):
        interpolate([], 2)
    with pytest.raises(ConfigError):
        interpolate(points, 0)


def test_peak_holds_all_in_flight_micro_batches_and_the_worst_transient() -> None:
    emb, layer, head = mem(10, 50), mem(100, 30, 64), mem(40, 5)
    # One micro-batch: the peak is at the head (10 + 2*100 + 40 + 5 = 255) vs the embedding (10 + 50), plus the
    # workspace once.
    assert peak_activation_bytes([emb, layer, layer, head], 1) == pytest.approx(255 + 64)
    # Three in flight: two more full micro-batches (250 each).
    assert peak_activation_bytes([emb, layer, layer, head], 3) == pytest.approx(2 * 250 + 255 + 64)
    # A big transient early in the stage can set the peak.
    assert peak_activation_bytes([mem(10, 1000), layer], 1) == pytest.approx(1010 + 64)
    assert peak_activation_bytes([], 2) == 0.0
    with pytest.raises(ConfigError):
        peak_activation_bytes([layer], 0)


def test_pipeline_buffers_follow_megatrons_schedule() -> None:
    h = 8.0
    assert pipeline_buffers(h, pp=1, first=True, last=True, in_flight=1, microbatches=4) == 0.0
    # First stage: outputs freed after sending (deallocate_pipeline_outputs), one received output gradient.
    assert pipeline_buffers(h, pp=4, first=True, last=False, in_flight=4, microbatches=8) == pytest.approx(-3 * h)
    # Middle stage: received inputs replace the freed outputs; plus the output gradient.
    assert pipeline_buffers(h, pp=4, first=False, last=False, in_flight=3, microbatches=8) == pytest.approx(h)
    # Last stage: its received input and the previous micro-batch's input gradient.
    assert pipeline_buffers(h, pp=4, first=False, last=True, in_flight=1, microbatches=8) == pytest.approx(2 * h)
    assert pipeline_buffers(h, pp=4, first=False, last=True, in_flight=1, microbatches=1) == pytest.approx(h)


def test_in_flight_micro_batches_of_1f1b() -> None:
    assert [in_flight(r, 4, 1, 8) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight(r, 4, 1, 2) for r in range(4)] == [2, 2, 2, 1]
    assert in_flight(0, 1, 1, 8) == 1
    assert in_flight(0, 4, 2, 8) > in_flight(0, 4, 1, 8)
    # interleaved: Megatron-Core's warm-up, (pp - rank - 1) * 2 + (vpp - 1) * pp chunk micro-batches, and the one
    # whose forward runs before the first backward (schedules.py, forward_backward_pipelining_with_interleaving)
    assert [in_flight(r, 4, 2, 8) for r in range(4)] == [11, 9, 7, 5]


def _record(kind: str, mb: int, **memory: float) -> SegmentRecord:
    return SegmentRecord(model="abc", model_name="gpt_tiny", segment=f"id-{kind}", kind=kind, partition="tp1", tp=1,
                         micro_batch=mb, seq_length=64, forward_s=0.01, backward_s=0.02, confirmed=True, **memory)


def test_segment_records_keep_memory_and_read_old_json() -> None:
    new = _record("dense", 2, activation_bytes=2e5, transient_bytes=5e4, workspace_bytes=1e4)
    assert SegmentRecord.from_json(new.to_json()) == new
    old = new.to_json()
    for key in ("activation_bytes", "transient_bytes", "workspace_bytes"):
        del old[key]
    assert SegmentRecord.from_json(old).activation_bytes is None  # written before memory was measured
    db = ProfileDB(fingerprint=FP).merged(segments=[new, SegmentRecord.from_json({**old, "micro_batch": 4})])
    db = ProfileDB.from_json(db.to_json())
    assert db.segment_memory("dense", "tp1", 2) == mem(2e5, 5e4, 1e4)
    assert db.segment_memory("id-dense", "tp1", 2) == mem(2e5, 5e4, 1e4)
    assert db.segment_memory("dense", "tp1", 4) is None  # times only
    assert db.has_segments("abc", 1, 2) and not db.has_segments("abc", 1, 4)
    assert measured_memory(db, "dense", "tp1", 6).activation_bytes == pytest.approx(6e5)
    assert measured_memory(db, "dense", "tp2", 2) is None
    assert NothingMeasured().segment_memory("dense", "tp1", 2) is None


def _tiny(**parallel: object):
    model = {"name": "gpt_tiny", "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 256,
             "num_attention_heads": 4, "vocab_size": 257, "max_position_embeddings": 256}
    train = {"global_batch_size": 16, "micro_batch_size": parallel.pop("mb", 1), "seq_length": 64}
    return job_from_config({"model": model, "cluster": {**load_preset("local"), "gpus_per_node": 4},
                            "parallel": parallel, "train": train})


def test_static_memory_counts_every_parameter_in_the_runtime_precision() -> None:
    # gpt_tiny (biases, learned positions, tied embeddings, vocabulary 257 padded to 384) in fp32 on CPU, as the
    # runtime's MemTracker counts it: 241,024 parameters x 4 bytes; gradients 4 bytes; Adam 8 bytes.
    whole = simulate(_tiny(), world_size=4).memory
    assert whole.parameters == 241_024 * 4 and whole.gradients == 241_024 * 4
    assert whole.optimizer_states == 241_024 * 8
    # The analytical peak: the first stage (four micro-batches in flight, fp32 activations; the last stage's fp32
    # loss keeps 4 bytes a logit, less than three more micro-batches).
    first = simulate(_tiny(pp=4, mb=8), world_size=4).memory
    assert first.stage == 0 and first.parameters == 90_944 * 4  # the word and position embeddings, a layer


def test_measured_segments_replace_the_analytical_activations() -> None:
    seg = [_record("embedding", 1, activation_bytes=1e3, transient_bytes=5e3),
           _record("dense", 1, activation_bytes=3e5, transient_bytes=1e5, workspace_bytes=6e4),
           _record("head", 1, activation_bytes=1e5, transient_bytes=1e5)]
    db = ProfileDB(fingerprint=FP).merged(segments=seg).for_model("abc")
    job = _tiny()
    # Priced as the planner prices a profiled CPU plan: the options the runtime builds there (no Transformer Engine
    # placeholders for the weight gradients: comm_buffers stays empty).
    here = options_here(job.cluster)
    measured = simulate(job, measurements=db, world_size=4, options=here).memory
    # PP=1: one micro-batch in flight; the peak is at the head's backward; the workspace once.
    assert measured.activations == pytest.approx(1e3 + 4 * 3e5 + 1e5 + 1e5 + 6e4)
    assert measured.comm_buffers == 0.0
    analytical = simulate(job, world_size=4).memory
    assert analytical.activations != measured.activations
    assert measured.parameters == analytical.parameters
    # Full recomputation (uniform, one layer per unit): each layer keeps only its output (mb 1 x seq 64 x hidden 64,
    # fp32) and runs its forward again in the backward pass; the peak is the last layer's backward: the embedding's
    # bytes, four layers' outputs (the last one's the input of the head), the layer's own activations made anew (its
    # output among them) and transient, the workspace, and the head's gradient of the tied word embeddings (384 x 64,
    # fp32), which autograd holds until the embedding's backward pass adds its own.
    hidden = 64 * 64 * 4
    tied = 384 * 64 * 4
    full = simulate(_tiny(recompute="full"), measurements=db, world_size=4).memory
    assert full.activations == pytest.approx(1e3 + 4 * hidden + 3e5 + 1e5 + tied + 6e4)
    # Two layers per unit keep two outputs fewer; the second unit's backward holds both its layers again.
    pairs = simulate(_tiny(recompute="full", recompute_num_layers=2), measurements=db, world_size=4).memory
    assert pairs.activations == pytest.approx(1e3 + 2 * hidden + 2 * 3e5 + 1e5 + tied + 6e4)
    # Untied, the head's weight gradient is accumulated (and freed) in the head's backward pass.
    untied = dataclasses.replace(_tiny(recompute="full"), model=dataclasses.replace(_tiny().model,
                                                                                   tie_embeddings=False))
    assert simulate(untied, measurements=db, world_size=4).memory.activations == pytest.approx(
        1e3 + 4 * hidden + 3e5 + 1e5 + 6e4)
    # The block method recomputes the first layer only; the other three keep their activations.
    block = simulate(_tiny(recompute="full", recompute_method="block", recompute_num_layers=1), measurements=db,
                     world_size=4).memory
    assert block.activations == pytest.approx(1e3 + hidden + 3 * 3e5 + 1e5 + 1e5 + 6e4)
    # Selective recomputation reads the decoder layer profiled under it (tp1-selective), the embedding and the head
    # as profiled without it; with no such record the analytical model stands.
    selective = _tiny(recompute="selective")
    assert simulate(selective, measurements=db, world_size=4).memory == simulate(selective, world_size=4).memory
    checkpointed = dataclasses.replace(_record("dense", 1, activation_bytes=2e5, transient_bytes=1.5e5,
                                               workspace_bytes=6e4), partition="tp1-selective")
    with_selective = ProfileDB(fingerprint=FP).merged(segments=[*seg, checkpointed]).for_model("abc")
    # Its peak: the last layer's backward pass (its larger transient, and the tied embeddings' head gradient).
    assert simulate(selective, measurements=with_selective, world_size=4).memory.activations == pytest.approx(
        1e3 + 4 * 2e5 + 1.5e5 + tied + 6e4)
    assert simulate(job, measurements=with_selective, world_size=4, options=here).memory == measured  # tp1
