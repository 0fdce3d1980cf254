"""Model FLOPs per token, for tokens/s -> MFU (PaLM's convention: 6 x active matmul parameters + attention)."""

from __future__ import annotations

import math

from cfp_megatron.base.config import AttentionKind, ModelSpec


def dense_linear_weights(m: ModelSpec) -> tuple[int, int, int, int]:
    """Elements of one layer's QKV, attention-output, FC1 and FC2 weights with multi- or grouped-query attention and
    a dense MLP of ``m.ffn_size`` (FC1 holds the gate too under SwiGLU)."""
    h, heads = m.hidden_size, m.num_attention_heads
    d = m.kv_channels or h // heads
    fc1 = (2 if m.activation.gated else 1) * h * m.ffn_size
    return h * d * (heads + 2 * m.query_groups), heads * d * h, fc1, m.ffn_size * h


def attention_params(m: ModelSpec) -> int:
    """Matmul parameters of one attention block (no norms, no biases)."""
    h = m.hidden_size
    if m.attention is AttentionKind.mla:
        heads, qk, rope, v = m.num_attention_heads, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        q = h * m.q_lora_rank + m.q_lora_rank * heads * (qk + rope) if m.q_lora_rank else h * heads * (qk + rope)
        kv = h * (m.kv_lora_rank + rope) + m.kv_lora_rank * heads * (qk + v)
        return q + kv + heads * v * h
    qkv, projection, _, _ = dense_linear_weights(m)
    return qkv + projection


def mlp_params(m: ModelSpec, ffn: int) -> int:
    """Matmul parameters of one MLP with hidden size ``ffn``."""
    return (3 if m.activation.gated else 2) * m.hidden_size * ffn


def active_matmul_params_per_token(m: ModelSpec) -> int:
    """Matmul parameters one token passes through (routed experts counted top-k times), including the logits."""
    attn = attention_params(m) * m.num_layers
    if m.is_moe:
        expert = mlp_params(m, m.moe_ffn_hidden_size or m.ffn_size)
        shared = mlp_params(m, m.moe_shared_expert_intermediate_size or 0)
        router = m.hidden_size * (m.num_experts or 0)
        moe_layers = m.num_layers - m.moe_first_dense_layers
        mlp = moe_layers * (m.moe_router_topk * expert + shared + router)
        mlp += m.moe_first_dense_layers * mlp_params(m, m.ffn_size)
    else:
        mlp = m.num_layers * mlp_params(m, m.ffn_size)
    return attn + mlp + m.hidden_size * m.padded_vocab_size


ATTENTION_TILE = 128
"""Query and key rows per tile of a fused attention kernel (FlashAttention's and cuDNN's 128 x 128 blocks): a
sliding window costs the tiles it touches, not the scores it keeps."""


def attended_keys(m: ModelSpec, seq_length: int) -> float:
    """Keys each query meets, summed over the decoder layers, by PaLM's convention (the whole sequence, no causal
    halving): ``seq_length`` for a layer of full attention, ``window_size + 1`` at most for a windowed one."""
    windowed = m.windowed_layers
    window = min(seq_length, (m.window_size or 0) + 1)
    return (m.num_layers - windowed) * seq_length + windowed * window


def causal_score_share(m: ModelSpec, seq_length: int) -> float:
    """Share of the ``seq x seq`` scores a fused causal kernel computes, averaged over the decoder layers: half for
    full attention; for a sliding window the :data:`ATTENTION_TILE` tiles it touches (the window's tiles and the
    diagonal one), at most half."""
    windowed = m.windowed_layers
    tiles = (math.ceil((m.window_size or 0) / ATTENTION_TILE) + 1) * ATTENTION_TILE
    window_share = min(0.5, tiles / seq_length)
    return ((m.num_layers - windowed) * 0.5 + windowed * window_share) / m.num_layers


def training_flops_per_token(m: ModelSpec, seq_length: int) -> float:
    """Model FLOPs (forward + backward, no recompute) per trained token: 6 N + 12 L H d s (a windowed layer's
    keys for its ``s``, :func:`attended_keys`)."""
    if m.attention is AttentionKind.mla:
        head_dims = m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim) / 2
    else:
        head_dims = m.num_attention_heads * (m.kv_channels or m.hidden_size // m.num_attention_heads)
    return 6.0 * active_matmul_params_per_token(m) + 12.0 * head_dims * attended_keys(m, seq_length)
