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
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfp_megatron.config import Activation, JobSpec
from cfp_megatron.errors import CfpError
from cfp_megatron.parallel_dims import ParallelDims

COLUMN_PARALLEL = ("linear_qkv", "linear_fc1", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj",
                   "output_layer")
"""Layers Megatron's TP splits along their output dimension: weight and bias ``Shard(0)``."""
ROW_PARALLEL = ("linear_proj", "linear_fc2")
"""Layers Megatron's TP splits along their input dimension: weight ``Shard(1)``, bias replicated."""


def _megatron_tp_placement(name: str, gated: bool) -> str:
    """What Megatron's TP does with the parameter ``name`` on the TP axis: ``S(0)``, ``S(1)`` or ``R``.

    With a gated MLP (SwiGLU) the fused ``linear_fc1`` holds ``[gate_r; up_r]`` on rank ``r``: the interleaved
    ``S(0;2)`` (``_StridedShard(0, split_factor=2)``).
    """
    layer, _, leaf = name.rpartition(".")
    layer = layer.rsplit(".", 1)[-1]
    if layer in COLUMN_PARALLEL and leaf in ("weight", "bias"):
        return "S(0;2)" if gated and layer == "linear_fc1" else "S(0)"
    if layer in ROW_PARALLEL and leaf == "weight":
        return "S(1)"
    return "R"


@dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """The device mesh the blocks are found on."""

    shape: tuple[int, ...]
    """Size of each axis."""
    names: tuple[str, ...]
    """Name of each axis (``dp``, ``tp``)."""

    def __str__(self) -> str:
        return "x".join(f"{n}{s}" for n, s in zip(self.names, self.shape, strict=True))


def mesh_for(job: JobSpec) -> MeshSpec:
    """The intra-operator mesh of ``job``'s layout (see the module docstring); the layout is validated first."""
    p, c = job.parallel, job.cluster
    world = c.nodes * c.gpus_per_node if c.gpus_per_node is not None else p.tp * p.cp * p.pp
    # Offline analysis needs no Transformer Engine: CP and MLA are analysed as the GPU would run them.
    dims = ParallelDims.build(job, world, te_available=True)
    axes = [(n, s) for n, s in (("dp", dims.dp), ("tp", dims.tp)) if s > 1] or [("tp", 1)]
    return MeshSpec(shape=tuple(s for _, s in axes), names=tuple(n for n, _ in axes))


def megatron_tp_candidates(block: Any, mesh: MeshSpec, *, gated: bool = False) -> list[Any]:
    """The block's candidates that are Megatron's own TP layout on the ``tp`` axis.

    Column-parallel weights ``Shard(0)`` (a gated MLP's fused ``linear_fc1`` interleaved, ``S(0;2)``), row-parallel
    ones ``Shard(1)``, every other weight replicated, on the ``tp`` axis; the other axes may hold anything.
    """
    from cfp_megatron.graph.propagation import placement_str

    if "tp" not in mesh.names:
        return []
    axis = mesh.names.index("tp")
    found = []
    for cand in block.candidates:
        ok = bool(cand.params)
        for name, placements in cand.params.items():
            p = placements[axis]
            ok = ok and placement_str((p,)) == _megatron_tp_placement(name, gated)
        if ok:
            found.append(cand)
    return found


def analyze(job: JobSpec, *, seq_length: int | None = None, micro_batch_size: int = 1,
            use_cache: bool = True) -> dict[str, Any]:
    """Capture, blocks and segments of ``job`` as a JSON-ready dict (cached)."""
    from cfp_megatron.model import cache

    mesh = mesh_for(job)
    seq = seq_length or job.train.seq_length
    inputs = {**cache.job_cache_inputs(job, seq_length=seq, micro_batch_size=micro_batch_size),
              "analysis": "blocks-v2", "mesh": [list(mesh.shape), list(mesh.names)]}
    key = cache.cache_key(inputs)
    found = cache.load_json(key, section="analysis") if use_cache else None
    if found is not None:
        return found
    result = _analyze(job, mesh, seq, micro_batch_size)
    cache.store_json(key, result, section="analysis")
    return result


def _analyze(job: JobSpec, mesh: MeshSpec, seq: int, micro_batch_size: int) -> dict[str, Any]:
    from cfp_megatron.graph.blocks import find_blocks
    from cfp_megatron.graph.propagation import fake_mesh
    from cfp_megatron.graph.segments import segment_model
    from cfp_megatron.model.capture import capture_job

    start = time.perf_counter()
    capture = capture_job(job, seq_length=seq, micro_batch_size=micro_batch_size)
    captured = time.perf_counter()
    with fake_mesh(mesh.shape, mesh.names) as device_mesh:
        blocks = {kind: find_blocks(graph, device_mesh) for kind, graph in capture.graphs.items()}
    segmentation = segment_model(capture.sequence, blocks, capture.graphs)
    done = time.perf_counter()
    gated = job.model.activation is Activation.swiglu
    data = segmentation.to_json()
    for cls_json, cls in zip(data["classes"], segmentation.classes, strict=True):
        for block_json, block in zip(cls_json["blocks"], cls.blocks, strict=True):
            block_json["megatron_tp"] = [c.to_json() for c in megatron_tp_candidates(block, mesh, gated=gated)]
    return {"model": job.model.name, "seq_length": seq, "micro_batch_size": micro_batch_size,
            "mesh": {"shape": list(mesh.shape), "names": list(mesh.names)},
            "params": capture.total_params, "flops_per_microbatch": capture.total_flops,
            "segments": segmentation.segments, "classes": data["classes"], "runs": data["runs"],
            "seconds": {"capture": round(captured - start, 3), "blocks": round(done - captured, 3)}}


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
    runs = " ".join(f"{r['class']}x{r['count']}" for r in result["runs"])
    console.print(f"runs: {runs}")
    console.print(f"capture {result['seconds']['capture']} s, blocks {result['seconds']['blocks']} s")


def main(argv: Sequence[str] | None = None) -> int:
    """Compose the Hydra config from ``key=value`` overrides, analyse, print, and write JSON."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cfp_megatron.analyze", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=llama3_8b parallel.tp=8")
    parser.add_argument("--json", dest="json_path", default=None, help="where to write the JSON result")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--no-cache", action="store_true")
    args = parser.parse_args(argv)
    from cfp_megatron.config import compose_job

    try:
        job = compose_job(args.overrides)
        result = analyze(job, micro_batch_size=args.micro_batch_size, use_cache=not args.no_cache)
    except CfpError as err:
        print(f"cfp-megatron: {type(err).__name__}\n{err}", file=sys.stderr)
        return 2
    render(result)
    out = Path(args.json_path or f"outputs/analyze/{job.model.name}-{'x'.join(map(str, result['mesh']['shape']))}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
