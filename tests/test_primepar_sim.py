"""PrimePar's MLP in the simulator and the search: its cost is the per-step max of GEMM and ring transfer,
its memory keeps fc1's input as one block of the grid, and the search offers it only where the runtime runs it."""

from __future__ import annotations

import dataclasses

import pytest

from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import MlpPartition, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.search.search import search
from cfp_megatron.search.space import Candidate, build_space
from cfp_megatron.sim.memory import memory_band
from cfp_megatron.sim.simulate import simulate

BASE = ["model=llama3_8b", "cluster=dgx_h100", "cluster.nodes=1", "train.global_batch_size=64",
        "train.seq_length=8192", "parallel.tp=4"]


def _predict(*overrides: str):
    job = job_from_config(compose_config([*BASE, *overrides]))
    return simulate(job, job.cluster, None, world_size=8)


def test_primepar_mlp_costs_its_ring_and_saves_fc1_input_memory() -> None:
    megatron = _predict("parallel.mlp=megatron", "train.micro_batch_size=1")
    primepar = _predict("parallel.mlp=primepar", "train.micro_batch_size=1")
    # Same FLOPs split over the same 4 ranks: compute within the GEMM-efficiency difference of smaller blocks.
    assert primepar.time.forward_compute_s == pytest.approx(megatron.time.forward_compute_s, rel=0.15)
    # Without recomputation each layer keeps fc1's input as a quarter block instead of the replicated hidden state,
    # but also keeps the rotated weight blocks between forward and backward.
    m = job_from_config(compose_config(BASE)).model
    tokens, layers = 8192, m.num_layers
    saving = tokens * m.hidden_size * 2 * 0.75 * layers
    copies = (m.hidden_size * m.ffn_size * 2 + m.ffn_size * m.hidden_size) / 4 * 2 * layers
    diff = megatron.memory.activations - primepar.memory.activations
    assert diff == pytest.approx(saving - copies, rel=1e-6)


def test_primepar_under_sp_pays_the_resharding_and_saves_no_input_memory() -> None:
    """Under SP the grid's replicated input and output are resharded from and to the sequence split: one more
    all-gather of the activation per pass than without SP; fc1's input is a 1/tp chunk under Megatron's SP split
    too, so only the rotated weight blocks tell the two apart in memory."""
    from cfp_megatron.cluster.costs import CollectiveCosts
    from cfp_megatron.cluster.measured import Collective
    from cfp_megatron.sim.calibration import efficiency_for
    from cfp_megatron.sim.kernels import KernelModel
    from cfp_megatron.sim.primepar_cost import primepar_mlp_cost

    job = job_from_config(compose_config(BASE))
    m, cluster = job.model, job.cluster
    kernels = KernelModel(cluster, efficiency_for(cluster), job.train.precision)
    costs = CollectiveCosts(cluster)
    args = {"tp": 4, "tp_per_node": 8, "tokens": 8192.0, "hidden": m.hidden_size, "ffn": m.ffn_size, "gated": True}
    plain, split = primepar_mlp_cost(kernels, costs, **args), primepar_mlp_cost(kernels, costs, sp=True, **args)
    gather = costs.seconds(Collective.all_gather, 8192.0 * m.hidden_size * kernels.elem, 4, 8)
    assert gather > 0
    assert split.forward_comm_s == pytest.approx(plain.forward_comm_s + gather)
    assert split.backward_comm_s == pytest.approx(plain.backward_comm_s + gather)
    assert split.forward_compute_s == plain.forward_compute_s
    megatron = _predict("parallel.sp=true", "parallel.mlp=megatron", "train.micro_batch_size=1")
    primepar = _predict("parallel.sp=true", "parallel.mlp=primepar", "train.micro_batch_size=1")
    copies = (m.hidden_size * m.ffn_size * 2 + m.ffn_size * m.hidden_size) / 4 * 2 * m.num_layers
    assert primepar.memory.activations - megatron.memory.activations == pytest.approx(copies, rel=1e-6)


def test_ring_transfers_beyond_the_gemm_are_exposed() -> None:
    """On a slow interconnect the weight blocks' ring transfer outlasts the step's GEMM and shows as TP time."""
    fast = _predict("parallel.mlp=primepar", "train.micro_batch_size=1")
    slow = _predict("parallel.mlp=primepar", "train.micro_batch_size=1", "cluster.intra_node_bandwidth_gbps=20")
    assert slow.time.tp_comm_s > fast.time.tp_comm_s
    assert slow.time.forward_compute_s == pytest.approx(fast.time.forward_compute_s)


