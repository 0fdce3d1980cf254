"""A memory prediction with a cost cache reads its layers' parameters from pass costs of the same layout under
other communication options, recompute choices or FSDP groups (``pass_costs.params_key``) without pricing its own
passes: the memory is the same as predicted without a cache, on real candidates of a search's space."""

from __future__ import annotations

import dataclasses
import random

import pytest

from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.search.space import Candidate, build_space
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import CostCache, comm_options, cost_key
from cfp_megatron.sim.simulate import predict_memory, prepare_costs


@pytest.mark.parametrize(("model", "extra"), [
    ("moe_tiny", ("cfp.ep=2",)), ("moe_tiny", ("cfp.ep=4", "model.moe_first_dense_layers=1")), ("gpt_tiny", ()),
])
def test_memory_from_another_keys_parameters_is_the_memory_without_a_cache(model: str, extra: tuple[str, ...]) -> None:
    """For sampled candidates: their costs priced first, then each of their overlap and FSDP variants predicted
    with the cache (most without pricing their own key: checked) equals the variant predicted without one."""
    cfg = compose_config(["+cfp=auto", f"model={model}", "model.num_layers=4", "cluster=dgx_h100", "cluster.nodes=1",
                          "cluster.gpus_per_node=8", "train.global_batch_size=32", "train.seq_length=256",
                          "cfp.constraints.max_micro_batch=2", *extra])
    job, cfp = job_from_config(cfg), cfp_from_config(cfg)
    space = build_space(job, 8, cfp)
    options = SimOptions()
    cache = CostCache.for_job(job, None, options)
    keys = [k for f in space.families for k in space.keys(f)]
    rng = random.Random(7)
    compared = unpriced = 0
    for key in rng.sample(keys, min(40, len(keys))):
        cand = Candidate.from_key(key)
        try:
            prepare_costs(cand.screened_job(job), job.cluster, None, options=options, world_size=8, cache=cache)
        except ConfigError:
            continue
        variants = [dataclasses.replace(cand, dp_overlap=True, tp_overlap=cand.tp > 1, a2a_overlap=cand.ep > 1)]
        variants += [dataclasses.replace(cand, fsdp=fsdp, dp_shard=0) for fsdp in space.fsdp_values()[1:]]
        for variant in variants:
            try:
                vjob = variant.screened_job(job)
                expected = predict_memory(vjob, job.cluster, None, options=options, world_size=8)
            except ConfigError:
                continue
            cache.prepared = None  # not the plan just prepared
            before = len(cache.costs)
            assert predict_memory(vjob, job.cluster, None, options=options, world_size=8, cache=cache) == expected
            compared += 1
            p = vjob.parallel
            layout_key = cost_key(build_layout(vjob, 8), p.recompute, options, p.mlp, comm=comm_options(p),
                                  recompute_modules=p.recompute_modules)
            unpriced += len(cache.costs) == before and layout_key not in cache.costs
    assert compared >= 10
    assert unpriced >= 5  # the path without pricing is taken

