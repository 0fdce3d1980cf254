"""Tensor memory of a training step, measured per rank (the reference the simulator's memory model is checked on)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.multirank import MultiRankRuns, case

pytestmark = pytest.mark.slow

COMMON = ["model=gpt_tiny", "train.steps=2", "train.memory_step=2", "train.global_batch_size=8",
          "train.micro_batch_size=2", "train.seq_length=64"]


def _memory(result) -> list[dict]:
    (event,) = [r for r in result.records if r.get("event") == "memory"]
    return event["ranks"]


def _params(result) -> int:
    (start,) = [r for r in result.records if r.get("event") == "start"]
    return int(start["params_on_rank0"])


def test_tracker_frees_leaf_inputs_and_their_gradients() -> None:
    """A module's leaf input (as a later pipeline stage receives its input: ``requires_grad``, no graph behind it)
    and its gradient are freed once the micro-batch's backward pass is done, under the step's tracker as without it.
    ``ModTracker``'s backward hooks held them in a reference cycle through C++, and a pipeline's last stage measured
    every micro-batch's input and input gradient at once (dp1 tp2 pp2 mb1 of gpt_tiny, 16 micro-batches: 475,136
    bytes, +29% on that stage)."""
    from cfp_megatron.engine.memory import tensor_tracker

    layer = torch.nn.Linear(64, 64)
    tracker = tensor_tracker()
    tracker.track_external(layer)
    inputs = []
    with tracker:
        before = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        for _ in range(4):
            x = torch.randn(32, 64, requires_grad=True)
            layer(x).sum().backward()
            assert x.grad is not None
            inputs.append(weakref.ref(x))
            del x
        layer.zero_grad(set_to_none=True)
        gc.collect()
        left = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"] - before
    assert all(ref() is None for ref in inputs)
    assert left < 32 * 64 * 4  # not even one input is left


SINGLE, TP2 = case(1, *COMMON), case(2, *COMMON, "parallel.tp=2")
BF16 = [*COMMON, "train.precision=bf16"]
BF16_GRADS = {fp32: case(1, *BF16, f"parallel.grad_reduce_in_fp32={str(fp32).lower()}") for fp32 in (False, True)}
"""The runs (cases of the multirank fixture's jobs, tests/multirank.py): a breakdown, measured on step 2."""


@pytest.mark.multirank(SINGLE, TP2)
def test_memory_breakdown_single_rank_and_tensor_parallel(multirank: MultiRankRuns) -> None:
    single = multirank[SINGLE]
    assert single.returncode == 0, single.output[-3000:]
    (one,) = _memory(single)
    params = _params(single)
    fp32 = 4 * params
    b = one["breakdown"]
    assert b["parameters"] == fp32  # weights (+ no buffers in gpt_tiny)
    assert b["gradients"] == fp32  # Megatron's contiguous main_grad buffer
    assert 2 * fp32 <= b["optimizer"] <= 2 * fp32 + 4096  # Adam's two moments (+ step counters)
    assert b["activations"] > 0

    tp = multirank[TP2]
    assert tp.returncode == 0, tp.output[-3000:]
    ranks = _memory(tp)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        # TP halves the layer weights; embeddings are vocab-parallel, norms replicated: well under the single rank
        assert r["breakdown"]["parameters"] == 4 * _params(tp)
        assert r["breakdown"]["parameters"] < 0.6 * b["parameters"]
        assert r["breakdown"]["activations"] < b["activations"]


@pytest.mark.multirank(*BF16_GRADS.values())
def test_bf16_gradients_without_fp32_reduction_halve_the_gradient_buffer(multirank: MultiRankRuns) -> None:
    """``parallel.grad_reduce_in_fp32=false`` reaches Megatron's DDP: its main_grad buffer is bf16, as the memory
    model predicts (and with the default, fp32)."""
    from cfp_megatron.base.compose import compose_job
    from cfp_megatron.sim.simulate import predict_memory

    for fp32_grads, c in BF16_GRADS.items():
        run = multirank[c]
        assert run.returncode == 0, run.output[-3000:]
        (one,) = _memory(run)
        params = _params(run)
        assert one["breakdown"]["parameters"] == 2 * params
        assert one["breakdown"]["gradients"] == (4 if fp32_grads else 2) * params
        predicted = predict_memory(compose_job(list(c.overrides)), world_size=1)
        assert predicted.gradients == one["breakdown"]["gradients"]
