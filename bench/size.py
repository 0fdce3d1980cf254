"""Sizing speed: a 30-point sweep (3 GPU kinds x 10 node counts) of Llama-3 70B.

Run: ``python bench/size.py [--repeat N] [--markdown docs/figures/size.md]``.

1. The whole process, as a user runs it: ``python -m cfp_megatron.size`` with the sweep below, pinned to two cores
   (the first two this process may use), ``--repeat`` times (default 3); prints the wall time of each run, their
   median and the CPU seconds the runs took. Target: at most 10 s.
2. What sharing buys, in this process on one core: the 30 searches with one cost cache per GPU kind (what
   ``cfp size`` does: the pass costs, the group bounds' costs and the activations' bound, none of which read the node
   count) against each search with its own; CPU seconds of each, and whether the plans found are the same.

A busy machine makes both slower: the snippet's first line gives the load average at the start.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import snippet

from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import job_from_config
from cfp_megatron.model.derive import partition_options
from cfp_megatron.search.search import search
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import CostCache

ROOT = Path(__file__).resolve().parent.parent

KINDS = ("dgx_h100", "gb200_nvl72", "b200")
"""The GPU kinds swept."""
NODES = tuple(range(8, 88, 8))
"""The node counts swept (10)."""
JOB = ("model=llama3_70b", "train.global_batch_size=1024", "train.seq_length=8192")
"""The job every candidate shares."""
SWEEP = (*JOB, "train.tokens=15T", f"cluster=[{','.join(KINDS)}]", "cluster.nodes=range(8,88,8)")
"""The ``cfp size`` overrides of the sweep."""
TARGET_S = 10.0
"""The whole process's target on two cores."""


def two_cores() -> set[int]:
    """The first two cores this process may use (all of them where it has fewer)."""
    return set(sorted(os.sched_getaffinity(0))[:2]) if hasattr(os, "sched_getaffinity") else set()


def whole_process(repeat: int) -> tuple[list[float], float]:
    """Wall seconds of each ``python -m cfp_megatron.size`` run on two cores, and the CPU seconds of all."""
    cores = two_cores()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    walls = []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory(prefix="cfp-size-bench-") as out:
        for _ in range(repeat):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "cfp_megatron.size", *SWEEP, "--out", out], cwd=ROOT, env=env,
                           check=True, stdout=subprocess.DEVNULL,
                           preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
            walls.append(time.perf_counter() - started)
            print(f"  run {len(walls)}: {walls[-1]:.2f} s", flush=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return walls, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def sharing() -> tuple[float, float, bool]:
    """CPU seconds of the 30 searches with a cost cache per kind, and each alone; whether their plans agree."""
    shared_s = alone_s = 0.0
    same = True
    for kind in KINDS:
        cfg = compose_config(["+cfp=auto", *JOB, f"cluster={kind}"])
        job, cfp = job_from_config(cfg), cfp_from_config(cfg)
        partitions = partition_options(job)  # what cfp size and the preflight read (derived, cached by model)
        cache = CostCache.for_job(job, None, SimOptions())
        for nodes in NODES:
            sized = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, nodes=nodes))
            world = nodes * job.cluster.gpus_per_node
            t = time.process_time()
            with_cache = search(sized, world, cfp, cache=cache, partitions=partitions)
            shared_s += time.process_time() - t
            t = time.process_time()
            alone = search(sized, world, cfp, partitions=partitions)
            alone_s += time.process_time() - t
            same &= [(r.candidate, r.prediction.step_time_s) for r in with_cache.ranked] == \
                [(r.candidate, r.prediction.step_time_s) for r in alone.ranked]
    return shared_s, alone_s, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="whole-process runs (default 3)")
    parser.add_argument("--markdown", type=snippet.check_path, metavar="FILE.md",
                        help="also write the figures as a Markdown snippet for the docs (docs/figures/size.md)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: must be at least 1")
    first_line = snippet.header()
    command = "python -m cfp_megatron.size " + " ".join(SWEEP)
    print(f"whole process on two cores ({len(KINDS)} kinds x {len(NODES)} node counts): {command}")
    walls, cpu_s = whole_process(args.repeat)
    median = statistics.median(walls)
    print(f"median {median:.2f} s (target {TARGET_S:g} s), {cpu_s:.1f} CPU s over {len(walls)} runs")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    shared_s, alone_s, same = sharing()
    print(f"30 searches on one core: {shared_s:.2f} CPU s sharing a cost cache per kind, {alone_s:.2f} CPU s each "
          f"alone ({alone_s / shared_s:.2f}x); same plans: {same}")
    if args.markdown:
        runs = ", ".join(f"{w:.2f}" for w in walls)
        rows = [["whole process, two cores", f"{median:.2f} s median of {len(walls)} ({runs}); "
                 f"{cpu_s / len(walls):.1f} CPU s per run", f"{TARGET_S:g} s"],
                ["30 searches, a cost cache per kind", f"{shared_s:.2f} CPU s", ""],
                ["30 searches, each alone", f"{alone_s:.2f} CPU s ({alone_s / shared_s:.2f}x; same plans: "
                 f"{'yes' if same else 'NO'})", ""]]
        snippet.write(args.markdown, first_line, [f"`{command}`:", "", *snippet.table(["what", "time", "target"],
                                                                                      rows, "lll")])


if __name__ == "__main__":
    main()
