"""A layer kind the project has never seen plans and trains: ``model.spec=tests.custom_layers:custom_layer_spec``
(gpt_tiny with every MLP a gated MLP with a third projection, no biases; nothing in model/options.py names it) gets
its options derived from its ParallelBlocks, is planned for 2 ranks with TP pinned to 2 (``python -m
cfp_megatron.plan``: the search ``+cfp=auto`` runs, on the presets' figures instead of a profile), and trains under
that plan (``+cfp=manual cfp.plan_file=...``) on 2 gloo ranks like its single-rank reference. Tolerances as
tests/test_train_parallel.py's (fp32, 4 steps)."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest

from tests.multirank import TMP, MultiRankRuns, case
from tests.test_train_parallel import GRAD_RTOL, LOSS_ATOL, STEPS, reference_case

pytestmark = pytest.mark.slow

SPEC = "model.spec=tests.custom_layers:custom_layer_spec"
PLAN = "custom_layer/plan.json"
"""Where the prepared plan lies under the session's folder."""
PLANNED_WITH = ["model=gpt_tiny", SPEC, "train.global_batch_size=8", "train.seq_length=64", "train.precision=fp32"]


def _plan(folder: Path) -> None:
    """The multirank job's preparation: plan the custom model for 2 ranks with TP pinned to 2 (in-process, as
    ``python -m cfp_megatron.plan`` does). A failure is written beside the plan for the test to report, never raised
    into the session's other jobs."""
    from cfp_megatron.planner.plan_cli import main

    out = folder / Path(PLAN).parent
    out.mkdir(parents=True, exist_ok=True)
    try:
        code = main([*PLANNED_WITH, "cfp.tp=2", f"cfp.plan_file={folder / PLAN}", "--world", "2",
                     "--out", str(out / "plans")])
        if code:
            (out / "error.txt").write_text(f"python -m cfp_megatron.plan exited {code}")
    except BaseException:  # noqa: BLE001 - reported by the test that reads it
        (out / "error.txt").write_text(traceback.format_exc())


PLANNED = case(2, "+cfp=manual", f"cfp.plan_file={TMP}/{PLAN}", "model=gpt_tiny", SPEC, f"train.steps={STEPS}",
               "train.warmup_steps=0", prepare=_plan)
"""The plan trained on 2 gloo ranks (the plan sets the layout, batch, sequence and precision)."""
REFERENCE = reference_case("gpt_tiny", SPEC)
"""The custom model on one rank."""
STANDARD = reference_case("gpt_tiny")
"""gpt_tiny with Megatron-Core's own layers (tests/test_train_parallel.py's reference), for the parameter count."""


@pytest.mark.multirank(STANDARD, REFERENCE, PLANNED)  # the custom reference after another case: under its group
def test_a_custom_layer_kind_is_planned_and_trains_like_the_single_rank_reference(multirank: MultiRankRuns) -> None:
    from cfp_megatron.base.compose import compose_job
    from cfp_megatron.model import derive
    from cfp_megatron.model.options import model_options
    from cfp_megatron.plan import load_plan

    error = multirank.path(str(Path(PLAN).parent / "error.txt"))
    assert not error.exists(), error.read_text()
    plan = load_plan(multirank.path(PLAN))
    assert plan.parallel.tp == 2 and dict(plan.job_inputs)["model.spec"] == SPEC.partition("=")[2]

    # the options the search read: derived from the custom layer's blocks (its third projection column-parallel)
    job = compose_job(PLANNED_WITH, typed=True, runs_hydra=False)
    mlp = next(o for o in derive.derived_options(job) if (o.part, o.name) == ("mlp", "megatron-1d"))
    assert "linear_fc3 S(0)" in mlp.block and "linear_fc2 S(1)" in mlp.block
    assert not any("linear_fc3" in o.modules for o in model_options(job.model))  # the catalogue has no entry

    reference, standard, run = multirank[REFERENCE], multirank[STANDARD], multirank[PLANNED]
    for result in (reference, standard, run):
        assert result.returncode == 0, result.output[-4000:]
    start = [r for r in run.records if r.get("event") == "start"][0]
    assert "tp=2" in start["layout"], start
    # the custom layer is what trained: each layer's MLP holds the third projection and no biases
    m = job.model
    params = {name: [r for r in res.records if r.get("event") == "start"][0]["params_on_rank0"]
              for name, res in (("custom", reference), ("standard", standard))}
    assert params["custom"] - params["standard"] == m.num_layers * (m.hidden_size * m.ffn_size - m.ffn_size
                                                                     - m.hidden_size)
    assert sorted(run.losses) == sorted(reference.losses) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert abs(run.losses[step] - reference.losses[step]) <= LOSS_ATOL, (step, run.losses, reference.losses)
        assert run.grad_norms[step] == pytest.approx(reference.grad_norms[step], rel=GRAD_RTOL), step
    assert run.losses[STEPS] < run.losses[1]
