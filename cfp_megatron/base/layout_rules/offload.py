"""Activation offloading to host memory (Megatron-Core's ``cpu_offloading``): what it does not run with, and the
layers it can offload. The rules are Megatron-Core 0.16.1's own (``TransformerConfig.__post_init__``)."""

from __future__ import annotations

from cfp_megatron.base.layout_rules.problem import Problem

KEY = "parallel.cpu_offloading_num_layers"


def settings(*, layers: int, pp: int, recompute: str, cuda_graph_impl: str) -> list[Problem]:
    """Offloading ``layers`` layers' activations: none is negative; Megatron-Core refuses it with pipeline
    parallelism, with activation recomputation and with CUDA graphs."""
    if layers == 0:
        return []
    if layers < 0:
        return [Problem(key=KEY, value=layers, problem="counts the layers whose activations go to host memory; it "
                        "cannot be negative.", fix=f"set {KEY}=0 (no offloading) or a positive count.",
                        brief=f"{layers} offloaded layers")]
    found = []
    if pp > 1:
        found.append(Problem(key=KEY, value=layers, problem="Megatron-Core offloads activations only without "
                             f"pipeline parallelism (parallel.pp={pp}).",
                             fix=f"set parallel.pp=1 or {KEY}=0.", brief=f"activation offloading with pp={pp}"))
    if recompute != "none":
        found.append(Problem(key=KEY, value=layers, problem="Megatron-Core does not offload activations with "
                             f"activation recomputation (parallel.recompute={recompute}).",
                             fix=f"set parallel.recompute=none or {KEY}=0.",
                             brief=f"activation offloading with recompute={recompute}"))
    if cuda_graph_impl != "none":
        found.append(Problem(key=KEY, value=layers, problem="Megatron-Core does not offload activations with CUDA "
                             f"graphs (parallel.cuda_graph_impl={cuda_graph_impl}).",
                             fix=f"set parallel.cuda_graph_impl=none or {KEY}=0.",
                             brief=f"activation offloading with cuda_graph_impl={cuda_graph_impl}"))
    return found


def within_model(layers: int, num_layers: int) -> list[Problem]:
    """Megatron-Core offloads fewer layers than the model has (``0 <= cpu_offloading_num_layers < num_layers``)."""
    if layers < num_layers:
        return []
    return [Problem(key=KEY, value=layers, problem=f"Megatron-Core offloads fewer layers than the model's "
                    f"{num_layers}.", fix=f"set {KEY} to at most {num_layers - 1}.",
                    brief=f"{layers} offloaded layers of {num_layers}")]


def runs(layers: int, *, on_cpu: bool, te: bool) -> list[Problem]:
    """Megatron-Core offloads activations with Transformer Engine's CPU offload context, which copies on CUDA
    streams: a GPU with Transformer Engine (without it, Megatron-Core keeps every activation on the device)."""
    if not layers or (not on_cpu and te):
        return []
    return [Problem(key=KEY, value=layers,
                    problem="Megatron-Core offloads activations with Transformer Engine's CPU offload context on "
                            "GPUs; " + ("this cluster is CPU." if on_cpu else "Transformer Engine is not installed."),
                    fix=f"plan it for a GPU cluster with transformer-engine installed, or set {KEY}=0.",
                    brief="activation offloading needs a GPU with Transformer Engine")]
