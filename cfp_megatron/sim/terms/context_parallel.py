"""The context-parallel term: seconds of context-parallel attention's key/value exchange for one micro-batch on one
rank under each of Transformer Engine's communication types, the buffers it holds, the attention kernel's efficiency
at the chunk length CP leaves it, and the term's lane. How each is modelled: docs/simulator.md, "cp_cost.py".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cfp_megatron.base.config import CpCommType, JobSpec
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim.layout import Layout
from cfp_megatron.sim.memory import Stage
from cfp_megatron.sim.terms.base import CostTerm, Lane, LaneKind, MemoryCategory, Placement

ATTENTION_HALF_LENGTH = 256.0
"""Query-block length (tokens) at which a fused causal attention kernel reaches half its long-sequence throughput,
the ``L0`` of ``L / (L + L0)``: FlashAttention-2's causal forward+backward at head dimension 128 on A100 (Dao 2023,
"FlashAttention-2", the A100 benchmark figures) runs at about two thirds of its long-sequence speed on 512 tokens
and within a few percent of it from 8k tokens up, which ``L0 = 256`` reproduces (0.67 at 512, 0.97 at 8k)."""


@dataclass(frozen=True, kw_only=True)
class CpCost:
    """The CP exchange of one layer for one micro-batch on one rank (seconds)."""

    forward_s: float
    """Forward exchange left on the critical path (after overlapping with the attention core)."""
    backward_s: float
    """Backward exchange left on the critical path."""


def kernel_share(length: float) -> float:
    """Share of its long-sequence throughput a fused causal attention kernel reaches on query blocks of ``length``
    tokens (:data:`ATTENTION_HALF_LENGTH`)."""
    return length / (length + ATTENTION_HALF_LENGTH) if length > 0 else 0.0


def chunk_slowdown(seq_length: int, cp: int) -> float:
    """How much longer the attention core takes per FLOP on a CP rank than on the whole sequence: the load-balanced
    split gives each rank 2 x CP chunks' worth of blocks of ``seq / (2 cp)`` queries."""
    if cp <= 1:
        return 1.0
    return kernel_share(seq_length) / kernel_share(seq_length / (2 * cp))


def cp_cost(job: JobSpec, layout: Layout, costs: CollectiveCosts, *, elem_bytes: int, q_width: float,
            kv_width: float, core_fwd_s: float, core_bwd_s: float) -> CpCost:
    """The exchange of ``job``'s CP type for one layer: ``q_width`` and ``kv_width`` are the query and the (keys +
    values) columns per token of the whole layer, split over TP here; ``core_fwd_s`` / ``core_bwd_s`` the attention
    core's seconds on this rank, which the ring overlaps with."""
    dims = layout.dims
    cp = dims.cp
    if cp <= 1:
        return CpCost(forward_s=0.0, backward_s=0.0)
    q_bytes, kv_bytes = _local_bytes(layout, elem_bytes=elem_bytes, q_width=q_width, kv_width=kv_width)
    kind = job.parallel.cp_comm_type
    if kind is CpCommType.a2a:
        return _a2a(costs, cp, layout.cp_per_node, q_bytes, kv_bytes)
    if kind is CpCommType.all_gather:
        gather_s = costs.seconds(Collective.all_gather, kv_bytes * cp, cp, layout.cp_per_node)
        scatter_s = costs.seconds(Collective.reduce_scatter, kv_bytes * cp, cp, layout.cp_per_node)
        # Transformer Engine gathers K/V chunk by chunk while the first chunks' attention runs: half overlapped.
        return CpCost(forward_s=max(gather_s - 0.5 * core_fwd_s, gather_s / cp),
                      backward_s=max(gather_s + scatter_s - 0.5 * core_bwd_s, (gather_s + scatter_s) / cp))
    if kind is CpCommType.a2a_p2p:
        inner = math.gcd(cp, max(layout.cp_per_node, 1))
        outer = cp // inner
        a2a = _a2a(costs, inner, inner, q_bytes, kv_bytes)
        ring = _ring(costs, outer, 1, kv_bytes * inner, core_fwd_s, core_bwd_s)
        return CpCost(forward_s=a2a.forward_s + ring.forward_s, backward_s=a2a.backward_s + ring.backward_s)
    return _ring(costs, cp, layout.cp_per_node, kv_bytes, core_fwd_s, core_bwd_s)


