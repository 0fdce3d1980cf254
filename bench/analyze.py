"""Capture + ParallelBlock analysis time of large presets, cold and cached, as a user runs it.

Run: ``python bench/analyze.py [--models llama3_405b deepseek_v3] [--tp 8] [--seq 4096] [--nodes 1]
[--markdown docs/figures/analyze.md]`` (``--markdown``: also the figures as a snippet for the docs). With
``--nodes 2`` the job spans two DGX H100 nodes, so the mesh is 2-D (dp x tp) (MoE models then also get EP = TP).
MoE models with TP get sequence parallelism, as Megatron-Core needs for MoE layers with TP. Each case is a fresh
``python -m cfp_megatron.analyze`` process (imports included); "cold" uses an empty cache directory, "cached" runs
the same command again. Prints figures, asserts nothing. Target: 10 s or less cold, 1 s with a cache.

``--derive``: the planner's analysis stage instead (:func:`cfp_megatron.model.derive.partition_options`, what the
search reads): each model in a fresh process with an empty cache (cold: the whole process, imports, capture and
derivation), then in a fresh process with that cache, the seconds the stage's call takes (what a preflight spends on
it). Targets: 5 s cold, 0.1 s warm. ``--options FILE.md``: the derived options of each model as Markdown tables
(the docs' table per preset; from the cache where the stage ran before).
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
            cmd += [f"parallel.ep={tp}"]
    if model in MOE and tp > 1:
        cmd += ["parallel.sp=true"]  # Megatron-Core needs sequence parallelism for MoE layers with TP
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


_STAGE = """
import json, sys, time
from cfp_megatron.base.compose import compose_job
from cfp_megatron.compat.quiet import quiet_expected_warnings, say_once
from cfp_megatron.model import derive
say_once(quiet_expected_warnings(distributed=False))
job = compose_job(["model=" + sys.argv[1]], typed=True, runs_hydra=False)
start = time.perf_counter()
options = derive.partition_options(job)
print(json.dumps({"stage_s": time.perf_counter() - start, "options": len(options)}))
"""
"""One planning stage in a fresh process: the stage's seconds and the options it gave, as JSON."""


def _stage(model: str, cache: str) -> tuple[float, float, dict]:
    """Wall and CPU seconds of a fresh process running the stage, and what it printed."""
    env = {**os.environ, "CFP_CACHE_DIR": cache}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _STAGE, model], env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return elapsed, cpu, json.loads(proc.stdout.strip().splitlines()[-1])


def derive_main(models: list[str], markdown: str | None) -> None:
    """The ``--derive`` figures (module docstring)."""
    first_line = snippet.header()
    print(f"{'model':<14} {'cold s':>7} {'cpu s':>6} {'warm stage s':>13} {'options':>8}")
    rows = []
    for model in models:
        with tempfile.TemporaryDirectory() as tmp:
            cold, cold_cpu, _ = _stage(model, tmp)
            _, _, warm = _stage(model, tmp)
        print(f"{model:<14} {cold:7.2f} {cold_cpu:6.2f} {warm['stage_s']:13.4f} {warm['options']:8d}")
        rows.append([model, f"{cold:.2f}", f"{cold_cpu:.2f}", f"{warm['stage_s']:.4f}", str(warm["options"])])
    if markdown:
        lines = ["The planner's analysis stage (the partition options derived from the ParallelBlocks): cold, a fresh "
                 "process with an empty cache (imports, capture and derivation), in wall and CPU seconds; warm, the "
                 "seconds the stage takes in a fresh process with that cache (what a preflight spends on it). "
                 "Targets: 5 s cold, 0.1 s warm.", "",
                 *snippet.table(["model", "cold s", "cold CPU s", "warm stage s", "options"], rows, "lrrrr")]
        snippet.write(markdown, first_line, lines)


def options_tables(models: list[str], markdown: str) -> None:
    """The derived options of each model, one Markdown table each (``--options``)."""
    from cfp_megatron.base.compose import compose_job
    from cfp_megatron.compat.quiet import quiet_expected_warnings, say_once
    from cfp_megatron.model.derive import options_report

    say_once(quiet_expected_warnings(distributed=False))
    first_line = snippet.header()
    lines = ["The partition options derived from each preset's ParallelBlocks (`python bench/analyze.py --options "
             f"{markdown}`): the block as the probe mesh of 2 ranks placed it, the sizes its checks read from the "
             "block's sharded dimensions, the layer kinds it was found in, and whether Megatron-Core runs it."]
    for model in models:
        job = compose_job([f"model={model}"], typed=True, runs_hydra=False)
        rows = [[o["part"], o["name"], o["knob"], "=".join(o["choice"]) if o["choice"] else "(default)", o["block"],
                 ", ".join(f"{k}={v}" for k, v in o["sizes"].items()) or "-", ", ".join(o["kinds"]),
                 "yes" if o["offered"] else o["rule"].removeprefix("lacks:")] for o in options_report(job)]
        lines += ["", f"**{model}**", "",
                  *snippet.table(["part", "option", "splits by", "selected by", "block", "sizes read", "layer kinds",
                                  "offered"], rows, "llllllll")]
        print(f"{model}: {len(rows)} options")
    snippet.write(markdown, first_line, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["llama3_405b", "deepseek_v3"])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--nodes", type=int, default=1, help="nodes of 8 GPUs; 2 or more gives a 2-D mesh")
    parser.add_argument("--markdown", type=snippet.check_path, metavar="FILE.md",
                        help="also write the figures as a Markdown snippet for the docs (docs/figures/analyze.md)")
    parser.add_argument("--derive", action="store_true", help="time the planner's analysis stage instead")
    parser.add_argument("--options", type=snippet.check_path, metavar="FILE.md",
                        help="write the derived options of each model as Markdown tables")
    args = parser.parse_args()
    if args.options:
        options_tables(args.models, args.options)
        return
    if args.derive:
        derive_main(args.models, args.markdown)
        return
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
