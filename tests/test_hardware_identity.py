"""Hardware identity as preset data (issue M, item 2): every preset in conf/cluster states its generation, its
capabilities (TP communication overlap, number formats, NVLink domain) and the names its GPU goes by; a name maps to
its preset by the longest alias it contains; the simulator's efficiencies follow the stated generation (never the
device name) and are data the fitting bench writes; a cluster whose generation is missing or unknown gets a warning
in the plan's output.

Behaviour only: no wall-clock assertions.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import types
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import ClusterSpec
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.cluster.presets import (
    IDENTITY_KEYS,
    cluster_preset,
    cluster_preset_names,
    known_gpus,
    preset_for_gpu,
    squashed,
)
from cfp_megatron.plan import load_plan
from cfp_megatron.planner import plan_cli
from cfp_megatron.search.space import build_space
from cfp_megatron.sim import calibration
from cfp_megatron.sim.calibration import (
    EFFICIENCIES_FILE,
    FITTED,
    TABLE,
    UNKNOWN,
    efficiencies_text,
    efficiency_for,
    generation,
    identity_warnings,
    read_efficiencies,
)
from cfp_megatron.validate import RowError, gpu_preset
from tests.test_config import _schema, make_job  # noqa: F401  (_schema: the schema fixture)

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted(p.stem for p in (ROOT / "conf" / "cluster").glob("*.yaml"))
GPU_PRESETS = [name for name in PRESETS if name != "local"]


def _bench_validate(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """bench/validate.py, the fitting bench, as a module (its folder on the path, as when run: it imports snippet)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_validate", ROOT / "bench" / "validate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------------------------------
# Every preset says what it is.


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_declares_its_generation_capabilities_and_aliases(name: str) -> None:
    raw = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "cluster" / f"{name}.yaml"))
    for key in (*IDENTITY_KEYS, "nvlink_domain_size"):
        assert key in raw, f"{name}.yaml states {key}"
    c = make_job(f"cluster={name}").cluster
    assert c.generation in FITTED, "a generation the efficiencies file knows (fitted or borrowed)"
    assert isinstance(c.supports_tp_overlap, bool)
    assert c.number_formats and set(c.number_formats) <= set(ClusterSpec.NUMBER_FORMATS) and "bf16" in c.number_formats
    assert identity_warnings(c) == []
    if name == "local":
        assert c.generation == "cpu" and not c.aliases and not c.supports_tp_overlap
        return
    assert c.aliases, "a GPU preset names its GPU as published tables do"
    assert ("fp8" in c.number_formats) == (c.peak_tflops_fp8 is not None), "fp8 listed where its peak is stated"
    assert c.supports_tp_overlap == (c.generation in ("hopper", "blackwell"))


def test_capabilities_follow_the_datasheets() -> None:
    # each preset's generation: tests/test_cluster_presets.py, test_generation_of_each_preset
    assert "nvfp4" in make_job("cluster=b200").cluster.number_formats
    assert "tf32" not in make_job("cluster=mi355x").cluster.number_formats  # CDNA 4 dropped the TF32 matrix rate
    assert make_job("cluster=gb200_nvl72").cluster.domain_size() == 72
    assert make_job("cluster=dgx_h100").cluster.domain_size() == 8  # null: one node of 8


def test_an_unknown_number_format_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        make_job("cluster=dgx_h100", "cluster.number_formats=[bf16,fp9]")
    assert info.value.keys == ["cluster.number_formats"] and "'fp9'" in str(info.value)


# --------------------------------------------------------------------------------------------------------------------
# Names to presets.


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_every_alias_maps_back_to_its_preset(name: str) -> None:
    for alias in cluster_preset(name)["aliases"]:
        assert preset_for_gpu(alias) == name, alias
        assert preset_for_gpu(f"NVIDIA {alias.lower()} (8 per node)") == name, alias


def test_no_alias_belongs_to_two_presets() -> None:
    owners: dict[str, str] = {}
    for name in GPU_PRESETS:
        for alias in cluster_preset(name)["aliases"]:
            assert owners.setdefault(squashed(alias), name) == name, alias


@pytest.mark.parametrize(("gpu", "preset"), [
    ("GB300", "gb300_nvl72"), ("B300", "b300"), ("GB200 NVL72", "gb200_nvl72"), ("HGX B200", "b200"),
    ("H100 NVL", "h100_nvl"), ("H100-NVL 94GB", "h100_nvl"), ("H100 PCIe", "dgx_h100"), ("H100 SXM5", "dgx_h100"),
    ("H200", "h200"), ("H20", "h20"), ("H20 96GB", "h20"),
    ("A100 40GB", "dgx_a100_40gb"), ("A100-PCIE-40GB", "dgx_a100_40gb"), ("A100", "dgx_a100"),
    ("A100-80GB", "dgx_a100"), ("DGX A100 320GB", "dgx_a100_40gb"), ("DGX A100", "dgx_a100"),
])
def test_the_more_specific_name_wins(gpu: str, preset: str) -> None:
    assert preset_for_gpu(gpu) == preset