def test_space_offers_primepar_only_where_the_runtime_runs_it() -> None:
    cfg = compose_config(["+cfp=auto", *BASE[:-1]])
    job, cfp = job_from_config(cfg), cfp_from_config(cfg)
    space = build_space(job, 8, cfp)
    offered = {(f.tp, sp) for f in space.families for g in space.groups(f) for sp in [g.head[5]]
               if g.head[8] == MlpPartition.primepar.value}
    assert offered == {(4, False), (4, True)}  # tp=4 (a 2x2 grid), with or without SP; tp=2 and 8 are not 4^k
    # Profiled clusters: only where profiling timed the PrimePar layer.
    none = dataclasses.replace(space, primepar=frozenset())
    assert not any(g.head[8] == MlpPartition.primepar.value for f in none.families for g in none.groups(f))


def test_search_with_primepar_is_exactly_the_exhaustive_optimum() -> None:
    cfg = compose_config(["+cfp=auto", *BASE[:-1], "cfp.tp=4", "cfp.constraints.recompute=[none,full]",
                          "cfp.top_k=1000"])
    job, cfp = job_from_config(cfg), cfp_from_config(cfg)
    pruned, full = search(job, 8, cfp), search(job, 8, cfp, exhaustive=True)
    assert [r.candidate for r in pruned.ranked] == [r.candidate for r in full.ranked]
    # PrimePar candidates were simulated and ranked next to Megatron's.
    assert {r.candidate.mlp for r in full.ranked} == {"megatron", "primepar"}


def test_primepar_needs_a_square_tp_group_of_4k_ranks() -> None:
    with pytest.raises(ConfigError, match="parallel.mlp"):
        job_from_config(compose_config(["parallel.tp=2", "parallel.mlp=primepar"]))


def test_profiling_times_the_primepar_layer_next_to_megatrons() -> None:
    """The segments round has a PrimePar case on the 4-rank TP group that times the decoder layer only (the
    embedding and the head are Megatron's either way); the overheads round probes Megatron's cases alone."""
    from cfp_megatron.profile.overheads import overhead_cases
    from cfp_megatron.profile.segments import segment_cases, segment_steps

    job = job_from_config(compose_config(["train.global_batch_size=16"]))
    cases, _ = segment_cases(job, 4)
    assert [c.partition for c in cases] == ["tp1", "tp2", "tp2-sp", "tp4", "tp4-sp", "tp4-primepar"]
    primepar = cases[-1]
    assert primepar.layers_only and primepar.job.parallel.mlp is MlpPartition.primepar
    _, meaning = segment_steps([primepar], [1, 2], ["embedding", "dense", "head"], repeats=1)
    assert {kind for _, _, kind, _ in meaning.values()} == {"dense"}
    assert {name for *_, name in meaning.values()} == {"tp4-primepar"}
    assert {c.tp for c in overhead_cases(cases, 4, job.model.num_layers)} == {1, 2, 4}
    assert {c.dims.sp for c in overhead_cases(cases, 4, job.model.num_layers) if c.tp > 1} == {False, True}
    assert all(c.job.parallel.mlp is MlpPartition.megatron for c in overhead_cases(cases, 4, 4))


def test_megatron_lm_arguments_refuse_a_primepar_plan_by_name() -> None:
    from cfp_megatron.plan import Plan, megatron_lm_args
    from cfp_megatron.plan.errors import PlanError

    job = job_from_config(compose_config([*BASE, "parallel.mlp=primepar", "train.micro_batch_size=1"]))
    plan = Plan.from_job(job, world_size=8, prediction=None, inputs_fingerprint="")
    with pytest.raises(PlanError, match="parallel.mlp=primepar") as err:
        megatron_lm_args(plan)
    assert "torchrun" in str(err.value)
    assert "--tensor-model-parallel-size" in megatron_lm_args(Plan.from_job(
        job_from_config(compose_config([*BASE, "train.micro_batch_size=1"])), world_size=8, prediction=None,
        inputs_fingerprint=""))


def test_cpu_ranks_pay_the_ring_beside_the_gemms() -> None:
    """Accelerators overlap the ring with the GEMMs; CPU ranks run gloo's transfers on the same cores."""
    from cfp_megatron.cluster.costs import CollectiveCosts
    from cfp_megatron.sim.calibration import efficiency_for
    from cfp_megatron.sim.kernels import KernelModel
    from cfp_megatron.sim.primepar_cost import primepar_mlp_cost

    job = job_from_config(compose_config([*BASE, "parallel.mlp=primepar", "train.micro_batch_size=1"]))
    kernels = KernelModel(job.cluster, efficiency_for(job.cluster), job.train.precision)
    costs = CollectiveCosts(job.cluster)
    sizes = {"tp": 4, "tp_per_node": 8, "tokens": 8192.0, "hidden": 4096, "ffn": 14336, "gated": True}
    gpu = primepar_mlp_cost(kernels, costs, **sizes)
    cpu = primepar_mlp_cost(kernels, costs, **sizes, overlap=False)
    assert cpu.forward_compute_s == gpu.forward_compute_s and cpu.backward_compute_s == gpu.backward_compute_s
    assert cpu.forward_comm_s > gpu.forward_comm_s and cpu.backward_comm_s > gpu.backward_comm_s


