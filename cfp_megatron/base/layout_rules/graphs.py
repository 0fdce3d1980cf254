"""CUDA graphs (Megatron-Core's ``cuda_graph_impl`` and ``cuda_graph_scope``) against the model and the layout: what
Megatron-Core 0.16.1 refuses to capture (``TransformerConfig.__post_init__``, the checks under
``cuda_graph_impl != "none"``), and the scope the search captures for a model (docs/planning.md, "CUDA graphs and
the MoE token policy"). A region whose shapes follow the routing cannot be replayed: a dropless or token-drop MoE
block sizes its buffers by the token counts it copies to the host."""

from __future__ import annotations

from cfp_megatron.base.layout_rules.problem import Problem

SCOPE_KEY = "parallel.cuda_graph_scope"
IMPL_KEY = "parallel.cuda_graph_impl"
ROUTER_SCOPE = "attn+moe_router+moe_preprocess"
"""What NVIDIA's dropless MoE recipes capture (Megatron-Bridge's DeepSeek-V3 and Qwen3 presets: the router and the
dispatch's preprocessing, with the attention)."""


def model_scopes(scopes: tuple[str, ...], *, moe: bool, dense_layers: bool, drop_pad: bool, capacity: bool,
                 dispatcher: str) -> list[Problem]:
    """Megatron-Core's rules for the scope names ``scopes`` (empty: the whole layer) on a model: ``moe`` and
    ``moe_router`` need experts and not both; ``mlp`` needs dense layers; ``moe`` needs drop-and-pad (``drop_pad``:
    a capacity factor with padding; else the block's shapes follow the routing); ``moe_preprocess`` is not captured
    by the all-to-all ``dispatcher`` when a ``capacity`` factor without padding copies counts to the host in it."""
    found: list[Problem] = []
    text = "+".join(scopes)

    def refuse(problem: str, fix: str, brief: str) -> None:
        found.append(Problem(key=SCOPE_KEY, value=text, problem=problem, fix=fix, brief=brief))

    if not moe and {"moe", "moe_router", "moe_preprocess"} & set(scopes):
        refuse("captures MoE parts, and the model has no experts (Megatron-Core: moe cuda graph is only supported "
               "for MoE).", f"drop the moe scopes, e.g. {SCOPE_KEY}=attn+mlp, or null (the whole layer).",
               "MoE graph scopes on a dense model")
    if moe and "moe" in scopes and "moe_router" in scopes:
        refuse("names moe and moe_router together; Megatron-Core captures one of them.",
               f"keep one: {SCOPE_KEY}=attn+moe or attn+moe_router.", "moe and moe_router together")
    if moe and not dense_layers and "mlp" in scopes:
        refuse("captures dense MLPs, and every layer of the model is MoE.",
               f"drop mlp from {SCOPE_KEY} (moe_router captures the MoE layers' router).",
               "an mlp graph scope without dense layers")
    if moe and not drop_pad and "moe" in scopes:
        refuse("captures the whole MoE block, whose shapes follow the routing unless tokens are dropped and padded "
               "to capacity (Megatron-Core: moe cuda graph is only supported with drop-padding MoE).",
               f"capture the router instead ({SCOPE_KEY}={ROUTER_SCOPE}), or set "
               "model.moe_expert_capacity_factor and model.moe_pad_expert_input_to_capacity=true.",
               "the moe graph scope without drop-and-pad")
    if moe and not drop_pad and capacity and dispatcher == "alltoall" and "moe_preprocess" in scopes:
        refuse("captures the dispatch's preprocessing, which copies the token counts to the host under token-drop "
               "without padding (Megatron-Core: not supported when there are DtoH copies in the preprocess step).",
               f"set {SCOPE_KEY}=attn+moe_router, or pad to capacity "
               "(model.moe_pad_expert_input_to_capacity=true).", "moe_preprocess with token-drop without padding")
    return found


def with_recompute(scopes: tuple[str, ...], *, impl: str, recompute: str, modules: frozenset[str] = frozenset(),
                   attention_dropout: float = 0.0, hidden_dropout: float = 0.0) -> list[Problem]:
    """Megatron-Core replays full recomputation only inside a whole-iteration graph (``full_iteration``); under
    selective recomputation of ``modules``, a recomputed module is not covered by a graph when it draws random
    numbers (dropout), and Transformer Engine's graphs do not take the MoE block's recomputation beside a captured
    router."""
    if recompute == "none" or scopes == ("full_iteration",):
        return []
    if recompute == "full":
        return [Problem(key=IMPL_KEY, value=impl,
                        problem="per-layer CUDA graphs do not run with full recomputation (parallel.recompute=full; "
                                "Megatron-Core: full recompute is only supported with full iteration CUDA graph).",
                        fix="set parallel.recompute (cfp.recompute) to selective or none, or "
                            "parallel.cuda_graph_impl=none (or local with parallel.cuda_graph_scope=full_iteration).",
                        brief="per-layer CUDA graphs with full recomputation")]
    whole = not scopes
    graphed = {"core_attn": whole or "attn" in scopes, "mlp": whole or "mlp" in scopes,
               "moe": whole or "moe" in scopes}
    dropout = {"core_attn": attention_dropout, "mlp": hidden_dropout, "moe": hidden_dropout}
    clash = [m for m in ("core_attn", "mlp", "moe") if m in modules and graphed[m] and dropout[m]]
    if impl == "transformer_engine" and "moe" in modules and "moe_router" in scopes:
        clash.append("moe")
    if not clash:
        return []
    return [Problem(key="parallel.recompute_modules", value="+".join(sorted(modules)),
                    problem=f"recomputes {clash[0]} inside a CUDA graph, which Megatron-Core refuses (graphed "
                            "recomputation takes no random numbers, and Transformer Engine's no MoE recomputation "
                            "beside a captured router).",
                    fix=f"drop {clash[0]} from parallel.recompute_modules, or capture less "
                        f"({SCOPE_KEY}) or parallel.cuda_graph_impl=none.",
                    brief=f"selective recomputation of {clash[0]} inside a CUDA graph")]


def searched_scope(*, moe: bool, drop_pad: bool, dispatcher: str) -> str | None:
    """The scope the search captures where it turns CUDA graphs on: the whole layer (``None``) for a dense model
    and a drop-and-pad MoE model, whose shapes are static; else the attention, the router and (but for the
    all-gather dispatcher, whose preprocessing copies the counts to the host) the dispatch's preprocessing, as
    NVIDIA's dropless recipes do (the whole layer would capture the dispatcher's host synchronisation)."""
    if not moe or drop_pad:
        return None
    return "attn+moe_router" if dispatcher == "allgather" else ROUTER_SCOPE


def runs(impl: str, *, on_cpu: bool, te: bool) -> str | None:
    """Why ``impl`` cannot run where the plan trains (``None``: it can): CUDA graphs capture CUDA streams, and
    ``transformer_engine`` needs Transformer Engine."""
    if impl == "none":
        return None
    if on_cpu:
        return "CUDA graphs capture CUDA streams, and this cluster is CPU"
    if impl == "transformer_engine" and not te:
        return "Transformer Engine's make_graphed_callables is not installed here"
    return None
