"""Sequence parallelism's memory on two gloo ranks against the memory model.

``python bench/sp_memory.py [--seq 64] [--micro-batch 2] [--recompute none full] [override ...]`` (overrides such
as ``model.hidden_size=256 model.ffn_hidden_size=512``). Builds Megatron-Core's ``GPTModel`` (llama_tiny, 2
layers, TP 2, fp32, local spec) with and without SP, runs two forward and backward passes, then a third under
``torch.profiler``'s allocator events, and prints per case: the peak of what that pass allocates over its start
(frees of tensors made before it not counted), Megatron-Core's global memory buffer it holds, and the simulator's
activations (logits included) and TP buffers (``predict_memory`` with the unfused core this CPU runs). Asserts
nothing (tests/test_memory_global_buffer.py checks the buffer).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile


def job_of(args: argparse.Namespace, sp: bool, recompute: str):
    from cfp_megatron.base.compose import compose_job

    return compose_job(["model=llama_tiny", "model.num_layers=2", "cluster=local", "cluster.gpus_per_node=2",
                        "parallel.tp=2", f"parallel.sp={str(sp).lower()}", f"parallel.recompute={recompute}",
                        f"train.seq_length={args.seq}", f"train.micro_batch_size={args.micro_batch}",
                        f"train.global_batch_size={args.micro_batch}", *args.overrides])


def step_peak(step, trace: Path) -> int:
    """Peak bytes of what ``step`` allocates and still holds at once (CPU allocator events, by address)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    prof.export_chrome_trace(str(trace))
    live: dict[int, int] = {}
    now = top = 0
    for event in json.loads(trace.read_text())["traceEvents"]:
        if event.get("name") != "[memory]":
            continue
        size, addr = event["args"]["Bytes"], event["args"]["Addr"]
        if size > 0:
            live[addr] = size
            now += size
            top = max(top, now)
        elif addr in live:
            now -= live.pop(addr)
    return top


def rank_main(rank: int, args: argparse.Namespace, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    from cfp_megatron.base.parallel_dims import ParallelDims
    from cfp_megatron.compat.cpu import install_if_needed
    from cfp_megatron.engine.distributed import model_groups
    from cfp_megatron.engine.model import build_model_chunks
    from cfp_megatron.model.megatron_config import transformer_config
    from cfp_megatron.profile.segments import init_probe_groups

    install_if_needed()
    rows = {}
    for recompute in args.recompute:
        for sp in (False, True):
            job = job_of(args, sp, recompute)
            dims = ParallelDims.build(job, 2, te_available=False)
            init_probe_groups(dims, job.train.seed)
            parallel_state._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()
            (gpt,) = build_model_chunks(job, transformer_config(job, dims, on_gpu=False), dims, model_groups())
            tokens = torch.randint(0, job.model.vocab_size, (args.micro_batch, args.seq))
            positions = torch.arange(args.seq).unsqueeze(0).expand(args.micro_batch, args.seq)

            def step(gpt=gpt, tokens=tokens, positions=positions) -> None:
                gpt(tokens, positions, None, labels=tokens).sum().backward()

            step()
            step()
            peak = step_peak(step, Path(out) / f"trace{rank}.json")
            held = sum(t.numel() * t.element_size() for t in parallel_state.get_global_memory_buffer().buffer.values())
            rows[f"{recompute} sp={sp}"] = {"peak": peak, "global_buffer": held}
            del gpt
    if rank == 0:
        (Path(out) / "rows.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--recompute", nargs="+", default=["none", "full"])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from cfp_megatron.base.config import AttentionKernel
    from cfp_megatron.sim.options import SimOptions
    from cfp_megatron.sim.simulate import predict_memory

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(args, out), nprocs=2)
        rows = json.loads((Path(out) / "rows.json").read_text())
    cpu = SimOptions(attention=AttentionKernel.torch_softmax)
    print(f"{'case':<16} {'step peak KiB':>14} {'predicted act KiB':>18} {'buffer KiB':>11} {'predicted KiB':>14}")
    for name, row in rows.items():
        recompute, sp = name.split(" sp=")
        memory = predict_memory(job_of(args, sp == "True", recompute), options=cpu, world_size=2)
        parts = dict(memory.parts)
        print(f"{name:<16} {row['peak'] / 1024:14.1f} {memory.activations / 1024:18.1f} "
              f"{row['global_buffer'] / 1024:11.1f} {parts['tp_buffers'] / 1024:14.1f}")


if __name__ == "__main__":
    main()