def test_a_name_no_alias_covers_has_no_preset() -> None:
    assert preset_for_gpu("V100-SXM2-32GB") is None and preset_for_gpu("") is None
    with pytest.raises(RowError) as info:
        gpu_preset("V100")
    assert all(name in str(info.value) for name in known_gpus())
    assert known_gpus()[:3] == ["A800", "B200", "B300"]  # each preset's first alias, in preset order


def test_cluster_preset_is_a_copy() -> None:
    first = cluster_preset("dgx_h100")
    first["aliases"].append("mine")
    assert "mine" not in cluster_preset("dgx_h100")["aliases"]
    assert cluster_preset_names() == PRESETS
    with pytest.raises(KeyError):
        cluster_preset("dgx_v100")


@pytest.mark.parametrize(("device", "memory_gib", "preset"), [  # names as torch.cuda.get_device_properties gives them
    ("NVIDIA H100 80GB HBM3", 79.1, "dgx_h100"), ("NVIDIA H100 PCIe", 79.6, "dgx_h100"),
    ("NVIDIA H100 NVL", 93.1, "h100_nvl"), ("NVIDIA A100-SXM4-40GB", 39.4, "dgx_a100_40gb"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "dgx_a100"), ("NVIDIA A100-PCIE-40GB", 39.4, "dgx_a100_40gb"),
    ("NVIDIA A100 80GB PCIe", 79.2, "dgx_a100"), ("NVIDIA A800-SXM4-80GB", 79.2, "a800"), ("NVIDIA H800", 79.1, "h800"),
    ("NVIDIA H20", 95.0, "h20"), ("NVIDIA H200", 139.8, "h200"), ("NVIDIA B200", 178.4, "b200"),
    ("NVIDIA GB200", 184.0, "gb200_nvl72"), ("NVIDIA B300 SXM6 AC", 268.0, "b300"),
    ("NVIDIA GB300", 268.0, "gb300_nvl72"),
    ("AMD Instinct MI300X", 191.5, "mi300x"), ("AMD Instinct MI325X", 255.0, "mi325x"),
    ("AMD Instinct MI355X", 287.0, "mi355x"),
    # a bare name leaves the variant open: the memory picks among the presets whose aliases extend it
    ("NVIDIA A100", 39.4, "dgx_a100_40gb"), ("NVIDIA A100", 79.2, "dgx_a100"), ("NVIDIA H100", 93.1, "h100_nvl"),
    ("NVIDIA GeForce RTX 4090", 23.6, None), ("NVIDIA L40S", 44.5, None), ("Tesla V100-SXM2-32GB", 31.7, None),
])
def test_a_device_name_finds_its_preset_through_the_aliases(device: str, memory_gib: float,
                                                            preset: str | None) -> None:
    from cfp_megatron.cluster.presets import preset_for_device
    from cfp_megatron.profile.cluster import device_preset

    assert preset_for_device(device, memory_gib) == preset
    found = device_preset(device, memory_gib)
    assert (found["name"] if found else None) == preset


# --------------------------------------------------------------------------------------------------------------------
# The stated generation, not the name, selects the efficiencies and TP overlap.


def test_generation_is_read_not_guessed_from_the_name() -> None:
    h100 = make_job("cluster=dgx_h100").cluster
    renamed = dataclasses.replace(h100, device_name="Accelerator 9000")
    assert generation(renamed) == "hopper" and efficiency_for(renamed) is FITTED["hopper"]
    unstated = dataclasses.replace(h100, generation=None)  # the name still says H100: nothing guesses from it
    assert generation(unstated) == UNKNOWN and efficiency_for(unstated) is FITTED[TABLE.fallback]
    ampere = dataclasses.replace(h100, generation="ampere")
    assert efficiency_for(ampere) is FITTED["ampere"]


def test_tp_overlap_follows_the_clusters_capability() -> None:
    job = make_job("cluster=dgx_h100", "model=gpt_tiny", "train.precision=bf16")
    space = build_space(job, 8, CfpSpec())
    assert space.tp_overlap(tp=2, sp=True)
    for value in (False, None):
        cluster = dataclasses.replace(job.cluster, supports_tp_overlap=value)
        other = build_space(dataclasses.replace(job, cluster=cluster), 8, CfpSpec())
        assert not other.tp_overlap(tp=2, sp=True)
    mi300x = make_job("cluster=mi300x", "model=gpt_tiny", "train.precision=bf16")
    assert not build_space(mi300x, 8, CfpSpec()).tp_overlap(tp=2, sp=True)


