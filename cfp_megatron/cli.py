"""``cfp``: one command for the project's tools, ``cfp <subcommand> [arguments]``.

Each subcommand runs the same ``main`` as its ``python -m cfp_megatron.<tool>`` form, with the same arguments, in the
same process; ``cfp-plan``, ``cfp-analyze``, ``cfp-validate`` and ``cfp-profile`` are the short forms. ``cfp train``
and ``cfp profile --nproc-per-node N`` start torchrun on this node (the command is printed first); a job on several
nodes runs torchrun itself (the plan's ``torchrun.sh``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Sequence

from cfp_megatron import analyze as analyze_cli
from cfp_megatron import validate as validate_cli
from cfp_megatron.base.compose import CONF_DIR
from cfp_megatron.base.config_help import config_help
from cfp_megatron.planner import plan_cli, size_cli
from cfp_megatron.profile import cli as profile_cli

SUBCOMMANDS: dict[str, str] = {
    "plan": "plan a job offline (preflight): the best layouts, plan.json and its exports",
    "size": "size clusters for a token budget: time to train, GPU-hours, energy and price per candidate",
    "analyze": "ParallelBlocks and segment classes of a model (python -m cfp_megatron.analyze)",
    "validate": "predict published training runs (the shipped ones, or CSV files) and report the error",
    "profile": "profile this machine or cluster into its ProfileDB (--nproc-per-node N starts torchrun)",
    "train": "train with torchrun on this node: launch/train.py with the same overrides (--nproc-per-node N)",
}
"""The subcommands and their one-line summaries."""

TRAIN_SCRIPT = CONF_DIR.parent / "launch" / "train.py"
"""The training entry point ``cfp train`` starts under torchrun (next to ``conf/`` in a source checkout)."""

_HELP = ("-h", "--help")


def overview() -> str:
    """``cfp --help``: the subcommands, then the config groups and the common keys."""
    width = max(len(name) for name in SUBCOMMANDS)
    lines = ["usage: cfp <subcommand> [arguments]   (cfp <subcommand> --help for its own options)", "",
             "subcommands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, summary in SUBCOMMANDS.items()]
    lines += ["", "Examples:",
              "  cfp plan model=llama3_8b cluster=dgx_h100 cluster.nodes=4 train.global_batch_size=512",
              "  cfp size model=llama3_70b train.tokens=15T cluster=[dgx_h100,gb200_nvl72] cluster.nodes=[8,16,32]",
              "  cfp analyze model=llama3_8b parallel.tp=8",
              "  cfp train --nproc-per-node 4 +cfp=auto train.steps=8", "", config_help()]
    return "\n".join(lines)


def _torchrun(nproc: int, target: list[str], args: Sequence[str]) -> list[str]:
    """The argv that starts torchrun with this Python on one node."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *target, *args]


def _exec(argv: list[str]) -> int:
    """Say the command, then replace this process with it (signals reach torchrun directly)."""
    shown = ["torchrun", *argv[3:]] if argv[1:3] == ["-m", "torch.distributed.run"] else argv
    print(f"cfp: running {shlex.join(shown)}", file=sys.stderr, flush=True)
    os.execv(argv[0], argv)
    return 0  # not reached


def _launcher_args(name: str, argv: Sequence[str], what: str) -> tuple[argparse.Namespace, list[str]]:
    """``--nproc-per-node N`` and the rest (passed on unchanged)."""
    parser = argparse.ArgumentParser(prog=f"cfp {name}", description=what, add_help=False)
    parser.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=None)
    known, rest = parser.parse_known_args(list(argv))
    if known.nproc is not None and known.nproc < 1:
        parser.error(f"--nproc-per-node={known.nproc}: must be at least 1 (processes on this node), e.g. 4")
    return known, rest


def train(argv: Sequence[str]) -> int:
    """``cfp train [--nproc-per-node N] [overrides]``: ``torchrun --nproc_per_node=N launch/train.py overrides``."""
    if any(a in _HELP for a in argv):
        print("usage: cfp train [--nproc-per-node N] [overrides ...]\n\n"
              f"Runs torchrun --nproc_per_node=N {TRAIN_SCRIPT} with the overrides (N: 1 unless given), on this "
              "node;\nfor several nodes run torchrun yourself (a plan's torchrun.sh has the command).\n\n"
              + config_help())
        return 0
    known, rest = _launcher_args("train", argv, SUBCOMMANDS["train"])
    if not TRAIN_SCRIPT.exists():
        print(f"cfp train: {TRAIN_SCRIPT} does not exist: cfp train needs a source checkout of cfp-megatron "
              "(pip install -e .); run torchrun launch/train.py from the checkout instead.", file=sys.stderr)
        return 2
    return _exec(_torchrun(known.nproc or 1, [str(TRAIN_SCRIPT)], rest))


def profile(argv: Sequence[str] | None = None) -> int:
    """``cfp profile [--nproc-per-node N] [arguments]``: in this process, or under torchrun when N > 1."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in _HELP for a in argv):
        profile_cli.parse_args(["--help"])  # exits after printing
    known, rest = _launcher_args("profile", argv, SUBCOMMANDS["profile"])
    if known.nproc is not None and known.nproc > 1 and "RANK" not in os.environ:
        return _exec(_torchrun(known.nproc, ["-m", "cfp_megatron.profile"], rest))
    return profile_cli.main(rest)


def plan(argv: Sequence[str] | None = None) -> int:
    """``cfp plan``: ``python -m cfp_megatron.plan`` (:mod:`cfp_megatron.planner.plan_cli`)."""
    return plan_cli.main(sys.argv[1:] if argv is None else list(argv))


def size(argv: Sequence[str] | None = None) -> int:
    """``cfp size``: ``python -m cfp_megatron.size`` (:mod:`cfp_megatron.planner.size_cli`)."""
    return size_cli.main(sys.argv[1:] if argv is None else list(argv))


def analyze(argv: Sequence[str] | None = None) -> int:
    """``cfp analyze``: ``python -m cfp_megatron.analyze``."""
    return analyze_cli.main(sys.argv[1:] if argv is None else list(argv))


def validate(argv: Sequence[str] | None = None) -> int:
    """``cfp validate``: ``python -m cfp_megatron.validate``."""
    return validate_cli.main(sys.argv[1:] if argv is None else list(argv))


_RUN: dict[str, Callable[[list[str]], int]] = {"plan": plan, "size": size, "analyze": analyze, "validate": validate,
                                                "profile": profile, "train": train}


def main(argv: Sequence[str] | None = None) -> int:
    """``cfp <subcommand> [arguments]``; exit status 2 for an unknown subcommand."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in _HELP:
        print(overview(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in _RUN:
        print(f"cfp: unknown subcommand {name!r}; choose one of {', '.join(SUBCOMMANDS)} (cfp --help lists them "
              "with the config groups and keys)", file=sys.stderr)
        return 2
    return _RUN[name](rest)