# PrimePar on some layers of each chunk (parallel.primepar_layers): the search's count against every count simulated.
MIXED = ["model=llama3_8b", "cluster=dgx_h100", "cluster.nodes=1", "train.global_batch_size=64",
         "train.seq_length=8192"]
PINS = ["cfp.tp=4", "cfp.pp=1", "cfp.cp=1", "cfp.recompute=none", "cfp.distributed_optimizer=false",
        "cfp.mlp=primepar", "cfp.constraints.memory_headroom=0", "cfp.top_k=1000"]


def _mixed_job(limit_gib: float, *overrides: str):
    """The job whose search admits plans predicted at up to ``limit_gib`` (headroom 0: the GPU's memory is the limit
    times the allocator band's upper end, :func:`~cfp_megatron.sim.memory.memory_band`)."""
    # The GPU overlaps off: _every_count simulates the layouts as parallel gives them.
    probe = compose_config(["+cfp=auto", *MIXED, *PINS])
    hbm_gib = limit_gib * memory_band(job_from_config(probe).cluster).high
    cfg = compose_config(["+cfp=auto", *MIXED, f"cluster.hbm_gib={hbm_gib}", *PINS, "cfp.overlap=false", *overrides])
    return job_from_config(cfg), cfp_from_config(cfg)


def _every_count(job, sp: bool, mb: int, measurements=None) -> dict[int, tuple[float, float]]:
    """(step seconds, peak GiB) of the layout with PrimePar on the first n layers, for every n (0: Megatron's)."""
    from cfp_megatron.sim.prediction import GIB

    out = {}
    for n in range(job.model.num_layers + 1):
        parallel = dataclasses.replace(job.parallel, tp=4, sp=sp, mlp=MlpPartition.primepar if n else
                                       MlpPartition.megatron, primepar_layers=n or None)
        train = dataclasses.replace(job.train, micro_batch_size=mb)
        p = simulate(dataclasses.replace(job, parallel=parallel, train=train), measurements=measurements,
                     world_size=8)
        out[n] = (p.step_time_s, p.memory.total / GIB)
    return out


def test_simulated_time_and_memory_follow_the_count_of_primepar_layers() -> None:
    """Each PrimePar layer adds its difference from Megatron's to the step and, with one micro-batch in flight, to
    the peak: halfway is half of each (Llama-3 8B, TP=4, 4 x 8K tokens: PrimePar's fc1 input saving outweighs its
    rotated weight blocks, and its ring makes it the slower)."""
    job, _ = _mixed_job(200)
    every = _every_count(job, sp=False, mb=4)
    (t0, m0), (t16, m16), (t32, m32) = every[0], every[16], every[32]
    assert t0 < t16 < t32 and m0 > m16 > m32
    assert t16 - t0 == pytest.approx((t32 - t0) / 2, rel=0.02)
    assert m16 - m0 == pytest.approx((m32 - m0) / 2, rel=1e-6)


def test_a_slower_primepar_layer_is_not_mixed_in() -> None:
    """PrimePar's layer is the slower and the smaller here: the fewest PrimePar layers that fit would beat every
    layer PrimePar's, but their bound is Megatron's layer, which the PrimePar group's bound is not; the search keeps
    the candidate whole (every layer PrimePar's), as the exhaustive search does."""
    probe, _ = _mixed_job(200)
    every = _every_count(probe, sp=False, mb=4)
    limit = (every[0][1] + every[32][1]) / 2  # between Megatron's peak and every layer PrimePar's
    job, cfp = _mixed_job(limit, "cfp.sp=false", "cfp.micro_batch=4")
    found = search(job, 8, cfp)
    assert [r.candidate.primepar_layers for r in found.ranked] == [0]
    assert found.ranked[0].prediction.step_time_s == pytest.approx(every[32][0])
    assert [r.candidate for r in search(job, 8, cfp, exhaustive=True).ranked] == [found.ranked[0].candidate]


