"""Simulator accuracy against published runs, leave-one-source-out cross-validation, and simulator speed.

    python bench/validate.py                 # figures with the shipped (fitted) efficiencies
    python bench/validate.py --fit           # refit the efficiencies on the whole file and print them
    python bench/validate.py --fit --write   # ... and write them to cfp_megatron/sim/efficiencies.json
    python bench/validate.py --loso          # also leave-one-source-out: refit without each source, predict it
                                             # (Nelder-Mead; beside it the linearised fit of validate --bands)
    python bench/validate.py --markdown docs/figures/validate.md   # also the figures as a snippet for the docs

Prints MAPE overall, per source, on the Korthikanti et al. Table 5 runs, leave-one-source-out MAPE, and
``simulate()`` calls per second. With ``--markdown`` it also writes those figures, and the per-class MAPE and the
layout sweeps' totals that ``python -m cfp_megatron.validate`` prints over ``--classes`` files (both shipped files by
default), as a Markdown
snippet whose first line gives the command, the date and the machine. The fit minimises MAPE per GPU generation
with Nelder-Mead on log-parameters (scipy), from the same neutral starting point (``NEUTRAL``); it never looks at row
ids or model names. ``--write`` stores the fit in the efficiencies file the simulator loads
(``cfp_megatron/sim/efficiencies.json``): the generations with rows in the file fitted, with this run as their source,
the others as the file had them (fitted earlier, or borrowing another generation's).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import snippet  # noqa: E402

from cfp_megatron.base.errors import CfpError  # noqa: E402
from cfp_megatron.base.files import write_atomic  # noqa: E402
from cfp_megatron.base.number_format import NumberFormat  # noqa: E402
from cfp_megatron.sim.calibration import (  # noqa: E402
    EFFICIENCIES_FILE,
    FITTED,
    GENERATION_FIELDS,
    TABLE,
    Borrowed,
    Efficiency,
    EfficiencyTable,
    FitSource,
    efficiencies_text,
    generation,
)
from cfp_megatron.sim.simulate import simulate  # noqa: E402
from cfp_megatron.validate import (  # noqa: E402
    RowPlan,
    class_errors,
    has_step_time,
    predict_rows,
    read_rows,
    row_plan,
)
from cfp_megatron.validate import mape as row_mape  # noqa: E402
from cfp_megatron.validation.bands import held_out_predictions  # noqa: E402
from cfp_megatron.validation.fit import BOUNDS, MIN_ROWS_FULL_FIT, NEUTRAL, source_of  # noqa: E402
from cfp_megatron.validation.report import rows_by_id  # noqa: E402
from cfp_megatron.validation.rows import PUBLISHED_RUNS  # noqa: E402
from cfp_megatron.validation.superseded import set_apart  # noqa: E402
from cfp_megatron.validation.sweeps import find_sweeps, sweep_lines  # noqa: E402

DEFAULT_CSV = PUBLISHED_RUNS[0]
def load(csv_path: Path) -> tuple[list[RowPlan], list[tuple[str, str]]]:
    plans, skipped = [], []
    for row in read_rows(csv_path):
        try:
            plans.append(row_plan(row))
        except CfpError as err:
            skipped.append((row.get("id", "?"), str(err)))
    return plans, skipped


def errors(plans: list[RowPlan], effs: dict[str, Efficiency]) -> list[float]:
    out = []
    for p in plans:
        pred = simulate(p.job, options=p.options, efficiency=effs[generation(p.job.cluster)]).step_time_s
        out.append(100.0 * (pred - p.measured_s) / p.measured_s)
    return out


def mape(errs: list[float]) -> float:
    return sum(abs(e) for e in errs) / len(errs) if errs else math.nan


def fit_generation(plans: list[RowPlan], start: Efficiency, names: list[str], effs: dict[str, Efficiency],
                   gen: str, maxiter: int) -> Efficiency:
    """Minimise MAPE over ``plans`` (all of generation ``gen``) by tuning ``names``."""
    from scipy.optimize import minimize

    def make(x) -> Efficiency:
        vals = {}
        for n, v in zip(names, x, strict=True):
            lo, hi = BOUNDS[n]
            vals[n] = min(max(math.exp(v), lo), hi)
        return start.replace(**vals)

    def objective(x) -> float:
        trial = dict(effs)
        trial[gen] = make(x)
        return mape(errors(plans, trial))

    x0 = [math.log(getattr(start, n)) for n in names]
    res = minimize(objective, x0, method="Nelder-Mead", options={"maxiter": maxiter, "xatol": 1e-3, "fatol": 1e-3})
    best = make(res.x)
    return best.replace(**{n: float(f"{getattr(best, n):.3g}") for n in names})


def fit(plans: list[RowPlan], base: dict[str, Efficiency], maxiter: int,
        borrowed: dict[str, Borrowed] = TABLE.borrowed, fields: list[str] | None = None) -> dict[str, Efficiency]:
    """Fit every generation that has rows, most rows first. A field a generation's rows cannot pin down (FP8 GEMMs
    without FP8 rows, everything but the GEMM efficiencies with fewer than
    ``MIN_ROWS_FULL_FIT`` rows) is taken from the generation that could fit it. A generation without rows that
    ``borrowed`` names gets the efficiencies of the one it uses (the efficiencies file's ``borrowed``). ``fields``:
    tune only these, the others kept as ``base`` has them."""
    effs = dict(base)
    by_gen: dict[str, list[RowPlan]] = {}
    for p in plans:
        by_gen.setdefault(generation(p.job.cluster), []).append(p)
    order = sorted(by_gen, key=lambda g: -len(by_gen[g]))
    for gen in order:
        rows = by_gen[gen]
        has = {"gemm": any(not NumberFormat.of(p.job.train).low for p in rows),
               "gemm_fp8": any(NumberFormat.of(p.job.train).low for p in rows)}
        start = effs.get(gen, NEUTRAL)
        if len(rows) >= MIN_ROWS_FULL_FIT:
            names = [n for n in GENERATION_FIELDS if has.get(n, True)]
        else:
            names = [n for n in ("gemm", "gemm_fp8") if has[n]]
            donor = effs[order[0]]
            start = donor.replace(**{n: getattr(start, n) for n in ("gemm", "gemm_fp8")})
        if fields is not None:
            names, start = [n for n in names if n in fields], effs.get(gen, NEUTRAL)
        effs[gen] = fit_generation(rows, start, names, effs, gen, maxiter) if names else start
    for gen, b in borrowed.items():  # no calibration rows: the generation it borrows from (efficiencies.json)
        if gen not in by_gen and b.uses in effs:
            effs[gen] = effs[b.uses]
    return effs


def fitted_table(effs: dict[str, Efficiency], plans: list[RowPlan], *, data: str, written_by: str, date: str,
                 base: EfficiencyTable = TABLE) -> EfficiencyTable:
    """The efficiencies file's content after a fit on ``plans``: each generation with rows fitted (``effs``), with
    this run (``written_by``, ``date``, ``data``, its row count) as its source; the others as ``base`` has them."""
    rows = collections.Counter(generation(p.job.cluster) for p in plans)
    fitted, sources = dict(base.fitted), dict(base.sources)
    for gen, count in sorted(rows.items()):
        refit = Efficiency(**{n: float(f"{getattr(effs[gen], n):.3g}") for n in GENERATION_FIELDS})
        if refit != fitted.get(gen):  # a generation the fit left as it was keeps its source
            fitted[gen] = refit
            sources[gen] = FitSource(written_by=written_by, date=date, data=data, rows=count)
    borrowed = {gen: b for gen, b in base.borrowed.items() if gen not in rows}
    return EfficiencyTable(fitted=fitted, sources=sources, borrowed=borrowed, fallback=base.fallback)


def write_efficiencies(table: EfficiencyTable, path: Path = EFFICIENCIES_FILE) -> Path:
    """Write ``table`` as the efficiencies file the simulator loads (``calibration.read_efficiencies`` reads it)."""
    return write_atomic(path, efficiencies_text(table), key="--write")


def search_speed() -> tuple[float, int]:
    """simulate() calls per second over the (TP, PP, VPP, micro-batch, recompute) plans of LLaMA-3-70B on 1,024
    H100s (128 DGX nodes), the kind of sweep the search runs; returns (calls/s, plans)."""
    from cfp_megatron.base.config import job_from_config
    from cfp_megatron.validate import load_preset

    cluster = {**load_preset("dgx_h100"), "nodes": 128}
    model = {"name": "llama3_70b", "num_layers": 80, "hidden_size": 8192, "ffn_hidden_size": 28672,
             "num_attention_heads": 64, "num_query_groups": 8, "vocab_size": 128256, "activation": "swiglu",
             "max_position_embeddings": 8192, "position_embedding": "rope", "normalization": "RMSNorm",
             "add_bias_linear": False, "tie_embeddings": False}
    jobs = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 5, 8, 10, 16):
            for vpp in (None, 2):
                for mb in (1, 2, 4):
                    for rc in ("none", "selective", "full"):
                        if vpp and (pp == 1 or 80 % (pp * vpp)):
                            continue
                        cfg = {"model": model, "cluster": cluster,
                               "parallel": {"tp": tp, "pp": pp, "vpp": vpp, "sp": tp > 1, "recompute": rc,
                                            "distributed_optimizer": True, "overlap_grad_reduce": True},
                               "train": {"global_batch_size": 2048, "micro_batch_size": mb, "seq_length": 8192}}
                        try:
                            job = job_from_config(cfg)
                            simulate(job)
                        except CfpError:
                            continue
                        jobs.append(job)
    n, t0, cpu0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < 2.0:
        for job in jobs:
            simulate(job)
            n += 1
    return n / (time.process_time() - cpu0), len(jobs)  # per CPU second: other work on the machine does not count


def speed(plans: list[RowPlan]) -> float:
    """simulate() calls per CPU second over the file's plans (each simulated once per round)."""
    n, t0, cpu0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < 2.0:
        for p in plans:
            simulate(p.job, options=p.options)
            n += 1
    return n / (time.process_time() - cpu0)


def class_lines(paths: list[Path]) -> list[str]:
    """Coverage, per-class MAPE and the layout sweeps' totals over ``paths`` as ``python -m cfp_megatron.validate``
    computes them, as Markdown; then each file alone where there are several."""
    rows = [row for path in paths for row in read_rows(path)]
    modelled, _ = predict_rows(rows)
    superseded = set_apart(modelled, rows_by_id(rows))  # rows their source re-measured: not in the figures
    results = [r for r in modelled if r.plan.row_id not in superseded]
    errs_all = [abs(r.error_pct) for r in results]
    table = [["all", str(len(results)), f"{row_mape(results):.2f}%", f"{max(errs_all):.1f}%"]]
    for name, errs in sorted(class_errors(results, {row.get("id", ""): row for row in rows}).items()):
        table.append([name, str(len(errs)), f"{sum(errs) / len(errs):.2f}%", f"{max(errs):.1f}%"])
    sweeps = sweep_lines(find_sweeps(results, rows_by_id(rows)))[-1]  # the totals as validate prints them
    shipped = [p.resolve() for p in paths] == [p.resolve() for p in PUBLISHED_RUNS]
    files = "" if shipped else " " + " ".join(_shown(p) for p in paths)  # validate reads the shipped runs by default
    lines = [f"Step-time error per class, `python -m cfp_megatron.validate{files}`: "
             f"{len(modelled)} of {sum(has_step_time(r) for r in rows)} rows with a step time modelled"
             + (f", {len(superseded)} of them superseded by their source and set apart (MAPE over all modelled "
                f"rows {row_mape(modelled):.2f}%)." if superseded else "."), "",
             *snippet.table(["class", "rows", "MAPE", "max error"], table), "",
             sweeps[:1].upper() + sweeps[1:] + ".", ""]
    if len(paths) > 1:
        for path in paths:
            alone = [r for r in predict_rows(read_rows(path))[0] if r.plan.row_id not in superseded]
            lines.append(f"- `{path.name}` alone: MAPE {row_mape(alone):.2f}% over {len(alone)} rows.")
        lines.append("")
    return lines


def _shown(path: Path) -> str:
    """``path`` as the docs write it: relative to the repository root where it can be (``cfp_megatron/...``,
    ``../shared/...``)."""
    root = Path(__file__).resolve().parent.parent
    for base, shown in ((root, Path()), (root.parent, Path(".."))):
        if path.resolve().is_relative_to(base):
            return str(shown / path.resolve().relative_to(base))
    return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--fit", action="store_true", help="refit the efficiencies on the whole file and print them")
    ap.add_argument("--write", type=Path, nargs="?", const=EFFICIENCIES_FILE, default=None, metavar="FILE.json",
                    help="with --fit: write them to FILE.json (default: cfp_megatron/sim/efficiencies.json, the "
                         "file the simulator loads)")
    ap.add_argument("--loso", action="store_true", help="leave-one-source-out cross-validation (refits; slow)")
    ap.add_argument("--maxiter", type=int, default=400)
    ap.add_argument("--fields", nargs="+", choices=GENERATION_FIELDS, metavar="FIELD",
                    help="with --fit: tune only these efficiencies (e.g. gemm_fp8), starting from the shipped ones")
    ap.add_argument("--markdown", type=snippet.check_path, metavar="FILE.md",
                    help="also write the figures as a Markdown snippet for the docs (docs/figures/validate.md)")
    ap.add_argument("--classes", type=Path, nargs="+", default=list(PUBLISHED_RUNS), metavar="FILE.csv",
                    help="files of the snippet's per-class table")
    args = ap.parse_args()
    if args.write is not None and not args.fit:
        ap.error("--write stores a fit: pass --fit too")
    first_line = snippet.header()
    plans, skipped = load(args.csv)
    effs = dict(FITTED)
    if args.fit:
        start = dict(FITTED) if args.fields else {g: NEUTRAL for g in FITTED}
        effs = fit(plans, start, args.maxiter, fields=args.fields)
        table = fitted_table(effs, plans, data=_shown(args.csv), written_by=snippet.command_line(),
                             date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"))
        print(efficiencies_text(table), end="")
        if args.write is not None:
            print(f"efficiencies written to {write_efficiencies(table, args.write)}")
    errs = errors(plans, effs)
    print(f"rows modelled {len(plans)}, not modelled {len(skipped)}")
    print(f"MAPE overall: {mape(errs):.2f}% over {len(errs)} rows (max |error| {max(abs(e) for e in errs):.1f}%)")
    sources = sorted({source_of(p) for p in plans})
    per_source: list[list[str]] = []
    for s in sources:
        e = [x for p, x in zip(plans, errs, strict=True) if source_of(p) == s]
        print(f"  {s:<42} {mape(e):6.2f}% over {len(e)} rows")
        full = next(p.source for p in plans if source_of(p) == s).split(",")[0].split("(")[0].strip()
        per_source.append([full, str(len(e)), f"{mape(e):.2f}%", "", ""])
    t5 = [x for p, x in zip(plans, errs, strict=True) if "Table 5" in _detail(p)]
    t5_new = [x for p, x in zip(plans, errs, strict=True) if "Table 5" in _detail(p) and "present work" in _detail(p)]
    print(f"Korthikanti Table 5, present work (SP + selective): {mape(t5_new):.2f}% over {len(t5_new)} rows")
    print(f"Korthikanti Table 5, all end-to-end rows: {mape(t5):.2f}% over {len(t5)} rows")
    loso = ""
    if args.loso:
        fast = held_out_predictions(plans)  # what validate --bands computes, for comparison
        all_errs: list[float] = []
        for i, s in enumerate(sources):
            train = [p for p in plans if source_of(p) != s]
            test = [p for p in plans if source_of(p) == s]
            effs_s = fit(train, {g: NEUTRAL for g in FITTED}, args.maxiter)
            e = errors(test, effs_s)
            all_errs += e
            quick = [100.0 * (fast[p.row_id] - p.measured_s) / p.measured_s for p in test]
            print(f"  leave out {s:<42} test MAPE {mape(e):6.2f}% over {len(e)} rows (linearised fit, "
                  f"validate --bands: {mape(quick):6.2f}%)")
            per_source[i][3:] = [f"{mape(e):.2f}%", str(len(e))]
        print(f"leave-one-source-out MAPE: {mape(all_errs):.2f}% over {len(all_errs)} rows")
        loso = (f" Leave-one-source-out (refit without the source from the neutral starting point, predict it): "
                f"MAPE {mape(all_errs):.2f}% over {len(all_errs)} rows.")
    file_rate = speed(plans)
    print(f"simulate() calls per second, rows of the file (up to 65k pipeline passes each): {file_rate:.0f}")
    rate, count = search_speed()
    print(f"simulate() calls per second, {count} LLaMA-3-70B plans on 1,024 H100s: {rate:.0f}")
    if args.markdown:
        efficiencies = "refitted on the whole file (`--fit`)" if args.fit else "the shipped efficiencies"
        columns = ["source", "rows", "MAPE", "left out: MAPE", "rows"] if args.loso else ["source", "rows", "MAPE"]
        lines = [*class_lines(args.classes),
                 f"`{args.csv.name}` with {efficiencies}, the {len(plans)} rows that state their layout: MAPE "
                 f"{mape(errs):.2f}% (largest error {max(abs(e) for e in errs):.1f}%); Korthikanti et al. Table 5, "
                 f"the four end-to-end runs (SP + selective recompute) {mape(t5_new):.2f}%, all {len(t5)} "
                 f"end-to-end rows {mape(t5):.2f}%.{loso}",
                 "", *snippet.table(columns, [row[:len(columns)] for row in per_source]), "",
                 f"`simulate()` runs {rate:,.0f} times per CPU second for {count} LLaMA-3-70B plans on 1,024 "
                 f"H100s (TP, PP, VPP, micro-batch, recompute) and {file_rate:,.0f} times per CPU second over the "
                 f"file's rows (up to 65k pipeline passes each)."]
        snippet.write(args.markdown, first_line, lines)
    return 0


def _detail(plan: RowPlan) -> str:
    return plan.source_detail


if __name__ == "__main__":
    sys.exit(main())
