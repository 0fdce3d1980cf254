"""Tensor parallelism: what the TP size must divide, PrimePar's grid, and what sequence parallelism and TP
communication overlap ask of it."""

from __future__ import annotations

import math

from cfp_megatron.base.layout_rules.problem import Problem


def attention_heads(heads: int, query_groups: int | None, tp: int) -> list[Problem]:
    """The attention heads and (standard attention: ``query_groups``, else ``None``) the key/value heads are split
    over the TP group."""
    found = []
    if heads % tp:
        found.append(Problem(key="parallel.tp", value=tp,
                             problem=f"model.num_attention_heads={heads} is not divisible by parallel.tp={tp}.",
                             fix=f"use a parallel.tp that divides {heads}.",
                             brief=f"{heads} attention heads are not divisible by it"))
    if query_groups is not None and query_groups % tp:
        found.append(Problem(key="parallel.tp", value=tp,
                             problem=f"model.num_query_groups={query_groups} (key/value heads) is not divisible by "
                                     f"parallel.tp={tp}.",
                             fix=f"use a parallel.tp that divides {query_groups}.",
                             brief=f"{query_groups} key/value heads are not divisible by it"))
    return found


def dense_mlp(ffn: int | None, tp: int) -> list[Problem]:
    """The dense MLP's FFN size (``None``: the model has no dense MLP) is split over the TP group."""
    if ffn is None or not ffn % tp:
        return []
    return [Problem(key="parallel.tp", value=tp,
                    problem=f"model.ffn_hidden_size={ffn} is not divisible by parallel.tp={tp}.",
                    fix=f"use a parallel.tp that divides {ffn}.", brief=f"the FFN size {ffn} is not divisible by it")]


def vocabulary(padded_vocab: int, tp: int) -> list[Problem]:
    """The embedding's and the output layer's (padded) vocabulary is split over the TP group."""
    if not padded_vocab % tp:
        return []
    return [Problem(key="parallel.tp", value=tp,
                    problem=f"the padded vocabulary {padded_vocab} is not divisible by parallel.tp={tp}.",
                    fix="raise model.make_vocab_size_divisible_by to a multiple of parallel.tp.",
                    brief=f"the padded vocabulary {padded_vocab} is not divisible by it")]


def primepar_grid_side(tp: int) -> int | None:
    """The side 2^k of PrimePar's square grid on a tensor-parallel group of ``tp = 4^k`` ranks (k >= 1); ``None``
    for any other size."""
    side = math.isqrt(tp)
    return side if tp >= 4 and side * side == tp and not side & (side - 1) else None


def primepar_grid(tp: int) -> list[Problem]:
    """PrimePar's MLP needs a TP group of 4^k ranks (its square grid)."""
    if primepar_grid_side(tp) is not None:
        return []
    return [Problem(key="parallel.mlp", value="primepar",
                    problem=f"PrimePar's P_{{2^k x 2^k}} needs a square grid of 4^k ranks as the tensor-parallel "
                            f"group; parallel.tp={tp} is not 4, 16, 64, ...",
                    fix="set parallel.tp to 4 or 16, or parallel.mlp=megatron.",
                    brief=f"PrimePar's grid needs 4^k ranks, not {tp}")]


def primepar_sizes(*, model: str, moe: bool, hidden: int, ffn: int, tokens: int, tp: int) -> list[Problem]:
    """Model ``model`` fits PrimePar's MLP on a grid of ``tp`` ranks with ``tokens`` tokens per micro-batch: a dense
    model (``moe`` false) whose sizes the grid side divides (a ``tp`` that is not 4^k is :func:`primepar_grid`'s)."""
    side = primepar_grid_side(tp)
    if side is None:
        return []
    found = []
    if moe:
        text = f"model {model} has MoE layers; the PrimePar MLP replaces the dense MLP only."
        found.append(Problem(key="parallel.mlp", value="primepar", problem=text, fix="set parallel.mlp=megatron.",
                             brief=text))
    for key, size in (("model.hidden_size", hidden), ("model.ffn_hidden_size", ffn),
                      ("train.micro_batch_size x train.seq_length", tokens)):
        if size % side:
            text = f"the PrimePar grid of parallel.tp={tp} ranks splits {key}={size} into {side} blocks."
            found.append(Problem(key="parallel.mlp", value="primepar", problem=text, brief=text,
                                 fix=f"use sizes divisible by {side}, or parallel.mlp=megatron."))
    return found


def sequence_parallel_needs_tp(sp: bool, tp: int) -> list[Problem]:
    """Sequence parallelism shards over the TP group, so it needs one."""
    if not sp or tp != 1:
        return []
    return [Problem(key="parallel.sp", value=True, problem="sequence parallelism needs parallel.tp > 1.",
                    fix="set parallel.sp=false or parallel.tp to 2 or more.",
                    brief="sequence parallelism splits over TP")]


def tp_overlap_needs_sp(overlap: bool, sp: bool) -> list[Problem]:
    """Transformer Engine overlaps TP communication only under sequence parallelism."""
    if not overlap or sp:
        return []
    return [Problem(key="parallel.tp_comm_overlap", value=True,
                    problem="Transformer Engine overlaps TP communication only under sequence parallelism.",
                    fix="set parallel.sp=true (with parallel.tp > 1), or parallel.tp_comm_overlap=false.",
                    brief="TP communication overlap needs sequence parallelism")]


def tp_overlap_runs(overlap: bool, *, on_cpu: bool, te: bool) -> list[Problem]:
    """TP communication overlap runs in Transformer Engine's userbuffers: a GPU with Transformer Engine."""
    if not overlap or (not on_cpu and te):
        return []
    return [Problem(key="parallel.tp_comm_overlap", value=True,
                    problem="Transformer Engine's userbuffers overlap TP communication on GPUs; "
                            + ("this cluster is CPU." if on_cpu else "Transformer Engine is not installed."),
                    fix="plan it for a GPU cluster with transformer-engine installed, or set "
                        "parallel.tp_comm_overlap=false.",
                    brief="TP communication overlap needs a GPU with Transformer Engine")]
