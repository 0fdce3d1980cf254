"""The CFP analysis of a model: captured on the meta device (one graph per layer kind), its ParallelBlocks over the
intra-operator device mesh, its layers clustered into segment classes, and the partitions each block offers.

The mesh is the intra-operator part of the layout: ``("dp", dp)`` and ``("tp", tp)`` for the axes larger than one
(``dp`` = ``cluster.nodes x cluster.gpus_per_node / (tp x cp x pp)`` when the cluster size is set, else 1; the layout
is validated as for training). Pipeline stages split the layer sequence and do not change a layer's blocks. Results
are cached by the capture key and the mesh.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from cfp_megatron.base.config import JobSpec
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.graph.blocks import find_blocks
from cfp_megatron.graph.propagation import fake_mesh, placement_str
from cfp_megatron.graph.segments import segment_model
from cfp_megatron.model import cache
from cfp_megatron.model.capture import capture_job
from cfp_megatron.model.derive import options_report

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
    mesh = mesh_for(job)
    seq = seq_length or job.train.seq_length
    inputs = {**cache.job_cache_inputs(job, seq_length=seq, micro_batch_size=micro_batch_size),
              "analysis": "blocks-v4", "mesh": [list(mesh.shape), list(mesh.names)]}
    key = cache.cache_key(inputs)
    found = cache.load_json(key, section="analysis") if use_cache else None
    if found is not None:
        return found
    result = _analyze(job, mesh, seq, micro_batch_size, use_cache=use_cache)
    cache.store_json(key, result, section="analysis")
    return result


def _analyze(job: JobSpec, mesh: MeshSpec, seq: int, micro_batch_size: int, *,
             use_cache: bool = True) -> dict[str, Any]:
    start = time.perf_counter()
    capture = capture_job(job, seq_length=seq, micro_batch_size=micro_batch_size)
    captured = time.perf_counter()
    with fake_mesh(mesh.shape, mesh.names) as device_mesh:
        blocks = {kind: find_blocks(graph, device_mesh) for kind, graph in capture.graphs.items()}
    segmentation = segment_model(capture.sequence, blocks, capture.graphs)
    done = time.perf_counter()
    gated = job.model.activation.gated
    data = segmentation.to_json()
    for cls_json, cls in zip(data["classes"], segmentation.classes, strict=True):
        for block_json, block in zip(cls_json["blocks"], cls.blocks, strict=True):
            block_json["megatron_tp"] = [c.to_json() for c in megatron_tp_candidates(block, mesh, gated=gated)]
    return {"model": job.model.name, "seq_length": seq, "micro_batch_size": micro_batch_size,
            "mesh": {"shape": list(mesh.shape), "names": list(mesh.names)},
            "params": capture.total_params, "flops_per_microbatch": capture.total_flops,
            "segments": segmentation.segments, "classes": data["classes"], "runs": data["runs"],
            "options": options_report(job, use_cache=use_cache),
            "seconds": {"capture": round(captured - start, 3), "blocks": round(done - captured, 3)}}
