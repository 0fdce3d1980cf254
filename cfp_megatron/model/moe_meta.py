"""Run Megatron-Core MoE layers on the meta device under a balanced-routing assumption.

Token dispatch is data dependent (``masked_select`` on the routing map, split sizes read back from the device), so it
cannot run on meta tensors. :class:`BalancedMetaDispatcher` stands in for the layer's token dispatcher during capture:
every expert receives ``tokens x topk / experts`` tokens (the remainder spread over the first experts), the permute is
an ``index_select`` and the unpermute an ``index_add`` of the same sizes as Megatron's. The router and the experts are
Megatron's own modules and run unchanged. With expert parallelism 1 (capture builds TP = EP = 1) there is no
all-to-all to stand in for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class BalancedMetaDispatcher:
    """Token-dispatcher stand-in with a fixed, balanced routing (meta tensors only)."""

    num_experts: int
    """Local experts (all experts: capture uses expert parallelism 1)."""
    topk: int
    """Experts per token."""
    state: dict
    """Per-step scratch: the token count and hidden shape seen by :meth:`dispatch_preprocess`."""

    def tokens_per_expert(self, tokens: int) -> list[int]:
        """Balanced split of ``tokens x topk`` routed copies over the experts."""
        total = tokens * self.topk
        base, extra = divmod(total, self.num_experts)
        return [base + (1 if i < extra else 0) for i in range(self.num_experts)]

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Permute: one row per (token, chosen expert), grouped by expert."""
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        tokens = flat.shape[0]
        index = torch.arange(tokens * self.topk, device=flat.device) % tokens
        self.state.update(shape=shape, tokens=tokens, index=index)
        permuted_probs = probs.reshape(-1).index_select(0, torch.arange(tokens * self.topk, device=probs.device))
        return flat.index_select(0, index), permuted_probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """No all-to-all at expert parallelism 1."""
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor,
                             probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens per expert as a host tensor, as Megatron's dispatchers return it."""
        with torch._C.DisableTorchFunction():  # a host tensor even under meta_device()
            counts = torch.tensor(self.tokens_per_expert(self.state["tokens"]), dtype=torch.long, device="cpu")
        return hidden_states, counts, probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Nothing to do before the (absent) all-to-all."""
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """No all-to-all at expert parallelism 1."""
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Unpermute: sum each token's expert outputs back into its row."""
        shape, tokens, index = self.state["shape"], self.state["tokens"], self.state["index"]
        out = torch.zeros(tokens, hidden_states.shape[-1], dtype=hidden_states.dtype, device=hidden_states.device)
        return out.index_add(0, index, hidden_states).reshape(*shape[:-1], hidden_states.shape[-1])


def is_moe_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Megatron MoE layer (it has a router and a token dispatcher)."""
    return hasattr(module, "token_dispatcher") and hasattr(module, "router")


@contextlib.contextmanager
def balanced_dispatch(module: torch.nn.Module) -> Iterator[int]:
    """Swap every MoE layer's token dispatcher inside ``module`` for a balanced meta one; yield how many."""
    swapped: list[tuple[torch.nn.Module, object]] = []
    for sub in module.modules():
        if is_moe_layer(sub):
            cfg = sub.config
            local = getattr(sub, "num_local_experts", None) or cfg.num_moe_experts
            swapped.append((sub, sub.token_dispatcher))
            sub.token_dispatcher = BalancedMetaDispatcher(num_experts=local, topk=cfg.moe_router_topk, state={})
    try:
        yield len(swapped)
    finally:
        for sub, original in swapped:
            sub.token_dispatcher = original
