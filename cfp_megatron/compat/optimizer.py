"""A fix Megatron-Core's distributed optimizer needs on PyTorch's own Adam (no Apex, no Transformer Engine).

megatron-core 0.16.1 restores a checkpoint saved in its ``fully_reshardable`` format by copying every entry of each
parameter's optimizer state from the checkpoint; with PyTorch's Adam that state also holds ``step``, which the
checkpoint's per-parameter tensors do not (Megatron restores it from the parameter groups just before), so the load
fails with ``KeyError: 'step'``. The adapter copies the entries the checkpoint has; everything else is Megatron's.
Megatron also gives every parameter's state the *same* ``step`` tensor on that path, which PyTorch's Adam then
increments once per parameter per step (wrong bias correction after a resume): :func:`unshare_steps` gives each
parameter its own copy after a load.
"""

from __future__ import annotations

from typing import Any

_installed = False


def install() -> None:
    """Apply the fix where Megatron runs on PyTorch's optimizers (idempotent)."""
    global _installed
    if _installed:
        return
    from megatron.core.optimizer import distrib_optimizer

    if not getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        original = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states

        def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            missing = set(self.optimizer.state[main_param]) - set(tensors)
            if missing != {"step"}:
                original(self, model_param, tensors)
                return
            kept = self.optimizer.state[main_param].pop("step")  # restored from the parameter groups already
            try:
                original(self, model_param, tensors)
            finally:
                self.optimizer.state[main_param]["step"] = kept

        distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    _installed = True


def unshare_steps(optimizer: Any) -> None:
    """Give each parameter's PyTorch optimizer state its own ``step`` tensor (see the module docstring)."""
    import torch

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        seen: set[int] = set()
        for state in getattr(inner, "state", {}).values():
            step = state.get("step") if isinstance(state, dict) else None
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.clone()
                seen.add(id(state["step"]))


def retain_shard_grads(optimizer: Any) -> int:
    """Mark the fp32 parameter shards of Megatron's distributed optimizer as tensors whose ``.grad`` is meant to be
    read; return how many were marked.

    For fp32 parameters (CPU runs, ``train.precision=fp32``) Megatron-Core 0.16 hands PyTorch's optimizer views of
    the parameters (``param.view(-1)[start:end]``, not detached: non-leaf tensors) and assigns their ``.grad`` itself
    every step; its ``zero_grad`` reads that ``.grad`` before the first assignment, which PyTorch reports as a
    likely mistake ("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"). ``retain_grad``
    says it is intended; autograd never reaches these views (the forward pass uses the parameters themselves), so
    nothing else changes.
    """
    marked = 0
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for group in getattr(opt, "shard_fp32_groups", None) or []:
            for shard in group:
                if shard.requires_grad and not shard.is_leaf and not shard.retains_grad:
                    shard.retain_grad()
                    marked += 1
    return marked
