"""A layer kind the project has no entry for: a gated MLP with a third projection (``linear_fc3``, the up projection
kept apart from the gate), given to Megatron-Core through a ``ModuleSpec``."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def gated_mlp_module() -> type:
    """The module class (Megatron-Core imported on first use)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.module import MegatronModule

    class ThreeProjectionMLP(MegatronModule):
        """``fc2(silu(fc1(x)) * fc3(x))``, each projection a Megatron-Core parallel linear."""

        def __init__(self, config: Any, **kwargs: Any) -> None:
            super().__init__(config=config)
            ffn, hidden = config.ffn_hidden_size, config.hidden_size
            common = dict(config=config, init_method=config.init_method, bias=False, gather_output=False,
                          skip_bias_add=True)
            self.linear_fc1 = ColumnParallelLinear(hidden, ffn, **common)
            self.linear_fc3 = ColumnParallelLinear(hidden, ffn, **common)
            self.linear_fc2 = RowParallelLinear(ffn, hidden, config=config, init_method=config.output_layer_init_method,
                                                bias=False, input_is_parallel=True, skip_bias_add=True)

        def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
            gate, _ = self.linear_fc1(hidden_states)
            up, _ = self.linear_fc3(hidden_states)
            out, _ = self.linear_fc2(torch.nn.functional.silu(gate) * up)
            return out, None

    return ThreeProjectionMLP


def custom_layer_spec(config: Any, vp_stage: int | None = None) -> Any:
    """Megatron-Core's local GPT block spec (this pipeline stage's layers) with every layer's MLP replaced by
    :func:`gated_mlp_module`'s: what ``model.spec=tests.custom_layers:custom_layer_spec`` trains."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization,
                                       vp_stage=vp_stage)
    mlp = ModuleSpec(module=gated_mlp_module())
    layers = [dataclasses.replace(s, submodules=dataclasses.replace(s.submodules, mlp=mlp))
              for s in block.layer_specs]
    return dataclasses.replace(block, layer_specs=layers)


def mlp_only_spec(config: Any) -> Any:
    """A mistake a user makes: the MLP's spec where the decoder layer's is expected (bench/bad_inputs.py)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=gated_mlp_module())


def whole_model_spec(config: Any) -> Any:
    """Another mistake: every layer of the model in the block whatever the pipeline stage (bench/bad_inputs.py)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(dataclasses.replace(config, pipeline_model_parallel_size=1),
                                      use_transformer_engine=False, normalization=config.normalization, pp_rank=0)


class PlainThreeProjectionMLP(torch.nn.Module):
    """The same layer in plain PyTorch (the names Megatron's gives its projections), for a check on gloo ranks."""

    def __init__(self, hidden: int = 16, ffn: int = 24) -> None:
        super().__init__()
        self.linear_fc1 = torch.nn.Linear(hidden, ffn, bias=False)
        self.linear_fc3 = torch.nn.Linear(hidden, ffn, bias=False)
        self.linear_fc2 = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(torch.nn.functional.silu(self.linear_fc1(x)) * self.linear_fc3(x))


def build_plain() -> torch.nn.Module:
    """A seeded :class:`PlainThreeProjectionMLP` (every rank builds the same)."""
    torch.manual_seed(0)
    return PlainThreeProjectionMLP().double()


def plain_input() -> torch.Tensor:
    """A seeded ``[seq, batch, hidden]`` input."""
    torch.manual_seed(1)
    return torch.randn(8, 2, 16, dtype=torch.float64)
