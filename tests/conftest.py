"""Fixtures shared by the test files: the multi-rank training jobs (tests/multirank.py), and the search's unchecked
layouts checked."""

from __future__ import annotations

import os
import sys

# One OpenMP thread in the test process and every process it starts (the gloo spawns, the subprocesses), as the
# torchrun jobs have already: the tests' models are tiny, and a second thread per process only spins against the
# others on a 2-core machine (docs/testing.md, "Keeping the suite fast"). Set before torch is first imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported by a plugin before this file: its pool is sized already
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import pytest  # noqa: E402

from cfp_megatron.compat.import_cost import import_megatron  # noqa: E402

# Megatron-Core, which most test files import, imported once with its import costs cut (and its heap frozen out of
# the collector's sight for the whole session: compat/import_cost.py).
import_megatron()

from cfp_megatron.base.config import JobSpec  # noqa: E402
from cfp_megatron.base.errors import ConfigError  # noqa: E402
from cfp_megatron.profile.load import LOAD_ENV  # noqa: E402
from cfp_megatron.search.space import Candidate  # noqa: E402
from tests.multirank import MultiRankRuns, run_cases  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    # The machine's load never decides a test's outcome: profiling's load readings say "quiet" in every process the
    # tests start (tests/test_profile_load.py reads the load for real, and simulates a busy machine).
    os.environ.setdefault(LOAD_ENV, "quiet")
    config.addinivalue_line("markers", "multirank(*cases): training runs (tests.multirank.Case) the test reads from "
                                       "the session's one torchrun job per world size (the multirank fixture)")


@pytest.fixture(scope="session")
def multirank(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> MultiRankRuns:
    """Every case the selected tests name (``@pytest.mark.multirank``), trained once per session: one torchrun job
    per world size (:func:`tests.multirank.run_cases`)."""
    cases = [c for item in request.session.items for mark in item.iter_markers("multirank") for c in mark.args]
    return run_cases(cases, tmp_path_factory.mktemp("multirank"))


@pytest.fixture
def screened_jobs_checked(monkeypatch: pytest.MonkeyPatch) -> list[Candidate]:
    """While the test runs, every job the search builds without ParallelSpec's checks (``Candidate.screened_job``)
    is checked: the checked constructor must accept it (a ``ConfigError`` fails the test, where the search would
    read it as a refused candidate) and build an equal job. Yields the candidates built so."""
    screened = Candidate.screened_job
    built: list[Candidate] = []

    def checked(cand: Candidate, base: JobSpec) -> JobSpec:
        fast = screened(cand, base)
        try:
            slow = cand.job(base)
        except ConfigError as err:
            pytest.fail(f"the search built {cand.describe(1)}, which fails the checks: {err}")
        assert fast == slow and fast.parallel.__dict__ == slow.parallel.__dict__
        built.append(cand)
        return fast

    monkeypatch.setattr(Candidate, "screened_job", checked)
    return built
