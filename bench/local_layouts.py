"""Every feasible (DP, TP, PP, micro-batch; EP for a MoE model) layout of a small model on this machine: measured vs
simulated.

Run: ``python bench/local_layouts.py [--nproc 4] [--model gpt_tiny] [--steps 12] [--gbs 16] [--seq 64] [--passes 2]
[--recompute none] [--markdown docs/figures/local_layouts.md]`` (``--markdown``: also the figures as a snippet for
the docs, with the date and machine).

1. Trains every feasible layout of ``--model`` on ``--nproc`` gloo ranks with ``launch/train.py`` for ``--steps``
   steps; a pass's step time is the median of the steps after the first two (warm-up), the measured memory the
   largest per-rank peak of ``train.memory_step=2``.
2. Profiles the machine once (``torchrun -m cfp_megatron.profile``; reused from the ProfileDB when present).
3. Trains every layout again, in the reverse order (``--passes 2``, the default). A layout's measured step time is
   the mean of its two passes. This machine's speed drifts by 10-30% within a run (a shared virtual machine):
   with one pass after the profile, the layouts run last were measured on a different machine from the one the
   profile timed, and the drift landed on whole layout families (the order runs TP=1 first, TP=4 last). With the
   profile between two passes in opposite orders, a drift linear in time cancels in every layout's mean, and the
   pass-to-pass ratio printed for each layout shows how much the machine moved. ``--passes 1`` profiles first and
   measures once.
4. Predicts each with :func:`cfp_megatron.sim.simulate` on the ``local`` cluster filled from the ProfileDB.

``--recompute selective`` or ``full`` runs every layout under that recomputation (the memory check under each
recompute choice; full: uniform, one layer per checkpointed unit). Prints one line per layout, then the
step-time MAPE, the Spearman rank correlation between measured and predicted step times, and the memory MAPE.
Targets: MAPE 10% or less, Spearman 0.9 or more, memory within 10%. Then the layout the planner picks
from the same ProfileDB within this space, and how much slower than the measured fastest it measured (target: 10%
or less).
Asserts nothing; figures on a loaded machine are noisy, so run it alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import snippet

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One layout to run."""

    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    dp: int
    """Data-parallel size."""
    micro_batch: int
    """Sequences per micro-batch."""
    ep: int = 1
    """Expert-parallel size (MoE models)."""
    sp: bool = False
    """Sequence parallelism (Megatron-Core requires it for MoE layers under TP)."""

    def overrides(self) -> list[str]:
        """Hydra overrides for this layout."""
        return [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.ep={self.ep}",
                f"parallel.sp={str(self.sp).lower()}", f"train.micro_batch_size={self.micro_batch}"]

    def __str__(self) -> str:
        return (f"dp{self.dp} tp{self.tp} pp{self.pp}" + (f" ep{self.ep}" if self.ep > 1 else "")
                + (" sp" if self.sp else "") + f" mb{self.micro_batch}")


