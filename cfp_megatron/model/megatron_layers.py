"""Record the parts of a Megatron-Core ``GPTModel`` (embedding, one decoder layer, head) on meta inputs.

Inputs follow Megatron's layout: token ids ``[batch, seq]``, hidden states ``[seq, batch, hidden]``. Rotary
embeddings are computed once per step by ``GPTModel._preprocess`` (outside the layers), so they are built here outside
the recording and passed to each layer as ``GPTModel.forward`` passes them to the decoder; MLA layers compute their
own. The attention mask is ``None``: Megatron's causal attention builds its causal mask itself.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from cfp_megatron.graph.opgraph import OpGraph
from cfp_megatron.graph.record import record_step
from cfp_megatron.model.errors import CaptureError
from cfp_megatron.model.meta_env import meta_device
from cfp_megatron.model.moe_meta import balanced_dispatch, is_moe_layer


def meta_copy(module: torch.nn.Module, *, always: bool = False) -> torch.nn.Module:
    """``module`` itself when its parameters are already on meta (unless ``always``), else a copy with meta
    parameters and buffers. The copy shares no storage with ``module`` and allocates none; ``module`` is unchanged.
    """
    tensors = list(module.parameters()) + list(module.buffers())
    if not always and all(t.device.type == "meta" for t in tensors):
        return module
    memo: dict[int, Any] = {}
    for p in module.parameters():
        meta = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        meta.__dict__.update(p.__dict__)
        memo[id(p)] = meta
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    # Process groups cannot be copied and configs need not be: the copy shares them.
    for m in module.modules():
        for name, value in vars(m).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                _share(value, memo, depth=4)
    return copy.deepcopy(module, memo)


def _share(value: Any, memo: dict[int, Any], *, depth: int) -> None:
    """Enter process groups and configs found in ``value`` (a few levels of containers/objects) into ``memo``."""
    if id(value) in memo or depth < 0 or isinstance(value, torch.Tensor | torch.nn.Module | type):
        return
    if isinstance(value, dist.ProcessGroup) or type(value).__name__ == "ProcessGroupCollection" or (
            dataclasses.is_dataclass(value)):
        memo[id(value)] = value
    elif isinstance(value, dict):
        for v in value.values():
            _share(v, memo, depth=depth - 1)
    elif isinstance(value, list | tuple | set):
        for v in value:
            _share(v, memo, depth=depth - 1)
    elif hasattr(value, "__dict__") and not callable(value):
        for v in vars(value).values():
            _share(v, memo, depth=depth - 1)


def training_copy(module: torch.nn.Module, config: Any) -> torch.nn.Module:
    """A meta copy of ``module`` as Megatron trains it: in train mode, and under bf16/fp16 cast to the
    half-precision dtype as Megatron's ``Float16Module`` casts the whole model (norm weights included)."""
    needs_cast = any(p.is_floating_point() and p.dtype != _half(config) for p in module.parameters())
    return cast_for_training(meta_copy(module, always=_half(config) is not None and needs_cast), config)


def _half(config: Any) -> torch.dtype | None:
    if getattr(config, "bf16", False):
        return torch.bfloat16
    return torch.float16 if getattr(config, "fp16", False) else None


def cast_for_training(module: torch.nn.Module, config: Any) -> torch.nn.Module:
    """``module`` itself, in train mode and cast to the half-precision dtype under bf16/fp16 (in place)."""
    half = _half(config)
    if half is not None:
        module.to(half)
    return module.train()


def activation_dtype(config: Any) -> torch.dtype:
    """Dtype of the hidden states between layers."""
    return torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else config.params_dtype


def layer_kind_name(layer: torch.nn.Module) -> str:
    """``moe`` for a layer with an MoE MLP, else ``dense``."""
    return "moe" if any(is_moe_layer(m) for m in layer.modules()) else "dense"


def layer_signature(layer: torch.nn.Module) -> tuple:
    """What makes two decoder layers the same kind: module types by path and parameter shapes/dtypes by name."""
    modules = tuple((name, type(m).__qualname__) for name, m in layer.named_modules())
    params = tuple((name, tuple(p.shape), str(p.dtype)) for name, p in layer.named_parameters())
    return modules, params


