"""Bad inputs end in a clear error: a quick in-process subset of ``bench/bad_inputs.py`` in the default run, the whole
catalogue as a drill (``pytest -m drill``).

Each case composes the real Hydra configs and calls the function the command line calls; it passes when the error is
a typed ``CfpError`` that names the key or file, without a traceback, and fails on a traceback, a hang or a silent
success.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from cfp_megatron.base.compose import compose_config, compose_job
from cfp_megatron.base.config import MAX_GLOBAL_BATCH, MAX_LAYERS, MAX_WORLD_SIZE
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.parallel_dims import ParallelDims

_SPEC = importlib.util.spec_from_file_location("bad_inputs", Path(__file__).resolve().parent.parent / "bench"
                                               / "bad_inputs.py")
assert _SPEC is not None and _SPEC.loader is not None
bad_inputs = importlib.util.module_from_spec(_SPEC)
sys.modules["bad_inputs"] = bad_inputs
_SPEC.loader.exec_module(bad_inputs)

QUICK = ("gbs-huge", "layers-huge", "nodes-huge", "world-huge", "microbatches-huge", "memory-step-late", "lr-nan",
         "seed-neg", "tp-huge", "model-bogus", "cfp-tp-text", "unknown-key", "unknown-group", "enum-recompute",
         "parse-bracket", "interp-missing", "div-heads", "div-layers", "data-truncated-bin", "data-empty-bin",
         "data-corrupt-idx", "analyze-mbs-0", "analyze-json-dir", "plan-world-huge")
"""Cases of the catalogue run in the default suite (each well under a second, none needs a subprocess)."""

_CASES = {case.id: case for case in bad_inputs.cases()}


@pytest.mark.parametrize("case_id", QUICK)
def test_bad_input_is_a_clear_error(case_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path / "cache"))
    case = _CASES[case_id]
    result = case.run(tmp_path)
    assert bad_inputs.classify(case, result) == "clear", result.output[-3000:]


def test_classify_tells_the_outcomes_apart() -> None:
    case = _CASES["gbs-huge"]
    R = bad_inputs.Result
    assert bad_inputs.classify(case, R(exit_code=None, output="")) == "hang"
    assert bad_inputs.classify(case, R(exit_code=0, output="trained 20 steps")) == "silent"
    assert bad_inputs.classify(case, R(exit_code=1, output="Traceback (most recent call last):\n  x\nE: y")) \
        == "traceback"
    assert bad_inputs.classify(case, R(exit_code=2, output="something went wrong")) == "vague"
    assert bad_inputs.classify(case, R(exit_code=2, output="train.global_batch_size=9: too big")) == "clear"


def test_the_catalogue_holds_at_least_130_cases_with_a_subprocess_per_command() -> None:
    cases = bad_inputs.cases()
    assert len(cases) >= 130
    assert len({case.id for case in cases}) == len(cases)
    launched = {case.command for case in cases if case.mode != "in-process"}
    assert {"plan", "analyze", "validate", "profile", "train"} <= launched


def test_bounds_admit_the_largest_real_jobs() -> None:
    """Llama 3 405B on 16,384 H100s with its 2,048 x 8,192-token batch, and a 100k-GPU cluster, stay valid."""
    job = compose_job(["model=llama3_405b", "cluster=dgx_h100", "cluster.nodes=2048", "train.global_batch_size=2048",
                       "train.micro_batch_size=1", "train.seq_length=8192", "parallel.tp=8", "parallel.pp=16",
                       "parallel.sp=true", "parallel.account_for_embedding_in_pipeline_split=true",
                       "parallel.account_for_loss_in_pipeline_split=true"])
    dims = ParallelDims.build(job, 16384, te_available=True)
    assert dims.dp == 128 and dims.num_microbatches == 16
    compose_job(["cluster=dgx_h100", "cluster.nodes=12500"])  # 100,000 GPUs


@pytest.mark.parametrize(("overrides", "key"), [
    ([f"train.global_batch_size={MAX_GLOBAL_BATCH + 1}"], "train.global_batch_size"),
    ([f"model.num_layers={MAX_LAYERS + 1}"], "model.num_layers"),
    (["cluster=dgx_h100", f"cluster.nodes={MAX_WORLD_SIZE // 8 + 1}"], "cluster.nodes"),
])
def test_one_past_each_bound_is_refused(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose_job(overrides)
    assert err.value.keys == [key]


def test_hydra_errors_name_the_key_value_and_options() -> None:
    with pytest.raises(ConfigError) as err:
        compose_config(["model=bogus"])
    issue = err.value.issues[0]
    assert (issue.key, issue.value) == ("model", "bogus") and "llama3_8b" in issue.fix
    with pytest.raises(ConfigError) as err:
        compose_config(["+cfp=auto", "cfp.tp=abc"])
    assert (err.value.issues[0].key, err.value.issues[0].value) == ("cfp.tp", "abc")


@pytest.mark.drill
def test_the_whole_catalogue(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every case of the bench (torchrun runs included); fails while any case is not a clear error, naming them."""
    verdicts = bad_inputs.run_cases(bad_inputs.cases(), tmp_path, echo=False)
    bad = [f"{v.case.id}: {v.outcome}: {v.message}" for v in verdicts if v.outcome not in ("clear", bad_inputs.SKIPPED)]
    assert not bad, "\n".join(bad)
