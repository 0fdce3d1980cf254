"""Session fixtures shared by the test files: the multi-rank training jobs (tests/multirank.py)."""

from __future__ import annotations

import pytest

from tests.multirank import MultiRankRuns, run_cases


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multirank(*cases): training runs (tests.multirank.Case) the test reads from "
                                       "the session's one torchrun job per world size (the multirank fixture)")


@pytest.fixture(scope="session")
def multirank(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> MultiRankRuns:
    """Every case the selected tests name (``@pytest.mark.multirank``), trained once per session: one torchrun job
    per world size (:func:`tests.multirank.run_cases`)."""
    cases = [c for item in request.session.items for mark in item.iter_markers("multirank") for c in mark.args]
    return run_cases(cases, tmp_path_factory.mktemp("multirank"))
