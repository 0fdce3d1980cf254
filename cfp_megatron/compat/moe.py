"""Fixes Megatron-Core 0.16's MoE code needs to run on CPU with gloo (filled in below)."""


def install() -> None:
    """Apply the MoE fixes (idempotent)."""