def rotary_embedding(model: torch.nn.Module, seq_length: int) -> torch.Tensor | None:
    """The rotary embedding ``GPTModel`` passes its decoder, as a meta tensor (``None`` when it passes none)."""
    config = model.config
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None or getattr(model, "position_embedding_type", None) != "rope" or config.multi_latent_attention:
        return None
    with meta_device():
        out = rope(seq_length)
    return out if out.device.type == "meta" else torch.empty_like(out, device="meta")


def record_layer(layer: torch.nn.Module, *, kind: str, seq_length: int, micro_batch_size: int,
                 rotary_pos_emb: torch.Tensor | None, owned: bool = False) -> OpGraph:
    """Forward + backward of one ``TransformerLayer`` on a meta ``[seq, batch, hidden]`` input.

    ``owned``: the layer was built for this capture on meta, so it is cast in place instead of copied.
    """
    config = layer.config
    layer = cast_for_training(layer, config) if owned else training_copy(layer, config)
    with meta_device():
        hidden = torch.empty(seq_length, micro_batch_size, config.hidden_size, dtype=activation_dtype(config),
                             requires_grad=True)
    with meta_device(), balanced_dispatch(layer):
        return record_step(layer, (hidden,), kind=kind,
                           forward=lambda h: layer(hidden_states=h, attention_mask=None, rotary_pos_emb=rotary_pos_emb))


def record_embedding(model: torch.nn.Module, *, seq_length: int, micro_batch_size: int) -> OpGraph:
    """Forward + backward of ``model.embedding`` (word + learned position embeddings) on meta token ids."""
    embedding = getattr(model, "embedding", None)
    if embedding is None:
        raise CaptureError("the model has no `embedding` (is it a GPTModel built with pre_process=True?).")
    embedding = training_copy(embedding, model.config)
    with meta_device():
        ids = torch.zeros(micro_batch_size, seq_length, dtype=torch.long)
        positions = torch.arange(seq_length).unsqueeze(0).expand(micro_batch_size, -1)
        return record_step(embedding, (ids, positions), kind="embedding",
                           forward=lambda i, p: embedding(input_ids=i, position_ids=p))


class HeadModule(torch.nn.Module):
    """GPTModel's post-process as one module: final norm, output layer, vocabulary-parallel cross entropy.

    Built from meta copies of the model's own modules (never deep-copied itself: the model is kept only to call its
    loss).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        decoder = getattr(model, "decoder", None)
        norm = getattr(decoder, "final_layernorm", None)
        self.final_layernorm = meta_copy(norm, always=True) if norm is not None else None
        self.output_layer = meta_copy(model.output_layer, always=True)
        tied = bool(getattr(model, "share_embeddings_and_output_weights", False))
        # The tied output weight is the embedding's: registered here so the head's graph names it as a parameter.
        self.word_embeddings = meta_copy(model.embedding.word_embeddings, always=True) if tied else None
        self._loss_owner = [model]  # a list, so the whole model is not registered as a submodule

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token loss ``[batch, seq]``."""
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        weight = self.word_embeddings.weight if self.word_embeddings is not None else None
        logits, _ = self.output_layer(hidden_states, weight=weight)
        return self._loss_owner[0].compute_language_model_loss(labels, logits)


def record_head(model: torch.nn.Module, *, seq_length: int, micro_batch_size: int) -> tuple[OpGraph, int]:
    """Forward + backward of the final norm, output layer and loss; also the tied parameters it shares."""
    if getattr(model, "output_layer", None) is None:
        raise CaptureError("the model has no `output_layer` (is it a GPTModel built with post_process=True?).")
    config = model.config
    head = cast_for_training(HeadModule(model), config)  # its parts are copies already
    with meta_device():
        hidden = torch.empty(seq_length, micro_batch_size, config.hidden_size, dtype=activation_dtype(config),
                             requires_grad=True)
        labels = torch.zeros(micro_batch_size, seq_length, dtype=torch.long)
        graph = record_step(head, (hidden, labels), kind="head", forward=head, loss_fn=lambda loss: loss.sum())
    shared = head.word_embeddings.weight.numel() if head.word_embeddings is not None else 0
    return graph, shared
