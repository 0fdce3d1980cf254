"""Capture + ParallelBlock analysis time of large presets, cold and cached, as a user runs it.

Run: ``python bench/analyze.py [--models llama3_405b deepseek_v3] [--tp 8] [--seq 4096]``. Each case is a fresh
``python -m cfp_megatron.analyze`` process (imports included); "cold" uses an empty cache directory, "cached" runs
the same command again. Prints figures, asserts nothing. Target: 10 s or less cold, 1 s with a cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _run(model: str, tp: int, seq: int, cache: str, out: str) -> tuple[float, dict]:
    env = {**os.environ, "CFP_CACHE_DIR": cache}
    cmd = [sys.executable, "-m", "cfp_megatron.analyze", f"model={model}", f"parallel.tp={tp}",
           f"train.seq_length={seq}", "--json", out]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
    with open(out) as fh:
        return elapsed, json.load(fh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["llama3_405b", "deepseek_v3"])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    print(f"{'model':<14} {'cold s':>7} {'cached s':>9} {'capture s':>10} {'blocks s':>9} {'classes':>8} "
          f"{'segments':>9} {'blocks/class':>14}")
    for model in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "a.json")
            cold, result = _run(model, args.tp, args.seq, tmp, out)
            cached, _ = _run(model, args.tp, args.seq, tmp, out)
        per_class = ",".join(str(len(c["blocks"])) for c in result["classes"])
        print(f"{model:<14} {cold:7.2f} {cached:9.2f} {result['seconds']['capture']:10.2f} "
              f"{result['seconds']['blocks']:9.2f} {len(result['classes']):8d} {result['segments']:9d} "
              f"{per_class:>14}")


if __name__ == "__main__":
    main()