def feasible_layouts(model: str, nproc: int, common: list[str]) -> list[Layout]:
    """Layouts the project's own validation accepts (heads, layers, batch divisibility), in a stable order; for a
    MoE model also every expert-parallel size, with sequence parallelism under TP (Megatron-Core requires it)."""
    from hydra import compose, initialize_config_dir

    from cfp_megatron.base.compose import register_configs
    from cfp_megatron.base.config import job_from_config
    from cfp_megatron.base.errors import ConfigError
    from cfp_megatron.base.parallel_dims import ParallelDims

    register_configs()
    found = []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        moe = job_from_config(compose(config_name="config", overrides=[f"model={model}", *common])).model.is_moe
        sizes = (1, 2, 4, 8)
        for tp, pp, ep, mb in itertools.product(sizes, sizes, sizes if moe else (1,), sizes):
            if nproc % (tp * pp):
                continue
            layout = Layout(tp=tp, pp=pp, dp=nproc // (tp * pp), micro_batch=mb, ep=ep, sp=moe and tp > 1)
            cfg = compose(config_name="config", overrides=[f"model={model}", *common, *layout.overrides()])
            try:
                ParallelDims.build(job_from_config(cfg), nproc)
            except ConfigError:
                continue
            found.append(layout)
    return found


def _torchrun(nproc: int, args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def measure(layout: Layout, nproc: int, model: str, common: list[str], steps: int, env: dict[str, str],
            work: Path) -> tuple[float, int]:
    """Median step time (s) after warm-up and the largest per-rank tensor peak (bytes)."""
    run = work / str(layout).replace(" ", "_")
    run.mkdir(parents=True, exist_ok=True)
    metrics = run / "metrics.jsonl"
    args = [str(ROOT / "launch" / "train.py"), f"model={model}", *common, *layout.overrides(),
            f"train.steps={steps}", "train.memory_step=2", f"train.metrics_file={metrics}",
            f"hydra.run.dir={run / 'hydra'}"]
    proc = _torchrun(nproc, args, run, env)
    if proc.returncode != 0:
        raise SystemExit(f"{layout}: training failed\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = [r["step_time_s"] for r in records if r.get("event") == "step" and r["step"] > 2]
    memory = next(r for r in records if r.get("event") == "memory")
    return statistics.median(times), int(memory["peak_bytes_max"])


def _measure_pass(layouts: list[Layout], args: argparse.Namespace, common: list[str], env: dict[str, str],
                  work: Path, name: str) -> dict[str, tuple[float, int]]:
    """One pass over ``layouts`` in the given order: (median step time, peak bytes) by layout, each printed."""
    found = {}
    for layout in layouts:
        t, mem = measure(layout, args.nproc, args.model, common, args.steps, env, work / name.replace(" ", "_"))
        found[str(layout)] = (t, mem)
        print(f"{name}: {str(layout):<22} {t * 1e3:10.1f} ms {mem / 2**20:8.2f} MiB", flush=True)
    return found


def predict(layout: Layout, nproc: int, model: str, common: list[str]) -> tuple[float, float]:
    """Simulated step time (s) and peak memory (bytes) on the profiled local cluster."""
    from hydra import compose, initialize_config_dir

    from cfp_megatron.base.compose import register_configs
    from cfp_megatron.base.config import job_from_config
    from cfp_megatron.profile.cluster import local_measurements
    from cfp_megatron.sim.simulate import simulate

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=[f"model={model}", *common, *layout.overrides()])
    job = job_from_config(cfg)
    cluster, db = local_measurements(job, world_size=nproc)
    if db is None:
        raise SystemExit("no ProfileDB for this machine and world size: the profiling step failed")
    prediction = simulate(job, cluster, db, world_size=nproc)
    return prediction.step_time_s, prediction.memory.total


def chosen_layout(nproc: int, model: str, common: list[str], recompute: str = "none") -> Layout:
    """The layout the planner picks (as ``+cfp=auto`` would, from the same ProfileDB) within this bench's space:
    (DP, TP, PP, EP, micro-batch) under the bench's ``recompute``, without interleaving, the distributed optimizer
    or uneven stages; SP only where Megatron-Core requires it (MoE under TP)."""
    from cfp_megatron.base.cfp_spec import cfp_from_config
    from cfp_megatron.base.compose import compose_config
    from cfp_megatron.base.config import job_from_config
    from cfp_megatron.profile.cluster import local_measurements
    from cfp_megatron.search.search import search

    moe = job_from_config(compose_config([f"model={model}", *common])).model.is_moe
    space = ["cfp.constraints.vpp=[1]", f"cfp.constraints.recompute=[{recompute}]",
             *([] if moe else ["cfp.constraints.sp=[false]", "cfp.constraints.ep=[1]"]),
             "cfp.constraints.distributed_optimizer=[false]", "cfp.constraints.uneven_stages=false",
             "cfp.constraints.cp=[1]", "cfp.top_k=1"]
    cfg = compose_config(["+cfp=auto", f"model={model}", *common, *space])
    job, cfp = job_from_config(cfg), cfp_from_config(cfg)
    cluster, db = local_measurements(job, world_size=nproc)
    import dataclasses

    best = search(dataclasses.replace(job, cluster=cluster), nproc, cfp, measurements=db).best.candidate
    return Layout(tp=best.tp, pp=best.pp, dp=nproc // (best.tp * best.pp), micro_batch=best.micro_batch, ep=best.ep,
                  sp=best.sp)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (Pearson correlation of the ranks; ties get their average rank)."""
    def ranks(x: list[float]) -> np.ndarray:
        values = np.asarray(x, dtype=float)
        order = values.argsort(kind="stable")
        out = np.empty(len(values))
        out[order] = np.arange(len(values), dtype=float)
        for v in np.unique(values):
            same = values == v
            out[same] = out[same].mean()
        return out

    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--model", default="gpt_tiny")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--gbs", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--budget", type=int, default=None,
                        help="profiling budget in seconds, all rounds (default 120; 180 with --recompute, whose "
                             "round runs on what the others leave)")
    parser.add_argument("--passes", type=int, choices=(1, 2), default=2,
                        help="2: measure every layout before and after the profile, in opposite orders; 1: after")
    parser.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                        help="every layout's recomputation (full: uniform, one layer per checkpointed unit)")
    parser.add_argument("--markdown", type=snippet.check_path, metavar="FILE.md",
                        help="also write the figures as a Markdown snippet (docs/figures/local_layouts.md)")
    args = parser.parse_args()
    first_line = snippet.header()
    cells: list[list[str]] = []
    if args.budget is None:
        args.budget = 120 if args.recompute == "none" else 180
    common = [f"train.global_batch_size={args.gbs}", f"train.seq_length={args.seq}",
              f"parallel.recompute={args.recompute}"]
    if args.recompute == "full":
        common += ["parallel.recompute_method=uniform", "parallel.recompute_num_layers=1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        layouts = feasible_layouts(args.model, args.nproc, common)
        print(f"{len(layouts)} feasible layouts of {args.model} on {args.nproc} ranks", flush=True)
        passes: list[dict[str, tuple[float, int]]] = []
        if args.passes == 2:
            passes.append(_measure_pass(layouts, args, common, env, work, "pass 1"))
        profile = _torchrun(args.nproc, ["-m", "cfp_megatron.profile", f"model={args.model}", *common,
                                         "--budget", str(args.budget)], work, env)
        print(profile.stdout[-3000:])
        if profile.returncode != 0:
            raise SystemExit(f"profiling failed\n{profile.stderr[-4000:]}")
        passes.append(_measure_pass(layouts[::-1] if args.passes == 2 else layouts, args, common, env, work,
                                    f"pass {len(passes) + 1}"))
        print(f"{'layout':<22} {'pass 2/1':>8} {'measured ms':>12} {'predicted ms':>13} {'error':>7} {'mem MiB':>8} "
              f"{'pred MiB':>9} {'error':>7}")
        measured, predicted, mem_measured, mem_predicted = [], [], [], []
        for layout in layouts:
            runs = [found[str(layout)] for found in passes]
            t = statistics.fmean(time for time, _ in runs)
            mem = max(peak for _, peak in runs)
            drift = f"{runs[-1][0] / runs[0][0]:8.2f}" if len(runs) > 1 else f"{'-':>8}"
            pt, pmem = predict(layout, args.nproc, args.model, common)
            measured.append(t)
            predicted.append(pt)
            mem_measured.append(mem)
            mem_predicted.append(pmem)
            print(f"{str(layout):<22} {drift} {t * 1e3:12.1f} {pt * 1e3:13.1f} {(pt - t) / t * 100:6.1f}% "
                  f"{mem / 2**20:8.2f} {pmem / 2**20:9.2f} {(pmem - mem) / mem * 100:6.1f}%", flush=True)
            cells.append([str(layout), drift.strip(), f"{t * 1e3:.1f}", f"{pt * 1e3:.1f}", f"{(pt - t) / t:+.1%}",
                          f"{mem / 2**20:.2f}", f"{pmem / 2**20:.2f}", f"{(pmem - mem) / mem:+.1%}"])
        chosen = chosen_layout(args.nproc, args.model, common, args.recompute)
    by_layout = {str(layout): t for layout, t in zip(layouts, measured, strict=True)}
    fastest = min(by_layout, key=by_layout.__getitem__)
    if str(chosen) in by_layout:
        gap = by_layout[str(chosen)] / by_layout[fastest] - 1
        choice = (f"The planner's choice: {chosen}, measured {by_layout[str(chosen)] * 1e3:.1f} ms; measured best "
                  f"{fastest}, {by_layout[fastest] * 1e3:.1f} ms; the choice is {gap:.1%} slower (target 10% or less).")
    else:
        choice = f"The planner's choice {chosen} is not among the measured layouts."
    print(choice)
    mape = 100 * statistics.fmean(abs(p - m) / m for p, m in zip(predicted, measured, strict=True))
    mem_mape = 100 * statistics.fmean(abs(p - m) / m for p, m in zip(mem_predicted, mem_measured, strict=True))
    print(f"step time: MAPE {mape:.1f}% over {len(measured)} layouts, Spearman {spearman(measured, predicted):.3f}")
    print(f"memory: MAPE {mem_mape:.1f}% over {len(measured)} layouts")
    if args.markdown:
        rho = spearman(measured, predicted)
        dims = "DP, TP, PP, EP" if any(x.ep > 1 for x in layouts) else "DP, TP, PP"
        lines = [f"Every feasible ({dims}, micro-batch) layout of `{args.model}` on {args.nproc} gloo ranks "
                 f"(global batch {args.gbs}, seq {args.seq}, recompute {args.recompute}, {args.steps} steps, "
                 f"{args.passes} pass{'es' if args.passes > 1 else ''}, profiling budget {args.budget} s), measured "
                 f"against the prediction from a fresh profile: **step-time MAPE {mape:.1f}% over {len(measured)} "
                 f"layouts, Spearman {rho:.3f}; memory MAPE {mem_mape:.1f}%.** {choice}", "",
                 *snippet.table(["layout", "pass 2/1", "measured ms", "predicted ms", "error", "memory MiB",
                                 "predicted MiB", "error"], cells, "lrrrrrrr")]
        snippet.write(args.markdown, first_line, lines)


if __name__ == "__main__":
    main()
