"""Capture time of large presets: cold (build on meta + record one layer per kind) and cached (summary from disk).

Run: ``python bench/capture.py [--models llama3_405b deepseek_v3] [--seq 4096] [--mbs 1]``. Prints figures, asserts
nothing. The cache goes to a fresh temporary directory unless ``--cache-dir`` is given, so "cold" is really cold.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _one(model: str, seq: int, mbs: int) -> None:
    """Child process: import, capture through the cache, print one line of figures and the per-kind table."""
    t0 = time.perf_counter()
    import yaml

    from cfp_megatron.base.config import job_from_config
    from cfp_megatron.model import cache

    with open(ROOT / "conf" / "model" / f"{model}.yaml") as fh:
        job = job_from_config({"model": yaml.safe_load(fh)})
    key = cache.cache_key(cache.job_cache_inputs(job, seq_length=seq, micro_batch_size=mbs))
    t1 = time.perf_counter()
    summary = cache.load(key)
    hit = summary is not None
    t2 = t3 = time.perf_counter()
    if summary is None:
        from cfp_megatron.model.capture import capture_job  # torch + Megatron

        t2 = time.perf_counter()
        summary = capture_job(job, seq_length=seq, micro_batch_size=mbs).summary()
        cache.store(key, summary)
        t3 = time.perf_counter()
    print(f"  cache {'hit ' if hit else 'miss'}  config {t1 - t0:5.2f} s  cache read {t2 - t1 if hit else 0:5.2f} s  "
          f"torch+megatron import {0 if hit else t2 - t1:5.2f} s  capture+store {t3 - t2:5.2f} s  "
          f"total {time.perf_counter() - t0:5.2f} s")
    print(f"  params {summary.total_params / 1e9:.2f} B   FLOPs per micro-batch step {summary.total_flops:.3e}")
    print(f"    {'kind':<10} {'count':>5} {'params':>14} {'FLOPs/instance':>16} {'fwd FLOPs':>12} {'ops':>6}")
    for k in summary.kinds.values():
        print(f"    {k.kind:<10} {k.count:>5} {k.params:>14,} {k.flops:>16.3e} {k.forward_flops:>12.3e} "
              f"{k.operators:>6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["llama3_405b", "deepseek_v3"])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _one(args.child, args.seq, args.mbs)
        return
    cache = args.cache_dir or tempfile.mkdtemp(prefix="cfp-capture-bench-")
    env = {**os.environ, "CFP_CACHE_DIR": cache, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    print(f"seq_length {args.seq}, micro_batch_size {args.mbs}, cache {cache}")
    for model in args.models:
        for label in ("cold", "cached"):
            print(f"{model} ({label}, fresh process)")
            cmd = [sys.executable, "-W", "ignore", __file__, "--child", model, "--seq", str(args.seq),
                   "--mbs", str(args.mbs)]
            start = time.perf_counter()
            subprocess.run(cmd, env=env, check=True)
            print(f"  process wall time (interpreter start included) {time.perf_counter() - start:6.2f} s")


if __name__ == "__main__":
    main()
