"""Training on Megatron's indexed dataset through the real entry point (torchrun, gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cfp_megatron.data.preprocess import preprocess
from cfp_megatron.data.tokenizer import ByteTokenizer
from tests.multirank import TMP, MultiRankRuns, case

pytestmark = pytest.mark.slow

TEXT = "\n\n".join(
    f"Document {i}: the quick brown fox jumps over the lazy dog {i} times, then rests by the river bank."
    for i in range(60)
)


def write_corpus(folder: Path) -> None:
    """A small indexed dataset built from text with the project's preprocessing, under ``folder/corpus``."""
    (folder / "corpus").mkdir(parents=True, exist_ok=True)
    source = folder / "corpus" / "docs.txt"
    source.write_text(TEXT)
    preprocess(str(source), str(folder / "corpus" / "docs"), tokenizer=ByteTokenizer())


DATA = ["data=indexed", f"data.path=[{TMP}/corpus/docs]", f"data.cache_dir={TMP}/corpus/cache", "train.steps=3",
        "train.warmup_steps=0", "train.seq_length=32", "train.precision=fp32"]
SINGLE = case(1, *DATA, prepare=write_corpus)
DOUBLE = case(2, *DATA, "parallel.tp=2", prepare=write_corpus)
"""The runs on a dataset built at test time (the multirank fixture's jobs, tests/multirank.py)."""


@pytest.mark.multirank(SINGLE, DOUBLE)
def test_indexed_data_trains_alike_on_one_and_two_ranks(multirank: MultiRankRuns) -> None:
    single, double = multirank[SINGLE], multirank[DOUBLE]
    assert single.returncode == 0, single.output[-4000:]
    assert double.returncode == 0, double.output[-4000:]
    assert sorted(single.losses) == [1, 2, 3]
    for step, loss in single.losses.items():
        assert double.losses[step] == pytest.approx(loss, abs=1e-4)


def test_missing_indexed_data_is_reported_before_any_process_group(tmp_path: Path) -> None:
    """The launch's checks of a 2-rank job (in-process: what the launch runs before any process group; how torchrun
    then reports a ConfigError once and exits is tests/test_rank_errors.py's)."""
    from cfp_megatron.base.compose import compose_job
    from cfp_megatron.base.errors import ConfigError
    from cfp_megatron.planner.job_checks import validate_job

    job = compose_job(["data=indexed", f"data.path=[{tmp_path / 'nope'}]", "parallel.tp=3"])
    with pytest.raises(ConfigError) as err:
        validate_job(job, 2)
    # One error names both the layout problem and the data problem, each with its fix.
    assert "parallel.tp=3" in str(err.value)
    assert "data.path" in err.value.keys and "cfp_megatron.data.preprocess" in str(err.value)
