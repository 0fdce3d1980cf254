"""Predicted peak memory per rank against what one rank allocates while it trains.

Run on a machine with a GPU: ``python bench/gpu_memory.py [--model llama3_8b] [--seq 4096] [--fill 0.6]
[--recompute none selective full] [--micro-batches 1 2] [--cluster auto]``.

For each recompute choice and micro-batch size it trains a model on one rank (``torchrun --nproc_per_node=1
launch/train.py``, NCCL, bf16, two micro-batches per step, 3 steps, ``train.memory_step=2``) and prints the
simulator's predicted peak against ``torch.cuda.max_memory_allocated`` over step 2 and against the tensor tracker's
peak (``cfp_megatron.engine.memory``), then the MAPE of each. On a GPU the model is ``--model`` with as many layers
as keep the predicted peak within ``--fill`` of the GPU's memory (``--layers`` pins the count), so it fills a good
part of the device; the prediction is the simulator's on the vendor preset of the GPU (``--cluster auto``: the
preset of the same model and nearest memory, e.g. H200 -> ``h200``), the analytical memory model the preflight
planner uses with the attention core this machine runs (unfused without Transformer Engine), or ``--cluster local``:
profiled on this machine first (measured segment memory, as ``+cfp=auto``).

Without a GPU the same steps run on CPU (gloo, fp32) with ``--model``'s own layers against the tracker's peak alone,
on the ``local`` cluster profiled first: ``python bench/gpu_memory.py --model gpt_tiny --seq 64`` (the code path's
check; ``bench/local_layouts.py`` covers CPU memory on 4 ranks). Asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
def preset_for(device_name: str, capacity: float) -> str:
    """The cluster preset of a GPU (:func:`cfp_megatron.profile.cluster.device_preset`); a clear error for one
    without a preset."""
    from cfp_megatron.profile.cluster import device_preset

    preset = device_preset(device_name, capacity / 2**30)
    if preset is None:
        raise SystemExit(f"--cluster auto: no preset for the GPU {device_name!r}; pass --cluster <preset> or "
                         "--cluster local")
    return str(preset["name"])


def overrides(args: argparse.Namespace, recompute: str, micro_batch: int, layers: int | None) -> list[str]:
    """Hydra overrides of one case."""
    out = [f"model={args.model}", f"cluster={args.cluster}", f"train.seq_length={args.seq}",
           f"train.micro_batch_size={micro_batch}", f"train.global_batch_size={2 * micro_batch}",
           f"parallel.recompute={recompute}"]
    if args.cluster != "local":  # a preset describes full nodes; this job is one rank of one
        out += ["cluster.nodes=1", "cluster.gpus_per_node=1"]
    if recompute == "full":
        out += ["parallel.recompute_method=uniform", "parallel.recompute_num_layers=1"]
    if layers is not None:
        out.append(f"model.num_layers={layers}")
    return out


@functools.cache
def predicted_bytes(case: tuple[str, ...]) -> float:
    """The simulator's peak memory of the one-rank job ``case``, on its cluster (measured when ``local``); cached,
    so the case the layer fit settled on is not predicted again."""
    import dataclasses

    from cfp_megatron.base.compose import compose_config
    from cfp_megatron.base.config import job_from_config
    from cfp_megatron.sim.options import options_here
    from cfp_megatron.sim.simulate import simulate

    job = job_from_config(compose_config(list(case)))
    db = None
    if job.cluster.name == "local":
        from cfp_megatron.profile.cluster import local_measurements

        cluster, db = local_measurements(job, world_size=1)
        if db is None:
            raise SystemExit("no ProfileDB for this machine: the profiling step failed")
        job = dataclasses.replace(job, cluster=cluster)
    # The attention core as this machine runs it (unfused without Transformer Engine: it keeps its scores).
    options = options_here(job.cluster) if torch.cuda.is_available() else None
    return simulate(job, job.cluster, db, world_size=1, options=options).memory.total


def fitting_layers(args: argparse.Namespace, recompute: str, micro_batch: int, capacity: float) -> int:
    """The most layers (1 .. the model's own) whose predicted peak stays within ``--fill`` of ``capacity``."""
    from cfp_megatron.base.compose import compose_config

    most = int(compose_config([f"model={args.model}"]).model.num_layers)
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if predicted_bytes(tuple(overrides(args, recompute, micro_batch, mid))) <= args.fill * capacity:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        raise SystemExit(f"{args.model} with recompute={recompute}, micro-batch {micro_batch}: even one layer is "
                         f"predicted above {args.fill:.0%} of the GPU's {capacity / 2**30:.1f} GiB; lower --seq")
    return lo


def measure(case: list[str], name: str, work: Path, env: dict[str, str]) -> dict:
    """The ``memory`` event of a 3-step run of ``case`` on one rank (its files under ``work / name``)."""
    run = work / name
    run.mkdir(parents=True, exist_ok=True)
    metrics = run / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(ROOT / "launch" / "train.py"), *case, "train.steps=3", "train.memory_step=2",
           f"train.metrics_file={metrics}", f"hydra.run.dir={run / 'hydra'}"]
    proc = subprocess.run(cmd, cwd=run, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(case)}: training failed\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return next(r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "memory")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3_8b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--fill", type=float, default=0.6, help="share of the GPU's memory the prediction may fill")
    parser.add_argument("--layers", type=int, default=None, help="pin the layer count instead of fitting it")
    parser.add_argument("--recompute", nargs="+", default=["none", "selective", "full"])
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--cluster", default="auto", help="auto (the GPU's preset), a preset name, or local")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    capacity = float(torch.cuda.get_device_properties(0).total_memory) if on_gpu else 0.0
    if args.cluster == "auto":
        args.cluster = preset_for(torch.cuda.get_device_name(0), capacity) if on_gpu else "local"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    where = f"{torch.cuda.get_device_name(0)}, {capacity / 2**30:.1f} GiB" if on_gpu else "CPU"
    print(f"{args.model}, seq {args.seq}, one rank on {where}; predicted on cluster={args.cluster}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.cluster == "local":
            profile = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                      "--nproc_per_node=1", "-m", "cfp_megatron.profile", f"model={args.model}",
                                      f"train.seq_length={args.seq}"], cwd=work, env=env, capture_output=True,
                                     text=True, timeout=1800)
            print(profile.stdout[-1500:])
            if profile.returncode != 0:
                raise SystemExit(f"profiling failed\n{profile.stderr[-4000:]}")
        unit, scale = ("GiB", 2**30) if on_gpu else ("MiB", 2**20)
        print(f"{'recompute':<10} {'mb':>3} {'layers':>6} {'pred ' + unit:>9} {'cuda max ' + unit:>13} {'error':>7} "
              f"{'tracked ' + unit:>12} {'error':>7}")
        cuda_err, tracked_err = [], []
        for recompute in args.recompute:
            for mb in args.micro_batches:
                layers = args.layers
                if layers is None and on_gpu:
                    layers = fitting_layers(args, recompute, mb, capacity)
                case = overrides(args, recompute, mb, layers)
                pred = predicted_bytes(tuple(case))
                event = measure(case, f"{recompute}_mb{mb}", work, env)
                tracked = float(event["peak_bytes_max"])
                tracked_err.append((pred - tracked) / tracked)
                device = [r["device_max_allocated_bytes"] for r in event["ranks"]]
                cuda_cell = f"{'-':>13} {'-':>7}"
                if device[0] is not None:
                    cuda_max = float(max(device))
                    cuda_err.append((pred - cuda_max) / cuda_max)
                    cuda_cell = f"{cuda_max / scale:13.2f} {cuda_err[-1] * 100:6.1f}%"
                shown = layers if layers is not None else "own"
                print(f"{recompute:<10} {mb:>3} {shown:>6} {pred / scale:9.2f} {cuda_cell} {tracked / scale:12.2f} "
                      f"{tracked_err[-1] * 100:6.1f}%", flush=True)
    if cuda_err:
        print(f"memory vs torch.cuda.max_memory_allocated: MAPE {100 * statistics.fmean(map(abs, cuda_err)):.1f}% "
              f"over {len(cuda_err)} runs")
    print(f"memory vs tracked tensor peak: MAPE {100 * statistics.fmean(map(abs, tracked_err)):.1f}% over "
          f"{len(tracked_err)} runs")


if __name__ == "__main__":
    main()
