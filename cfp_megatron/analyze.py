"""``python -m cfp_megatron.analyze model=<name> [parallel sizes]``: ParallelBlocks and segments of a model.

Captures the model on the meta device (one graph per layer kind), finds the ParallelBlocks of each kind's forward
pass over the intra-operator device mesh, clusters the layers into segment classes, and prints a report (blocks,
segments, candidate partitions, FLOPs and parameters per segment); the same result is written as JSON for the
profiling and search stages. Results are cached by the capture key and the mesh.

The mesh is the intra-operator part of the layout: ``("dp", dp)`` and ``("tp", tp)`` for the axes larger than one
(``dp`` = ``cluster.nodes x cluster.gpus_per_node / (tp x cp x pp)`` when the cluster size is set, else 1; the layout
is validated as for training). Pipeline
stages split the layer sequence and do not change a layer's blocks.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.config import MAX_GLOBAL_BATCH
from cfp_megatron.base.config_help import config_help
from cfp_megatron.base.errors import CfpError
from cfp_megatron.base.files import WriteLocation, check_write_locations, own_json_problem, write_atomic
from cfp_megatron.compat.quiet import quiet_expected_warnings, say_once

RESULT_KEYS = frozenset({"model", "seq_length", "mesh", "runs", "options"})
"""Keys every analysis result has (:func:`cfp_megatron.model.analysis.analyze`): an existing ``--json`` file is
replaced only when it has them all (an earlier analysis), never when it is anything else."""


def _human(value: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def render(result: dict[str, Any]) -> None:
    """Print the readable report."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 160
    mesh = "x".join(f"{n}{s}" for n, s in zip(result["mesh"]["names"], result["mesh"]["shape"], strict=True))
    console.print(f"[bold]{result['model']}[/] | {_human(result['params'], '')} params | "
                  f"{_human(result['flops_per_microbatch'], 'FLOP')} per micro-batch (fwd+bwd) | seq "
                  f"{result['seq_length']} x mbs {result['micro_batch_size']} | mesh {mesh} | "
                  f"{result['segments']} segments in {len(result['classes'])} classes")
    seg = Table(title="Segment classes")
    for col in ("class", "kinds", "instances", "params/segment", "FLOP/segment (fwd+bwd)", "blocks"):
        seg.add_column(col)
    for c in result["classes"]:
        seg.add_row(c["id"], ",".join(c["kinds"]), str(c["instances"]), _human(c["params"], ""),
                    _human(c["flops"], "FLOP"), str(len(c["blocks"])))
    console.print(seg)
    for c in result["classes"]:
        table = Table(title=f"Blocks of class {c['id']} ({','.join(c['kinds'])})")
        for col in ("block", "ops", "modules", "entry shape", "candidates (entry -> exit)", "Megatron TP"):
            table.add_column(col, overflow="fold")
        for b in c["blocks"]:
            cands = "; ".join(f"{x['entry']}->{x['exit']}" for x in b["candidates"][:6])
            more = len(b["candidates"]) - 6
            modules = ", ".join(sorted({m.split(".")[-1] for m in b["modules"]}))[:60]
            table.add_row(f"{b['start']}:{b['stop']}", str(len(b["ops"])), modules, str(b["entry_shape"]),
                          cands + (f" (+{more})" if more > 0 else ""), "yes" if b["megatron_tp"] else "")
        console.print(table)
    options = Table(title="Partition options derived from the ParallelBlocks, handed to the search")
    for col in ("part", "option", "splits by", "selected by", "block", "communication per pass", "layer kinds",
                "offered", "declared"):
        options.add_column(col, overflow="fold")
    for o in result["options"]:
        options.add_row(o["part"], o["name"], o["knob"], "=".join(o["choice"]) if o["choice"] else "(default)",
                        o["block"], o["communication"], ",".join(o["kinds"]),
                        "yes" if o["offered"] else o["rule"].removeprefix("lacks:"), "yes" if o["declared"] else "NO")
    console.print(options)
    runs = " ".join(f"{r['class']}x{r['count']}" for r in result["runs"])
    console.print(f"runs: {runs}")
    console.print(f"capture {result['seconds']['capture']} s, blocks {result['seconds']['blocks']} s")


def main(argv: Sequence[str] | None = None) -> int:
    """Compose the Hydra config from ``key=value`` overrides, analyse, print, and write JSON."""

    import argparse

    parser = argparse.ArgumentParser(prog="python -m cfp_megatron.analyze", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=config_help())
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=llama3_8b parallel.tp=8")
    parser.add_argument("--json", dest="json_path", default=None, help="where to write the JSON result")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--no-cache", action="store_true")
    args = parser.parse_args(argv)
    if not 1 <= args.micro_batch_size <= MAX_GLOBAL_BATCH:
        parser.error(f"--micro-batch-size={args.micro_batch_size}: must be in [1, {MAX_GLOBAL_BATCH}] sequences, "
                     "e.g. --micro-batch-size 1")
    if args.json_path is not None and Path(args.json_path).is_dir():
        parser.error(f"--json={args.json_path}: is a folder; name the JSON file to write, e.g. "
                     f"--json {Path(args.json_path) / 'analysis.json'}")
    say_once(quiet_expected_warnings(distributed=False))
    # Imported here, after the filters: Megatron-Core warns at import about absent Transformer Engine/Apex.
    from cfp_megatron.model.analysis import analyze

    try:
        job = compose_job(args.overrides, typed=True, runs_hydra=False)
        # a --json that cannot be written is said before the analysis, not after; a file there that is not an
        # analysis (a user's notes) is kept
        problem = own_json_problem(args.json_path, "--json", RESULT_KEYS, "an analysis written by analyze --json") \
            if args.json_path else None
        if problem is not None:
            print(f"cfp-megatron: {problem}", file=sys.stderr)
            return 2
        check_write_locations([WriteLocation(key="--json", path=Path(args.json_path), folder=False)
                               if args.json_path else
                               WriteLocation(key="--json", path=Path("outputs/analyze"), folder=True)])
        result = analyze(job, micro_batch_size=args.micro_batch_size, use_cache=not args.no_cache)
    except CfpError as err:
        print(f"cfp-megatron: {type(err).__name__}\n{err}", file=sys.stderr)
        return 2
    render(result)
    out = Path(args.json_path or f"outputs/analyze/{job.model.name}-{'x'.join(map(str, result['mesh']['shape']))}.json")
    try:  # atomically: a refused write leaves no truncated file, and an earlier result as it was
        write_atomic(out, json.dumps(result, indent=1), key="--json")
    except CfpError as err:
        print(f"cfp-megatron: {type(err).__name__}\n{err}", file=sys.stderr)
        return 2
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
