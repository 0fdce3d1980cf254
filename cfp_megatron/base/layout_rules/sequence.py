"""Sequence and context parallelism: how the sequence splits over CP (and under SP over TP), what they need of the
attention, and the sequence against learned positions."""

from __future__ import annotations

from cfp_megatron.base.layout_rules.problem import Problem


def context_chunks(seq: int, cp: int) -> list[Problem]:
    """Context parallelism splits the sequence into ``2 x cp`` load-balanced chunks."""
    if cp <= 1 or not seq % (2 * cp):
        return []
    return [Problem(key="train.seq_length", value=seq,
                    problem=f"context parallelism splits the sequence into 2 x parallel.cp = {2 * cp} chunks.",
                    fix=f"use a multiple of {2 * cp}.",
                    brief=f"the sequence {seq} does not split into 2 x {cp} chunks")]


def context_needs_te(cp: int, te: bool) -> list[Problem]:
    """Context parallelism runs in Transformer Engine's attention."""
    if cp <= 1 or te:
        return []
    return [Problem(key="parallel.cp", value=cp,
                    problem="context parallelism needs Transformer Engine's attention (TEDotProductAttention); it is "
                            "not installed, and Megatron-Core's local attention does not support CP.",
                    fix="install transformer-engine (GPU only), or set parallel.cp=1.",
                    brief="context parallelism needs Transformer Engine's attention, which this target lacks")]


def context_attention(mla: bool, cp: int) -> list[Problem]:
    """Megatron-Core's multi-latent attention has no context parallelism."""
    if not mla or cp <= 1:
        return []
    return [Problem(key="parallel.cp", value=cp, problem="multi-latent attention does not support context "
                    "parallelism.", fix="set parallel.cp=1.",
                    brief="multi-latent attention does not support context parallelism")]


def context_all_to_all(*, comm_type: str, a2a_size: int, heads_per_rank: int, groups_per_rank: int) -> list[Problem]:
    """The all-to-all CP exchange (``a2a``, and ``a2a+p2p``'s inner level of ``a2a_size`` ranks) splits each TP
    rank's heads and key/value groups over its ranks."""
    if not heads_per_rank % a2a_size and not groups_per_rank % a2a_size:
        return []
    return [Problem(key="parallel.cp_comm_type", value=comm_type,
                    problem=f"the all-to-all splits each TP rank's {heads_per_rank} heads and {groups_per_rank} "
                            f"key/value groups over {a2a_size} CP ranks.",
                    fix="use parallel.cp_comm_type=p2p (or all_gather), or a parallel.cp that divides them.",
                    brief=f"the CP all-to-all splits {heads_per_rank} heads per TP rank over {a2a_size} ranks")]


def sequence_parallel_split(sp: bool, seq: int, cp: int, tp: int) -> list[Problem]:
    """Sequence parallelism shards each CP rank's tokens over the TP group."""
    if not sp or not (seq // cp) % tp:
        return []
    return [Problem(key="train.seq_length", value=seq,
                    problem=f"sequence parallelism shards each context-parallel rank's {seq // cp} tokens over "
                            f"parallel.tp={tp}.",
                    fix=f"use a multiple of {tp * cp}, or set parallel.sp=false.",
                    brief=f"sequence parallelism needs the {seq // cp} tokens per CP rank (train.seq_length={seq}) "
                          f"divisible by TP {tp}")]


def sequence_parallel_required(moe: bool, tp: int) -> bool:
    """Whether Megatron-Core requires sequence parallelism: a MoE model under TP, with or without EP (its
    ``MoELayer`` refuses to train without it)."""
    return moe and tp > 1


def sequence_parallel_missing(sp: bool, moe: bool, tp: int) -> list[Problem]:
    """The problem of leaving sequence parallelism off where :func:`sequence_parallel_required`."""
    if sp or not sequence_parallel_required(moe, tp):
        return []
    return [Problem(key="parallel.sp", value=False, problem="Megatron-Core needs sequence parallelism for MoE with TP "
                    "(its MoELayer refuses to train under TP without it).", fix="set parallel.sp=true.",
                    brief=f"Megatron-Core's MoE layer trains under TP {tp} only with sequence parallelism")]


def learned_positions(*, value: str, mtp_layers: int | None, pp: int, seq: int, max_positions: int) -> list[Problem]:
    """A learned position table (``model.position_embedding=value``) covers the sequence, and is not copied to the
    MTP layers' stage (Megatron-Core 0.16 neither syncs nor checkpoints that copy with the first stage's)."""
    found = []
    if mtp_layers and pp > 1:
        found.append(Problem(key="model.position_embedding", value=value,
                             problem=f"model.mtp_num_layers={mtp_layers} with parallel.pp={pp}: the MTP layers' stage "
                                     "keeps its own copy of the learned position table, which Megatron-Core neither "
                                     "syncs nor checkpoints with the first stage's.",
                             fix="use rotary positions (model.position_embedding=rope, as MTP models do), or "
                                 "parallel.pp=1.",
                             brief="learned positions with MTP layers on another stage"))
    if seq > max_positions:
        found.append(Problem(key="train.seq_length", value=seq,
                             problem=f"exceeds model.max_position_embeddings={max_positions}.",
                             fix="shorten the sequence or raise model.max_position_embeddings.",
                             brief=f"the sequence {seq} exceeds the {max_positions} learned positions"))
    return found
