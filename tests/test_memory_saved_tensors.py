"""The activation model's per-layer terms against what a real Megatron-Core GPT model keeps on this CPU: every tensor
autograd saves for the backward pass (``torch.autograd.graph.saved_tensors_hooks``), by storage, per decoder layer,
under no, selective and full recomputation at micro-batch 1, 2 and 4 (docs/simulator.md, "Saved tensors")."""

from __future__ import annotations

import functools

import pytest
import torch

from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.config import AttentionKernel, JobSpec, Recompute
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.memory import layer_activation_bytes, stage, unfused_attention_working_bytes
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.terms.recompute import kept_and_working

SEQ = 64
MICRO_BATCHES = (1, 2, 4)
CPU_OPTIONS = SimOptions(attention=AttentionKernel.torch_softmax, rope_fusion=False)  # as Megatron-Core runs here
"""Megatron's unfused core with PyTorch's softmax: what a CPU without Transformer Engine runs."""


def _job(model: str, recompute: str, micro_batch: int, group: int = 1) -> JobSpec:
    return compose_job([f"model={model}", "model.num_layers=2", "cluster=local", f"parallel.recompute={recompute}",
                        f"train.seq_length={SEQ}", f"train.micro_batch_size={micro_batch}",
                        f"train.global_batch_size={micro_batch}", f"parallel.recompute_num_layers={group}"])


@functools.cache
def _measured(model: str, recompute: str, group: int = 1) -> dict[int, tuple[float, float]]:
    """Per micro-batch size: (bytes one decoder layer saves in the forward pass, bytes one layer saves while its
    backward pass recomputes it), each the mean over the layers, counted by storage; storages that several layers
    save (the causal mask, the rotary table a checkpointed unit keeps) are shared, once a rank, and left out."""
    from cfp_megatron.engine.distributed import model_groups
    from cfp_megatron.engine.model import build_model_chunks
    from cfp_megatron.model.megatron_config import transformer_config
    from cfp_megatron.model.meta_env import megatron_meta_env

    found = {}
    with megatron_meta_env():
        job = _job(model, recompute, 1, group)
        dims = ParallelDims.build(job, 1, te_available=False)
        (gpt,) = build_model_chunks(job, transformer_config(job, dims, on_gpu=False), dims, model_groups())
        weights = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
        tag: list[str] = ["outside"]
        saved: dict[str, dict[int, int]] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in weights:
                saved.setdefault(tag[0], {})[storage.data_ptr()] = storage.nbytes()
            return tensor

        phase = ["forward"]
        for index, layer in enumerate(gpt.decoder.layers):
            layer.register_forward_pre_hook(lambda _m, _a, i=index: tag.__setitem__(0, f"{phase[0]}{i}"))
            # The checkpointed units of full recomputation save their inputs in the block, between the layers.
            layer.register_forward_hook(lambda _m, _a, _o: tag.__setitem__(0, "units"))
        gpt.decoder.register_forward_pre_hook(lambda _m, _a: tag.__setitem__(0, "units"))
        gpt.decoder.final_layernorm.register_forward_pre_hook(lambda _m, _a: tag.__setitem__(0, "outside"))
        layers = len(gpt.decoder.layers)
        for micro_batch in MICRO_BATCHES:
            saved.clear()
            tag[0], phase[0] = "outside", "forward"
            tokens = torch.randint(0, job.model.vocab_size, (micro_batch, SEQ))
            positions = torch.arange(SEQ).unsqueeze(0).expand(micro_batch, SEQ)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                loss = gpt(tokens, positions, None, labels=tokens)
                phase[0] = "recompute"
                loss.sum().backward()
            gpt.zero_grad(set_to_none=True)
            per_layer = ([saved.get(f"forward{i}", {}) for i in range(layers)] if recompute != "full"
                         else [saved.get("units", {})])
            counts: dict[int, int] = {}
            for storages in per_layer:
                for ptr in storages:
                    counts[ptr] = counts.get(ptr, 0) + 1
            kept = sum(size for storages in per_layer for ptr, size in storages.items()
                       if counts[ptr] == 1 or recompute == "full")
            if recompute == "full" and job.model.position_embedding.value == "rope":
                # the units' rotary table (one [s, 1, 1, head_dim] fp32 tensor) is the rank's, shared
                kept -= SEQ * (job.model.kv_channels or job.model.hidden_size // job.model.num_attention_heads) * 4
            recomputed = [sum(saved.get(f"recompute{i}", {}).values()) for i in range(layers)]
            found[micro_batch] = (kept / layers, sum(recomputed) / layers)
    return found


def _predicted(model: str, recompute: str, micro_batch: int) -> tuple[float, float, float]:
    job = _job(model, recompute, micro_batch)
    layout = build_layout(job, world_size=1)
    kept, full = layer_activation_bytes(job, layout, CPU_OPTIONS, moe=False)
    whole = layer_activation_bytes(job, layout, CPU_OPTIONS, moe=False, recompute=Recompute.none)[0]
    return kept, full, whole


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_a_layers_kept_activations_match_what_megatron_saves(recompute: str) -> None:
    for micro_batch, (measured, _) in _measured("llama_tiny", recompute).items():
        kept = _predicted("llama_tiny", recompute, micro_batch)[0]
        assert kept == pytest.approx(measured, rel=0.01), (recompute, micro_batch)


def test_full_recomputation_keeps_each_layers_input_and_recomputes_its_whole_activations() -> None:
    for micro_batch, (measured, recomputed) in _measured("llama_tiny", "full").items():
        _, full, whole = _predicted("llama_tiny", "full", micro_batch)
        assert full == pytest.approx(measured, rel=0.01), micro_batch  # the layer's input, nothing else
        # Its backward pass runs the layer's forward again: the same tensors as without recomputation.
        assert whole == pytest.approx(recomputed, rel=0.01), micro_batch


def test_uniform_recomputation_in_groups_keeps_one_input_a_group_and_recomputes_the_group_at_once() -> None:
    # recompute_num_layers=2 (uniform): the one checkpointed group of the 2 layers keeps its input alone; its backward
    # pass saves both layers' tensors again before differentiating them.
    for micro_batch, (measured, recomputed) in _measured("llama_tiny", "full", 2).items():
        job = _job("llama_tiny", "full", micro_batch, 2)
        layout = build_layout(job, world_size=1)
        rank = stage(job, layout, CPU_OPTIONS, rank=0, layer_params=0.0, expert_params=0.0, layers=2, moe_layers=0,
                     first=True, last=True)
        kept, working = kept_and_working(rank)
        assert kept == pytest.approx(2 * measured, rel=0.01), micro_batch  # the group's input
        assert kept == pytest.approx(_predicted("llama_tiny", "full", micro_batch)[1], rel=1e-9)
        core = unfused_attention_working_bytes(job, layout, CPU_OPTIONS)  # the scores' gradient, not saved
        assert working - core == pytest.approx(2 * recomputed, rel=0.01), micro_batch


def test_layernorm_and_learned_positions_keep_what_the_model_counts() -> None:
    # gpt_tiny: LayerNorm (mean and rstd), no RoPE: under selective recomputation Q, K and V are views of the QKV
    # projection's output, which the checkpointed core keeps whole.
    for micro_batch, (measured, _) in _measured("gpt_tiny", "selective").items():
        kept = _predicted("gpt_tiny", "selective", micro_batch)[0]
        assert kept == pytest.approx(measured, rel=0.01), micro_batch
