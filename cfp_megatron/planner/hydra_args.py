"""``launch/train.py``'s command line, checked before Hydra runs.

Hydra prints its own composition errors (an unknown key, a group without an option, an override it cannot parse) on
every rank, some as a traceback, and exits 1; a few (``~model``) it accepts and trains the schema's built-in values.
So every rank first reads the command line with Hydra's own argument parser and composes the overrides the way Hydra
will (:func:`~cfp_megatron.base.compose.compose_config`, a person's command line: a key given twice is said by rank 0;
under ``-m`` each job of the sweep); a problem is said once per node (:func:`~cfp_megatron.planner.rank_errors.
report_error`) and the job exits with status 2 before Hydra, a process group or a file exists. Hydra's flags keep
working: ``--help``, ``--hydra-help`` and ``--shell-completion`` go straight to Hydra, ``--cfg`` and ``--info``
after the check, printed by rank 0 only. Another config (``--config-name``, ``--config-path``, ``--config-dir``) is
Hydra's to compose, once its flags are checked here: a folder that does not exist and a config file that is not in
the search path are one error naming the flag (Hydra prints a paragraph on every rank); ``--experimental-rerun`` is
Hydra's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cfp_megatron.base.compose import CONF_DIR, compose_config, nearest, override_issues, say_repeats
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.planner.rank_errors import end_rank, report_error


@dataclass(frozen=True, kw_only=True)
class HydraArgs:
    """A ``launch/train.py`` command line as Hydra reads it."""

    overrides: tuple[str, ...]
    """The ``key=value`` overrides, in order."""
    multirun: bool
    """``-m``/``--multirun``: one job per combination of the sweeps' values."""
    help_only: bool
    """``--help``, ``--hydra-help`` or ``--shell-completion``: Hydra prints and exits, composing nothing we check."""
    prints_only: bool
    """Hydra prints something and exits without running the job (the help flags, ``--cfg``, ``--info``)."""
    own_config: bool
    """Another config than ``conf/config.yaml`` (``--config-name``, ``--config-path``, ``--config-dir``,
    ``--experimental-rerun``): Hydra composes it (:func:`config_flag_issues` checks the flags)."""
    config_name: str | None = None
    """``--config-name``/``-cn``: the primary config's name (a YAML file of the search path, without ``.yaml``)."""
    config_path: str | None = None
    """``--config-path``/``-cp``: the primary config's folder (absolute, or relative to the script's folder)."""
    config_dir: str | None = None
    """``--config-dir``/``-cd``: a folder added to the search path (relative to the current folder)."""
    rerun: bool = False
    """``--experimental-rerun``: Hydra runs a pickled config again."""


