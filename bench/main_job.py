"""The README's main job, several times from an empty cache: is the profile complete, and does the plan check hold?

    python bench/main_job.py                 # 3 runs of `torchrun --nproc_per_node=4 launch/train.py +cfp=auto`
    python bench/main_job.py --runs 3 --nproc 4 -- train.steps=20
    python bench/main_job.py --load 0        # no loaded first run
    python bench/main_job.py --markdown docs/figures/main_job.md   # also the table as a snippet for the docs

The first run profiles under a background load (``--load N`` busy-loop processes, default one per core, ended when
the run ends), as on a newcomer's busy machine: its profile should say which rounds ran busy, and the next run, on
the quiet machine, should measure those again (its ``cfp: profiled ...`` line) rather than reuse them.

Each run uses one fresh ``CFP_CACHE_DIR`` (shared by the runs, empty before the first) and its own Hydra run
directory. Per run it prints the wall time, what the profile measured, reused and still missed (the launch's
``cfp: profile`` line), the plan, and the plan check (predicted vs measured step time and peak memory, from the run's
``metrics.jsonl``), with the load average before the run: a busy machine makes the plan check's step time
meaningless, and the check says so itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import snippet
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]


def busy_loops(count: int) -> list[subprocess.Popen[bytes]]:
    """``count`` processes that each keep one core busy until ended."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def one_run(i: int, cache: Path, out: Path, nproc: int, overrides: list[str], timeout: float,
            load_procs: int = 0) -> dict[str, object]:
    """Run the main job once (with ``load_procs`` busy loops beside it); what it printed and logged."""
    run_dir = out / f"run{i}"
    env = dict(os.environ, CFP_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
    cmd = ["torchrun", f"--nproc_per_node={nproc}", "launch/train.py", "+cfp=auto", f"hydra.run.dir={run_dir}",
           *overrides]
    loops = busy_loops(load_procs)
    try:
        load = os.getloadavg()[0]
        began = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        wall = time.perf_counter() - began
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    text = proc.stdout + proc.stderr
    (out / f"run{i}.log").write_text(text)
    profile = next((line.split("cfp: ", 1)[1] for line in text.splitlines() if "cfp: profile (budget" in line), "")
    plan = next((line.split("cfp: ", 1)[1] for line in text.splitlines()
                 if re.match(r"cfp: (plan|chose|planned)", line)), "")
    measured = next((line.split("cfp: ", 1)[1] for line in text.splitlines()
                     if re.match(r"cfp: (profiled in|reused the ProfileDB)", line)), "")
    busy_note = next((line.split("cfp: ", 1)[1] for line in text.splitlines()
                      if line.startswith("cfp: measured on a busy machine")), "")
    check: dict[str, object] = {}
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == "plan_check":
                check = record
    return {"rc": proc.returncode, "wall_s": wall, "load": load, "profile": profile, "plan": plan, "check": check,
            "loops": load_procs, "measured": measured.rsplit(" (", 1)[0], "busy_note": busy_note}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1,
                        help="busy-loop processes beside the first run (default: one per core; 0: none)")
    parser.add_argument("--keep", type=Path, default=None, help="folder for the cache, run dirs and logs (default: a "
                        "temporary one, removed at the end)")
    parser.add_argument("--markdown", type=snippet.check_path, metavar="FILE.md",
                        help="also write the table as a Markdown snippet for the docs (docs/figures/main_job.md)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides after --")
    args = parser.parse_args()
    first_line = snippet.header()
    console = Console() if sys.stdout.isatty() else Console(width=200)  # a log keeps the table's columns
    with tempfile.TemporaryDirectory(prefix="cfp-main-job-") as tmp:
        out = args.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        cache = out / "cache"
        console.print(f"{datetime.date.today()} {platform.node()} {os.cpu_count()} cores, empty cache {cache}")
        rows = []
        for i in range(1, args.runs + 1):
            row = one_run(i, cache, out, args.nproc, args.overrides, args.timeout, args.load if i == 1 else 0)
            rows.append(row)
            loops = f" with {row['loops']} busy loops" if row["loops"] else ""
            console.print(f"run {i}: rc {row['rc']}, {row['wall_s']:.1f} s, load {row['load']:.1f}{loops}; "
                          f"{row['profile'] or 'no profile line'}; {row['measured'] or 'no profiled/reused line'}",
                          markup=False)
            if row["busy_note"]:
                console.print(f"run {i}: {row['busy_note']}", markup=False)
        table = Table(title="main job from an empty cache")
        columns = ("run", "rc", "wall s", "load", "busy loops", "profile", "measured under", "pred ms", "meas ms",
                   "step diff", "pred MiB", "meas MiB", "mem diff", "busy")
        for col in columns:
            table.add_column(col)
        cells: list[list[str]] = []
        for i, row in enumerate(rows, 1):
            c = row["check"] if isinstance(row["check"], dict) else {}
            counts = re.findall(r"(\d+)/(\d+)", str(row["profile"]))
            complete = ("complete" if counts and all(a == b for a, b in counts) else "partial" if counts
                        else "?")
            under = str(row["measured"]).rsplit(", ", 1)[-1] if row["measured"] else "?"  # busy rounds, or quiet
            cells.append([str(i), str(row["rc"]), f"{row['wall_s']:.1f}", f"{row['load']:.1f}", str(row["loops"]),
                          complete, under,
                          *(("-",) * 7 if not c else (
                              f"{float(c['predicted_step_s']) * float(c.get('calibration', 1.0)) * 1e3:.1f}",
                              f"{float(c['measured_step_s']) * 1e3:.1f}", f"{float(c['step_time_diff']):+.1%}",
                              f"{float(c['predicted_peak_gib']) * 1024:.2f}",
                              f"{float(c['measured_peak_gib']) * 1024:.2f}", f"{float(c['memory_diff']):+.1%}",
                              str(c.get("busy") or "no")))])
            table.add_row(*cells[-1])
        console.print(table)
        if args.markdown:
            launch = shlex.join(["torchrun", f"--nproc_per_node={args.nproc}", "launch/train.py", "+cfp=auto",
                                 *args.overrides])
            lines = [f"`{launch}` {args.runs} times from one empty cache (`CFP_CACHE_DIR`, shared by the runs), the "
                     f"first beside {args.load} busy-loop processes: wall time of each run with the load average "
                     "before it, whether the profile was complete and under what load it was measured, and the plan "
                     "check (predicted against measured step time and peak memory).", "",
                     *snippet.table(list(columns), cells, "rrrrrllrrrrrrl"), "",
                     *(f"- run {i}: {row['profile'] or 'no profile line'}; {row['plan'] or 'no plan line'}"
                       for i, row in enumerate(rows, 1))]
            snippet.write(args.markdown, first_line, lines)
        console.print(f"logs: {out}" if args.keep else "logs removed (use --keep DIR to keep them)")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
