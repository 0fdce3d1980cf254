"""Model FLOPs per token, for tokens/s -> MFU (PaLM's convention: 6 x active matmul parameters + attention)."""

from __future__ import annotations

from cfp_megatron.base.config import Activation, AttentionKind, ModelSpec


def attention_params(m: ModelSpec) -> int:
    """Matmul parameters of one attention block (no norms, no biases)."""
    h = m.hidden_size
    if m.attention is AttentionKind.mla:
        heads, qk, rope, v = m.num_attention_heads, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        q = h * m.q_lora_rank + m.q_lora_rank * heads * (qk + rope) if m.q_lora_rank else h * heads * (qk + rope)
        kv = h * (m.kv_lora_rank + rope) + m.kv_lora_rank * heads * (qk + v)
        return q + kv + heads * v * h
    d = m.kv_channels or h // m.num_attention_heads
    return h * d * (m.num_attention_heads + 2 * m.query_groups) + m.num_attention_heads * d * h


def mlp_params(m: ModelSpec, ffn: int) -> int:
    """Matmul parameters of one MLP with hidden size ``ffn``."""
    return (3 if m.activation is Activation.swiglu else 2) * m.hidden_size * ffn


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


def training_flops_per_token(m: ModelSpec, seq_length: int) -> float:
    """Model FLOPs (forward + backward, no recompute) per trained token: 6 N + 12 L H d s."""
    if m.attention is AttentionKind.mla:
        head_dims = m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim) / 2
    else:
        head_dims = m.num_attention_heads * (m.kv_channels or m.hidden_size // m.num_attention_heads)
    return 6.0 * active_matmul_params_per_token(m) + 12.0 * m.num_layers * head_dims * seq_length
