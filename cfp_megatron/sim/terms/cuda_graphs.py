"""The CUDA graphs term: the memory captured graphs keep for their replays (static inputs, outputs and gradient
buffers per captured layer and micro-batch, ``sim/cuda_graphs.yaml``; docs/simulator.md, "CUDA graphs"). The launches
they remove are the host term's (:mod:`cfp_megatron.sim.host_costs`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from cfp_megatron.base.config import CudaGraphImpl
from cfp_megatron.sim.memory import in_flight
from cfp_megatron.sim.terms.base import CostTerm, MemoryCategory

if TYPE_CHECKING:
    from cfp_megatron.sim.memory import Stage

GRAPHS_FILE = Path(__file__).resolve().parent.parent / "cuda_graphs.yaml"
"""What each captured graph keeps, with its sources."""


@dataclass(frozen=True, kw_only=True)
class GraphBuffers:
    """What one captured (layer, micro-batch) graph keeps (``cuda_graphs.yaml``)."""

    hidden_buffers: int
    """Static buffers of one layer's hidden states for one micro-batch on one rank."""
    mask_bytes: int
    """Bytes per element of Transformer Engine's static attention mask ``[micro_batch, 1, seq / cp, seq]``."""
    router_bytes: int
    """Bytes per token and expert of a MoE layer captured up to its router (probabilities and routing map)."""
    batch_bytes: int
    """Bytes per token of one micro-batch's data-loader batch, which a full-iteration graph keeps for every
    micro-batch of the step."""


@functools.cache
def graph_buffers() -> GraphBuffers:
    """:class:`GraphBuffers` from ``cuda_graphs.yaml``."""
    data = yaml.safe_load(GRAPHS_FILE.read_text())
    return GraphBuffers(hidden_buffers=int(data["hidden_buffers_per_graph"]),
                        mask_bytes=int(data["attention_mask_bytes_per_element"]),
                        router_bytes=int(data["router_output_bytes_per_token_expert"]),
                        batch_bytes=int(data["full_iteration_batch_bytes_per_token"]))


def graph_bytes(stage: Stage) -> float:
    """Bytes the captured graphs of one rank of ``stage`` keep beyond eager execution: per captured layer and
    micro-batch in flight (one without pipeline parallelism or the expert overlap), its static hidden-state buffers,
    Transformer Engine's static attention mask where the attention is captured, and a router-scoped MoE layer's
    router outputs; a full-iteration graph, the data-loader batch of each micro-batch of the step. Zero without CUDA
    graphs."""
    job = stage.job
    parallel, model = job.parallel, job.model
    if parallel.cuda_graph_impl is CudaGraphImpl.none or not stage.layers:
        return 0.0
    scopes = set(parallel.graph_scopes())
    if "full_iteration" in scopes:
        tokens = stage.layout.micro_batch * stage.layout.seq_length / stage.layout.dims.cp
        return graph_buffers().batch_bytes * tokens * stage.layout.dims.num_microbatches
    whole = not scopes
    moe_layers, dense_layers = stage.moe_layers, stage.layers - stage.moe_layers
    attention = whole or "attn" in scopes
    captured_dense = dense_layers if attention or "mlp" in scopes else 0
    captured_moe = moe_layers if attention or scopes & {"moe", "moe_router", "moe_preprocess"} else 0
    dims = stage.layout.dims
    per_layer = 1.0
    if dims.pp > 1 or parallel.moe_a2a_overlap:
        per_layer = in_flight(stage.rank, dims.pp, dims.vpp, dims.num_microbatches,
                              stage.options.pipeline_schedule) / dims.vpp
    buffers = graph_buffers()
    rows = stage.tokens / (dims.tp if dims.sp else 1)
    per_graph = buffers.hidden_buffers * rows * model.hidden_size * stage.common.elem_bytes
    if attention and parallel.cuda_graph_impl is CudaGraphImpl.transformer_engine:
        seq = stage.layout.seq_length
        per_graph += buffers.mask_bytes * stage.layout.micro_batch * (seq / dims.cp) * seq
    total = (captured_dense + captured_moe) * per_graph
    router_only = model.is_moe and "moe" not in scopes and not (whole and model.moe_pad_expert_input_to_capacity)
    if captured_moe and router_only:
        total += captured_moe * buffers.router_bytes * rows * (model.num_experts or 1)
    return per_layer * total


class CudaGraphs(CostTerm):
    """The captured graphs' static buffers (their saved time is the host term's)."""

    name = "cuda_graphs"
    stores = (MemoryCategory(name="cuda_graph_buffers", label="CUDA graph static buffers", field="comm_buffers"),)

    def memory(self, stage: Stage) -> dict[str, float]:
        """The graphs' static buffers on one rank of ``stage`` (:func:`graph_bytes`)."""
        return {"cuda_graph_buffers": graph_bytes(stage)}
