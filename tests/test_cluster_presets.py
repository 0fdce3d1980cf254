"""Hardware presets and the cluster fields that override them: every preset in conf/cluster composes through the
project's Hydra config; the NVLink domain, not the node, is the cost model's fast link (a TP/EP group of 16 or 64
ranks on an NVL72 rack is priced at NVLink speed, over the NIC on 8-GPU nodes); the network and a clock or power
limit can be overridden from Hydra, and bad values come back as ConfigError naming the key.

Behaviour only: no wall-clock assertions.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.config import ClusterSpec, JobSpec, Network, ParallelSpec, Precision, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.cluster.costs import CollectiveCosts, group_placement
from cfp_megatron.cluster.fabrics import FABRICS_FILE, FabricDataError, bandwidth_scale, load_fabrics
from cfp_megatron.cluster.measured import Collective, CollectiveFit, NothingMeasured, Span
from cfp_megatron.cluster.unstated import UNSTATED_FILE, UnstatedDataError, unstated_rates
from cfp_megatron.profile.cluster import measured_cluster
from cfp_megatron.sim import simulate
from cfp_megatron.sim.calibration import FITTED, efficiency_for, generation
from cfp_megatron.sim.kernels import KernelModel, target_peak_tflops
from cfp_megatron.sim.layout import place
from cfp_megatron.validate import gpu_preset
from tests.test_config import _schema, compose_cfg, make_job  # noqa: F401  (_schema: the schema fixture)

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
CLUSTER_PRESETS = sorted(p.stem for p in (CONF_DIR / "cluster").glob("*.yaml"))
GPU_PRESETS = [n for n in CLUSTER_PRESETS if n != "local"]
NEW_PRESETS = ["gb200_nvl72", "gb300_nvl72", "b300", "h800", "h20", "dgx_a100_40gb", "h100_nvl", "mi300x", "mi325x",
               "mi355x", "a800"]
GIB = 1 << 30


def cluster(*overrides: str) -> ClusterSpec:
    return make_job(*overrides).cluster


def big_job(preset: str, *overrides: str) -> JobSpec:
    """A GPT-style job large enough that compute and communication both matter."""
    return make_job(f"cluster={preset}", "model=gpt_tiny", "model.num_layers=8", "model.hidden_size=4096",
                    "model.ffn_hidden_size=16384", "model.num_attention_heads=32", "model.vocab_size=51200",
                    "model.max_position_embeddings=4096", "train.seq_length=4096", "train.micro_batch_size=1",
                    "train.precision=bf16", *overrides)


# --------------------------------------------------------------------------------------------------------------------
# Every preset.


def test_every_asked_for_preset_exists() -> None:
    assert not [n for n in NEW_PRESETS if n not in CLUSTER_PRESETS]


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_preset_figures_are_sane(name: str) -> None:
    c = cluster(f"cluster={name}")
    peaks = [p for p in (c.peak_tflops_fp8, c.peak_tflops_bf16, c.peak_tflops_fp32) if p is not None]
    assert peaks == sorted(peaks, reverse=True), "fp8 >= bf16 >= fp32 peak"
    assert c.peak_tflops_bf16 is not None and c.peak_tflops_fp32 is not None
    assert c.hbm_gib and c.hbm_bandwidth_gbps and c.tdp_w
    assert c.intra_node_bandwidth_gbps > c.network_bandwidth_gbps > 0
    assert c.intra_node_latency_us < c.inter_node_latency_us
    domain, gpus = c.domain_size(), c.gpus_per_node
    assert domain % gpus == 0 or gpus % domain == 0
    assert c.clock_scale == 1.0  # a preset runs at its quoted clock
    if c.max_sm_clock_mhz is not None:
        assert 1000 <= c.max_sm_clock_mhz <= 3000


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_new_preset_names_its_sources(name: str) -> None:
    text = (CONF_DIR / "cluster" / f"{name}.yaml").read_text()
    head = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    assert "datasheet" in head or "product brief" in head, "the comment says where the figures come from"
    assert "dense" in head, "the comment says the peaks are dense, not 2:4 sparse"
    assert "orders of magnitude" in head, "latencies are marked as typical orders of magnitude"


def test_new_preset_key_figures() -> None:
    gb200, gb300, b300 = (cluster(f"cluster={n}") for n in ("gb200_nvl72", "gb300_nvl72", "b300"))
    assert (gb200.gpus_per_node, gb200.nvlink_domain_size) == (4, 72)
    assert (gb200.peak_tflops_bf16, gb200.peak_tflops_fp8, gb200.hbm_gib) == (2500.0, 5000.0, 186.0)
    assert (gb200.intra_node_bandwidth_gbps, gb200.inter_node_bandwidth_gbps) == (900.0, 50.0)
    assert (gb300.peak_tflops_fp8, gb300.hbm_gib, gb300.inter_node_bandwidth_gbps) == (5000.0, 288.0, 100.0)
    assert (b300.peak_tflops_bf16, b300.hbm_gib, b300.inter_node_bandwidth_gbps) == (2250.0, 288.0, 100.0)
    h800, h20, a40, nvl = (cluster(f"cluster={n}") for n in ("h800", "h20", "dgx_a100_40gb", "h100_nvl"))
    assert (h800.peak_tflops_bf16, h800.intra_node_bandwidth_gbps) == (989.0, 200.0)
    assert (h20.peak_tflops_bf16, h20.hbm_gib, h20.hbm_bandwidth_gbps) == (148.0, 96.0, 4000.0)
    assert (a40.hbm_gib, a40.hbm_bandwidth_gbps, a40.peak_tflops_fp8) == (40.0, 1555.0, None)
    assert (nvl.nvlink_domain_size, nvl.hbm_gib, nvl.peak_tflops_bf16) == (2, 94.0, 835.5)
    mi300, mi325, mi355 = (cluster(f"cluster={n}") for n in ("mi300x", "mi325x", "mi355x"))
    assert (mi300.peak_tflops_bf16, mi300.hbm_gib, mi300.hbm_bandwidth_gbps) == (1307.4, 192.0, 5300.0)
    assert (mi325.hbm_gib, mi325.hbm_bandwidth_gbps, mi325.tdp_w) == (256.0, 6000.0, 1000.0)
    assert (mi355.peak_tflops_fp8, mi355.hbm_gib, mi355.network) == (5033.2, 288.0, Network.roce)


@pytest.mark.parametrize(("name", "gen"), [
    ("gb200_nvl72", "blackwell"), ("gb300_nvl72", "blackwell"), ("b300", "blackwell"), ("b200", "blackwell"),
    ("h800", "hopper"), ("h20", "hopper"), ("h100_nvl", "hopper"), ("h200", "hopper"), ("dgx_h100", "hopper"),
    ("dgx_a100_40gb", "ampere"), ("dgx_a100", "ampere"), ("a800", "ampere"), ("mi300x", "cdna3"), ("mi325x", "cdna3"),
    ("mi355x", "cdna4"),
])
def test_generation_of_each_preset(name: str, gen: str) -> None:
    c = cluster(f"cluster={name}")
    assert generation(c) == gen
    assert efficiency_for(c) is FITTED[gen]


def test_amd_generations_reuse_hoppers_shares() -> None:
    assert FITTED["cdna3"] == FITTED["hopper"] and FITTED["cdna4"] == FITTED["hopper"]


@pytest.mark.parametrize(("gpu", "preset"), [
    ("A100-80GB (DGX A100, Selene)", "dgx_a100"), ("A100-80GB", "dgx_a100"), ("A100-SXM4-40GB", "dgx_a100_40gb"),
    ("A100 40GB", "dgx_a100_40gb"), ("H100-SXM5-80GB (DGX-H100)", "dgx_h100"),
    ("H100-80GB (variant not stated)", "dgx_h100"), ("H100 NVL", "h100_nvl"), ("H100-NVL 94GB", "h100_nvl"),
    ("H200", "h200"), ("H800 SXM", "h800"), ("H20", "h20"), ("H20-96GB", "h20"), ("B200", "b200"), ("B300", "b300"),
    ("GB200 NVL72", "gb200_nvl72"), ("GB300", "gb300_nvl72"), ("MI300X", "mi300x"),
    ("AMD Instinct MI325X", "mi325x"), ("MI355X", "mi355x"), ("A800-SXM4-80GB", "a800"),
])
def test_gpu_preset_maps_rows(gpu: str, preset: str) -> None:
    assert gpu_preset(gpu) == preset
    assert preset in CLUSTER_PRESETS


def test_gpu_preset_lists_what_it_knows() -> None:
    from cfp_megatron.validate import RowError

    with pytest.raises(RowError) as info:
        gpu_preset("V100")
    for name in ("A100-40GB", "H100 NVL", "H800", "H20", "B300", "GB200", "GB300", "MI300X", "MI325X", "MI355X"):
        assert name in str(info.value)


# --------------------------------------------------------------------------------------------------------------------
# The NVLink domain is the fast link.


def _dims(world: int, **parallel: int) -> ParallelDims:
    return ParallelDims(parallel=ParallelSpec(**parallel), world_size=world, num_microbatches=1)


def test_nvl72_prices_tp16_and_ep64_at_nvlink_speed() -> None:
    rack = cluster("cluster=gb200_nvl72", "cluster.nodes=18")
    # The same GPUs and links on 8-GPU nodes: only the domain differs.
    dgx = dataclasses.replace(rack, gpus_per_node=8, nodes=9, nvlink_domain_size=None)
    on_rack, on_dgx = CollectiveCosts(rack), CollectiveCosts(dgx)
    message = 256e6
    for op, size in ((Collective.all_reduce, 16), (Collective.all_gather, 16), (Collective.all_to_all, 64)):
        flat_nvlink = on_rack.flat(op, message, size, Span.intra_node)
        assert on_rack.seconds(op, message, size) == pytest.approx(flat_nvlink)
        assert on_dgx.seconds(op, message, size) > 1.5 * flat_nvlink  # crosses nodes: the NIC
    assert on_rack.domain_size == 72 and on_dgx.domain_size == 8


def test_nvl72_layout_keeps_tp_and_ep_groups_on_nvlink() -> None:
    rack = big_job("gb200_nvl72", "cluster.nodes=16")  # 64 GPUs of one rack
    dgx = big_job("dgx_h100", "cluster.nodes=8")  # 64 GPUs on 8-GPU nodes
    for job in (rack, dgx):
        assert job.cluster.nodes * job.cluster.gpus_per_node == 64
    tp16 = _dims(64, tp=16)
    ep64 = _dims(64, ep=64)
    assert place(rack, tp16, 4).tp_per_node == 16
    assert place(rack, ep64, 4).ep_per_node == 64
    assert place(dgx, tp16, 8).tp_per_node == 8
    assert place(dgx, ep64, 8).ep_per_node == 8
    assert place(rack, tp16, 4).domain_size == 72 and place(dgx, tp16, 8).domain_size == 8


def test_a_group_straddling_two_racks_gets_its_smaller_share() -> None:
    # Full racks (Slurm segments of 18 trays): TP groups of 16 do not tile a 72-GPU rack.
    two_racks = big_job("gb200_nvl72", "cluster.nodes=36", "cluster.nvlink_segment_nodes=18")  # 144 GPUs
    assert place(two_racks, _dims(144, tp=16), 4).tp_per_node == 8  # ranks 64..79: 8 in each rack
    assert place(two_racks, _dims(144, tp=8), 4).tp_per_node == 8  # 8 divides 72: every group inside a rack
    assert group_placement(16, 1, 72, world_size=64) == 16
    # Aligned groups: the same answer counted or not (8-GPU nodes, powers of two).
    for size, stride in ((8, 1), (4, 8), (8, 2), (16, 1), (2, 4)):
        assert group_placement(size, stride, 8) == group_placement(size, stride, 8, world_size=512)


def test_a_job_over_several_racks_runs_in_segments_of_16_trays_by_default() -> None:
    """NVIDIA's placement for jobs of 128 GPUs and more (Slurm's --segment=16): 64 consecutive ranks per rack, so
    groups of 16 or 64 stay on NVLink; a job that fits one rack runs in it; the segment is a setting."""
    two_racks = big_job("gb200_nvl72", "cluster.nodes=36")  # 144 GPUs
    assert place(two_racks, _dims(144, tp=16), 4).tp_per_node == 16
    assert place(two_racks, _dims(144, tp=16), 4).domain_size == 64
    four = big_job("gb200_nvl72", "cluster.nodes=64")  # 256 GPUs: four segments of 64
    assert place(four, _dims(256, ep=64), 4).ep_per_node == 64
    assert place(four, _dims(256, ep=128), 4).ep_per_node == 64
    assert four.cluster.domain_size(4, 256) == 64 and four.cluster.domain_size(4, 72) == 72
    assert four.cluster.domain_size(4) == 72  # no job size: the rack
    packed = dataclasses.replace(four.cluster, nvlink_segment_nodes=18)
    assert packed.domain_size(4, 256) == 72
    assert big_job("dgx_h100", "cluster.nodes=32").cluster.domain_size(8, 256) == 8  # a node: no segments
    slow = simulate(big_job("gb200_nvl72", "cluster.nodes=64", "cluster.nvlink_segment_nodes=18", "parallel.tp=16",
                            "parallel.sp=true", "train.global_batch_size=64"))
    fast = simulate(big_job("gb200_nvl72", "cluster.nodes=64", "parallel.tp=16", "parallel.sp=true",
                            "train.global_batch_size=64"))
    assert fast.time.tp_comm_s < slow.time.tp_comm_s


def test_nvlink_bridged_pairs_are_a_domain_smaller_than_a_node() -> None:
    job = big_job("h100_nvl")
    assert place(job, _dims(8, tp=2), 8).tp_per_node == 2
    assert place(job, _dims(8, tp=8), 8).tp_per_node == 2  # beyond the pair: the slow link
    costs = CollectiveCosts(job.cluster)
    assert costs.seconds(Collective.all_reduce, 64e6, 2) < costs.seconds(Collective.all_reduce, 64e6, 8)


def test_tp16_simulates_faster_on_a_rack_than_on_trays_with_the_same_links() -> None:
    rack = big_job("gb200_nvl72", "cluster.nodes=4", "parallel.tp=16", "parallel.sp=true",
                   "train.global_batch_size=8")
    trays = dataclasses.replace(rack, cluster=dataclasses.replace(rack.cluster, nvlink_domain_size=None))
    fast, slow = simulate(rack), simulate(trays)
    assert fast.time.tp_comm_s < slow.time.tp_comm_s
    assert fast.step_time_s < slow.step_time_s


def test_tp_within_node_constraint_follows_the_domain() -> None:
    from cfp_megatron.base.cfp_spec import CfpSpec
    from cfp_megatron.search.space import build_space

    cfp = CfpSpec()
    rack = big_job("gb200_nvl72", "cluster.nodes=4", "train.global_batch_size=16")
    reasons = {r.what: r.reason for r in build_space(rack, 16, cfp).rejected}
    assert "tp=16" not in reasons  # TP=16 stays inside the 72-GPU NVLink domain
    dgx = big_job("dgx_h100", "cluster.nodes=2", "train.global_batch_size=16")
    reasons = {r.what: r.reason for r in build_space(dgx, 16, cfp).rejected}
    assert "span nodes of 8 GPUs" in reasons["tp=16"]


# --------------------------------------------------------------------------------------------------------------------
# Network override.


def test_network_defaults_to_the_presets_figure() -> None:
    c = cluster("cluster=dgx_h100")
    assert c.network_bandwidth_gbps == c.inter_node_bandwidth_gbps == 50.0
    assert c.rails == 8


@pytest.mark.parametrize(("overrides", "gbps", "rails"), [
    (("cluster.nic_gbps=200",), 25.0, 8),  # HDR links, the preset's 8 of them
    (("cluster.nics_per_node=4",), 25.0, 4),  # half the links at the preset's 400 Gb/s
    (("cluster.nics_per_node=4", "cluster.nic_gbps=800"), 50.0, 4),
    (("cluster.nics_per_node=16", "cluster.nic_gbps=400", "cluster.inter_node_bandwidth_gbps=10"), 100.0, 16),
])
def test_network_override_sets_the_per_gpu_bandwidth(overrides: tuple[str, ...], gbps: float, rails: int) -> None:
    c = cluster("cluster=dgx_h100", "cluster.network=roce", *overrides)
    assert c.network is Network.roce
    assert c.network_bandwidth_gbps == pytest.approx(gbps)
    assert c.rails == rails
    costs = CollectiveCosts(c)
    assert costs.inter.bandwidth_bytes_per_s == pytest.approx(gbps * 1e9)


def test_network_override_slows_cross_node_gradient_sync() -> None:
    base = big_job("dgx_h100", "cluster.nodes=2", "train.global_batch_size=16")
    slow = big_job("dgx_h100", "cluster.nodes=2", "train.global_batch_size=16", "cluster.nic_gbps=100")
    assert slow.cluster.network_bandwidth_gbps == pytest.approx(12.5)
    assert simulate(slow).time.dp_comm_s > simulate(base).time.dp_comm_s


def test_every_fabric_names_its_source_and_every_network_has_an_entry() -> None:
    fabrics = load_fabrics()
    assert {fabric.network for fabric in fabrics.fabrics} == set(Network)
    assert all(len(fabric.source) > 40 and fabric.words for fabric in fabrics.fabrics)
    assert fabrics.reference.network is Network.infiniband
    assert fabrics.of(Network.infiniband).link_gbps["HDR"] == 200.0
    assert fabrics.named_in("8x200Gb/s HDR InfiniBand per node").network is Network.infiniband
    assert fabrics.named_in("ConnectX-7 RoCE").network is Network.roce  # RoCE before InfiniBand's ConnectX
    assert fabrics.named_in("NVLink 4 intra-node") is None


@pytest.mark.parametrize("network, scale", [
    ("infiniband", 1.0), ("roce", 1.0), ("efa", 1.0), ("omnipath", 0.34 / 0.85), ("slingshot", 1.0), ("ethernet", 1.0),
])
def test_the_fabric_scales_the_network_bandwidth_by_its_share_over_infinibands(network: str, scale: float) -> None:
    """The fitted network efficiency holds InfiniBand's share of line rate; Omni-Path reaches 135 of 400 Gb/s
    (cluster/fabrics.yaml); Slingshot and plain Ethernet have no measured share and stay at InfiniBand's."""
    ib = CollectiveCosts(cluster("cluster=dgx_a100"), inter_efficiency=0.75)
    other = CollectiveCosts(cluster("cluster=dgx_a100", f"cluster.network={network}"), inter_efficiency=0.75)
    assert other.inter.bandwidth_bytes_per_s == pytest.approx(ib.inter.bandwidth_bytes_per_s * scale)
    assert other.intra.bandwidth_bytes_per_s == ib.intra.bandwidth_bytes_per_s  # NVLink is not the fabric
    assert bandwidth_scale(Network(network)) == pytest.approx(scale)


