"""The grouped expert GEMM model against a GPU's measurement: ``python bench/grouped_gemm_check.py OPS_JSON
[--cluster h200]``, ``OPS_JSON`` being what ``bench/gpu_ops.py`` wrote (its ``grouped`` and ``gemm`` parts).

For each ``torch._grouped_mm`` row it prints the measured time, the simulator's (:meth:`KernelModel.grouped_gemm`
for the gated fc1 and the fc2, as ``bench/gpu_ops.py`` predicts them) and the error (predicted over measured, less
one), twice: as a step prices it (the efficiencies' dense GEMM rate) and with the dense rate set to what the same
run measured for the dense BF16 GEMMs (median), which isolates the shape of the model (tiles, waves, weights, launch)
from the end-to-end efficiency. Asserts nothing."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_ops import EXPERTS, LOCAL_EXPERTS, sim_kernels  # noqa: E402


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", type=Path, help="the JSON bench/gpu_ops.py wrote")
    parser.add_argument("--cluster", default="h200", help="the preset the GPU is (default h200)")
    args = parser.parse_args()
    ops = json.loads(args.ops.read_text())
    rows = [r for r in ops["parts"]["grouped"]["rows"] if r.get("impl") == "torch._grouped_mm" and "measured_s" in r]
    dense = [r["measured_tflops"] for r in ops["parts"].get("gemm", {}).get("rows", []) if r.get("dtype") == "bf16"]
    _, kernels, _ = sim_kernels(args.cluster)
    runs = [("as priced", None)] + ([("dense rate measured", statistics.median(dense))] if dense else [])
    print(f"{'case':26s} {'measured us':>11s} " + " ".join(f"{name + ' us':>24s} {'error':>7s}" for name, _ in runs))
    errors: dict[str, list[float]] = {name: [] for name, _ in runs}
    for r in rows:
        hidden, ffn = EXPERTS[r["case"].split()[0]]
        m = r["tokens_per_expert"]
        line = f"{r['case']:26s} {r['measured_s'] * 1e6:11.1f} "
        for name, tflops in runs:
            _, model, _ = sim_kernels(args.cluster)
            if tflops is not None:
                model.gemm_flops_per_s = tflops * 1e12
            predicted = (model.grouped_gemm(LOCAL_EXPERTS, m, 2 * ffn, hidden)
                         + model.grouped_gemm(LOCAL_EXPERTS, m, hidden, ffn))
            error = predicted / r["measured_s"] - 1.0
            errors[name].append(error)
            line += f"{predicted * 1e6:24.1f} {error:+7.1%} "
        print(line)
    for name, tflops in runs:
        rate = f" (dense {tflops:.0f} TFLOP/s)" if tflops else f" (dense {kernels.gemm_flops_per_s / 1e12:.0f})"
        values = errors[name]
        if values:
            print(f"{name}{rate}: mean |error| {statistics.mean(map(abs, values)):.1%}, "
                  f"from {min(values):+.1%} to {max(values):+.1%}")


if __name__ == "__main__":
    main()
