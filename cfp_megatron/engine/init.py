"""Layout-independent weight initialisation.

Megatron initialises each rank's shard from that rank's RNG stream, so the same seed gives different models under
different pipeline or expert layouts. Here every weight is drawn again from a generator keyed by the seed and the
weight's *global* identity (its checkpoint key and, for stacked layers and experts, its layer/expert index), and each
rank keeps the slice its ``ShardedTensor`` describes. The same seed therefore gives the same model under every
TP/PP/VPP/EP layout, which is what lets a parallel run be checked against a single-rank reference.

Distributions follow Megatron's: normal(0, ``init_method_std``) for weights, scaled by 1/sqrt(2 x num_layers) for
the output projections of attention and MLP (``output_layer_init_method``); constant tensors (norm weights, biases)
keep Megatron's values.
"""

from __future__ import annotations

import hashlib
import math

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")
"""Key suffixes Megatron initialises with ``output_layer_init_method`` (scaled by 1/sqrt(2 L))."""


def _seed_for(seed: int, key: str, index: tuple[int, ...]) -> int:
    digest = hashlib.sha256(f"{seed}|{key}|{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _sharded_tensors(model: torch.nn.Module) -> list[ShardedTensor]:
    """The model's ShardedTensors, with factories (e.g. SwiGLU's fused fc1) expanded into their parts."""
    out: list[ShardedTensor] = []
    # Megatron-Core's GPTModel reads the DP x CP group from the metadata where it ties an MTP stage's embedding copy.
    for value in nested_values(model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))):
        if isinstance(value, ShardedTensorFactory):
            out.extend(v for v in nested_values(value.build()) if isinstance(v, ShardedTensor))
        elif isinstance(value, ShardedTensor):
            out.append(value)
    return out


def init_std(key: str, config: TransformerConfig) -> float:
    """Standard deviation Megatron uses for the weight behind ``key``."""
    if key.endswith(OUTPUT_PROJECTIONS):
        return config.init_method_std / math.sqrt(2.0 * config.num_layers)
    return config.init_method_std


@torch.no_grad()
def layout_independent_init(chunks: list[torch.nn.Module], config: TransformerConfig, seed: int) -> int:
    """Redraw every randomly initialised weight of ``chunks`` from (seed, global key); return how many were set."""
    count = 0
    seen: set[tuple] = set()  # storage address + shape: factory views are temporaries, so id() can repeat
    for chunk in chunks:
        for sh in _sharded_tensors(chunk):
            data = sh.data
            if data is None or not data.is_floating_point() or data.numel() == 0:
                continue
            ident = (data.data_ptr(), tuple(data.shape), tuple(data.stride()))
            if ident in seen or bool((data == data.flatten()[0]).all()):
                continue  # tied weights appear twice; constants (norms, biases) keep Megatron's values
            seen.add(ident)
            pre = sh.prepend_axis_num
            index = tuple(int(o) for o in sh.global_offset[:pre])
            full_shape = tuple(int(s) for s in sh.global_shape[pre:])
            gen = torch.Generator(device="cpu").manual_seed(_seed_for(seed, sh.key, index))
            full = torch.empty(full_shape, dtype=torch.float32).normal_(0.0, init_std(sh.key, config), generator=gen)
            slices = tuple(slice(int(o), int(o) + n) for o, n in zip(sh.global_offset[pre:], sh.local_shape,
                                                                     strict=True))
            local = full[slices]
            if sh.flattened_range is not None:
                local = local.flatten()[sh.flattened_range]
            data.copy_(local.reshape(data.shape).to(data.dtype))
            count += 1
    return count
