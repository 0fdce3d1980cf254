"""The memory of PyTorch's eager ``loss_parallel`` cross entropy (torchtitan under TP without a compiled loss),
measured on CPU from the allocator's events against :data:`~cfp_megatron.sim.memory.EAGER_LOSS_PARALLEL_BYTES`
(docs/simulator.md, the memory section)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import ProfilerActivity, profile

from cfp_megatron.sim.memory import EAGER_LOSS_PARALLEL_BYTES, EAGER_TORCH_CE_BYTES, loss_bytes_per_logit

TOKENS, VOCAB, HIDDEN = 512, 2048, 16


def _peak_bytes(step, trace: Path) -> float:
    """Bytes allocated at the peak of ``step`` over what was allocated when it began (CPU allocator events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    prof.export_chrome_trace(str(trace))
    events = [e["args"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    start = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - start


def test_eager_loss_parallel_peaks_at_sixteen_bytes_a_logit_in_its_backward(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        weight = distribute_tensor(torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16), mesh, [Shard(0)])
        weight.requires_grad_()
        hidden = distribute_tensor(torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16), mesh, [Replicate()])
        labels = distribute_tensor(torch.randint(0, VOCAB, (TOKENS,)), mesh, [Replicate()])

        def step() -> None:  # torchtitan's step: bf16 logits split over the vocabulary, freed before the backward
            pred = torch.matmul(hidden, weight.t())
            with loss_parallel():
                loss = F.cross_entropy(pred.float(), labels)
                del pred
                loss.backward()

        step()  # the first step makes the weight's gradient, which the measured one overwrites
        weight.grad = None
        measured = _peak_bytes(step, tmp_path / "trace.json") / (TOKENS * VOCAB)
    finally:
        dist.destroy_process_group()
    assert measured == pytest.approx(EAGER_LOSS_PARALLEL_BYTES, rel=0.02)
    # saved log-softmax, the zeroed gradient, grad_input + exp(x) and its product with the loss's gradient
    assert EAGER_LOSS_PARALLEL_BYTES == 4 + 4 + 4 + 4
    assert loss_bytes_per_logit(2.0, eager_torch=True, loss_parallel=True) == 16.0
    assert loss_bytes_per_logit(2.0, 1, eager_torch=True, loss_parallel=True) == 32.0
    assert loss_bytes_per_logit(2.0, eager_torch=True) == EAGER_TORCH_CE_BYTES