def test_omni_path_slows_cross_node_gradient_sync_beyond_its_line_rate() -> None:
    base = big_job("dgx_a100", "cluster.nodes=2", "train.global_batch_size=16", "cluster.nics_per_node=4",
                   "cluster.nic_gbps=100")
    opa = big_job("dgx_a100", "cluster.nodes=2", "train.global_batch_size=16", "cluster.nics_per_node=4",
                  "cluster.nic_gbps=100", "cluster.network=omnipath")
    assert simulate(opa).time.dp_comm_s > 2 * simulate(base).time.dp_comm_s


@pytest.mark.parametrize("change, said", [
    (("- name: omnipath", "- name: myrinet"), "fabric 'myrinet' is not a cluster.network value"),
    (("bus_share: 0.34", "bus_share: 3.4"), "bus_share=3.4"),
    (("reference: infiniband", "reference: token-ring"), "reference 'token-ring'"),
    (("words: ['slingshot'", "words: ['(slingshot'"), "not a regular expression"),
])
def test_a_malformed_fabrics_file_is_refused_naming_the_fabric(tmp_path: Path, change: tuple[str, str],
                                                               said: str) -> None:
    text = FABRICS_FILE.read_text()
    assert text.count(change[0]) == 1
    bad = tmp_path / "fabrics.yaml"
    bad.write_text(text.replace(*change))
    with pytest.raises(FabricDataError) as caught:
        load_fabrics(bad)
    assert str(bad) in str(caught.value) and said in str(caught.value) and "Fix:" in str(caught.value)


