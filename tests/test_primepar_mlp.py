"""The PrimePar MLP (cfp_megatron.layers.primepar_mlp) against Megatron-Core's own MLP, on 4 gloo ranks (a 2x2
square made of Megatron's TP group). The reference is Megatron's ``MLP`` with ``ColumnParallelLinear`` /
``RowParallelLinear`` on a one-rank group (the dense layer, same activation code: fused or not), with the same
weights; every rank compares its blocks in float64. Also checked: each rank's ``sharded_state_dict`` entries hold
exactly the reference's values at their global offsets, the main replicas cover every element once over the square,
and gradient-norm clipping counts every parameter element once. Under sequence parallelism each rank feeds its
sequence shard and compares its shard of the output and of the input gradient, and fc2's bias gradient after the
TP all-reduce that Megatron's finalize_model_grads gives parameters marked ``sequence_parallel``."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from cfp_megatron.layers.errors import PrimeParError
from tests.launcher import free_port

S, B, H, FFN = 3, 2, 8, 12
"""Sequence 3 x micro-batch 2: 6 tokens, 3 per row of the square (a block that is not whole sequence positions)."""
S_SP = 4
"""The sequence under sequence parallelism: one position (2 tokens) per TP rank, 4 tokens per row of the square."""

CASES = {  # name: (gated, bias, bias_activation_fusion)
    "gelu_bias": (False, True, False),
    "gelu_bias_fused": (False, True, True),
    "swiglu": (True, False, False),
    "swiglu_bias_fused": (True, True, True),
}


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max())


def _check_sharded_state(mlp: torch.nn.Module, reference: torch.nn.Module, *, singleton: bool) -> tuple[float, list]:
    """Largest difference between each ShardedTensor's data and the reference's full tensor at its offsets, and the
    (key, offset, numel, main replica) of every entry for the coverage check on rank 0."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    metadata = ensure_metadata_has_dp_cp_group({"singleton_local_shards": singleton})
    full = {f"mlp.{k}": v.detach() for k, v in reference.state_dict().items() if isinstance(v, torch.Tensor)}
    for key in [k for k in full if k.startswith("mlp.linear_fc1.")]:  # Megatron's singleton halves of a GLU
        full[f"{key}_w"], full[f"{key}_v"] = torch.chunk(full[key], 2)
    error, entries = 0.0, []
    for value in mlp.sharded_state_dict(prefix="mlp.", metadata=metadata).values():
        parts = value.build() if isinstance(value, ShardedTensorFactory) else [value]
        for part in parts:
            if not isinstance(part, ShardedTensor):
                continue  # _extra_state objects
            whole = full[part.key]
            if tuple(part.global_shape) != tuple(whole.shape):
                return float("inf"), []
            index = tuple(slice(o, o + n) for o, n in zip(part.global_offset, part.local_shape, strict=True))
            error = max(error, _max_error(part.data.detach(), whole[index]))
            main = all(r == 0 for r in (part.replica_id if isinstance(part.replica_id, tuple) else (part.replica_id,)))
            entries.append((part.key, list(part.global_offset), part.data.numel(), main))
    return error, entries


def _sp_finalize(module: torch.nn.Module, group: object) -> None:
    """What Megatron's finalize_model_grads does under sequence parallelism: sum the gradients of the parameters
    marked ``sequence_parallel`` over the TP group."""
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            torch.distributed.all_reduce(p.grad, group=group)


def _sp_chunk(full: torch.Tensor, group: object) -> torch.Tensor:
    """This TP rank's sequence shard of a [s, ...] tensor."""
    return torch.chunk(full, group.size())[group.rank()]


