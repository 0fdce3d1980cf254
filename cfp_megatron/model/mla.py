"""Multi-latent attention (DeepSeek) without Transformer Engine.

megatron-core 0.16.1's local layer spec for MLA names :class:`DotProductAttention` as the core attention, but MLA
builds it with ``k_channels``/``v_channels`` (query/key heads of 192 = 128 + 64 rotary, value heads of 128), which only
TE's attention accepts, so the local spec cannot be built. :class:`MLADotProductAttention` is Megatron's local
attention taking those two arguments: the same baddbmm / softmax / bmm, with the output width ``heads x v_channels``.
:func:`local_mla_layer_spec` puts it into a layer spec. Also, without TE megatron-core 0.16.1's MLA module still
believes TE is present (its import of Megatron's TE extension succeeds with ``TELinear`` a ``MagicMock`` stub),
then calls ``isinstance(x, TELinear)``; :func:`install` sets its ``HAVE_TE`` flag to the truth.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from typing import Any

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec


class MLADotProductAttention(DotProductAttention):
    """Megatron's local dot-product attention with separate query/key and value head sizes."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None) -> None:
        if v_channels is not None:
            # The local attention sizes its output (heads x kv_channels) from the config; MLA's output is v_channels.
            config = dataclasses.replace(config, kv_channels=v_channels)
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)


def install() -> None:
    """Make Megatron's MLA module's ``HAVE_TE`` agree with what is importable (idempotent)."""
    from megatron.core.transformer import multi_latent_attention as mla

    if not isinstance(getattr(mla, "TELinear", None), type) or importlib.util.find_spec("transformer_engine") is None:
        mla.HAVE_TE = False


def local_mla_layer_spec(spec: ModuleSpec) -> ModuleSpec:
    """A copy of a local-spec TransformerLayer ``spec`` whose MLA core attention is :class:`MLADotProductAttention`.

    Returns ``spec`` itself when its attention is not MLA or its core attention is not the local one.
    """
    attention = getattr(spec.submodules, "self_attention", None)
    core = getattr(getattr(attention, "submodules", None), "core_attention", None)
    if core is not DotProductAttention or "MLA" not in getattr(attention.module, "__name__", ""):
        return spec
    install()
    patched = copy.deepcopy(spec)
    patched.submodules.self_attention.submodules.core_attention = MLADotProductAttention
    return patched