def test_the_fabrics_file_ships_with_the_package() -> None:
    globs = tomllib.loads((CONF_DIR.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "cluster/*.yaml" in globs["cfp_megatron"]


def test_a_measured_network_link_replaces_the_nic_override() -> None:
    fit = CollectiveFit(op=Collective.send_recv, group_size=2, span=Span.inter_node, latency_s=5e-6,
                        bandwidth_bytes_per_s=20e9)

    class Link(NothingMeasured):
        def collective(self, op, group_size, span):
            return fit if (op, group_size, span) == (fit.op, fit.group_size, fit.span) else None

    spec = cluster("cluster=dgx_h100", "cluster.nic_gbps=200")
    filled = measured_cluster(spec, Link())
    assert filled.network_bandwidth_gbps == pytest.approx(20.0)
    assert (filled.nics_per_node, filled.nic_gbps) == (None, None)


# --------------------------------------------------------------------------------------------------------------------
# Clock and power limits.


def test_power_limit_scales_the_peak_by_the_cube_root() -> None:
    c = cluster("cluster=dgx_h100", "cluster.power_limit_w=500")
    assert c.clock_scale == pytest.approx((500 / 700) ** (1 / 3))
    assert c.clocked_peak_tflops("bf16") == pytest.approx(989.0 * (500 / 700) ** (1 / 3))
    assert c.clocked_peak_tflops("fp8") < c.peak_tflops_fp8
    # Above the TDP the clock stays at its maximum.
    assert cluster("cluster=dgx_h100", "cluster.power_limit_w=900").clock_scale == 1.0


def test_clock_limit_scales_the_peak_linearly() -> None:
    c = cluster("cluster=dgx_h100", "cluster.sm_clock_mhz=915")
    assert c.clock_scale == pytest.approx(0.5)
    assert c.clocked_peak_tflops("fp32") == pytest.approx(494.7 / 2)
    both = cluster("cluster=dgx_h100", "cluster.sm_clock_mhz=1500", "cluster.power_limit_w=300")
    assert both.clock_scale == pytest.approx(min(1500 / 1830, (300 / 700) ** (1 / 3)))
    # A clock or power limit leaves memory and links alone.
    assert (both.hbm_bandwidth_gbps, both.network_bandwidth_gbps) == (3350.0, 50.0)


def test_clock_and_power_limits_slow_the_simulated_step() -> None:
    base = big_job("dgx_h100", "parallel.tp=8", "train.global_batch_size=4")
    capped = big_job("dgx_h100", "parallel.tp=8", "train.global_batch_size=4", "cluster.power_limit_w=400")
    locked = big_job("dgx_h100", "parallel.tp=8", "train.global_batch_size=4", "cluster.sm_clock_mhz=1200")
    fast = simulate(base)
    for job in (capped, locked):
        slow = simulate(job)
        assert slow.step_time_s > fast.step_time_s
        assert slow.time.forward_compute_s > fast.time.forward_compute_s
        # The links are not clocked: the TP collectives take as long, and slower gradient GEMMs hide as much or more
        # of the backward's share that runs beside them, so the exposed TP time does not grow.
        assert slow.time.tp_comm_s <= fast.time.tp_comm_s * (1 + 1e-9)
    # The kernel model reads the clocked peak; MFU stays against the quoted one.
    eff = efficiency_for(base.cluster)
    k_base = KernelModel(base.cluster, eff, base.train.precision)
    k_cap = KernelModel(capped.cluster, eff, capped.train.precision)
    assert k_cap.gemm_flops_per_s == pytest.approx(k_base.gemm_flops_per_s * capped.cluster.clock_scale)
    assert target_peak_tflops(capped) == target_peak_tflops(base) == 989.0


def test_measured_peak_is_not_scaled_twice() -> None:
    class Peak(NothingMeasured):
        def peak_tflops(self, dtype):
            return 500.0 if dtype == "bf16" else None

    spec = cluster("cluster=dgx_h100", "cluster.power_limit_w=350")
    filled = measured_cluster(spec, Peak())
    assert filled.clock_scale == 1.0 and filled.clocked_peak_tflops("bf16") == 500.0
    assert filled.peak_tflops_fp8 == pytest.approx(spec.clocked_peak_tflops("fp8"))  # unmeasured: scaled once


# --------------------------------------------------------------------------------------------------------------------
# Bad values.


@pytest.mark.parametrize(("overrides", "key", "fragment"), [
    (("cluster=gb200_nvl72", "cluster.nvlink_domain_size=6"), "cluster.nvlink_domain_size",
     "must be a multiple of cluster.gpus_per_node=4"),
    (("cluster=dgx_h100", "cluster.nvlink_domain_size=0"), "cluster.nvlink_domain_size", "positive integer"),
    (("cluster=gb200_nvl72", "cluster.nvlink_segment_nodes=20"), "cluster.nvlink_segment_nodes",
     "do not fit one NVLink domain of cluster.nvlink_domain_size=72"),
    (("cluster=gb200_nvl72", "cluster.nvlink_segment_nodes=0"), "cluster.nvlink_segment_nodes", "positive integer"),
    (("cluster=dgx_h100", "cluster.sm_clock_mhz=2500"), "cluster.sm_clock_mhz", "above the maximum clock"),
    (("cluster=b200", "cluster.sm_clock_mhz=1500"), "cluster.sm_clock_mhz", "cluster.max_sm_clock_mhz"),
    (("cluster=dgx_h100", "cluster.power_limit_w=0"), "cluster.power_limit_w", "must be positive"),
    (("cluster.power_limit_w=300",), "cluster.power_limit_w", "cluster.tdp_w"),
    (("cluster=dgx_h100", "cluster.nics_per_node=0"), "cluster.nics_per_node", "positive integer"),
    (("cluster=dgx_h100", "cluster.nic_gbps=-400"), "cluster.nic_gbps", "must be positive"),
    (("cluster.nic_gbps=400",), "cluster.nic_gbps", "cluster.gpus_per_node"),
    (("cluster=dgx_h100", "cluster.nics_per_node=4", "cluster.inter_node_bandwidth_gbps=null"),
     "cluster.nics_per_node", "cluster.nic_gbps"),
])
def test_bad_values_name_the_key(overrides: tuple[str, ...], key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_job(*overrides)
    assert info.value.keys == [key]
    assert fragment in str(info.value)
    assert " Fix: " in str(info.value)


def test_unknown_network_is_rejected_by_hydra() -> None:
    with pytest.raises(ConfigCompositionException):
        compose_cfg("cluster=dgx_h100", "cluster.network=myrinet")


def test_bad_network_rejected_by_specs() -> None:
    with pytest.raises(ConfigError) as info:
        job_from_config({"cluster": {"network": "myrinet"}})
    assert info.value.keys == ["cluster.network"]


def test_unstated_figures_come_from_their_data_file_with_sources(tmp_path: Path) -> None:
    """A cluster that states no peak, memory bandwidth or link figures (the local preset on CPU ranks) is priced
    at cluster/unstated.yaml's figures; a file without a figure's source is refused by name."""
    rates = unstated_rates()
    cluster = compose_job(["cluster=local", "cluster.gpus_per_node=2"]).cluster
    assert cluster.hbm_bandwidth_gbps is None and cluster.intra_node_bandwidth_gbps is None
    eff = efficiency_for(cluster)
    kernels = KernelModel(cluster, eff, Precision.fp32)
    assert kernels.mem_bytes_per_s == pytest.approx(rates.hbm_bandwidth_gbps * 1e9 * eff.memory)
    assert kernels.gemm_flops_per_s == pytest.approx(rates.peak_tflops * 1e12 * eff.gemm)
    costs = CollectiveCosts(cluster)
    assert costs.intra.bandwidth_bytes_per_s == pytest.approx(rates.intra_node_bandwidth_gbps * 1e9)
    assert costs.inter.latency_s == pytest.approx(rates.latency_us * 1e-6)
    text = UNSTATED_FILE.read_text()
    broken = tmp_path / "unstated.yaml"
    broken.write_text(text.replace("hbm_bandwidth_gbps:\n  value: 50.0\n  source:",
                                   "hbm_bandwidth_gbps:\n  value: 50.0\n  where:"))
    assert broken.read_text() != text
    with pytest.raises(UnstatedDataError, match="hbm_bandwidth_gbps needs a positive value and its source"):
        unstated_rates(broken)
