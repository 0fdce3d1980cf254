"""The loss's and the unfused attention core's peak memory per element, one CPU rank, bf16, under ``MemTracker``.

``python bench/loss_core_memory.py [--seq 256] [--vocab 8192] [--micro-batches 1 2 4]``. Runs Megatron-Core's
vocab-parallel cross entropy (``tensor_parallel.vocab_parallel_cross_entropy``, as ``GPTModel`` calls it) after an
output layer, with the runtime's ``loss_func`` sum, forward and backward; then its ``DotProductAttention`` (causal,
GQA, no fused softmax: the local spec) forward and backward. Prints the peak bytes per logit (beyond the head's
weight) and per ``s x s`` score (beyond Q, K and V) at each micro-batch, to set against the memory model's
(docs/simulator.md, "What grows with the micro-batch"). Asserts nothing.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

HEADS, GROUPS, HEAD_DIM, HIDDEN = 8, 2, 32, 64


def _peak(tracker: MemTracker) -> int:
    """The tracked peak on the CPU, bytes."""
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def loss_bytes_per_logit(seq: int, vocab: int, micro_batch: int) -> float:
    """Peak bytes per logit of the output layer, the cross entropy and the summed loss, forward and backward."""
    from megatron.core import tensor_parallel

    head = torch.nn.Linear(HIDDEN, vocab, bias=False).to(torch.bfloat16)
    hidden = torch.randn(seq, micro_batch, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (micro_batch, seq))
    tracker = MemTracker()
    tracker.track_external(head, hidden)
    with tracker:
        logits = head(hidden)
        losses = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous())
        del logits
        torch.sum(losses.transpose(0, 1).contiguous().float().reshape(-1) * torch.ones(micro_batch * seq)).backward()
    return (_peak(tracker) - head.weight.numel() * 2) / (seq * micro_batch * vocab)


def core_bytes_per_score(seq: int, micro_batch: int) -> float:
    """Peak bytes per score of Megatron-Core's unfused core, forward and backward, beyond its inputs."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, bf16=True, params_dtype=torch.bfloat16, attention_dropout=0.0,
                               masked_softmax_fusion=False, use_cpu_initialization=True)
    core = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    q = torch.randn(seq, micro_batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(seq, micro_batch, GROUPS, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    tracker = MemTracker()
    tracker.track_external(q, k, v)
    with tracker:
        core(q, k, v, None, attn_mask_type=AttnMaskType.causal).float().sum().backward()
    inputs = 2 * (q.numel() + k.numel() + v.numel())
    return (_peak(tracker) - inputs) / (micro_batch * HEADS * seq * seq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    from cfp_megatron.compat import cpu

    cpu.install_if_needed()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    model_parallel_cuda_manual_seed(1)
    for micro_batch in args.micro_batches:
        print(f"micro-batch {micro_batch}: loss {loss_bytes_per_logit(args.seq, args.vocab, micro_batch):.3f} B a "
              f"logit, unfused core {core_bytes_per_score(args.seq, micro_batch):.3f} B a score")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
