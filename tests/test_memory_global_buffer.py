"""Megatron-Core's global memory buffer against :func:`~cfp_megatron.sim.memory.global_buffer_bytes`, measured on
two gloo ranks: a real ``GPTModel`` (llama_tiny, 2 layers, TP 2, fp32, local spec, unfused core) runs forward and
backward passes with and without sequence parallelism, and the buffer it holds afterwards is read from
``parallel_state`` (docs/simulator.md, "Sequence parallelism's buffers")."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.config import AttentionKernel, JobSpec
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.memory import global_buffer_bytes
from cfp_megatron.sim.options import SimOptions

SHAPES = {"scores_larger": ("train.seq_length=128",),
          "gather_larger": ("train.seq_length=64", "model.hidden_size=256", "model.ffn_hidden_size=512")}
"""Two shapes: the unfused core's ``[b x heads / tp, s, s]`` request above SP's ``[tokens, hidden]``, and below it."""


def _job(shape: str, sp: bool) -> JobSpec:
    return compose_job(["model=llama_tiny", "model.num_layers=2", "cluster=local", "cluster.gpus_per_node=2",
                        "parallel.tp=2", f"parallel.sp={str(sp).lower()}", "train.micro_batch_size=2",
                        "train.global_batch_size=2", *SHAPES[shape]])


def _rank(rank: int, store: str, out: str) -> None:
    """Each case's global buffer after two training passes, as ``{name, dtype: bytes}`` (rank 0 writes them)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    from cfp_megatron.base.parallel_dims import ParallelDims
    from cfp_megatron.compat.cpu import install_if_needed
    from cfp_megatron.engine.distributed import model_groups
    from cfp_megatron.engine.model import build_model_chunks
    from cfp_megatron.model.megatron_config import transformer_config
    from cfp_megatron.profile.segments import init_probe_groups

    install_if_needed()
    found: dict[str, dict[str, int]] = {}
    for shape in SHAPES:
        for sp in (False, True):
            job = _job(shape, sp)
            dims = ParallelDims.build(job, 2, te_available=False)
            init_probe_groups(dims, job.train.seed)
            parallel_state._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()  # this case's requests alone
            (gpt,) = build_model_chunks(job, transformer_config(job, dims, on_gpu=False), dims, model_groups())
            seq, micro_batch = job.train.seq_length, job.train.micro_batch_size
            tokens = torch.randint(0, job.model.vocab_size, (micro_batch, seq))
            positions = torch.arange(seq).unsqueeze(0).expand(micro_batch, seq)
            for _ in range(2):
                gpt(tokens, positions, None, labels=tokens).sum().backward()
            held = parallel_state.get_global_memory_buffer().buffer
            found[f"{shape}/{sp}"] = {f"{name}/{dtype}": t.numel() * t.element_size()
                                      for (name, dtype), t in held.items()}
            del gpt
    if rank == 0:
        Path(out).write_text(json.dumps(found))
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_global_buffer_is_one_tensor_the_larger_of_sps_gather_and_the_unfused_scores(tmp_path: Path) -> None:
    out = tmp_path / "buffers.json"
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(out)), nprocs=2)
    found = json.loads(out.read_text())
    cpu = SimOptions(attention=AttentionKernel.torch_softmax)  # the core Megatron-Core runs here
    for shape in SHAPES:
        for sp in (False, True):
            job = _job(shape, sp)
            held = found[f"{shape}/{sp}"]
            # One tensor, reused by every layer's gathers (forward and backward) and score GEMMs, in fp32 here.
            assert list(held) == ["mpu/torch.float32"], (shape, sp, held)
            predicted = global_buffer_bytes(job, build_layout(job, world_size=2), cpu)
            assert held["mpu/torch.float32"] == predicted, (shape, sp, held, predicted)
    tokens_hidden = 64 * 2 * 256 * 4  # SP's gather: [tokens, hidden] in fp32
    assert found["gather_larger/True"]["mpu/torch.float32"] == tokens_hidden
    assert found["gather_larger/False"]["mpu/torch.float32"] < tokens_hidden  # the scores' alone without SP