def _faster_primepar_db(job):
    """A ProfileDB whose PrimePar decoder layer (TP=4; profiling times it without SP) was timed 20% faster than
    Megatron's."""
    from cfp_megatron.cluster.measured import partition_name
    from cfp_megatron.profile.db import ProfileDB
    from cfp_megatron.profile.fingerprint import Fingerprint
    from cfp_megatron.profile.records import SegmentRecord

    fp = Fingerprint(device_name="Test GPU", device_count=8, nodes=1, gpus_per_node=8, backend="nccl",
                     torch="2.13.0", megatron_core="0.16.1", cpu_cores=16)
    rows = []
    for mb in (1, 2):
        for kind, partition, seconds in (("embedding", "tp4", 0.002), ("head", "tp4", 0.004), ("dense", "tp4", 0.010),
                                         ("dense", partition_name(4, mlp=MlpPartition.primepar), 0.008)):
            rows.append(SegmentRecord(model="m", model_name=job.model.name, segment=f"{kind}-id", kind=kind,
                                      partition=partition, tp=4, micro_batch=mb, seq_length=job.train.seq_length,
                                      forward_s=mb * seconds / 3, backward_s=mb * seconds * 2 / 3, confirmed=True))
    return ProfileDB(fingerprint=fp).merged(segments=rows)


def test_search_takes_the_most_primepar_layers_that_fit_where_every_layer_does_not() -> None:
    """Where profiling timed PrimePar's layer the faster and it keeps more (one 8K sequence: its rotated weight
    blocks outweigh its fc1 input saving), the fastest plan of the layout that fits is the most PrimePar layers per
    chunk the memory allows."""
    probe, _ = _mixed_job(200)
    db = _faster_primepar_db(probe)
    every = _every_count(probe, sp=False, mb=1, measurements=db)
    assert every[32][0] < every[0][0] and every[32][1] > every[0][1]
    limit = (every[0][1] + every[32][1]) / 2
    job, cfp = _mixed_job(limit, "cfp.sp=false", "cfp.micro_batch=1")
    best = min((t, n) for n, (t, m) in every.items() if m <= limit)[1]
    assert 0 < best < 32
    found = search(job, 8, cfp, measurements=db)
    assert [r.candidate.primepar_layers for r in found.ranked] == [best]
    assert found.ranked[0].prediction.step_time_s == pytest.approx(every[best][0])
    assert [r.candidate for r in search(job, 8, cfp, measurements=db, exhaustive=True).ranked] == [
        found.ranked[0].candidate]
    assert f"primepar{best} " in found.ranked[0].candidate.describe(8)
    from cfp_megatron.plan import Plan  # the count travels in the plan: canonical string and back

    plan = Plan.from_job(found.ranked[0].job, world_size=8, prediction=None, inputs_fingerprint="")
    assert f",mlp=primepar,mlpn={best}," in plan.canonical()
    assert Plan.parse(plan.canonical()).parallel.primepar_layers == best


def test_the_primepar_counts_the_search_tries_pass_the_checks(screened_jobs_checked: list[Candidate]) -> None:
    """The PrimePar layer counts the search tries, built without ParallelSpec's checks as its other layouts are
    (``Candidate.screened_job``, tests/test_search.py), pass the checks and equal the checked layouts."""
    probe, _ = _mixed_job(200)
    db = _faster_primepar_db(probe)
    every = _every_count(probe, sp=False, mb=1, measurements=db)
    job, cfp = _mixed_job((every[0][1] + every[32][1]) / 2, "cfp.sp=false", "cfp.micro_batch=1")
    found = search(job, 8, cfp, measurements=db)
    assert 0 < found.ranked[0].candidate.primepar_layers < 32
    assert len({c.primepar_layers for c in screened_jobs_checked}) > 2  # the bisection's counts were built


def test_primepar_layers_need_primepar_and_no_block_recompute() -> None:
    with pytest.raises(ConfigError, match="parallel.primepar_layers"):
        job_from_config(compose_config(["parallel.tp=4", "parallel.primepar_layers=1"]))
    with pytest.raises(ConfigError, match="parallel.primepar_layers"):
        job_from_config(compose_config(["parallel.tp=4", "parallel.mlp=primepar", "parallel.primepar_layers=1",
                                        "parallel.recompute=full", "parallel.recompute_method=block"]))


def test_measured_memory_counts_each_layer_under_its_own_partition() -> None:
    """With profiled segment memory, the layers beyond parallel.primepar_layers hold what Megatron's layer was
    measured to keep, the others PrimePar's: the activations move by one layer's difference per layer."""
    from cfp_megatron.sim.prediction import GIB

    probe, _ = _mixed_job(200)
    rows = []
    base = _faster_primepar_db(probe)
    for r in base.segments:
        keep = 3e8 if r.partition.endswith("primepar") else 2e8
        rows.append(dataclasses.replace(r, activation_bytes=r.micro_batch * keep, transient_bytes=0.0,
                                        workspace_bytes=0.0))
    db = dataclasses.replace(base, segments=()).merged(segments=rows)
    every = _every_count(probe, sp=False, mb=1, measurements=db)
    steps = [every[n][1] - every[n - 1][1] for n in (1, 2, 17, 32)]
    assert steps == pytest.approx([1e8 / GIB] * 4, rel=1e-6)