def read_hydra_args(argv: Sequence[str]) -> HydraArgs:
    """``argv`` (without the program) read by Hydra's own parser; a flag it does not know, or a flag's bad value, is
    a :class:`ConfigError` naming it."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def refuse(message: str) -> None:
        raise ConfigError(ConfigIssue(key="<command line>", value=" ".join(argv), problem=f"{message}.",
                                      fix="see launch/train.py --help: settings are key=value (e.g. train.steps=5); "
                                          "Hydra's flags are --help, --cfg job, --info, -m."))

    parser.error = refuse  # type: ignore[method-assign]  # argparse would print its usage and exit, on every rank
    args, unknown = parser.parse_known_args(list(argv))
    if unknown:
        refuse(f"{' '.join(unknown)}: not a flag of launch/train.py")
    help_only = bool(args.help or args.hydra_help or args.shell_completion)
    return HydraArgs(overrides=tuple(args.overrides), multirun=bool(args.multirun), help_only=help_only,
                     prints_only=help_only or bool(args.cfg or args.info),
                     own_config=any(v is not None for v in (args.config_name, args.config_path, args.config_dir,
                                                           args.experimental_rerun)),
                     config_name=args.config_name, config_path=args.config_path, config_dir=args.config_dir,
                     rerun=args.experimental_rerun is not None)


SCRIPT_DIR = CONF_DIR.parent / "launch"
"""The folder of ``launch/train.py``, against which Hydra reads a relative ``--config-path``."""


def config_flag_issues(args: HydraArgs, script_dir: Path = SCRIPT_DIR) -> list[ConfigIssue]:
    """What is wrong with ``--config-path``, ``--config-dir`` and ``--config-name`` in ``args``, as Hydra would read
    them (``script_dir``: the folder a relative ``--config-path`` is read against): a folder that is not one, a
    primary config that none of the searched folders holds (the nearest named). A ``pkg://`` path and a command
    that adds ``hydra.searchpath`` are left to Hydra."""
    issues: list[ConfigIssue] = []
    fix = "see launch/train.py --help; leave the flag out for conf/config.yaml."
    primary: Path | None = CONF_DIR
    if args.config_path is not None:
        if args.config_path.startswith("pkg://"):
            primary = None
        else:
            primary = Path(args.config_path) if os.path.isabs(args.config_path) else script_dir / args.config_path
            if not primary.is_dir():
                issues.append(ConfigIssue(key="--config-path", value=args.config_path, problem=f"{primary} is not a "
                                          f"folder (a relative --config-path is read from {script_dir}, the script's "
                                          "folder).", fix=f"give the folder that holds the config; {fix}"))
                primary = None
    folders = [primary] if primary is not None else []
    if args.config_dir is not None:
        extra = Path(os.path.abspath(args.config_dir))
        if extra.is_dir():
            folders.insert(0, extra)
        else:
            issues.append(ConfigIssue(key="--config-dir", value=args.config_dir, problem=f"{extra} is not a folder.",
                                      fix=f"give a folder of configs; {fix}"))
    searched = any(o.lstrip("+").startswith("hydra.searchpath") for o in args.overrides)
    name = args.config_name
    if name is not None and not issues and primary is not None and not searched:
        stem = name.removesuffix(".yaml")
        if not any((folder / f"{stem}.yaml").is_file() for folder in folders):
            known = sorted({p.stem for folder in folders for p in folder.glob("*.yaml")})
            near = nearest(stem, known)
            issues.append(ConfigIssue(key="--config-name", value=name, problem="is not a config in "
                                      f"{' or '.join(str(f) for f in folders)}"
                                      + (f"; did you mean {near}?" if near else "."),
                                      fix=f"write --config-name {near}." if near else f"use one of {known}; {fix}"))
    return issues


def _project_config(args: HydraArgs) -> bool:
    """Whether the flags of ``args`` name ``conf/config.yaml`` itself (``--config-name config``)."""
    name = (args.config_name or "config").removesuffix(".yaml")
    return name == "config" and args.config_path is None and args.config_dir is None and not args.rerun


def sweep_jobs(overrides: Sequence[str]) -> list[list[str]]:
    """The overrides of each job ``-m`` runs (one per combination of the sweeps' values), as Hydra's basic sweeper
    splits them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def check_hydra_args(args: HydraArgs, world_size: int = 1) -> None:
    """Raise one :class:`ConfigError` for what Hydra would refuse, or accept silently, in ``args`` (module
    docstring). Under ``-m`` on more than one rank a sweep of several jobs is refused: Hydra runs them one after
    another in each rank's process, and the second job's process group cannot connect again (gloo's connection
    refused, a traceback on every rank)."""
    if args.help_only:
        return
    if args.own_config:
        issues = config_flag_issues(args)
        if issues:
            raise ConfigError(issues)
        if not _project_config(args):
            return
    chdir_issue(args.overrides)
    if not args.multirun:
        compose_config(args.overrides, typed=True)
        return
    issues = override_issues(args.overrides, sweeps=True)
    if issues:
        raise ConfigError(issues)
    say_repeats(args.overrides)
    jobs = sweep_jobs(args.overrides)
    if world_size > 1 and len(jobs) > 1:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parser = OverridesParser.create()
        swept = " ".join(o for o in args.overrides if parser.parse_override(o).is_sweep_override())
        raise ConfigError(ConfigIssue(key="-m", value=swept, problem=f"runs "
                                      f"{len(jobs)} jobs one after another in each of the {world_size} ranks' "
                                      "processes, and a second job cannot set up its process group again.",
                                      fix="start one torchrun per job (e.g. a shell loop over the values), or run "
                                          "the sweep on one rank (--nproc_per_node=1)."))
    for job in jobs:
        try:
            compose_config(job)
        except ConfigError as err:
            raise ConfigError([ConfigIssue(key=i.key, value=i.value, problem=f"{i.problem} (in the sweep's job "
                                           f"{' '.join(job)})", fix=i.fix) for i in err.issues]) from None


CHDIR_KEY = "hydra.job.chdir"
"""Hydra's setting that moves the job into its run folder (conf/config.yaml: false)."""


def chdir_issue(overrides: Sequence[str]) -> None:
    """Refuse ``hydra.job.chdir=true``: every relative path of the job (``train.checkpoint_dir=ck``, ``data.path``,
    ``cfp.plan_file``) would then be read from a new run folder each run, so a resume would not find its checkpoints
    and nothing would say so."""
    given, value = override_value(overrides, CHDIR_KEY)
    if given and value not in (False, None):
        raise ConfigError(ConfigIssue(key=CHDIR_KEY, value=value, problem="would move the job into its run folder, "
                                      "a new one each run: relative paths (train.checkpoint_dir=ck, data.path, "
                                      "cfp.plan_file) would silently mean folders in it, and a resume would not "
                                      "find the checkpoints an earlier run saved.", fix="leave it out (false): "
                                      "relative paths are read from the folder torchrun starts in, and the run's "
                                      "own files go to hydra.run.dir anyway."))


def override_value(overrides: Sequence[str], key: str) -> tuple[bool, object]:
    """Whether ``overrides`` set ``key``, and the value the last one gave it (Hydra's parse: quotes removed)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    found: tuple[bool, object] = (False, None)
    for text in overrides:
        if text.lstrip("+~").partition("=")[0] == key:
            override = parser.parse_override(text)
            found = (True, None if override.is_delete() else override.value())
    return found


def check_command_line(argv: Sequence[str]) -> HydraArgs:
    """Check ``argv`` as :func:`check_hydra_args` does; on a problem say it once per node and exit with status 2.
    A rank other than 0 exits (status 0) where Hydra would only print (``--cfg``...), so it is printed once."""
    env = LaunchEnv.read()
    try:
        args = read_hydra_args(argv)
        check_hydra_args(args, env.world_size)
    except ConfigError as err:
        report_error(err, env)
        end_rank(2)
    if args.prints_only and env.rank != 0:
        sys.exit(0)
    return args


__all__ = ["CHDIR_KEY", "SCRIPT_DIR", "HydraArgs", "check_command_line", "check_hydra_args", "chdir_issue",
           "config_flag_issues", "override_value", "read_hydra_args", "sweep_jobs"]
