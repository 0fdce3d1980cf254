"""Trials at launch (``cfp.trials``) against the same plans measured one launch each: is the pick the measured best,
and what do the trials cost?

Run: ``python bench/trials.py [--nproc 4] [--trials 3] [--steps 12] [--passes 2]``

1. Seeds a temporary cache with the recorded profile of gpt_tiny on 4 gloo ranks (tests/profiles.py), so nothing is
   profiled and the launch's budget goes to the trials.
2. Launches ``+cfp=auto cfp.trials=K`` for ``--steps`` steps: the trials' measurements (the ProfileDB's plan checks
   marked ``trial``), the plan it trains, and what the trials cost (the launch's own ``cfp: trials: ...`` line, in
   seconds and against the whole launch's wall time), its table printed as the launch printed it.
3. Trains each tried plan again with ``+cfp=manual cfp.plan='<canonical>'`` for ``--steps`` steps, ``--passes``
   times in alternating orders (a drift of the machine's speed linear in time cancels in each plan's mean), each
   launch's step time taken as the plan check takes it (:func:`cfp_megatron.plan.check.compare`: the median after
   ``cfp.check_warmup_steps``).
4. Prints per plan the prediction, the trial's measurement and the launches' mean, whether the trials' pick is the
   launches' fastest and by how much the pick is behind it, and the machine's load (the trials' ``other_load``,
   the load average), which on a shared 2-core machine moves every figure.

Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

COMMON = ["model=gpt_tiny", "train.global_batch_size=16", "train.seq_length=64", "train.warmup_steps=0",
          "train.precision=fp32"]
"""The job: the recorded profile's (gpt_tiny, sequence 64, fp32)."""


def _torchrun(nproc: int, args: list[str], cwd: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess,
                                                                                     float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "launch" / "train.py"), *args]
    began = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(args)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc, time.perf_counter() - began


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def measured(metrics: Path, warmup: int) -> float:
    """The launch's step time as the plan check takes it (:func:`~cfp_megatron.plan.check.compare`)."""
    from cfp_megatron.plan.check import PlanCheck, compare

    steps = [SimpleNamespace(step_time_s=r["step_time_s"], peak_bytes_max=None)
             for r in _records(metrics) if r.get("event") == "step"]
    check = PlanCheck(plan="", model_key="", after_steps=len(steps), warmup_steps=warmup, predicted_step_s=1.0,
                      calibration=1.0, predicted_peak_bytes=None)
    record = compare(check, steps)
    if record is None:
        raise SystemExit(f"{metrics}: no steps")
    return record.measured_step_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()

    from cfp_megatron.base.cfp_spec import CfpSpec
    from cfp_megatron.base.compose import compose_job
    from tests.profiles import seed_profile_db

    warmup = CfpSpec().check_warmup_steps
    work = Path(tempfile.mkdtemp(prefix="cfp-bench-trials-"))
    cache = work / "cache"
    db = seed_profile_db(cache, compose_job([*COMMON, "+cfp=auto"]), world=args.nproc)
    env = {**os.environ, "CFP_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    load_before = os.getloadavg()[0]

    run = work / "auto"
    run.mkdir()
    proc, wall = _torchrun(args.nproc, ["+cfp=auto", *COMMON, f"cfp.trials={args.trials}", "cfp.top_k=10",
                                        "cfp.profile_budget_s=600", f"train.steps={args.steps}",
                                        f"train.metrics_file={run / 'metrics.jsonl'}",
                                        f"hydra.run.dir={run / 'hydra'}"], run, env)
    output = proc.stdout + proc.stderr
    (run / "output.txt").write_text(output)
    shown = output.splitlines()
    start = next((i for i, line in enumerate(shown) if line.startswith("trials at launch")), None)
    table = [] if start is None else shown[start:next(
        (i + 1 for i, line in enumerate(shown) if i > start and line.startswith("cfp: trials:")), start + 1)]
    cost = re.search(r"cfp: trials: (\d+) of (\d+) measured in ([\d.]+) s", output)
    trials = [c for c in json.loads(db.read_text())["plan_checks"] if c.get("trial")]
    (stored,) = (run / "hydra" / "cfp").glob("plan-*.json")
    pick = json.loads(stored.read_text())["canonical"]
    plans = [c["plan"] for c in trials]

    # each tried plan launched on its own, passes in alternating orders
    launches: dict[str, list[float]] = {p: [] for p in plans}
    for n in range(args.passes):
        for i, plan in enumerate(plans if n % 2 == 0 else plans[::-1]):
            folder = work / f"manual-{n}-{i}"
            folder.mkdir()
            _torchrun(args.nproc, ["+cfp=manual", f"cfp.plan='{plan}'", *COMMON, f"train.steps={args.steps}",
                                   f"train.metrics_file={folder / 'metrics.jsonl'}",
                                   f"hydra.run.dir={folder / 'hydra'}"], folder, env)
            launches[plan].append(measured(folder / "metrics.jsonl", warmup))

    means = {p: statistics.mean(v) for p, v in launches.items()}
    best = min(means, key=means.get)
    print(f"bench/trials.py: gpt_tiny on {args.nproc} gloo ranks of a {os.cpu_count()}-core machine, "
          f"cfp.trials={args.trials}, {args.steps} steps, {args.passes} launch passes; load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("\n".join(table))
    print(f"{'plan (layout part)':58} {'predicted':>10} {'trial':>9} {'launches (mean; each)':>32}")
    for c in trials:
        p = c["plan"]
        each = ", ".join(f"{v * 1e3:.1f}" for v in launches[p])
        mark = (" <- trials' pick" if p == pick else "") + (" <- launches' fastest" if p == best else "")
        print(f"{p.split(':')[1][:58]:58} {c['predicted_step_s'] * 1e3:8.1f}ms {c['measured_step_s'] * 1e3:7.1f}ms "
              f"{means[p] * 1e3:9.1f}ms ({each}){mark}   other_load {c.get('other_load')}")
    behind = means[pick] / means[best] - 1.0
    print(f"the trials' pick is the launches' fastest: {pick == best} (the pick {behind:+.1%} against it)")
    if cost is not None:
        trial_s = float(cost.group(3))
        print(f"the trials cost {trial_s:.1f} s for {cost.group(1)} of {cost.group(2)} plans: {trial_s / wall:.0%} "
              f"of the launch's {wall:.1f} s wall time ({args.steps} training steps, start-up included)")
    print(f"work folder: {work}")


if __name__ == "__main__":
    main()
