"""Build Megatron-Core ``GPTModel`` chunks for a job on the live process groups: layer specs (``model.spec``'s,
PrimePar's MLP where the job says), one chunk per virtual pipeline stage."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_mtp_block_spec,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from cfp_megatron.base.config import JobSpec, MlpPartition
from cfp_megatron.base.parallel_dims import ParallelDims, transformer_engine_available
from cfp_megatron.layers.primepar_mlp import with_primepar_mlp
from cfp_megatron.model.layer_spec import block_spec as layer_spec_of


def build_model_chunks(job: JobSpec, config: TransformerConfig, dims: ParallelDims,
                       groups: ProcessGroupCollection) -> list[GPTModel]:
    """The GPTModel chunks this rank holds: one per virtual pipeline stage (``dims.vpp``), on ``groups``
    (:func:`~cfp_megatron.engine.distributed.model_groups`)."""
    m = job.model
    use_te = transformer_engine_available() and torch.cuda.is_available()
    chunks: list[GPTModel] = []
    for vp_stage in range(dims.vpp):
        vp = vp_stage if dims.vpp > 1 else None
        if m.spec is not None:  # the user's ModuleSpec (model.spec), this stage's layers where it takes vp_stage
            layer_spec = layer_spec_of(m, config, vp_stage=vp)
        else:
            layer_spec = get_gpt_decoder_block_spec(
                config, use_transformer_engine=use_te, normalization=m.normalization.value, vp_stage=vp)
        if job.parallel.mlp is MlpPartition.primepar:  # the dense MLP's fc1/fc2 on PrimePar's 2^k x 2^k square
            layer_spec = with_primepar_mlp(layer_spec, job.parallel.primepar_layers)
        # The MTP layers (None on chunks without them), each of the model's last layer kind (as Megatron-LM's
        # model provider passes it: the chunk that holds them may hold no decoder layer, as in DeepSeek-V3's mL).
        mtp_spec = None
        if m.mtp_num_layers:
            last_kind = get_gpt_decoder_layer_specs(config, use_transformer_engine=use_te,
                                                    normalization=m.normalization.value, vp_stage=vp)[-1]
            mtp_spec = get_gpt_mtp_block_spec(config, last_kind, use_transformer_engine=use_te, vp_stage=vp)
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            mtp_block_spec=mtp_spec,
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
        _drop_unused_output_weight(model)
        chunks.append(model)
    if torch.cuda.is_available():
        for model in chunks:
            model.cuda(torch.cuda.current_device())
    return chunks


def _drop_unused_output_weight(model: GPTModel) -> None:
    """Free the output layer's own weight where Megatron-Core never uses it: on a chunk that holds the MTP layers
    and the loss but not the embedding, with tied embeddings, GPTModel computes the logits with its copy of the
    word embedding (``shared_embedding_or_output_weight``) yet still allocates the output layer's weight, which its
    checkpoint code then refuses (``tie_embeddings_and_output_weights_state_dict`` asserts that this chunk has no
    output weight). Without it the chunk is what that code expects; the copy's gradient is all-reduced with the
    first stage's embedding as every tied last stage's is."""
    if (model.mtp_process and model.post_process and not model.pre_process
            and model.share_embeddings_and_output_weights and model.output_layer.weight is not None):
        del model.output_layer.weight
        model.output_layer.weight = None


def count_parameters(chunks: list[torch.nn.Module]) -> int:
    """Parameters held by this rank."""
    return sum(p.numel() for c in chunks for p in c.parameters())