def _case(name: str, single: object, *, sp: bool = False) -> tuple[dict[str, float], list]:
    import torch.nn.functional as F
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from cfp_megatron.layers.primepar_mlp import PrimeParColumnLinear, PrimeParMLP, PrimeParRowLinear

    gated, bias, fusion = CASES[name]
    config = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=4,
                               tensor_model_parallel_size=4, add_bias_linear=bias, gated_linear_unit=gated,
                               activation_func=F.silu if gated else F.gelu, bias_activation_fusion=fusion,
                               use_cpu_initialization=True, params_dtype=torch.float64, sequence_parallel=sp)
    reference = MLP(dataclasses.replace(config, sequence_parallel=False),
                    MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                    ffn_hidden_size=FFN, tp_group=single)
    mlp = PrimeParMLP(config, MLPSubmodules(linear_fc1=PrimeParColumnLinear, linear_fc2=PrimeParRowLinear),
                      ffn_hidden_size=FFN)
    gen = torch.Generator().manual_seed(len(name))
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    with torch.no_grad():
        for p in reference.parameters():  # non-zero biases too, so their paths show
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
        fc1.weight.copy_(fc1.local_block(reference.linear_fc1.weight))
        fc2.weight.copy_(fc2.local_block(reference.linear_fc2.weight))
        if bias:
            fc1.bias.copy_(fc1.local_block(reference.linear_fc1.bias))
            fc2.bias.copy_(reference.linear_fc2.bias)
    seq = S_SP if sp else S
    x = torch.randn(seq, B, H, generator=gen, dtype=torch.float64)
    grad = torch.randn(seq, B, H, generator=gen, dtype=torch.float64)

    def run(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inp = x.clone().requires_grad_()
        out, out_bias = module(inp)
        out = out + out_bias if out_bias is not None else out  # as TransformerLayer's bias-dropout-add
        (out * grad).sum().backward()
        return out.detach(), inp.grad

    (ref_out, ref_dx) = run(reference, x, grad)
    if sp:  # each rank: its sequence shard in and out, then finalize_model_grads' TP sum of the SP parameters
        tp = fc1.tp_group
        out, dx = run(mlp, _sp_chunk(x, tp), _sp_chunk(grad, tp))
        ref_out, ref_dx = _sp_chunk(ref_out, tp), _sp_chunk(ref_dx, tp)
        _sp_finalize(mlp, tp)
    else:
        out, dx = run(mlp, x, grad)
    errors = {"out": _max_error(out, ref_out), "dx": _max_error(dx, ref_dx),
              "fc1.dW": _max_error(fc1.weight.grad, fc1.local_block(reference.linear_fc1.weight.grad)),
              "fc2.dW": _max_error(fc2.weight.grad, fc2.local_block(reference.linear_fc2.weight.grad))}
    if bias:
        errors["fc1.db"] = _max_error(fc1.bias.grad, fc1.local_block(reference.linear_fc1.bias.grad))
        errors["fc2.db"] = _max_error(fc2.bias.grad, reference.linear_fc2.bias.grad)
        # Only fc2's bias is added to sequence shards; fc1's is summed over all tokens by primepar_linear.
        errors["sp_marks"] = float(getattr(fc2.bias, "sequence_parallel", None) is not sp
                                   or getattr(fc1.bias, "sequence_parallel", False))
    # Clipping's count: every element of the MLP once over the square.
    counted = torch.tensor([float(sum(p.numel() for p in mlp.parameters()
                                      if param_is_not_tensor_parallel_duplicate(p, tp_group=fc1.tp_group)))])
    torch.distributed.all_reduce(counted, group=fc1.tp_group)
    errors["clip_count"] = abs(float(counted) - sum(p.numel() for p in reference.parameters()))
    entries: list = []
    if sp:  # the checkpoint entries do not depend on sequence parallelism
        return errors, entries
    for singleton in (False, True):
        errors[f"sharded_singleton={singleton}"], found = _check_sharded_state(mlp, reference, singleton=singleton)
        entries.append(found)
    return errors, entries


def _standalone_layers(single: object) -> dict[str, float]:
    """fc1 and fc2 on their own with ``skip_bias_add=False`` (the bias added inside, nothing returned)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from cfp_megatron.layers.primepar_linear import output_block
    from cfp_megatron.layers.primepar_mlp import PrimeParColumnLinear, PrimeParRowLinear

    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, tensor_model_parallel_size=4,
                               use_cpu_initialization=True, params_dtype=torch.float64)
    init = config.init_method
    gen = torch.Generator().manual_seed(7)
    errors: dict[str, float] = {}
    for name, (ours, theirs, row) in {
        "column": (PrimeParColumnLinear(H, FFN, config=config, init_method=init, bias=True),
                   ColumnParallelLinear(H, FFN, config=config, init_method=init, bias=True, tp_group=single), False),
        "row": (PrimeParRowLinear(FFN, H, config=config, init_method=init, bias=True, input_is_parallel=True,
                                  skip_bias_add=False),
                RowParallelLinear(FFN, H, config=config, init_method=init, bias=True, input_is_parallel=True,
                                  skip_bias_add=False, tp_group=single), True),
    }.items():
        with torch.no_grad():
            for p in theirs.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            ours.weight.copy_(ours.local_block(theirs.weight))
            ours.bias.copy_(theirs.bias if row else ours.local_block(theirs.bias))
        x = torch.randn(S * B, theirs.input_size, generator=gen, dtype=torch.float64)
        ref_out, ref_bias = theirs(x)
        if row:  # fc2 takes fc1's output layout, (tokens r, block c), and returns the replicated output
            out, out_bias = ours(output_block(x, ours.grid))
        else:  # fc1 takes the replicated input and returns its output block (tokens r, block c)
            out, out_bias = ours(x)
            ref_out = output_block(ref_out, ours.grid)
        errors[f"{name}.out"] = _max_error(out, ref_out)
        errors[f"{name}.bias_returned"] = float(out_bias is not None or ref_bias is not None)
    return errors


def _standalone_row_sp(single: object) -> dict[str, float]:
    """fc2 on its own under sequence parallelism with ``skip_bias_add=False``: the bias added inside, to this rank's
    sequence shard of the output; its gradient after the TP sum equals the reference's."""
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from cfp_megatron.layers.primepar_linear import output_block
    from cfp_megatron.layers.primepar_mlp import PrimeParRowLinear

    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, tensor_model_parallel_size=4,
                               use_cpu_initialization=True, params_dtype=torch.float64, sequence_parallel=True)
    init = config.init_method
    ours = PrimeParRowLinear(FFN, H, config=config, init_method=init, bias=True, input_is_parallel=True,
                             skip_bias_add=False)
    theirs = RowParallelLinear(FFN, H, config=dataclasses.replace(config, sequence_parallel=False), init_method=init,
                               bias=True, input_is_parallel=True, skip_bias_add=False, tp_group=single)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
        ours.weight.copy_(ours.local_block(theirs.weight))
        ours.bias.copy_(theirs.bias)
    x = torch.randn(S_SP * B, FFN, generator=gen, dtype=torch.float64)
    grad = torch.randn(S_SP * B, H, generator=gen, dtype=torch.float64)
    ref_out, _ = theirs(x)
    (ref_out * grad).sum().backward()
    tp = ours.tp_group
    out, out_bias = ours(output_block(x, ours.grid))
    (out * _sp_chunk(grad, tp)).sum().backward()
    _sp_finalize(ours, tp)
    return {"row_sp.out": _max_error(out, _sp_chunk(ref_out.detach(), tp)),
            "row_sp.bias_returned": float(out_bias is not None),
            "row_sp.dW": _max_error(ours.weight.grad, ours.local_block(theirs.weight.grad)),
            "row_sp.db": _max_error(ours.bias.grad, theirs.bias.grad)}


