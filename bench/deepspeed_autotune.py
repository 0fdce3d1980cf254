"""Our DeepSpeed plan against the grid DeepSpeed's autotuner would run, on this machine (CPU, gloo).

Run: ``python bench/deepspeed_autotune.py [--nproc 4] [--model gpt_tiny] [--gbs 32] [--seq 64] [--steps 10]
[--markdown docs/figures/deepspeed_autotune.md]`` (alone on an idle machine; about 5 minutes; ``--markdown`` also
writes what it printed as a snippet for the docs, with the date and machine). ``CFP_CACHE_DIR`` is pointed at an
empty folder unless ``--reuse-profile`` is given, so our time includes profiling the machine from scratch.

1. **Ours.** ``launch/train.py backend=deepspeed +cfp=auto train.steps=1``: profiles, searches the DeepSpeed space
   (ZeRO stage x micro-batch x activation checkpointing; offload is not tried on CPU ranks) and prints how long
   choosing took (``cfp: planned in X s``).
2. **The autotuner's grid.** DeepSpeed's autotuner (fast mode, its default) launches one experiment per ZeRO stage
   (0-3, with its stage templates) and micro-batch size, and profiles steps 3-5 of each. The same grid, with the
   global batch fixed: every stage x every micro-batch that divides the per-rank batch, each launched with
   ``launch/train.py backend=deepspeed`` for ``--steps`` steps; measured step time = median of the steps after the
   first two. Its time spent choosing is the wall time of those launches.
3. Our choice measured the same way (when the grid does not hold it: it may checkpoint activations), each grid
   plan's prediction from the same ProfileDB and engine probes, the step-time MAPE and Spearman correlation of the
   predictions, and how much slower than the grid's measured best our choice measured.

Asserts nothing; figures on a loaded machine are noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import snippet

ROOT = Path(__file__).resolve().parent.parent


def _run(nproc: int, overrides: list[str], env: dict[str, str], out: Path) -> tuple[float, str]:
    """One torchrun launch of launch/train.py; (wall seconds, stdout)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=29561",
           str(ROOT / "launch" / "train.py"), *overrides, f"hydra.run.dir={out}"]
    began = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(overrides)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def _median_step(metrics: Path) -> float:
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = [s["step_time_s"] for s in steps if s.get("event") == "step"][2:]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--model", default="gpt_tiny")
    parser.add_argument("--gbs", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reuse-profile", action="store_true", help="keep CFP_CACHE_DIR (a stored ProfileDB)")
    parser.add_argument("--markdown", type=snippet.check_path, metavar="FILE.md",
                        help="also write what this prints as a docs snippet (command, date and machine first)")
    args = parser.parse_args()
    first_line = snippet.header()
    printed = _Tee(sys.stdout)
    with contextlib.redirect_stdout(printed):
        _bench(args)
    if args.markdown:
        snippet.write(args.markdown, first_line, ["```text", *printed.text().strip("\n").splitlines(), "```"])


class _Tee(io.TextIOBase):
    """Writes through to ``stream`` and keeps a copy."""

    def __init__(self, stream: io.TextIOBase) -> None:
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.stream.write(text)
        return self.copy.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def text(self) -> str:
        """Everything written so far."""
        return self.copy.getvalue()


def _bench(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="cfp-ds-bench-"))
    env = {**os.environ, "CFP_CACHE_DIR": os.environ.get("CFP_CACHE_DIR", "") if args.reuse_profile else
           str(work / "cache"), "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    if not env["CFP_CACHE_DIR"]:
        env.pop("CFP_CACHE_DIR")
    common = [f"model={args.model}", "backend=deepspeed", f"train.global_batch_size={args.gbs}",
              f"train.seq_length={args.seq}"]

    # 1. ours
    wall, out = _run(args.nproc, [*common, "+cfp=auto", "train.steps=1", "cfp.check_after_steps=0"], env,
                     work / "ours")
    planned = re.search(r"cfp: planned in ([0-9.]+) s", out)
    choose_s = float(planned.group(1)) if planned else float("nan")
    ours = json.loads((work / "ours" / "plan.json").read_text())
    plan = {**ours["zero"], "zero_stage": ours["zero"]["stage"], "micro_batch_size": ours["micro_batch_size"],
            "activation_checkpointing": ours["parallel"]["recompute"] == "full"}
    print(f"ours: {ours['canonical']}\n  chose in {choose_s:.1f} s (launch to plan; whole launch with one step "
          f"{wall:.1f} s)")

    # 2. the autotuner's grid
    per_rank = args.gbs // args.nproc
    grid = [(stage, mb) for stage in (0, 1, 2, 3) for mb in range(1, per_rank + 1) if per_rank % mb == 0]
    measured: dict[tuple[int, int, bool], float] = {}
    grid_wall = 0.0
    for stage, mb in grid:
        folder = work / f"z{stage}_mb{mb}"
        wall, _ = _run(args.nproc, [*common, f"backend.zero_stage={stage}", f"train.micro_batch_size={mb}",
                                    f"train.steps={args.steps}", f"train.metrics_file={folder / 'm.jsonl'}"],
                       env, folder)
        grid_wall += wall
        measured[(stage, mb, False)] = _median_step(folder / "m.jsonl")
        print(f"  grid zero{stage} mb{mb}: {measured[(stage, mb, False)] * 1e3:.1f} ms (launch {wall:.1f} s)",
              flush=True)
    mine = (plan["zero_stage"], plan["micro_batch_size"], plan["activation_checkpointing"])
    if mine not in measured:
        folder = work / "ours_measured"
        _run(args.nproc, [*common, f"backend.zero_stage={mine[0]}", f"train.micro_batch_size={mine[1]}",
                          f"backend.activation_checkpointing={str(mine[2]).lower()}", f"train.steps={args.steps}",
                          f"train.metrics_file={folder / 'm.jsonl'}"], env, folder)
        measured[mine] = _median_step(folder / "m.jsonl")

    # 3. predictions from the same ProfileDB
    os.environ.update({k: v for k, v in env.items() if k == "CFP_CACHE_DIR"})
    from cfp_megatron.backends.deepspeed.costs import simulate_zero
    from cfp_megatron.backends.deepspeed.engine_probe import load_probes, probe_path
    from cfp_megatron.backends.deepspeed.zero_plan import zero_plan
    from cfp_megatron.base.compose import compose_job
    from cfp_megatron.base.config import Precision
    from cfp_megatron.profile.cluster import local_measurements
    from cfp_megatron.profile.fingerprint import model_key

    job = compose_job([f"model={args.model}", f"train.global_batch_size={args.gbs}", f"train.seq_length={args.seq}"])
    cluster, measurements = local_measurements(job, world_size=args.nproc)
    # the probes the planner used: stored next to this ProfileDB under the model's key
    probes = (load_probes(probe_path(measurements.fingerprint.key, model_key(job, on_gpu=False)), args.nproc)
              if measurements is not None else None)
    job = job.__class__(model=job.model, cluster=cluster, parallel=job.parallel, train=job.train, data=job.data)
    print(f"\npredicted with {'the engine probes' if probes is not None else 'no engine probes (analytical)'}")
    print(f"{'plan':<24}{'measured ms':>12}{'predicted ms':>14}{'error':>9}")
    errors, pairs = [], []
    for (stage, mb, ckpt), value in sorted(measured.items()):
        p = zero_plan(job, world=args.nproc, zero_stage=stage, micro_batch=mb, activation_checkpointing=ckpt,
                              offload_optimizer=False, offload_param=False, bucket_elements=50_000_000,
                              precision=Precision.fp32)
        predicted = simulate_zero(job, p, measurements, probes=probes).step_time_s
        err = predicted / value - 1
        errors.append(abs(err))
        pairs.append((value, predicted))
        flag = "  <- ours" if (stage, mb, ckpt) == mine else ""
        print(f"{p.describe():<24}{value * 1e3:>12.1f}{predicted * 1e3:>14.1f}{err:>+9.1%}{flag}")
    m = np.array(pairs)
    ranks = [np.argsort(np.argsort(m[:, i])) for i in (0, 1)]
    spearman = float(np.corrcoef(ranks[0], ranks[1])[0, 1])
    best_key = min((k for k in measured if not k[2]), key=lambda k: measured[k])
    print(f"\nstep-time MAPE {100 * statistics.mean(errors):.1f}% over {len(errors)} plans, Spearman {spearman:.3f}")
    print(f"grid's measured best: zero{best_key[0]} mb{best_key[1]} {measured[best_key] * 1e3:.1f} ms; ours "
          f"{measured[mine] * 1e3:.1f} ms ({measured[mine] / measured[best_key] - 1:+.1%})")
    print(f"time spent choosing: ours {choose_s:.1f} s; the autotuner's grid {grid_wall:.1f} s over {len(grid)} "
          f"launches ({grid_wall / max(choose_s, 1e-9):.0f}x)")


if __name__ == "__main__":
    main()
