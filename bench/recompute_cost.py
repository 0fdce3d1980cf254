"""What recomputation costs in step time on this machine, measured against the simulator.

Run: ``python bench/recompute_cost.py [--recompute selective] [--nproc 4] [--steps 12] [--gbs 16] [--seq 64]
[--layouts dp4-tp1-pp1-mb4 dp2-tp1-pp2-mb8 ...]``.

Profiles the machine once (``torchrun -m cfp_megatron.profile``, reused from the ProfileDB in ``CFP_CACHE_DIR`` when
present), then trains each layout of ``gpt_tiny`` with no recomputation and with ``--recompute``, interleaved as
none, recompute, recompute, none, so a drift of the shared machine's speed that is linear in time cancels in the
ratio. Prints, per layout, the measured step times and their ratio next to the simulator's, then the mean ratios.
The ratio isolates what the recomputation adds from the rest of the step-time model. Asserts nothing; run it alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_layouts import Layout, _torchrun, measure, predict  # noqa: E402

DEFAULT_LAYOUTS = ["dp4-tp1-pp1-mb4", "dp2-tp1-pp2-mb8", "dp1-tp4-pp1-mb4", "dp2-tp2-pp1-mb2", "dp1-tp1-pp4-mb2"]
"""Layouts measured by default: each parallel kind of the 4-rank space once."""


def parse_layout(text: str) -> Layout:
    """``dp2-tp1-pp2-mb8`` as a :class:`Layout`; a clear error otherwise."""
    try:
        sizes = dict((part[:2], int(part[2:])) for part in text.split("-"))
        return Layout(dp=sizes["dp"], tp=sizes["tp"], pp=sizes["pp"], micro_batch=sizes["mb"])
    except (KeyError, ValueError) as err:
        raise SystemExit(f"--layouts: {text!r} is not like dp2-tp1-pp2-mb8 ({err})") from err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recompute", choices=("selective", "full"), default="selective")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--gbs", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--budget", type=int, default=120, help="profiling budget in seconds (all rounds)")
    parser.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS)
    args = parser.parse_args()
    layouts = [parse_layout(text) for text in args.layouts]
    base = [f"train.global_batch_size={args.gbs}", f"train.seq_length={args.seq}"]
    choice = {"none": [*base, "parallel.recompute=none"],
              args.recompute: [*base, f"parallel.recompute={args.recompute}"]}
    if args.recompute == "full":
        choice["full"] += ["parallel.recompute_method=uniform", "parallel.recompute_num_layers=1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    measured_ratios, predicted_ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        profile = _torchrun(args.nproc, ["-m", "cfp_megatron.profile", "model=gpt_tiny", *base, "--budget",
                                         str(args.budget)], work, env)
        if profile.returncode != 0:
            raise SystemExit(f"profiling failed\n{profile.stderr[-4000:]}")
        print(f"{'layout':<22} {'none ms':>9} {args.recompute + ' ms':>13} {'ratio':>6} | {'pred none':>9} "
              f"{'pred ' + args.recompute:>14} {'ratio':>6}")
        for layout in layouts:
            times: dict[str, list[float]] = {name: [] for name in choice}
            for name in ["none", args.recompute, args.recompute, "none"]:
                t, _ = measure(layout, args.nproc, "gpt_tiny", choice[name], args.steps, env,
                               work / f"{name}{len(times[name])}")
                times[name].append(t)
            none, other = statistics.fmean(times["none"]), statistics.fmean(times[args.recompute])
            pred_none = predict(layout, args.nproc, "gpt_tiny", choice["none"])[0]
            pred_other = predict(layout, args.nproc, "gpt_tiny", choice[args.recompute])[0]
            measured_ratios.append(other / none)
            predicted_ratios.append(pred_other / pred_none)
            print(f"{str(layout):<22} {none * 1e3:9.1f} {other * 1e3:13.1f} {other / none:6.3f} | "
                  f"{pred_none * 1e3:9.1f} {pred_other * 1e3:14.1f} {pred_other / pred_none:6.3f}", flush=True)
    print(f"{args.recompute} / none: measured {statistics.fmean(measured_ratios):.3f}, predicted "
          f"{statistics.fmean(predicted_ratios):.3f} (mean over {len(layouts)} layouts)")


if __name__ == "__main__":
    main()