def _rank(rank: int, world: int, port: int, tmp: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from cfp_megatron.compat.cpu import install_if_needed

    torch.set_num_threads(1)
    install_if_needed()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        singles = [dist.new_group([r]) for r in range(world)]
        report: dict[str, object] = {}
        for name in CASES:
            errors, entries = _case(name, singles[rank])
            report.update({f"{name}.{k}": v for k, v in errors.items()})
            gathered: list = [None] * world
            dist.all_gather_object(gathered, entries)
            report[f"{name}.entries"] = gathered
        for name in CASES:
            errors, _ = _case(name, singles[rank], sp=True)
            report.update({f"sp.{name}.{k}": v for k, v in errors.items()})
        report.update(_standalone_layers(singles[rank]))
        report.update(_standalone_row_sp(singles[rank]))
        Path(tmp, f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    os._exit(0)  # as tests/test_primepar_linear.py: skip the interpreter teardown gloo threads now and then abort


def test_grid_needs_a_tensor_parallel_group_of_4_to_the_k_ranks() -> None:
    from cfp_megatron.layers.primepar_mlp import tensor_parallel_grid

    class Group:  # the two methods read before any rank lookup
        def __init__(self, size: int) -> None:
            self._size = size

        def size(self) -> int:
            return self._size

        def rank(self) -> int:
            return 0

    for size in (1, 2, 8, 12):
        with pytest.raises(PrimeParError, match=rf"parallel.tp: .*4\^k ranks \(k >= 1\), got {size}\."):
            tensor_parallel_grid(Group(size))
    with pytest.raises(PrimeParError, match="tp_group"):
        tensor_parallel_grid(None)


def test_layer_spec_swaps_only_the_dense_mlp() -> None:
    """The MLP module and its fc1/fc2 change, nothing else; a spec that fuses the pre-MLP norm into fc1 (Transformer
    Engine's) gets the norm back as its own module under the fused layer's checkpoint keys; MoE layers are refused."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from cfp_megatron.layers.primepar_mlp import PrimeParColumnLinear, PrimeParMLP, PrimeParRowLinear, with_primepar_mlp

    class Norm:  # stands for the block's norm implementation
        pass

    def swapped(layer: object) -> object:
        block = with_primepar_mlp(TransformerBlockSubmodules(layer_specs=[layer, layer], layer_norm=Norm))
        assert len(block.layer_specs) == 2 and block.layer_norm is Norm
        return block.layer_specs[0].submodules

    local = get_gpt_layer_local_spec()
    sub = swapped(local)
    assert sub.mlp.module is PrimeParMLP
    assert (sub.mlp.submodules.linear_fc1, sub.mlp.submodules.linear_fc2) == (PrimeParColumnLinear, PrimeParRowLinear)
    assert dataclasses.replace(sub, mlp=local.submodules.mlp) == local.submodules  # everything else kept
    assert local.submodules.mlp.module is MLP  # Megatron's spec object itself is not changed

    fused = dataclasses.replace(local, submodules=dataclasses.replace(
        local.submodules, pre_mlp_layernorm=IdentityOp, sharded_state_dict_keys_map={"mlp.0.weight": "x"}))
    sub = swapped(fused)
    assert sub.pre_mlp_layernorm is Norm
    assert sub.sharded_state_dict_keys_map == {"mlp.0.weight": "x", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}

    with pytest.raises(PrimeParError, match="parallel.mlp"):
        swapped(get_gpt_layer_local_spec(num_experts=4))


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("primepar_mlp")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["TORCH_COMPILE_DISABLE"] = "1"  # Megatron's fused bias+activation run as plain PyTorch on CPU
    mp.spawn(_rank, args=(4, free_port(), str(tmp)), nprocs=4)
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(4)]


@pytest.mark.slow
def test_standalone_layers_add_their_bias_without_skip_bias_add(reports: list[dict]) -> None:
    for rank, report in enumerate(reports):
        errors = {k: v for k, v in report.items() if k.startswith(("column.", "row."))}
        assert set(errors) == {"column.out", "column.bias_returned", "row.out", "row.bias_returned"}
        assert all(v < 1e-12 for v in errors.values()), (rank, errors)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_mlp_matches_megatrons_dense_mlp(name: str, reports: list[dict]) -> None:
    """Output, input gradient, weight and bias gradients (each rank's blocks) equal Megatron's MLP on one rank,
    with the bias-activation fusion on and off, GELU and SwiGLU; clipping counts each element once."""
    for rank, report in enumerate(reports):
        errors = {k.removeprefix(f"{name}."): v for k, v in report.items() if k.startswith(f"{name}.")}
        errors.pop("entries")
        assert {"out", "dx", "fc1.dW", "fc2.dW", "clip_count"} <= set(errors), errors
        assert all(v < 1e-12 for v in errors.values()), (rank, errors)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_mlp_under_sequence_parallelism_matches_megatrons_dense_mlp(name: str, reports: list[dict]) -> None:
    """Under sequence parallelism each rank's output and input-gradient shards equal the dense MLP's, the weight
    and bias gradients too (fc2's bias once finalize_model_grads has summed it over TP: it is marked
    ``sequence_parallel``, fc1's is not); clipping still counts each element once."""
    for rank, report in enumerate(reports):
        errors = {k.removeprefix(f"sp.{name}."): v for k, v in report.items() if k.startswith(f"sp.{name}.")}
        assert {"out", "dx", "fc1.dW", "fc2.dW", "clip_count"} <= set(errors), errors
        assert not CASES[name][1] or {"fc1.db", "fc2.db", "sp_marks"} <= set(errors), errors
        assert all(v < 1e-12 for v in errors.values()), (rank, errors)


@pytest.mark.slow
def test_standalone_row_layer_under_sequence_parallelism_adds_its_bias_to_the_shard(reports: list[dict]) -> None:
    for rank, report in enumerate(reports):
        errors = {k: v for k, v in report.items() if k.startswith("row_sp.")}
        assert set(errors) == {"row_sp.out", "row_sp.bias_returned", "row_sp.dW", "row_sp.db"}
        assert all(v < 1e-12 for v in errors.values()), (rank, errors)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_state_main_replicas_cover_every_element_once(name: str, reports: list[dict]) -> None:
    """Over the 4 ranks, the entries with replica id 0 tile each global tensor exactly (the 2-D weight blocks, the
    gated fc1's gate and up parts, fc1's bias once per column, fc2's bias once), in both of Megatron's GLU forms."""
    totals = {"mlp.linear_fc1.weight": (2 if CASES[name][0] else 1) * FFN * H, "mlp.linear_fc2.weight": H * FFN}
    if CASES[name][1]:
        totals.update({"mlp.linear_fc1.bias": (2 if CASES[name][0] else 1) * FFN, "mlp.linear_fc2.bias": H})
    for singleton in (0, 1):  # Megatron's two forms of a GLU's fc1: one [gate; up] tensor, or _w and _v tensors
        main = [(k, tuple(o), n) for rank in reports[0][f"{name}.entries"] for k, o, n, m in rank[singleton] if m]
        assert len(set(main)) == len(main)  # no block saved twice
        per_key: dict[str, int] = {}
        for key, _, numel in main:
            base = key.removesuffix("_w").removesuffix("_v") if singleton else key
            per_key[base] = per_key.get(base, 0) + numel
        assert per_key == totals
