"""The partition options of each layer kind: how a part of the model (embedding, attention, dense MLP, MoE experts,
output layer) may be split over a parallel dimension, what the split asks of the model's sizes, and what it costs
in communication.

This is the declared catalogue: the planner's search reads the options derived from the model's ParallelBlocks
(:func:`cfp_megatron.model.derive.partition_options`, the same types), and this catalogue is the cross-check
(``tests/test_derive.py``: derived equals declared for every preset) and what a search built without the analysis
stage reads (:func:`cfp_megatron.search.space.build_space`). A new layer kind needs no entry here: its options come
from its blocks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cfp_megatron.base.config import AttentionKind, MlpPartition, ModelSpec
from cfp_megatron.base.layout_rules import moe, sequence, tensor
from cfp_megatron.base.layout_rules.problem import Problem, briefs


class LayerPart(enum.Enum):
    """A part of a transformer that has partition options of its own."""

    embedding = "embedding"
    attention = "attention"
    mlp = "mlp"
    moe = "moe"
    head = "head"


@dataclass(frozen=True, kw_only=True)
class SizeContext:
    """What an option's size checks read besides the model."""

    seq_length: int
    """Tokens per sequence."""
    micro_batch: int
    """Sequences per micro-batch (1 where the check is per size only)."""


@dataclass(frozen=True, kw_only=True)
class PartitionOption:
    """One way to split one part of the model over one parallel dimension."""

    part: LayerPart
    """The part it splits."""
    name: str
    """A short name, e.g. ``head-split`` or ``megatron-1d``."""
    knob: str
    """The ParallelSpec size it splits by (``tp``, ``cp``, ``ep``, ``etp``)."""
    choice: tuple[str, str] | None
    """``None`` for the part's default partition (its checks rule sizes out); else the ParallelSpec field and value
    that select this alternative (``("mlp", "primepar")``), offered where its checks pass."""
    block: str
    """The ParallelBlock it is, as the analysis writes placements: entry -> exit, weights."""
    communication: str
    """What it costs per micro-batch pass, in collectives over the ``knob`` group."""
    modules: frozenset[str]
    """Leaf module names a block must hold for the analysis to verify the option (empty: not analysable)."""
    checks: Callable[[ModelSpec, int, SizeContext], list[str]]
    """Reasons a size (of ``knob``) does not fit the model (empty: it fits): the briefs of the layout rules
    (:mod:`cfp_megatron.base.layout_rules`) the part follows."""

    def reasons(self, model: ModelSpec, size: int, context: SizeContext) -> list[str]:
        """Why ``size`` does not fit ``model`` under this option (empty: it does). A default partition fits a size of
        1 (nothing is split); an alternative is checked at every size (PrimePar's grid needs 4^k ranks)."""
        return self.checks(model, size, context) if size > 1 or self.choice is not None else []


def _rule(rule: Callable[[int], list[Problem]]) -> Callable[[ModelSpec, int, SizeContext], list[str]]:
    """An option's check from a layout rule of the size alone (:mod:`cfp_megatron.base.layout_rules`)."""
    def check(model: ModelSpec, size: int, context: SizeContext) -> list[str]:
        return briefs(rule(size))
    return check


def _context_chunks(model: ModelSpec, size: int, context: SizeContext) -> list[str]:
    return briefs(sequence.context_chunks(context.seq_length, size))


def _primepar_grid(model: ModelSpec, size: int, context: SizeContext) -> list[str]:
    return briefs(tensor.primepar_grid(size) or tensor.primepar_sizes(
        model=model.name, moe=model.is_moe, hidden=model.hidden_size, ffn=model.ffn_size,
        tokens=context.micro_batch * context.seq_length, tp=size))


