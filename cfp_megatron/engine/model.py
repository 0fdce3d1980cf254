"""Build Megatron-Core ``GPTModel`` chunks for a job on the live process groups: layer specs (PrimePar's MLP where
the job says), one chunk per virtual pipeline stage."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from cfp_megatron.base.config import JobSpec, MlpPartition
from cfp_megatron.base.parallel_dims import ParallelDims, transformer_engine_available
from cfp_megatron.layers.primepar_mlp import with_primepar_mlp


def build_model_chunks(job: JobSpec, config: TransformerConfig, dims: ParallelDims,
                       groups: ProcessGroupCollection) -> list[GPTModel]:
    """The GPTModel chunks this rank holds: one per virtual pipeline stage (``dims.vpp``), on ``groups``
    (:func:`~cfp_megatron.engine.distributed.model_groups`)."""
    m = job.model
    use_te = transformer_engine_available() and torch.cuda.is_available()
    chunks: list[GPTModel] = []
    for vp_stage in range(dims.vpp):
        vp = vp_stage if dims.vpp > 1 else None
        layer_spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization=m.normalization.value, vp_stage=vp)
        if job.parallel.mlp is MlpPartition.primepar:  # the dense MLP's fc1/fc2 on PrimePar's 2^k x 2^k square
            layer_spec = with_primepar_mlp(layer_spec, job.parallel.primepar_layers)
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=m.padded_vocab_size,
            max_sequence_length=m.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=m.tie_embeddings,
            position_embedding_type=m.position_embedding.value,
            rotary_base=int(m.rotary_base),
            vp_stage=vp,
            pg_collection=groups,
        )
        chunks.append(model)
    if torch.cuda.is_available():
        for model in chunks:
            model.cuda(torch.cuda.current_device())
    return chunks


def count_parameters(chunks: list[torch.nn.Module]) -> int:
    """Parameters held by this rank."""
    return sum(p.numel() for c in chunks for p in c.parameters())
