"""The caching allocator's share of a GPU's memory while one rank trains: what ``torch.cuda.max_memory_reserved``
holds beyond ``torch.cuda.max_memory_allocated``, the simulator's prediction beside both, and the tracked peak per
category beside the prediction's categories (the source of ``cfp_megatron/sim/memory_band.json``'s upper band).

Run on a machine with a GPU: ``python bench/allocator_share.py [--model llama3_8b] [--layers 4] [--seq 4096]
[--recompute none full] [--micro-batches 1 2] [--alloc default expandable]``.

Each case trains ``--model`` cut to ``--layers`` layers on one rank (``torchrun --nproc_per_node=1 launch/train.py``,
NCCL, bf16, two micro-batches per step, 3 steps, the tracker on step 2) with PyTorch's caching allocator as it comes
(``default``) or with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (``expandable``, what NVIDIA's recipes
set), and prints the run's peak allocated and reserved bytes and their ratio, then the largest ratio. Asserts
nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOC = {"default": "", "expandable": "expandable_segments:True"}
"""``PYTORCH_CUDA_ALLOC_CONF`` of each allocator setting."""


def child(argv: list[str]) -> None:
    """Run ``launch/train.py`` with ``argv`` in this process, then write the allocator's peaks to the file
    ``CFP_ALLOC_OUT`` names."""
    import torch

    sys.argv = [str(ROOT / "launch" / "train.py"), *argv]
    sys.path.insert(0, str(ROOT))
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as done:
        if done.code not in (0, None):
            raise
    finally:
        if torch.cuda.is_available():
            Path(os.environ["CFP_ALLOC_OUT"]).write_text(json.dumps(
                {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}))


def case_overrides(args: argparse.Namespace, recompute: str, micro_batch: int) -> list[str]:
    """Hydra overrides of one case (one rank of the GPU's vendor preset)."""
    out = [f"model={args.model}", f"model.num_layers={args.layers}", f"cluster={args.cluster}", "cluster.nodes=1",
           "cluster.gpus_per_node=1", f"train.seq_length={args.seq}", f"train.micro_batch_size={micro_batch}",
           f"train.global_batch_size={2 * micro_batch}", f"parallel.recompute={recompute}"]
    if recompute == "full":
        out += ["parallel.recompute_method=uniform", "parallel.recompute_num_layers=1"]
    return out


def predicted(case: list[str]):
    """The simulator's memory breakdown of the one-rank job ``case``, with the attention core this machine runs."""
    from cfp_megatron.base.compose import compose_job
    from cfp_megatron.sim.options import options_here
    from cfp_megatron.sim.simulate import simulate

    job = compose_job(case)
    return simulate(job, job.cluster, None, world_size=1, options=options_here(job.cluster)).memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3_8b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cluster", default="h200", help="the preset the prediction is made on")
    parser.add_argument("--recompute", nargs="+", default=["none", "full"])
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--alloc", nargs="+", choices=sorted(ALLOC), default=["default", "expandable"])
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no GPU: the caching allocator's share is a GPU's")
    print(f"{args.model} x {args.layers} layers, seq {args.seq}, one {torch.cuda.get_device_name(0)}; predicted on "
          f"cluster={args.cluster}")
    gib = 2.0**30
    print(f"{'alloc':<10} {'recompute':<9} {'mb':>2} {'pred':>7} {'allocated':>9} {'reserved':>8} {'res/alloc':>9} "
          f"{'pred/alloc':>10}   tracked step 2 by category (predicted / tracked GiB)")
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for alloc in args.alloc:
            for recompute in args.recompute:
                for mb in args.micro_batches:
                    case = case_overrides(args, recompute, mb)
                    run = Path(tmp) / f"{alloc}_{recompute}_{mb}"
                    run.mkdir()
                    out, metrics = run / "alloc.json", run / "metrics.jsonl"
                    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CFP_ALLOC_OUT": str(out)}
                    if ALLOC[alloc]:
                        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC[alloc]
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                           str(Path(__file__).resolve()), "--child", *case, "train.steps=3", "train.memory_step=2",
                           f"train.metrics_file={metrics}", f"hydra.run.dir={run / 'hydra'}"]
                    proc = subprocess.run(cmd, cwd=run, env=env, capture_output=True, text=True, timeout=900)
                    if proc.returncode != 0 or not out.exists():
                        print(f"{alloc:<10} {recompute:<9} {mb:>2} failed: {proc.stderr[-1500:]}", flush=True)
                        continue
                    peaks = json.loads(out.read_text())
                    event = next(r for r in map(json.loads, metrics.read_text().splitlines())
                                 if r.get("event") == "memory")
                    tracked = event["ranks"][0]["breakdown"]
                    pred = predicted(case)
                    ratio = peaks["reserved"] / peaks["allocated"]
                    ratios.append(ratio)
                    cats = (f"w {pred.parameters / gib:.2f}/{tracked.get('parameters', 0) / gib:.2f} "
                            f"g {pred.gradients / gib:.2f}/{tracked.get('gradients', 0) / gib:.2f} "
                            f"opt {pred.optimizer_states / gib:.2f}/{tracked.get('optimizer', 0) / gib:.2f} "
                            f"act {(pred.activations + pred.comm_buffers + pred.other) / gib:.2f}/"
                            f"{(tracked.get('activations', 0) + tracked.get('temporary', 0)) / gib:.2f}")
                    print(f"{alloc:<10} {recompute:<9} {mb:>2} {pred.total / gib:7.2f} "
                          f"{peaks['allocated'] / gib:9.2f} {peaks['reserved'] / gib:8.2f} {ratio:9.3f} "
                          f"{pred.total / peaks['allocated']:10.3f}   {cats}", flush=True)
    if ratios:
        print(f"reserved / allocated: {min(ratios):.3f} to {max(ratios):.3f} over {len(ratios)} runs")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        main()
