"""Capture a Megatron-Core GPT model with no memory: one layer of each distinct kind built and recorded on meta.

The whole model is the sequence ``embedding, <kind of each decoder layer>, head``; each kind is recorded once (one
forward + backward of one micro-batch, :func:`~cfp_megatron.graph.record.record_step`) and counted as often as it
occurs, never traced layer by layer. Capture builds TP = PP = CP = EP = 1 and no recomputation: partitions are
propagated over the graphs later (:mod:`cfp_megatron.graph.propagation`), recomputation is the simulator's choice.
MoE layers run with a balanced routing (:mod:`cfp_megatron.model.moe_meta`), MLA with Megatron's local attention
adapted to MLA's head sizes (:mod:`cfp_megatron.model.mla`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cfp_megatron.base.config import ClusterSpec, JobSpec, ParallelSpec, Precision, TrainSpec, resolve_precision
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.graph.opgraph import OpGraph, Phase
from cfp_megatron.model.errors import CaptureError
from cfp_megatron.model.layer_spec import block_spec
from cfp_megatron.model.megatron_config import params_dtype, transformer_config
from cfp_megatron.model.megatron_layers import (
    layer_kind_name,
    layer_signature,
    record_embedding,
    record_head,
    record_layer,
    rotary_embedding,
)
from cfp_megatron.model.meta_env import megatron_meta_env, meta_device
from cfp_megatron.model.mla import local_mla_layer_spec
from cfp_megatron.model.summary import CaptureSummary, KindSummary


@dataclass(frozen=True, kw_only=True)
class ModelCapture:
    """Operator graphs of every distinct layer kind of a model, and the order the kinds occur in."""

    model: str
    """Model name."""
    seq_length: int
    """Tokens per sequence the graphs were recorded with."""
    micro_batch_size: int
    """Sequences per micro-batch the graphs were recorded with."""
    graphs: dict[str, OpGraph]
    """One forward + backward graph per kind (``embedding``, ``dense``, ``moe``, ..., ``head``)."""
    layer_kinds: tuple[str, ...]
    """Kind of each decoder layer, in order."""
    shared_params: int = 0
    """Parameters that appear in two kinds' graphs (tied input/output embeddings), counted once in totals."""

    def __post_init__(self) -> None:
        missing = sorted(set(self.layer_kinds) - set(self.graphs))
        if missing:
            raise CaptureError(f"layer kinds {missing} have no graph; captured kinds are {sorted(self.graphs)}.")

    @property
    def counts(self) -> dict[str, int]:
        """How often each kind occurs in the model: decoder kinds as often as they occur, the others once."""
        return {kind: self.layer_kinds.count(kind) if kind in self.layer_kinds else 1 for kind in self.graphs}

    @property
    def sequence(self) -> tuple[str, ...]:
        """The model as a sequence of kinds: embedding, each decoder layer, head (those captured)."""
        return self.summary(with_graphs=False).sequence

    @property
    def total_params(self) -> int:
        """Parameters of the whole model."""
        return self.summary(with_graphs=False).total_params

    @property
    def total_flops(self) -> int:
        """FLOPs of one micro-batch's forward + backward through the whole model."""
        return self.summary(with_graphs=False).total_flops

    def summary(self, *, with_graphs: bool = True) -> CaptureSummary:
        """The JSON-ready summary (what the cache stores)."""
        counts = self.counts
        kinds = {k: KindSummary(kind=k, count=counts[k], params=g.param_count, flops=g.flops,
                                forward_flops=sum(o.flops for o in g.phase(Phase.forward)),
                                operators=len(g.operators), graph=g.to_json() if with_graphs else {})
                 for k, g in self.graphs.items()}
        return CaptureSummary(model=self.model, seq_length=self.seq_length, micro_batch_size=self.micro_batch_size,
                              layer_kinds=self.layer_kinds, kinds=kinds, shared_params=self.shared_params)

    def to_json(self, *, with_graphs: bool = True) -> dict[str, Any]:
        """``summary().to_json()``: per kind count, params, FLOPs, operator count (and operator lists)."""
        return self.summary(with_graphs=with_graphs).to_json(with_graphs=with_graphs)


