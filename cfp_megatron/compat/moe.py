"""Fixes Megatron-Core's MoE code needs without Transformer Engine, on CPU and GPU alike.

Each fix is a small adapter around a Megatron function; none changes the routing or expert computation.
"""

from __future__ import annotations

_installed = False


def install() -> None:
    """Apply the MoE fixes (idempotent)."""
    global _installed
    if _installed:
        return
    from megatron.core.transformer.moe import moe_utils

    _split_sizes_as_lists()
    # megatron-core 0.16.1 references te_general_gemm in the router without defining it when TE is absent.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _installed = True


def _as_list(sizes: object) -> object:
    """NumPy arrays and tensors of split sizes -> list[int] (what all_to_all_single's binding accepts)."""
    if sizes is None or isinstance(sizes, list):
        return sizes
    tolist = getattr(sizes, "tolist", None)
    return [int(x) for x in tolist()] if callable(tolist) else list(sizes)  # type: ignore[call-overload]


def _split_sizes_as_lists() -> None:
    """The all-to-all token dispatcher passes NumPy split sizes; torch.distributed's binding wants lists."""
    from megatron.core.tensor_parallel.mappings import _AllToAll

    original = _AllToAll.forward

    def forward(ctx, group, input, output_split_sizes, input_split_sizes, *rest, **kwargs):  # noqa: A002
        # Megatron's signature; newer releases add arguments after the split sizes (e.g. use_nccl_stream).
        return original(ctx, group, input, _as_list(output_split_sizes), _as_list(input_split_sizes), *rest, **kwargs)

    _AllToAll.forward = staticmethod(forward)