def model_options(model: ModelSpec) -> tuple[PartitionOption, ...]:
    """The partition options of ``model``'s parts, in model order (embedding, attention, MLP or experts, head)."""
    vocab = model.padded_vocab_size
    options = [PartitionOption(
        part=LayerPart.embedding, name="vocab-split", knob="tp", choice=None,
        block="tokens R -> hidden P, word_embeddings S(0)",
        communication="all-reduce of the hidden states forward (reduce-scatter under SP)",
        modules=frozenset(),  # the analysis' Megatron TP test keeps the embedding replicated: not checked there
        checks=_rule(lambda tp: tensor.vocabulary(vocab, tp)))]
    groups = model.query_groups if model.attention is AttentionKind.standard else None
    options.append(PartitionOption(
        part=LayerPart.attention, name="head-split", knob="tp", choice=None,
        block="hidden R -> hidden P, linear_qkv S(0), linear_proj S(1)",
        communication="all-reduce of the output forward and of the input gradient backward (under SP: all-gather "
                      "in, reduce-scatter out)",
        modules=frozenset({"linear_qkv", "linear_proj"}) if model.attention is AttentionKind.standard
        else frozenset({"linear_proj"}),
        checks=_rule(lambda tp: tensor.attention_heads(model.num_attention_heads, groups, tp))))
    if model.attention is AttentionKind.standard:  # Megatron-Core's MLA has no context parallelism
        options.append(PartitionOption(
            part=LayerPart.attention, name="context-split", knob="cp", choice=None,
            block="sequence S(seq) -> S(seq), keys and values passed around the ring (2 x cp load-balanced chunks)",
            communication="key/value ring exchange (send/recv) forward and backward, overlapped with attention",
            modules=frozenset(), checks=_context_chunks))
    dense = not model.is_moe or model.moe_first_dense_layers > 0
    if dense:
        options.append(PartitionOption(
            part=LayerPart.mlp, name="megatron-1d", knob="tp", choice=None,
            block="hidden R -> hidden P, linear_fc1 S(0), linear_fc2 S(1)",
            communication="all-reduce of the output forward and of the input gradient backward (under SP: "
                          "all-gather in, reduce-scatter out)",
            modules=frozenset({"linear_fc1", "linear_fc2"}),
            checks=_rule(lambda tp: tensor.dense_mlp(model.ffn_size, tp))))
    if not model.is_moe:
        options.append(PartitionOption(
            part=LayerPart.mlp, name="primepar-2d", knob="tp", choice=("mlp", MlpPartition.primepar.value),
            block="hidden R -> hidden R on a 2^k x 2^k grid, every weight and activation block held once",
            communication="ring send/recv of weight and partial-sum blocks over 2^k steps (overlapped), an "
                          "all-gather of the output",
            modules=frozenset(), checks=_primepar_grid))
    if model.is_moe and model.moe_shared_expert_intermediate_size:
        shared = model.moe_shared_expert_intermediate_size
        options.append(PartitionOption(
            part=LayerPart.moe, name="shared-expert-split", knob="tp", choice=None,
            block="hidden R -> hidden P, the shared expert's linear_fc1 S(0), linear_fc2 S(1)",
            communication="all-reduce of the output forward and of the input gradient backward (under SP: "
                          "all-gather in, reduce-scatter out)",
            modules=frozenset(), checks=_rule(lambda tp: moe.shared_expert(shared, tp))))
    if model.is_moe:
        expert_ffn = model.moe_ffn_hidden_size or model.ffn_size
        options += [
            PartitionOption(part=LayerPart.moe, name="expert-split", knob="ep", choice=None,
                            block="tokens routed to the ranks holding their experts",
                            communication="token dispatch and combine (all-to-all, or all-gather) forward and "
                                          "backward",
                            modules=frozenset(),
                            checks=_rule(lambda ep: moe.experts(model.num_experts, ep))),
            PartitionOption(part=LayerPart.moe, name="expert-tensor-split", knob="etp", choice=None,
                            block="each expert's fc1 S(0), fc2 S(1)",
                            communication="all-reduce (reduce-scatter) of each expert's output over the expert TP "
                                          "group",
                            modules=frozenset(),
                            checks=_rule(lambda etp: moe.expert_ffn(expert_ffn, etp)))]
    options.append(PartitionOption(
        part=LayerPart.head, name="vocab-split", knob="tp", choice=None,
        block="hidden R -> logits S(vocab), output_layer S(0)",
        communication="the cross-entropy's max and sum all-reduced over the vocabulary shards",
        modules=frozenset({"output_layer"}),
        checks=_rule(lambda tp: tensor.vocabulary(vocab, tp))))
    return tuple(options)


def size_reasons(options: Iterable[PartitionOption], knob: str, model: ModelSpec, size: int,
                 context: SizeContext) -> list[str]:
    """Why ``size`` of ``knob`` does not fit the model: the reasons of every part whose default partition it fails,
    once each; a size above 1 of a knob no part splits by is refused with why."""
    defaults = [o for o in options if o.knob == knob and o.choice is None]
    if size > 1 and not defaults:
        rule = _UNSPLIT.get((knob, model.attention))
        return briefs(rule(size)) if rule else [f"no part of model {model.name} splits over {knob}"]
    return list(dict.fromkeys(why for option in defaults for why in option.reasons(model, size, context)))


_UNSPLIT: dict[tuple[str, AttentionKind], Callable[[int], list[Problem]]] = {
    ("cp", AttentionKind.mla): lambda cp: sequence.context_attention(True, cp),
}
"""The rule that says why a knob splits nothing, where a layer kind is known to lack it."""


def choice_fits(options: Iterable[PartitionOption], field: str, value: str, model: ModelSpec, size: int,
                context: SizeContext) -> bool:
    """Whether an alternative partition (``field=value``, e.g. ``mlp=primepar``) fits at ``size`` of its knob."""
    found = [o for o in options if o.choice == (field, value)]
    return bool(found) and all(not o.reasons(model, size, context) for o in found)
