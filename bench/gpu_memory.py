"""Predicted peak memory per rank against what one rank allocates while it trains.

Run on a machine with a GPU: ``python bench/gpu_memory.py [--model llama3_8b] [--seq 4096] [--fill 0.6]
[--layers 4] [--recompute none selective full] [--micro-batches 1 2 4] [--cluster auto] [--out memory.json]``.

All cases run in this one process (one rank, NCCL, bf16, the engine's own training step: Megatron DDP, optimizer,
``get_forward_backward_func``): per recompute choice the model and optimizer are built once, then per micro-batch
size (two micro-batches per step) one step warms up (Adam's states appear at the first step) and the next is
measured; the model is freed before the next recompute choice. It prints the simulator's predicted peak, per
category (parameters, gradients, optimizer, activations, buffers), against ``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` over the measured step and against the tensor tracker's peak and categories
(``cfp_megatron.engine.memory``), then the MAPE of each; ``--out`` gets the same as JSON after every case. A case
that runs out of memory is recorded as such and the next one runs. On a GPU the model is ``--model`` with
``--layers`` layers (without it, as many as keep the largest micro-batch's predicted peak within ``--fill`` of the
GPU's memory); the prediction is the simulator's on the vendor preset of the GPU (``--cluster auto``: the
preset of the same model and nearest memory, e.g. H200 -> ``h200``), the analytical memory model the preflight
planner uses with the attention core this machine runs (unfused without Transformer Engine), or ``--cluster local``:
profiled on this machine first (measured segment memory, as ``+cfp=auto``).

Without a GPU the same steps run on CPU (gloo, fp32) with ``--model``'s own layers against the tracker's peak alone,
predicted on the ``local`` cluster (profiled first; ``--cluster <preset>`` skips the profiling and predicts for
that preset instead): ``python bench/gpu_memory.py --model gpt_tiny --seq 64`` (the code path's check;
``bench/local_layouts.py`` covers CPU memory on 4 ranks). Asserts nothing.
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
sys.path.insert(0, str(ROOT))

from cfp_megatron.base.cuda_env import alloc_conf, set_runtime_env  # noqa: E402
from cfp_megatron.sim.prediction import MemoryBreakdown  # noqa: E402

PREDICTED_CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "comm_buffers", "other")
"""The simulator's memory categories (:class:`~cfp_megatron.sim.prediction.MemoryBreakdown`'s fields)."""

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
           f"parallel.recompute={recompute}", "train.layout_independent_init=false"]  # memory: any weights do
    if args.cluster != "local":  # a preset describes full nodes; this job is one rank of one
        out += ["cluster.nodes=1", "cluster.gpus_per_node=1"]
    if recompute == "full":
        out += ["parallel.recompute_method=uniform", "parallel.recompute_num_layers=1"]
    if layers is not None:
        out.append(f"model.num_layers={layers}")
    return out


def predicted_bytes(case: tuple[str, ...]) -> float:
    """The simulator's peak memory of the one-rank job ``case`` (:func:`predicted_memory`'s total)."""
    return predicted_memory(case).total


@functools.cache
def predicted_memory(case: tuple[str, ...]) -> MemoryBreakdown:
    """The simulator's peak memory of the one-rank job ``case`` per category, on its cluster (measured when
    ``local``); cached, so the case the layer fit settled on is not predicted again."""
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
    return simulate(job, job.cluster, db, world_size=1, options=options).memory


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


def start_process_group() -> None:
    """This process as a one-rank world (NCCL on a GPU, gloo on the CPU; the CPU shims installed there)."""
    import torch.distributed as dist

    from cfp_megatron.base.launch_env import LaunchEnv
    from cfp_megatron.compat.cpu import install_if_needed
    from cfp_megatron.engine.distributed import prepare_device_and_env

    prepare_device_and_env(LaunchEnv.read(), port=29517)
    install_if_needed()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)


class Model:
    """The training state of one recompute choice on this rank (model, DDP, optimizer), built once and stepped at
    each micro-batch size."""

    def __init__(self, case: list[str]) -> None:
        from cfp_megatron.base.compose import compose_config
        from cfp_megatron.base.config import job_from_config
        from cfp_megatron.base.parallel_dims import ParallelDims
        from cfp_megatron.engine.step import build_training
        from cfp_megatron.profile.segments import init_probe_groups

        job = job_from_config(compose_config(case))
        dims = ParallelDims.build(job, 1)
        init_probe_groups(dims, job.train.seed)
        self.state = build_training(job, dims)

    def measure(self, case: list[str]) -> dict:
        """One warm-up step and one measured step of the job ``case`` (same model, its micro-batch size): the
        tracker's peak and categories, the CUDA allocator's peaks."""
        from cfp_megatron.base.compose import compose_config
        from cfp_megatron.base.config import job_from_config
        from cfp_megatron.base.parallel_dims import ParallelDims
        from cfp_megatron.data.batches import build_micro_batches
        from cfp_megatron.engine.memory import measure_step
        from cfp_megatron.engine.step import train_step

        state = self.state
        state.job = job_from_config(compose_config(case))
        state.dims = ParallelDims.build(state.job, 1)
        stream = build_micro_batches(state.job, dp_rank=0, dp_size=1)
        batches = [next(stream) for _ in range(state.dims.num_microbatches)]
        train_step(state, batches)  # Adam's states appear at the first step; the shapes warm up
        _, report = measure_step(lambda: train_step(state, batches), chunks=state.ddp_chunks,
                                 optimizer=state.optimizer, rank=0, step_number=state.step + 1)
        cuda = torch.cuda.is_available()
        return {"tracked_bytes": report.peak_bytes, "tracked": dict(report.breakdown),
                "cuda_max_allocated_bytes": report.device_max_allocated_bytes,
                "cuda_max_reserved_bytes": int(torch.cuda.max_memory_reserved()) if cuda else None}


def release() -> None:
    """Free what the last model left (its groups, the allocator's cached blocks)."""
    import gc

    from cfp_megatron.engine.distributed import destroy_model_parallel_groups

    destroy_model_parallel_groups()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3_8b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--fill", type=float, default=0.6, help="share of the GPU's memory the prediction may fill")
    parser.add_argument("--layers", type=int, default=None, help="pin the layer count instead of fitting it")
    parser.add_argument("--recompute", nargs="+", default=["none", "selective", "full"])
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=None, help="JSON file of the results (written after each case)")
    parser.add_argument("--cluster", default="auto", help="auto (the GPU's preset), a preset name, or local")
    args = parser.parse_args()
    set_runtime_env()  # the allocator the runtime trains with (expandable segments unless set), before CUDA starts
    on_gpu = torch.cuda.is_available()
    capacity = float(torch.cuda.get_device_properties(0).total_memory) if on_gpu else 0.0
    if args.cluster == "auto":
        args.cluster = preset_for(torch.cuda.get_device_name(0), capacity) if on_gpu else "local"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    where = f"{torch.cuda.get_device_name(0)}, {capacity / 2**30:.1f} GiB" if on_gpu else "CPU"
    print(f"{args.model}, seq {args.seq}, one rank on {where}; predicted on cluster={args.cluster}; "
          f"PYTORCH_CUDA_ALLOC_CONF={alloc_conf()!r}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.cluster == "local":  # measured on this machine first: its ProfileDB in CFP_CACHE_DIR
            profile = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                      "--nproc_per_node=1", "-m", "cfp_megatron.profile", f"model={args.model}",
                                      f"train.seq_length={args.seq}"], cwd=work, env=env, capture_output=True,
                                     text=True, timeout=1800)
            print(profile.stdout[-1500:])
            if profile.returncode != 0:
                raise SystemExit(f"profiling failed\n{profile.stderr[-4000:]}")
    start_process_group()
    unit, scale = ("GiB", 2**30) if on_gpu else ("MiB", 2**20)
    result: dict = {"device": where, "model": args.model, "seq": args.seq, "cluster": args.cluster,
                    "torch": torch.__version__, "alloc_conf": alloc_conf(), "cases": []}
    print(f"{'recompute':<10} {'mb':>3} {'layers':>6} {'pred ' + unit:>9} {'cuda max ' + unit:>13} {'error':>7} "
          f"{'reserved ' + unit:>13} {'tracked ' + unit:>12} {'error':>7}")
    cuda_err, tracked_err = [], []
    for recompute in args.recompute:
        layers = args.layers
        if layers is None and on_gpu:  # one model for every micro-batch size: the largest one must fit
            layers = fitting_layers(args, recompute, max(args.micro_batches), capacity)
        cases = {mb: overrides(args, recompute, mb, layers) for mb in args.micro_batches}
        model: Model | None = None
        for mb, case in cases.items():
            pred = predicted_memory(tuple(case))
            row: dict = {"recompute": recompute, "micro_batch": mb, "layers": layers, "predicted_bytes": pred.total,
                         "predicted": {c: getattr(pred, c) for c in PREDICTED_CATEGORIES}}
            result["cases"].append(row)
            try:
                if model is None:
                    row["allocated_before_build_bytes"] = _allocated()
                    if row["allocated_before_build_bytes"]:  # what the last model left: counted in the peaks below
                        print(f"    note: {row['allocated_before_build_bytes'] / scale:.2f} {unit} still allocated "
                              "before this model is built")
                    model = Model(case)
                row.update(model.measure(case))
            except torch.cuda.OutOfMemoryError as err:
                row["error"] = f"out of memory: {str(err)[:200]}"
                print(f"{recompute:<10} {mb:>3} {layers or 'own':>6} {pred.total / scale:9.2f}  out of memory")
                _write(args.out, result)
                continue
            tracked = float(row["tracked_bytes"])
            tracked_err.append(row.setdefault("tracked_error", (pred.total - tracked) / tracked))
            cuda_cell = f"{'-':>13} {'-':>7} {'-':>13}"
            if row["cuda_max_allocated_bytes"] is not None:
                cuda_max = float(row["cuda_max_allocated_bytes"])
                cuda_err.append(row.setdefault("cuda_error", (pred.total - cuda_max) / cuda_max))
                cuda_cell = (f"{cuda_max / scale:13.2f} {cuda_err[-1] * 100:6.1f}% "
                             f"{row['cuda_max_reserved_bytes'] / scale:13.2f}")
            shown = layers if layers is not None else "own"
            print(f"{recompute:<10} {mb:>3} {shown:>6} {pred.total / scale:9.2f} {cuda_cell} {tracked / scale:12.2f} "
                  f"{tracked_err[-1] * 100:6.1f}%", flush=True)
            print("    predicted " + ", ".join(f"{c} {getattr(pred, c) / scale:.2f}" for c in PREDICTED_CATEGORIES)
                  + "; tracked " + ", ".join(f"{c} {v / scale:.2f}" for c, v in sorted(row["tracked"].items())))
            _write(args.out, result)
        del model
        release()
    if cuda_err:
        print(f"memory vs torch.cuda.max_memory_allocated: MAPE {100 * statistics.fmean(map(abs, cuda_err)):.1f}% "
              f"over {len(cuda_err)} runs")
    if tracked_err:
        print(f"memory vs tracked tensor peak: MAPE {100 * statistics.fmean(map(abs, tracked_err)):.1f}% over "
              f"{len(tracked_err)} runs")


def _allocated() -> int:
    """Bytes the CUDA allocator holds for live tensors (0 on the CPU)."""
    return int(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0


def _write(path: Path | None, result: dict) -> None:
    """The results so far as JSON (nothing without ``--out``)."""
    if path is not None:
        path.write_text(json.dumps(result, indent=1) + "\n")

if __name__ == "__main__":
    main()