def _first_positions(keys: list[Any]) -> dict[Any, int]:
    """Position of the first occurrence of each distinct key, in order of first appearance."""
    first: dict[Any, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    return first


def _unique_names(names: list[str]) -> list[str]:
    """``dense, moe, dense`` -> ``dense, moe, dense_2`` (distinct kinds that would share a name)."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out


def capture_job_config(job: JobSpec, *, precision: Precision | None = None) -> Any:
    """Megatron's ``TransformerConfig`` for capturing ``job``: TP = PP = 1, meta-friendly initialisation.

    ``precision`` defaults to the job's, resolved as on a GPU (``auto`` -> bf16).
    """
    # One process, one stage: the job's own layout and cluster (checked elsewhere) do not change the layers' graphs.
    single = dataclasses.replace(job, parallel=ParallelSpec(), cluster=ClusterSpec(),
                                 train=TrainSpec(precision=job.train.precision))
    dims = ParallelDims.build(single, 1, te_available=False)
    config = transformer_config(single, dims, on_gpu=False)
    resolved = resolve_precision(precision or job.train.precision, True)
    dtype = params_dtype(resolved)
    return dataclasses.replace(config, use_cpu_initialization=True, perform_initialization=False,
                               params_dtype=dtype, pipeline_dtype=dtype, bf16=resolved is Precision.bf16,
                               fp16=resolved is Precision.fp16)


def capture_job(job: JobSpec, *, seq_length: int | None = None, micro_batch_size: int = 1,
                precision: Precision | None = None) -> ModelCapture:
    """Capture the model of ``job`` (``seq_length`` defaults to ``job.train.seq_length``)."""
    m = job.model
    config = capture_job_config(job, precision=precision)
    layer_spec = None
    if m.spec is not None:  # the user's ModuleSpec (model.spec), built for the capture's config
        with megatron_meta_env():
            layer_spec = block_spec(m, _prepare_config(config))
    return capture_transformer_config(
        config, vocab_size=m.padded_vocab_size, seq_length=seq_length or job.train.seq_length,
        micro_batch_size=micro_batch_size, name=m.name, normalization=m.normalization.value,
        position_embedding_type=m.position_embedding.value, rotary_base=int(m.rotary_base),
        max_sequence_length=m.max_position_embeddings, share_embeddings_and_output_weights=m.tie_embeddings,
        layer_spec=layer_spec)


def _prepare_config(config: Any) -> Any:
    """One stage, no recomputation, initialisation that allocates nothing on meta, Megatron's local attention."""
    from megatron.core.transformer.enums import AttnBackend

    changes: dict[str, Any] = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                   virtual_pipeline_model_parallel_size=None, context_parallel_size=1,
                                   expert_model_parallel_size=1, expert_tensor_parallel_size=1,
                                   sequence_parallel=False, use_cpu_initialization=True,
                                   perform_initialization=False, recompute_granularity=None,
                                   recompute_method=None, recompute_num_layers=None,
                                   attention_backend=AttnBackend.local)
    if config.recompute_modules is not None:
        changes["recompute_modules"] = []
    return dataclasses.replace(config, **changes)