def test_missing_or_unknown_generation_is_warned_with_the_efficiencies_used() -> None:
    h100 = make_job("cluster=dgx_h100").cluster
    (missing,) = identity_warnings(dataclasses.replace(h100, generation=None))
    assert "states no cluster.generation" in missing and f"{TABLE.fallback}'s efficiencies" in missing
    (unknown,) = identity_warnings(dataclasses.replace(h100, generation="rubin"))
    assert "cluster.generation=rubin" in unknown and f"{TABLE.fallback}'s efficiencies" in unknown
    notes = identity_warnings(dataclasses.replace(h100, supports_tp_overlap=None))
    assert len(notes) == 1 and "cluster.supports_tp_overlap" in notes[0]
    assert identity_warnings(ClusterSpec(name="mine", generation="cpu")) == []  # CPU ranks: no TP overlap to state


def test_the_plan_output_warns_of_an_unknown_generation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["model=llama3_8b", "cluster=dgx_h100", "cluster.generation=rubin", "cluster.supports_tp_overlap=null",
            "--out", str(tmp_path)]
    assert plan_cli.main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (f"warning: cluster dgx_h100 (NVIDIA H100-SXM5-80GB) states cluster.generation=rubin, which has no "
            f"fitted efficiencies: the simulator prices it with {TABLE.fallback}'s efficiencies instead") in out
    assert "does not state cluster.supports_tp_overlap: no plan overlaps its TP communication" in out
    (saved,) = tmp_path.glob("*/plan.json")
    assert not load_plan(saved).parallel.tp_comm_overlap  # on dgx_h100 as shipped the plan overlaps (test_cli)


def test_a_gpu_found_at_start_up_takes_its_presets_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from cfp_megatron.profile.cluster import this_device

    local = make_job().cluster
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(name="NVIDIA H200", total_memory=150_110_011_392))
    h200 = this_device(local)
    assert (h200.generation, h200.supports_tp_overlap) == ("hopper", True) and "H200" in h200.aliases
    assert identity_warnings(h200) == []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(name="NVIDIA GeForce RTX 4090", total_memory=24 * 2**30))
    monkeypatch.setattr("cfp_megatron.profile.cluster.copy_bandwidth_gbps", lambda: 912.5)
    rtx = this_device(local)
    assert rtx.generation is None and rtx.supports_tp_overlap is None  # not "cpu": no preset says what it is
    assert len(identity_warnings(rtx)) == 2


# --------------------------------------------------------------------------------------------------------------------
# The efficiencies are data the fitting bench writes.


def test_the_shipped_efficiencies_are_what_the_writer_writes() -> None:
    assert EFFICIENCIES_FILE.read_text() == efficiencies_text(read_efficiencies())
    data = json.loads(EFFICIENCIES_FILE.read_text())
    assert set(data["fitted"]) == {"ampere", "hopper"} and data["fallback"] == "hopper"
    assert {gen: b["uses"] for gen, b in data["borrowed"].items()} == {
        "blackwell": "hopper", "cdna3": "hopper", "cdna4": "hopper", "cpu": "hopper"}
    for entry in data["fitted"].values():
        assert entry["source"]["written_by"].startswith("python bench/validate.py --fit") and entry["source"]["date"]
    assert FITTED["blackwell"] is FITTED["hopper"]


def test_the_bench_writes_what_the_simulator_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench_validate(monkeypatch)
    ampere = make_job("cluster=dgx_a100").cluster
    blackwell = make_job("cluster=b200").cluster
    plans = [types.SimpleNamespace(job=types.SimpleNamespace(cluster=c)) for c in (ampere, ampere, blackwell)]
    refit = {**FITTED, "ampere": FITTED["ampere"].replace(gemm=0.81234),
             "blackwell": FITTED["hopper"].replace(gemm=0.7)}
    table = bench.fitted_table(refit, plans, data="runs.csv", written_by="python bench/validate.py --fit --write",
                               date="2026-11-28")
    path = bench.write_efficiencies(table, tmp_path / "efficiencies.json")
    loaded = read_efficiencies(path)
    assert loaded == table
    assert loaded.fitted["ampere"].gemm == 0.812 and loaded.sources["ampere"].rows == 2  # three significant digits
    assert loaded.fitted["blackwell"].gemm == 0.7 and "blackwell" not in loaded.borrowed  # fitted now: its own
    assert loaded.fitted["hopper"] == TABLE.fitted["hopper"] and loaded.sources["hopper"] == TABLE.sources["hopper"]
    assert loaded.by_generation()["cdna3"] is loaded.fitted["hopper"]


def test_a_borrowing_generation_without_its_source_is_refused(tmp_path: Path) -> None:
    data = json.loads(EFFICIENCIES_FILE.read_text())
    data["borrowed"]["cdna3"]["uses"] = "volta"
    bad = tmp_path / "efficiencies.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(calibration.EfficiencyFileError, match="volta is borrowed or the fallback but not fitted"):
        read_efficiencies(bad)
