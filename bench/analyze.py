"""Capture + ParallelBlock analysis time of large presets, cold and cached, as a user runs it.

Run: ``python bench/analyze.py [--models llama3_405b deepseek_v3] [--tp 8] [--seq 4096] [--nodes 1]
[--markdown docs/figures/analyze.md]`` (``--markdown``: also the figures as a snippet for the docs). With
``--nodes 2`` the job spans two DGX H100 nodes, so the mesh is 2-D (dp x tp) (MoE models then also get EP = TP and
sequence parallelism, as Megatron needs for MoE with TP). Each case is a fresh
``python -m cfp_megatron.analyze`` process (imports included); "cold" uses an empty cache directory, "cached" runs
the same command again. Prints figures, asserts nothing. Target: 10 s or less cold, 1 s with a cache.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import snippet

MOE = ("deepseek_v3", "mixtral_8x7b", "moe_tiny")
"""Presets with experts."""


def _run(model: str, tp: int, seq: int, nodes: int, cache: str, out: str) -> tuple[float, float, dict]:
    """Wall seconds, CPU seconds (user + system; what other work on the machine does not inflate) and the result."""
    env = {**os.environ, "CFP_CACHE_DIR": cache}
    cmd = [sys.executable, "-m", "cfp_megatron.analyze", f"model={model}", f"parallel.tp={tp}",
           f"train.seq_length={seq}"]
    if nodes > 1:
        cmd += ["cluster=dgx_h100", f"cluster.nodes={nodes}"]
        if model in MOE:
            cmd += [f"parallel.ep={tp}", "parallel.sp=true"]
    cmd += ["--json", out]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
    with open(out) as fh:
        return elapsed, cpu, json.load(fh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["llama3_405b", "deepseek_v3"])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--nodes", type=int, default=1, help="nodes of 8 GPUs; 2 or more gives a 2-D mesh")
    parser.add_argument("--markdown", type=snippet.check_path, metavar="FILE.md",
                        help="also write the figures as a Markdown snippet for the docs (docs/figures/analyze.md)")
    args = parser.parse_args()
    first_line = snippet.header()
    rows: list[list[str]] = []
    print(f"mesh: {args.nodes * 8 // args.tp} x {args.tp} (dp x tp)" if args.nodes > 1 else f"mesh: tp={args.tp}")
    print(f"{'model':<14} {'cold s':>7} {'cpu s':>6} {'cached s':>9} {'cpu s':>6} {'capture s':>10} "
          f"{'blocks s':>9} {'classes':>8} "
          f"{'segments':>9} {'blocks/class':>14}")
    for model in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "a.json")
            cold, cold_cpu, result = _run(model, args.tp, args.seq, args.nodes, tmp, out)
            cached, cached_cpu, _ = _run(model, args.tp, args.seq, args.nodes, tmp, out)
        per_class = ",".join(str(len(c["blocks"])) for c in result["classes"])
        print(f"{model:<14} {cold:7.2f} {cold_cpu:6.2f} {cached:9.2f} {cached_cpu:6.2f} "
              f"{result['seconds']['capture']:10.2f} "
              f"{result['seconds']['blocks']:9.2f} {len(result['classes']):8d} {result['segments']:9d} "
              f"{per_class:>14}")
        rows.append([model, f"{cold:.2f}", f"{cold_cpu:.2f}", f"{cached:.2f}", f"{cached_cpu:.2f}",
                     f"{result['seconds']['capture']:.2f}",
                     f"{result['seconds']['blocks']:.2f}", str(len(result["classes"])), str(result["segments"]),
                     per_class])
    if args.markdown:
        mesh = (f"a 2-D mesh of {args.nodes} DGX H100 nodes, {args.nodes * 8 // args.tp} x {args.tp} (dp x tp)"
                if args.nodes > 1 else f"tp={args.tp}")
        lines = [f"Capture and ParallelBlock analysis, {mesh}, seq {args.seq}: each case a fresh `python -m "
                 f"cfp_megatron.analyze` process (imports included), cold (empty cache) then cached, in wall and CPU "
                 f"seconds (user + system: on a busy machine the wall time grows, the CPU time much less). Target: "
                 f"10 s cold, 1 s cached.", "",
                 *snippet.table(["model", "cold s", "cold CPU s", "cached s", "cached CPU s", "capture s",
                                 "blocks s", "classes", "segments",
                                 "blocks per class"], rows, "lrrrrrrrrr")]
        snippet.write(args.markdown, first_line, lines)


if __name__ == "__main__":
    main()