def capture_transformer_config(config: Any, *, vocab_size: int, seq_length: int, micro_batch_size: int = 1,
                               name: str = "model", normalization: str | None = None,
                               position_embedding_type: str = "rope", rotary_base: int = 10000,
                               max_sequence_length: int | None = None,
                               share_embeddings_and_output_weights: bool = False,
                               layer_spec: Any = None) -> ModelCapture:
    """Capture the GPT model a user's ``TransformerConfig`` describes (Megatron's local layer specs, or
    ``layer_spec``: a ``ModuleSpec`` of a layer or a ``TransformerBlockSubmodules``, as GPTModel takes them)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, _get_block_submodules

    if seq_length <= 0 or micro_batch_size <= 0:
        raise CaptureError(f"seq_length={seq_length} and micro_batch_size={micro_batch_size} must be positive.")
    config = _prepare_config(config)
    with megatron_meta_env():
        block = (get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=normalization)
                 if layer_spec is None else _get_block_submodules(config, layer_spec))
        specs = [local_mla_layer_spec(s) for s in block.layer_specs]
        spec_key = [repr(spec) for spec in specs]
        first_index = _first_positions(spec_key)
        # The embedding, rotary embedding and head of Megatron's GPTModel, with an empty decoder.
        with meta_device():
            shell = GPTModel(
                config=dataclasses.replace(config, num_layers=1, moe_layer_freq=1),
                transformer_layer_spec=TransformerBlockSubmodules(layer_specs=[], layer_norm=block.layer_norm),
                vocab_size=vocab_size, max_sequence_length=max_sequence_length or seq_length, pre_process=True,
                post_process=True, share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                position_embedding_type=position_embedding_type, rotary_base=rotary_base)
        rope = rotary_embedding(shell, seq_length)
        graphs: dict[str, OpGraph] = {
            "embedding": record_embedding(shell, seq_length=seq_length, micro_batch_size=micro_batch_size)}
        head, shared = record_head(shell, seq_length=seq_length, micro_batch_size=micro_batch_size)
        layers: dict[str, torch.nn.Module] = {}
        for key, i in first_index.items():
            with meta_device():
                layers[key] = build_module(specs[i], config=config, layer_number=i + 1)
        names = dict(zip(first_index, _unique_names([layer_kind_name(layers[k]) for k in first_index]), strict=True))
        for key, layer in layers.items():
            graphs[names[key]] = record_layer(layer, kind=names[key], seq_length=seq_length,
                                              micro_batch_size=micro_batch_size, rotary_pos_emb=rope, owned=True)
        graphs["head"] = head
    return ModelCapture(model=name, seq_length=seq_length, micro_batch_size=micro_batch_size, graphs=graphs,
                        layer_kinds=tuple(names[k] for k in spec_key), shared_params=shared)


def capture_model(model: torch.nn.Module, *, seq_length: int, micro_batch_size: int = 1,
                  name: str | None = None) -> ModelCapture:
    """Capture an already-built Megatron ``GPTModel`` (any device; recorded on meta copies of one layer per kind).

    Layers are the same kind when their module types and parameter shapes match (:func:`layer_signature`).
    """
    decoder = getattr(model, "decoder", None)
    layers = list(getattr(decoder, "layers", None) or [])
    if decoder is None or getattr(model, "config", None) is None:
        raise CaptureError(f"{type(model).__name__} is not a Megatron GPTModel (it needs .config and .decoder).")
    with megatron_meta_env():
        keys = [layer_signature(layer) for layer in layers]
        first = _first_positions(keys)
        names = dict(zip(first, _unique_names([layer_kind_name(layers[i]) for i in first.values()]), strict=True))
        rope = rotary_embedding(model, seq_length)
        graphs: dict[str, OpGraph] = {}
        shared = 0
        if getattr(model, "pre_process", True) and getattr(model, "embedding", None) is not None:
            graphs["embedding"] = record_embedding(model, seq_length=seq_length, micro_batch_size=micro_batch_size)
        for key, i in first.items():
            graphs[names[key]] = record_layer(layers[i], kind=names[key], seq_length=seq_length,
                                              micro_batch_size=micro_batch_size, rotary_pos_emb=rope)
        if getattr(model, "post_process", True) and getattr(model, "output_layer", None) is not None:
            graphs["head"], shared = record_head(model, seq_length=seq_length, micro_batch_size=micro_batch_size)
    return ModelCapture(model=name or type(model).__name__, seq_length=seq_length, micro_batch_size=micro_batch_size,
                        graphs=graphs, layer_kinds=tuple(names[k] for k in keys), shared_params=shared)


def parameters_on_meta(modules: Mapping[str, torch.nn.Module] | list[torch.nn.Module]) -> bool:
    """Whether every parameter of ``modules`` lives on the meta device."""
    values = modules.values() if isinstance(modules, Mapping) else modules
    return all(p.device.type == "meta" for m in values for p in m.parameters())
