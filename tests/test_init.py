"""Layout-independent initialisation keeps Megatron's distributions (one gloo rank, in this process)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from cfp_megatron.base.config import job_from_config
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.parallel_dims import ParallelDims
from tests.launcher import free_port


@pytest.fixture(scope="module")
def megatron_single_rank() -> Iterator[None]:
    """Megatron's process groups for world size 1; torn down so later tests see no process group."""
    from cfp_megatron.compat.cpu import install_if_needed
    from cfp_megatron.engine.distributed import destroy_distributed, init_distributed

    install_if_needed()
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    job = job_from_config({})
    env = LaunchEnv.read()
    init_distributed(job, ParallelDims.build(job, 1), env)
    yield
    destroy_distributed()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def build_spec(model: str, seed: int, layout_independent: bool) -> tuple[list[torch.nn.Module], object]:
    import yaml

    from cfp_megatron.engine.distributed import model_groups
    from cfp_megatron.engine.init import layout_independent_init
    from cfp_megatron.engine.model import build_model_chunks
    from cfp_megatron.model.megatron_config import transformer_config

    conf = os.path.join(os.path.dirname(__file__), "..", "conf", "model", f"{model}.yaml")
    with open(conf) as fh:
        job = job_from_config({"model": yaml.safe_load(fh), "train": {"seed": seed}})
    dims = ParallelDims.build(job, 1)
    config = transformer_config(job, dims, on_gpu=False)
    torch.manual_seed(seed)
    chunks = build_model_chunks(job, config, dims, model_groups())
    if layout_independent:
        layout_independent_init(chunks, config, seed)
    return chunks, config


def _params(chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for c in chunks for name, p in c.named_parameters()}


@pytest.mark.parametrize("model", ["llama_tiny", "moe_tiny"])
def test_distribution_matches_megatron_and_seed_decides(model: str, megatron_single_rank: None) -> None:
    megatron = _params(build_spec(model, 7, layout_independent=False)[0])
    ours = _params(build_spec(model, 7, layout_independent=True)[0])
    again = _params(build_spec(model, 7, layout_independent=True)[0])
    other = _params(build_spec(model, 8, layout_independent=True)[0])
    assert megatron.keys() == ours.keys()
    redrawn = 0
    for name, reference in megatron.items():
        assert torch.equal(ours[name], again[name]), name  # same seed, same weights
        if bool((reference == reference.flatten()[0]).all()):
            assert torch.equal(ours[name], reference), name  # norms and biases keep Megatron's constants
            continue
        redrawn += 1
        assert not torch.equal(ours[name], reference), name
        assert not torch.equal(ours[name], other[name]), name  # another seed, other weights
        assert abs(ours[name].mean().item()) < 0.1 * reference.std().item() + 1e-3, name
        assert ours[name].std().item() == pytest.approx(reference.std().item(), rel=0.1), name
    assert redrawn >= 10