def _local_bytes(layout: Layout, *, elem_bytes: int, q_width: float, kv_width: float) -> tuple[float, float]:
    """(queries, keys + values) bytes of one micro-batch on one CP and TP rank."""
    tokens = layout.micro_batch * layout.seq_length / layout.dims.cp
    return tokens * q_width / layout.dims.tp * elem_bytes, tokens * kv_width / layout.dims.tp * elem_bytes


def _ring(costs: CollectiveCosts, ring: int, per_node: int, kv_bytes: float, core_fwd_s: float,
          core_bwd_s: float) -> CpCost:
    """``ring - 1`` steps passing ``kv_bytes`` to the next rank (twice that backward: K/V and their gradients), each
    overlapped with the attention of the block already received (``1 / ring`` of the core)."""
    if ring <= 1:
        return CpCost(forward_s=0.0, backward_s=0.0)
    # Every rank passes to its neighbour at once: a ring that leaves its node waits for the network hop.
    step_s = costs.seconds(Collective.send_recv, kv_bytes, 2, 2 if per_node >= ring else 1)
    steps = ring - 1
    forward_s = steps * max(0.0, step_s - core_fwd_s / ring)
    backward_s = steps * max(0.0, 2 * step_s - core_bwd_s / ring)
    return CpCost(forward_s=forward_s, backward_s=backward_s)


def _a2a(costs: CollectiveCosts, size: int, per_node: int, q_bytes: float, kv_bytes: float) -> CpCost:
    """DeepSpeed-Ulysses: all-to-all of Q, K and V from sequence to head shards before attention and of the output
    back after it (the same backward, for the gradients); nothing overlaps."""
    if size <= 1:
        return CpCost(forward_s=0.0, backward_s=0.0)
    exchange_s = (costs.seconds(Collective.all_to_all, q_bytes + kv_bytes, size, per_node)
                  + costs.seconds(Collective.all_to_all, q_bytes, size, per_node))
    return CpCost(forward_s=exchange_s, backward_s=exchange_s)


def cp_buffer_bytes(job: JobSpec, layout: Layout, *, elem_bytes: int, q_width: float, kv_width: float) -> float:
    """Memory the CP exchange holds while a layer runs on one rank: the ring's K/V blocks in flight (sent and
    received), every rank's K/V gathered, or the transposed Q, K and V of the all-to-all."""
    dims = layout.dims
    if dims.cp <= 1:
        return 0.0
    q_bytes, kv_bytes = _local_bytes(layout, elem_bytes=elem_bytes, q_width=q_width, kv_width=kv_width)
    kind = job.parallel.cp_comm_type
    if kind is CpCommType.all_gather:
        return kv_bytes * dims.cp
    if kind is CpCommType.a2a:
        return q_bytes + kv_bytes
    if kind is CpCommType.a2a_p2p:
        return q_bytes + kv_bytes + 2 * kv_bytes * math.gcd(dims.cp, max(layout.cp_per_node, 1))
    return 2 * kv_bytes


class ContextParallel(CostTerm):
    """The K/V exchange of context-parallel attention the passes wait for (after what the attention core hides)."""

    name = "context_parallel"
    lanes = (Lane(name="cp_comm_s", label="CP comm", part="TP/CP/EP/FSDP comm", kind=LaneKind.comm,
                  placement=Placement.in_pass, pass_field="cp_comm_s", key="cp", trace="CP comm",
                  style=("CP ring exchange", "#DD8452", "terrible"), overlaps=("the attention core",)),)
    stores = (MemoryCategory(name="cp_buffers", label="CP exchange buffers", field="comm_buffers"),)

    def memory(self, stage: Stage) -> dict[str, float]:
        """What the exchange holds while a layer runs (:func:`cp_buffer_bytes`)."""
        job, layout = stage.job, stage.layout
        if layout.dims.cp <= 1 or stage.measured is not None:
            return {"cp_buffers": 0.0}
        model = job.model
        head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
        return {"cp_buffers": cp_buffer_bytes(job, layout, elem_bytes=stage.common.elem_bytes,
                                              q_width=model.num_attention_heads * head_dim,
                                              kv_width=2 * model.query_groups * head_dim)}
