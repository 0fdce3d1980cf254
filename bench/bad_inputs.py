"""The bad-input and fault catalogue: does every bad input end in a clear error?

    python bench/bad_inputs.py                          # every case (about 5 minutes on 2 cores)
    python bench/bad_inputs.py --only config,plan       # some commands
    python bench/bad_inputs.py --no-torchrun            # skip the launch/train.py runs under torchrun
    python bench/bad_inputs.py --markdown docs/faults.md   # also write the catalogue section of that page

Each case gives one command one bad input or fault and classifies what the user gets:

* ``clear``: an error exit (status != 0, or a typed ``CfpError`` in-process), no ``Traceback`` in the output, and
  the message names the key or file the case is about (for the few cases where a report is the right answer, such
  as a bad row among good ones for ``validate``: exit 0 with the problem named);
* ``vague``: an error exit without a traceback that does not name the key or file;
* ``traceback``: a Python traceback reaches the user (in-process: any exception other than ``CfpError``);
* ``hang``: the command did not finish within the case's timeout;
* ``silent``: exit 0 (or no error in-process) without the problem named: a result computed from a bad input;
* ``skipped``: the case cannot run on this machine (the full and read-only disk cases mount a tmpfs, which needs
  root with CAP_SYS_ADMIN): listed and counted apart, neither clear nor a failure.

Most cases run in-process and call the function the command line calls (``compose_config`` + ``job_from_config`` +
``validate_job`` as ``launch/train.py`` does before any process group, ``plan_cli.main``, ``analyze.main``,
``validate.main``, ``read_db``, ``load_plan``, ``check_before_start``); at least one case per command runs it as
the user does (``python -m ...`` in a subprocess, ``torchrun launch/train.py`` with 1-2 ranks) to show that no
traceback reaches the terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTCOMES = ("clear", "vague", "traceback", "hang", "silent")
SKIPPED = "skipped"
"""The outcome of a case that cannot run on this machine (:class:`CaseSkipped`: a disk case where mounting a tmpfs
is not allowed): listed and counted apart, never as ``clear``, and not a failure of the run."""
CATALOGUE_START = "<!-- bad-inputs catalogue: start (written by bench/bad_inputs.py --markdown) -->"
CATALOGUE_END = "<!-- bad-inputs catalogue: end -->"


@dataclass(frozen=True, kw_only=True)
class Result:
    """What one run of a case gave."""

    exit_code: int | None
    """Exit status (in-process: 0 no error, 2 a ``CfpError``, 1 another exception); ``None``: it timed out."""
    output: str
    """stdout and stderr together (in-process: the error message, or the traceback)."""
    seconds: float = 0.0
    """Wall time."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """One bad input or fault given to one command."""

    id: str
    """Short unique name."""
    command: str
    """The command or area: config, plan, size, analyze, validate, profile, data, profiledb, planfile, checkpoint,
    cache, train."""
    what: str
    """The bad input, as the user would type or meet it."""
    names: tuple[str, ...]
    """Strings of which the message must contain one (the key, the file); compared without case."""
    run: Callable[[Path], Result] = field(repr=False)
    """Runs the case in a scratch folder."""
    mode: str = "in-process"
    """in-process, subprocess or torchrun."""
    report_ok: bool = False
    """Exit 0 with the problem named is the right answer (a report, not a refusal)."""
    once: str | None = None
    """A line that must appear exactly once (an error printed by one rank, not by each)."""


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """A case, what it gave and its class."""

    case: Case
    """The case."""
    result: Result
    """What it gave."""
    outcome: str
    """One of :data:`OUTCOMES`."""

    @property
    def message(self) -> str:
        """The line a user reads first: the first line naming the problem (for a traceback, its last line)."""
        output = self.result.output
        if self.case.mode == "torchrun":
            output = without_launcher_traceback(output)
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        if self.outcome == "traceback":
            return lines[-1] if lines else ""
        if self.outcome == "hang":
            return f"no answer within {self.result.seconds:.0f} s"
        for test in (lambda line: line.startswith("- ") or "Fix:" in line,
                     lambda line: line.startswith("cfp-megatron") and len(line.split(": ", 1)[-1].split()) > 3,
                     lambda line: "error" in line.lower() or "could not" in line.lower()):
            for line in lines:
                if test(line):
                    return line.removeprefix("- ")
        return lines[0] if lines else ""


LAUNCHER_ERROR = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
"""The exception torchrun's own agent raises, with its traceback, whenever a worker exits non-zero: torch's code,
printed after the workers' output, so it is not counted against the project."""
LAUNCHER_SIGNAL = "torch.distributed.elastic.multiprocessing.api.SignalException"
"""The exception torchrun's agent raises, with its traceback, when it is sent SIGINT or SIGTERM (Ctrl-C): torch's
code too."""


def without_launcher_traceback(output: str) -> str:
    """``output`` without the traceback of torchrun's agent (ending in :data:`LAUNCHER_ERROR`)."""
    lines = output.splitlines()
    kept: list[str] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("Traceback (most recent call last)"):
            end = i + 1
            while end < len(lines) and (lines[end].startswith(" ") or not lines[end].strip()):
                end += 1
            if end < len(lines) and lines[end].startswith((LAUNCHER_ERROR, LAUNCHER_SIGNAL)):
                i = end + 1
                continue
        kept.append(lines[i])
        i += 1
    return "\n".join(kept)


def classify(case: Case, result: Result) -> str:
    """The outcome class of ``result`` (see the module docstring)."""
    if result.exit_code is None:
        return "hang"
    output = without_launcher_traceback(result.output) if case.mode == "torchrun" else result.output
    if "Traceback (most recent call last)" in output:
        return "traceback"
    named = any(name.lower() in output.lower() for name in case.names)
    if case.once is not None and sum(line.strip() == case.once for line in output.splitlines()) != 1:
        named = False
    if result.exit_code == 0:
        return "clear" if case.report_ok and named else "silent"
    return "clear" if named else "vague"


# ------------------------------------------------------------------------------------------------------- runners
class _Timeout(Exception):
    """Raised by the alarm of an in-process case."""


def in_process(fn: Callable[[], object], timeout_s: float = 60.0) -> Result:
    """Run ``fn`` here with stdout/stderr captured and an alarm: ``CfpError`` -> exit 2 with its message, any other
    exception -> exit 1 with its traceback, an ``int`` return -> that status, ``SystemExit`` -> its code."""
    from cfp_megatron.base.errors import CfpError

    def alarm(signum: int, frame: object) -> None:
        raise _Timeout

    buffer = io.StringIO()
    start = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    code: int | None
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            value = fn()
        code = value if isinstance(value, int) and not isinstance(value, bool) else 0
    except _Timeout:
        code = None
    except CfpError as err:
        buffer.write(f"cfp-megatron: {type(err).__name__}\n{err}\n")
        code = 2
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
        if not isinstance(err.code, int | None):
            buffer.write(f"{err.code}\n")
    except Exception:  # noqa: BLE001 - what a user would see as a traceback
        buffer.write(traceback.format_exc())
        code = 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return Result(exit_code=code, output=buffer.getvalue(), seconds=time.perf_counter() - start)


def _env(work: Path) -> dict[str, str]:
    from cfp_megatron.base.files import CACHE_ENV

    env = dict(os.environ)
    env[CACHE_ENV] = str(work / "cache")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.pop("HYDRA_FULL_ERROR", None)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_process(argv: Sequence[str], work: Path, timeout_s: float) -> Result:
    """Run ``argv`` from the repository root (cache in ``work``); a timeout kills its process group."""
    start = time.perf_counter()
    proc = subprocess.Popen(list(argv), cwd=ROOT, env=_env(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = None
    return Result(exit_code=code, output=out or "", seconds=time.perf_counter() - start)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun(ranks: int, overrides: Sequence[str], work: Path, timeout_s: float = 240.0) -> Result:
    """``torchrun --nproc_per_node=ranks launch/train.py overrides`` with the run directory in ``work``."""
    run_dir = work / f"run-{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={_free_port()}",
            "launch/train.py", *overrides, f"hydra.run.dir={run_dir}", "train.steps=2"]
    return run_process(argv, work, timeout_s)


# ------------------------------------------------------------------------------------------------ functions called
def check_train_config(overrides: Sequence[str], world: int = 1) -> None:
    """What ``launch/train.py`` checks on every rank before any process group exists (``train_from_config``): the
    composed config, the planner's and the backend's groups, and the job on ``world`` ranks."""
    from cfp_megatron.base.backend_spec import backend_from_config
    from cfp_megatron.base.cfp_spec import CfpMode, cfp_from_config
    from cfp_megatron.base.compose import compose_config
    from cfp_megatron.base.config import job_from_config
    from cfp_megatron.planner.job_checks import validate_job, validate_rest

    cfg = compose_config(list(overrides))
    backend_from_config(cfg)
    job = job_from_config(cfg)
    cfp = cfp_from_config(cfg)
    if cfp.mode is CfpMode.auto:
        validate_rest(job)
    else:
        validate_job(job, world)


def plan_main(args: Sequence[str], work: Path) -> int:
    """``python -m cfp_megatron.plan`` in-process, writing under ``work``."""
    from cfp_megatron.planner.plan_cli import main

    return main([*args, "--out", str(work / "plans")] if "--out" not in args else list(args))


def size_main(args: Sequence[str], work: Path) -> int:
    """``cfp size`` in-process, writing under ``work``."""
    from cfp_megatron.planner.size_cli import main

    return main([*args, "--out", str(work / "sizing")] if "--out" not in args else list(args))


def config_case(cid: str, overrides: Sequence[str], names: Sequence[str], *, world: int = 1) -> Case:
    """A training config checked in-process as ``launch/train.py`` checks it."""
    return Case(id=cid, command="config", what=" ".join(overrides) + (f" (world {world})" if world != 1 else ""),
                names=tuple(names), run=lambda work: in_process(lambda: check_train_config(overrides,
                                                                                                     world)))


# --------------------------------------------------------------------------------------------------- fixtures
def build_corpus(work: Path) -> str:
    """A small indexed dataset (byte tokenizer) under ``work``; returns its prefix."""
    from cfp_megatron.data.preprocess import preprocess
    from cfp_megatron.data.tokenizer import ByteTokenizer

    prefix = work / "data" / "corpus"
    if not Path(f"{prefix}.bin").exists():
        prefix.parent.mkdir(parents=True, exist_ok=True)
        text = work / "data" / "corpus.txt"
        text.write_text("\n\n".join(f"document {i}: " + "the quick brown fox jumps. " * 8 for i in range(60)))
        preprocess(str(text), str(prefix), tokenizer=ByteTokenizer())
    return str(prefix)


def damaged_corpus(work: Path, name: str, damage: Callable[[Path, Path], None]) -> str:
    """A copy of :func:`build_corpus`'s dataset under the prefix ``name``, damaged by ``damage(bin, idx)``."""
    src = build_corpus(work)
    prefix = work / "data" / name
    for ext in (".bin", ".idx"):
        shutil.copy(src + ext, f"{prefix}{ext}")
    damage(Path(f"{prefix}.bin"), Path(f"{prefix}.idx"))
    return str(prefix)


def data_case(cid: str, what: str, names: Sequence[str], overrides: Callable[[Path], list[str]]) -> Case:
    """An indexed-data config checked in-process (files, split, tokenizer, sizes) as ``launch/train.py`` does."""
    base = ["data=indexed", "model.vocab_size=257"]
    return Case(id=cid, command="data", what=what, names=tuple(names),
                run=lambda work: in_process(lambda: check_train_config([*base, *overrides(work)])))


def _truncate(bin_path: Path, idx_path: Path) -> None:
    os.truncate(bin_path, bin_path.stat().st_size // 2)


def sample_db_json() -> dict:
    """A small valid ProfileDB as JSON (one collective fit, three GEMMs, one segment)."""
    from cfp_megatron.cluster.measured import Collective, Span, partition_name
    from cfp_megatron.profile.db import ProfileDB
    from cfp_megatron.profile.fingerprint import Fingerprint
    from cfp_megatron.profile.fit import fit_collective
    from cfp_megatron.profile.records import CollectiveRecord, GemmRecord, SegmentRecord

    fp = Fingerprint(device_name="Bench CPU", device_count=2, nodes=1, gpus_per_node=2, backend="gloo",
                     torch="2.13.0", megatron_core="0.16.1", cpu_cores=2)
    fit = fit_collective(Collective.send_recv, 2, Span.intra_node, [(1000, 2e-5), (1_000_000, 1.1e-3)])
    rec = CollectiveRecord(fit=fit, samples=((1000, 2e-5), (1_000_000, 1.1e-3)), pattern="contiguous")
    gemms = [GemmRecord(m=m, n=m, k=m, dtype="fp32", tflops=m / 1000, seconds=1.0) for m in (64, 256, 1024)]
    seg = SegmentRecord(model="abc", model_name="gpt_tiny", segment="5933c33a899f", kind="dense",
                        partition=partition_name(1), tp=1, micro_batch=1, seq_length=64, forward_s=0.01,
                        backward_s=0.02, confirmed=True)
    return ProfileDB(fingerprint=fp).merged(collectives=[rec], gemms=gemms, segments=[seg]).to_json()


def db_case(cid: str, what: str, write: Callable[[Path], Path], names: Sequence[str] = ("db.json",)) -> Case:
    """A ProfileDB file read as every command reads one (``read_db``)."""
    from cfp_megatron.profile.db import read_db

    return Case(id=cid, command="profiledb", what=what, names=tuple(names),
                run=lambda work: in_process(lambda: read_db(write(_mkdir(work / cid)))))


def _db_file(work: Path, change: Callable[[dict], object] | None = None, text: str | bytes | None = None) -> Path:
    path = work / "db" / "db.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if text is not None:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return path
    data = sample_db_json()
    if change is not None:
        change(data)
    path.write_text(json.dumps(data, allow_nan=True))
    return path


def sample_plan_file(work: Path) -> Path:
    """A plan.json the planner wrote (planned once per bench run, in-process)."""
    target = work / "plans" / "sample" / "plan.json"
    if not target.exists():
        with contextlib.redirect_stdout(io.StringIO()):
            code = plan_main(["cluster=dgx_h100", "--out", str(work / "plans" / "sample-out")], work)
        if code != 0:
            raise RuntimeError("the planner could not write the sample plan")
        found = sorted((work / "plans" / "sample-out").rglob("plan.json"))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(found[0], target)
    return target


def plan_file_case(cid: str, what: str, make: Callable[[Path], Path], names: Sequence[str] = ("plan.json",)) -> Case:
    """A plan file read as ``cfp.plan_file`` reads it (``load_plan``)."""
    from cfp_megatron.plan.artifact import load_plan

    return Case(id=cid, command="planfile", what=what, names=tuple(names),
                run=lambda work: in_process(lambda: load_plan(make(work))))


def _plan_variant(work: Path, name: str, change: Callable[[dict], object] | None = None,
                  text: str | bytes | None = None) -> Path:
    path = work / "plans" / name / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if text is not None:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return path
    data = json.loads(sample_plan_file(work).read_text())
    if change is not None:
        change(data)
    path.write_text(json.dumps(data, indent=2))
    return path


def ckpt_case(cid: str, what: str, make: Callable[[Path], Path], *, resume: bool, names: Sequence[str]) -> Case:
    """A checkpoint folder checked before start, as ``launch/train.py`` checks it (``check_before_start``)."""

    def run(work: Path) -> Result:
        from cfp_megatron.engine.checkpoint import check_before_start

        root = make(work)
        return in_process(lambda: check_before_start(str(root), resume=resume, restarted=False))

    return Case(id=cid, command="checkpoint", what=what, names=tuple(names), run=run)


def _ckpt_dir(work: Path, name: str, pointer: str | None, steps: Sequence[int] = (), files: bool = True) -> Path:
    from cfp_megatron.engine.checkpoint import LATEST, step_dir

    root = work / "ckpt" / name
    root.mkdir(parents=True, exist_ok=True)
    for step in steps:
        folder = step_dir(root, step)
        folder.mkdir(parents=True, exist_ok=True)
        if files:
            (folder / "common.pt").write_bytes(b"not a real checkpoint")
    if pointer is not None:
        (root / LATEST).write_text(pointer)
    return root


def runs_csv(work: Path, name: str, change: Callable[[list[dict]], object] | None = None,
             text: str | bytes | None = None) -> Path:
    """A validate CSV: the first three published rows, changed by ``change``, or raw ``text``."""
    import csv

    path = work / "csv" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if text is not None:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return path
    from cfp_megatron.validation.rows import PUBLISHED_RUNS

    with PUBLISHED_RUNS[0].open(newline="") as f:
        reader = csv.DictReader(f)
        rows = [row for _, row in zip(range(3), reader, strict=False)]
        columns = reader.fieldnames or []
    if change is not None:
        change(rows)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def validate_case(cid: str, what: str, make: Callable[[Path], Sequence[str]], names: Sequence[str], *,
                  report_ok: bool = False) -> Case:
    """``python -m cfp_megatron.validate`` in-process."""
    from cfp_megatron.validate import main

    return Case(id=cid, command="validate", what=what, names=tuple(names), report_ok=report_ok,
                run=lambda work: in_process(lambda: main(list(make(work)))))


def _set_row(field_name: str, value: str) -> Callable[[list[dict]], None]:
    def change(rows: list[dict]) -> None:
        rows[0][field_name] = value
        rows[0]["derived_step_time_s"] = value if field_name == "step_time_s" else rows[0]["derived_step_time_s"]
    return change


def _hold_lock(work: Path) -> Result:
    """Another job holds the ProfileDB's write lock while this one stores."""
    from cfp_megatron.profile.db import ProfileDB, db_path, lock_path, store_db

    data = sample_db_json()
    db = ProfileDB.from_json(data)
    os.environ["CFP_CACHE_DIR"] = str(work / "cache-locked")
    try:
        lock = lock_path(db_path(db.fingerprint))
        lock.parent.mkdir(parents=True, exist_ok=True)
        holder = subprocess.Popen([sys.executable, "-c", "import fcntl,sys,time; f=open(sys.argv[1],'a'); "
                                   "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(120)",
                                   str(lock)], stdout=subprocess.PIPE, text=True)
        try:
            holder.stdout.readline() if holder.stdout else None
            # the store says it waits, then gives up after the lock timeout (shortened here from its 120 s)
            import cfp_megatron.profile.db as dbmod

            kept, dbmod.LOCK_TIMEOUT_S = dbmod.LOCK_TIMEOUT_S, 3.0
            try:
                return in_process(lambda: store_db(db), timeout_s=20.0)
            finally:
                dbmod.LOCK_TIMEOUT_S = kept
        finally:
            holder.kill()
            holder.wait()
    finally:
        os.environ.pop("CFP_CACHE_DIR", None)


def _cache_is_a_file(work: Path) -> Result:
    from cfp_megatron.profile.db import ProfileDB, store_db

    blocker = work / "cache-file"
    blocker.write_text("a file where the cache folder should be")
    os.environ["CFP_CACHE_DIR"] = str(blocker)
    try:
        return in_process(lambda: store_db(ProfileDB.from_json(sample_db_json())))
    finally:
        os.environ.pop("CFP_CACHE_DIR", None)


# ------------------------------------------------------------------------------------------------------ the cases
def cases() -> list[Case]:
    """Every case, in catalogue order."""
    py = sys.executable
    found: list[Case] = []
    add = found.append

    # --- configuration values, checked as launch/train.py checks them before any process group -----------------
    numeric = [
        ("layers-0", ["model.num_layers=0"], "model.num_layers"),
        ("layers-neg", ["model.num_layers=-1"], "model.num_layers"),
        ("layers-huge", ["model.num_layers=200000"], "model.num_layers"),
        ("layers-float", ["model.num_layers=1.5"], "model.num_layers"),
        ("hidden-0", ["model.hidden_size=0"], "model.hidden_size"),
        ("hidden-huge", ["model.hidden_size=1048576"], "model.hidden_size"),
        ("hidden-text", ["model.hidden_size=abc"], "model.hidden_size"),
        ("hidden-heads", ["model.hidden_size=66"], "model.hidden_size"),
        ("heads-0", ["model.num_attention_heads=0"], "model.num_attention_heads"),
        ("heads-huge", ["model.num_attention_heads=100000"], "model.num_attention_heads"),
        ("kv-groups", ["model.num_query_groups=3"], "model.num_query_groups"),
        ("ffn-neg", ["model.ffn_hidden_size=-5"], "model.ffn_hidden_size"),
        ("ffn-huge", ["model.ffn_hidden_size=100000000"], "model.ffn_hidden_size"),
        ("vocab-0", ["model.vocab_size=0"], "model.vocab_size"),
        ("vocab-huge", ["model.vocab_size=100000000"], "model.vocab_size"),
        ("maxpos-0", ["model.max_position_embeddings=0"], "model.max_position_embeddings"),
        ("maxpos-huge", ["model.max_position_embeddings=1000000000"], "model.max_position_embeddings"),
        ("init-std-0", ["model.init_method_std=0"], "model.init_method_std"),
        ("dropout-1", ["model.hidden_dropout=1.0"], "model.hidden_dropout"),
        ("norm-eps-0", ["model.norm_epsilon=0"], "model.norm_epsilon"),
        ("rotary-neg", ["model.rotary_base=-1"], "model.rotary_base"),
        ("experts-huge", ["model=moe_tiny", "model.num_experts=1000000"], "model.num_experts"),
        ("topk-over", ["model=moe_tiny", "model.moe_router_topk=9"], "model.moe_router_topk"),
        ("gbs-0", ["train.global_batch_size=0"], "train.global_batch_size"),
        ("gbs-neg", ["train.global_batch_size=-8"], "train.global_batch_size"),
        ("gbs-huge", ["train.global_batch_size=1073741824"], "train.global_batch_size"),
        ("mbs-0", ["train.micro_batch_size=0"], "train.micro_batch_size"),
        ("mbs-over-gbs", ["train.micro_batch_size=16"], "train.global_batch_size"),
        ("microbatches-huge", ["train.global_batch_size=1048576", "train.micro_batch_size=1"],
         "train.global_batch_size"),
        ("seq-0", ["train.seq_length=0"], "train.seq_length"),
        ("seq-huge", ["train.seq_length=100000000"], "train.seq_length"),
        ("seq-over-maxpos", ["train.seq_length=100000"], "train.seq_length"),
        ("steps-neg", ["train.steps=-1"], "train.steps"),
        ("steps-huge", ["train.steps=10000000000000"], "train.steps"),
        ("steps-text", ["train.steps=abc"], "train.steps"),
        ("lr-0", ["train.lr=0"], "train.lr"),
        ("lr-nan", ["train.lr=nan"], "train.lr"),
        ("lr-inf", ["train.lr=inf"], "train.lr"),
        ("min-lr-over", ["train.min_lr=1.0"], "train.min_lr"),
        ("clip-neg", ["train.clip_grad=-1"], "train.clip_grad"),
        ("clip-inf", ["train.clip_grad=inf"], "train.clip_grad"),
        ("seed-neg", ["train.seed=-1"], "train.seed"),
        ("seed-huge", ["train.seed=99999999999"], "train.seed"),
        ("warmup-neg", ["train.warmup_steps=-1"], "train.warmup_steps"),
        ("log-interval-0", ["train.log_interval=0"], "train.log_interval"),
        ("weight-decay-neg", ["train.weight_decay=-0.1"], "train.weight_decay"),
        ("beta1-over", ["train.adam_beta1=1.5"], "train.adam_beta1"),
        ("adam-eps-0", ["train.adam_eps=0"], "train.adam_eps"),
        ("memory-step-late", ["train.memory_step=21"], "train.memory_step"),
        ("memory-step-0", ["train.memory_step=0"], "train.memory_step"),
        ("resume-no-dir", ["train.resume=true"], "train.resume"),
        ("save-no-dir", ["train.save_interval=5"], "train.save_interval"),
        ("tp-0", ["parallel.tp=0"], "parallel.tp"),
        ("tp-neg", ["parallel.tp=-2"], "parallel.tp"),
        ("tp-huge", ["parallel.tp=1000000000"], "parallel.tp"),
        ("tp-text", ["parallel.tp=two"], "parallel.tp"),
        ("pp-0", ["parallel.pp=0"], "parallel.pp"),
        ("pp-huge", ["parallel.pp=1000000000"], "parallel.pp"),
        ("cp-0", ["parallel.cp=0"], "parallel.cp"),
        ("vpp-0", ["parallel.vpp=0"], "parallel.vpp"),
        ("vpp-no-pp", ["parallel.vpp=2"], "parallel.vpp"),
        ("etp-0", ["parallel.etp=0"], "parallel.etp"),
        ("rcn-0", ["parallel.recompute_num_layers=0"], "parallel.recompute_num_layers"),
        ("rcn-over", ["parallel.recompute=full", "parallel.recompute_num_layers=10"], "parallel.recompute_num_layers"),
        ("first-stage-0", ["parallel.first_stage_layers=0"], "parallel.first_stage_layers"),
        ("order-bad", ["parallel.order=tp-dp"], "parallel.order"),
        ("sp-no-tp", ["parallel.sp=true"], "parallel.sp"),
        ("opg-no-dopt", ["parallel.overlap_param_gather=true"], "parallel.overlap_param_gather"),
        ("fsdp-no-dopt", ["parallel.fsdp=optim_grads_params"], "parallel.fsdp"),
        ("fsdp-optim", ["parallel.distributed_optimizer=true", "parallel.fsdp=optim"], "parallel.fsdp"),
        ("fsdp-bogus", ["parallel.distributed_optimizer=true", "parallel.fsdp=zero3"], "parallel.fsdp"),
        ("fsdp-ckpt", ["parallel.distributed_optimizer=true", "parallel.fsdp=optim_grads",
                       "train.checkpoint_dir=ckpt"], "parallel.fsdp"),
        ("dpsh-no-shard", ["parallel.dp_shard_size=1"], "parallel.dp_shard_size"),
        ("dopt-sgd", ["parallel.distributed_optimizer=true", "train.optimizer=sgd"], "parallel.distributed_optimizer"),
        ("dpsh-0", ["parallel.distributed_optimizer=true", "parallel.dp_shard_size=0"], "parallel.dp_shard_size"),
        ("primepar-tp2", ["parallel.mlp=primepar", "parallel.tp=2"], "parallel.mlp"),
        ("layout-commas", ["parallel.pp=2", "parallel.pipeline_model_parallel_layout='Et,t|tL'"],
         "parallel.pipeline_model_parallel_layout"),
        ("nodes-0", ["cluster.nodes=0"], "cluster.nodes"),
        ("nodes-neg", ["cluster.nodes=-1"], "cluster.nodes"),
        ("nodes-huge", ["cluster=dgx_h100", "cluster.nodes=100000000"], "cluster.nodes"),
        ("world-huge", ["cluster=dgx_h100", "cluster.nodes=200000"], "cluster.nodes"),
        ("gpn-0", ["cluster.gpus_per_node=0"], "cluster.gpus_per_node"),
        ("gpn-huge", ["cluster.gpus_per_node=100000"], "cluster.gpus_per_node"),
        ("hbm-neg", ["cluster=dgx_h100", "cluster.hbm_gib=-1"], "cluster.hbm_gib"),
        ("hbm-inf", ["cluster=dgx_h100", "cluster.hbm_gib=inf"], "cluster.hbm_gib"),
        ("nvl-domain", ["cluster=gb200_nvl72", "cluster.nvlink_domain_size=6"], "cluster.nvlink_domain_size"),
        ("clock-over", ["cluster=dgx_h100", "cluster.sm_clock_mhz=5000"], "cluster.sm_clock_mhz"),
        ("world-mismatch", ["cluster=dgx_h100"], "cluster.nodes"),
    ]
    for cid, overrides, key in numeric:
        add(config_case(cid, overrides, [key]))
    divisibility = [
        ("div-world", ["parallel.tp=3"], 4, "parallel.tp"),
        ("div-dp-shard", ["parallel.distributed_optimizer=true", "parallel.dp_shard_size=3"], 4,
         "parallel.dp_shard_size"),
        ("fsdp-hsdp-cpu", ["parallel.distributed_optimizer=true", "parallel.fsdp=optim_grads_params",
                           "parallel.dp_shard_size=1"], 2, "parallel.dp_shard_size"),
        ("div-heads", ["parallel.tp=8"], 8, "num_attention_heads"),
        ("div-layers", ["parallel.pp=3"], 3, "num_layers"),
        ("div-experts", ["model=moe_tiny", "parallel.ep=3"], 3, "num_experts"),
        ("div-seq-cp", ["parallel.cp=2", "train.seq_length=63"], 2, "train.seq_length"),
        ("div-seq-sp", ["parallel.tp=2", "parallel.sp=true", "train.seq_length=63"], 2, "train.seq_length"),
        ("div-gbs", ["train.global_batch_size=7"], 2, "train.global_batch_size"),
        ("div-interleave", ["parallel.pp=2", "parallel.vpp=2", "train.global_batch_size=2"], 2,
         "train.global_batch_size"),
        ("ep-dense", ["parallel.ep=2"], 2, "parallel.ep"),
    ]
    for cid, overrides, world, key in divisibility:
        add(config_case(cid, overrides, [key], world=world))
    names = [
        ("unknown-key", ["train.nosuch=1"], "train.nosuch"),
        ("unknown-group", ["nosuch.x=1"], "nosuch"),
        ("unknown-model-key", ["model.nosuch=1"], "model.nosuch"),
        ("typo-key", ["parallel.tpp=2"], "parallel.tpp"),
        ("append-existing", ["+train.steps=3"], "train.steps"),
        ("enum-recompute", ["parallel.recompute=bogus"], "parallel.recompute"),
        ("enum-precision", ["train.precision=fp64"], "train.precision"),
        ("enum-activation", ["model.activation=relu"], "model.activation"),
        ("enum-optimizer", ["train.optimizer=lion"], "train.optimizer"),
        ("enum-backend", ["cluster.backend=mpi"], "cluster.backend"),
        ("enum-data-kind", ["data.kind=csv"], "data.kind"),
        ("enum-cp-comm", ["parallel.cp_comm_type=ring"], "parallel.cp_comm_type"),
        ("enum-fp8-recipe", ["train.precision=fp8", "train.fp8_recipe=current"], "train.fp8_recipe"),
        ("fmt-fp8-here", ["train.precision=fp8"], "train.precision"),
        ("fmt-mxfp8-here", ["train.precision=fp8", "train.fp8_recipe=mxfp8"], "train.fp8_recipe"),
        ("fmt-nvfp4-planned-here", ["+cfp=auto", "train.precision=fp4"], "train.precision"),
        ("fmt-recipe-unread", ["train.precision=bf16", "train.fp8_recipe=tensorwise"], "train.fp8_recipe"),
        ("fmt-deepspeed-fp8", ["backend=deepspeed", "train.precision=fp8"], "train.precision"),
        ("fp8pg-no-dopt", ["train.precision=fp8", "parallel.fp8_param_gather=true"], "parallel.fp8_param_gather"),
        ("fp8pg-bf16", ["train.precision=bf16", "parallel.distributed_optimizer=true",
                        "parallel.fp8_param_gather=true"], "parallel.fp8_param_gather"),
        ("fp8pg-auto-here", ["parallel.distributed_optimizer=true", "parallel.fp8_param_gather=true"],
         "parallel.fp8_param_gather"),
        ("enum-lr-schedule", ["train.lr_schedule=step"], "train.lr_schedule"),
        ("model-bogus", ["model=bogus"], "model"),
        ("cluster-bogus", ["cluster=bogus"], "cluster"),
        ("data-bogus", ["data=bogus"], "data"),
        ("cfp-bogus", ["+cfp=bogus"], "cfp"),
        ("backend-bogus", ["backend=bogus"], "backend"),
        ("parallel-bogus", ["parallel=bogus"], "parallel"),
        ("parse-bracket", ["train.steps=[1"], "train.steps=[1"),
        ("parse-no-equals", ["foo"], "foo"),
        ("interp-missing", ["train.checkpoint_dir=${nope}"], "train.checkpoint_dir"),
        ("mandatory-missing", ["train.steps=???"], "train.steps"),
        ("cfp-tp-0", ["+cfp=auto", "cfp.tp=0"], "cfp.tp"),
        ("cfp-tp-text", ["+cfp=auto", "cfp.tp=abc"], "cfp.tp"),
        ("cfp-headroom", ["+cfp=auto", "cfp.constraints.memory_headroom=1.5"], "cfp.constraints.memory_headroom"),
        ("cfp-top-k-0", ["+cfp=auto", "cfp.top_k=0"], "cfp.top_k"),
        ("cfp-budget-0", ["+cfp=auto", "cfp.profile_budget_s=0"], "cfp.profile_budget_s"),
        ("cfp-trials-word", ["+cfp=auto", "cfp.trials=some"], "cfp.trials"),
        ("cfp-trials-over-top-k", ["+cfp=auto", "cfp.top_k=2", "cfp.trials=3"], "cfp.trials"),
        ("cfp-allowed-0", ["+cfp=auto", "cfp.constraints.tp=[0]"], "cfp.constraints.tp"),
        ("cfp-check-neg", ["+cfp=auto", "cfp.check_after_steps=-1"], "cfp.check_after_steps"),
        ("ds-zero-5", ["backend=deepspeed", "backend.zero_stage=5"], "backend.zero_stage"),
        ("ds-bucket-0", ["backend=deepspeed", "backend.bucket_elements=0"], "backend.bucket_elements"),
    ]
    for cid, overrides, key in names:
        add(config_case(cid, overrides, [key]))

    # --- a custom decoder layer through model.spec: its path, its import, what it names and what it returns -------
    layer_specs = [
        ("spec-form", ["model.spec=gated_mlp_spec"], "model.spec"),
        ("spec-no-module", ["model.spec=no_such_layers.specs:gated_mlp_spec"], "model.spec"),
        ("spec-no-name", ["model.spec=megatron.core.models.gpt.gpt_layer_specs:gated_mlp_spec"], "model.spec"),
        ("spec-not-callable", ["model.spec=cfp_megatron.base.config:MAX_LAYERS"], "model.spec"),
        ("spec-returns-str", ["model.spec=builtins:str"], "model.spec"),
        ("spec-call-fails", ["model.spec=megatron.core.models.gpt.gpt_layer_specs:get_gpt_decoder_layer_specs"],
         "model.spec"),
        ("spec-auto-no-module", ["+cfp=auto", "model.spec=no_such_layers.specs:gated_mlp_spec"], "model.spec"),
    ]
    for cid, overrides, key in layer_specs:
        add(config_case(cid, overrides, [key]))
    add(config_case("spec-primepar", ["model.spec=tests.custom_layers:custom_layer_spec", "parallel.tp=4",
                                      "parallel.mlp=primepar"], ["parallel.mlp"], world=4))

    # --- indexed data files ----------------------------------------------------------------------------------
    add(data_case("data-no-path", "data=indexed without data.path", ["data.path"], lambda work: []))
    add(data_case("data-missing", "data.path=[/nonexistent/corpus]", ["data.path"],
                  lambda work: ["data.path=[/nonexistent/corpus]"]))
    add(data_case("data-extension", "data.path=[corpus.bin] (with the extension)", ["data.path"],
                  lambda work: [f"data.path=[{build_corpus(work)}.bin]"]))
    add(data_case("data-truncated-bin", "a .bin cut to half its size", ["truncated", ".bin"],
                  lambda work: [f"data.path=[{damaged_corpus(work, 'truncated', _truncate)}]"]))
    add(data_case("data-empty-bin", "an empty .bin", [".bin", "data.path"],
                  lambda work: [f"data.path=[{damaged_corpus(work, 'empty', lambda b, i: b.write_bytes(b''))}]"]))
    add(data_case("data-corrupt-idx", "an .idx that is not an index", ["data.path"],
                  lambda work: [f"data.path=[{damaged_corpus(work, 'badidx', lambda b, i: i.write_bytes(b'junk'))}]"]))
    add(data_case("data-truncated-idx", "an .idx cut short", ["data.path"],
                  lambda work: [f"data.path=[{damaged_corpus(work, 'shortidx', lambda b, i: os.truncate(i, 40))}]"]))
    add(data_case("data-split-text", "data.split=abc", ["data.split"],
                  lambda work: [f"data.path=[{build_corpus(work)}]", "data.split=abc"]))
    add(data_case("data-split-no-train", "data.split=0,1,0", ["data.split"],
                  lambda work: [f"data.path=[{build_corpus(work)}]", "data.split='0,1,0'"]))
    add(data_case("data-hf-no-path", "data.tokenizer=huggingface without a tokenizer.json", ["data.tokenizer_path"],
                  lambda work: [f"data.path=[{build_corpus(work)}]", "data.tokenizer=huggingface"]))
    add(data_case("data-hf-missing", "data.tokenizer_path=/nonexistent/tokenizer.json", ["tokenizer"],
                  lambda work: [f"data.path=[{build_corpus(work)}]", "data.tokenizer=huggingface",
                                "data.tokenizer_path=/nonexistent/tokenizer.json"]))
    add(Case(id="data-vocab-small", command="data", what="model.vocab_size=100 with the byte tokenizer",
             names=("model.vocab_size",), run=lambda work: in_process(lambda: check_train_config(
                 ["data=indexed", "model.vocab_size=100", f"data.path=[{build_corpus(work)}]"]))))

    # --- python -m cfp_megatron.plan ----------------------------------------------------------------------------
    plan = [py, "-m", "cfp_megatron.plan"]
    for cid, args, key in [("plan-model-bogus", ["model=bogus"], "model"),
                           ("plan-tp-text", ["cfp.tp=abc"], "cfp.tp"),
                           ("plan-nodes-huge", ["cluster=dgx_h100", "cluster.nodes=100000000"], "cluster.nodes"),
                           ("plan-world-text", ["--world", "abc"], "--world"),
            ("plan-spec-no-module", ["cluster=dgx_h100", "model.spec=no_such_layers.specs:gated_mlp_spec"],
             "model.spec")]:
        add(Case(id=cid, command="plan", what="python -m cfp_megatron.plan " + " ".join(args), names=(key,),
                 mode="subprocess", run=lambda work, a=args: run_process([*plan, *a, "--out", str(work / "plans")],
                                                                       work, 120)))
    for cid, args, key in [
            ("plan-world-0", ["--world", "0"], "--world"),
            ("plan-world-neg", ["--world", "-3"], "--world"),
            ("plan-world-huge", ["--world", "1000000000"], "--world"),
            ("plan-gbs-huge", ["cluster=dgx_h100", "train.global_batch_size=1073741824"], "train.global_batch_size"),
            ("plan-layers-huge", ["cluster=dgx_h100", "model.num_layers=200000"], "model.num_layers"),
            ("plan-pin-impossible", ["cluster=dgx_h100", "cfp.tp=3"], "cfp"),
            ("plan-pin-outside", ["cluster=dgx_h100", "cfp.tp=2", "cfp.constraints.tp=[4]"], "cfp.tp"),
            ("plan-manual", ["+cfp=manual"], "cfp"),
            ("plan-seq-huge", ["cluster=dgx_h100", "train.seq_length=100000000"], "train.seq_length"),
            ("plan-enum-options", ["train.precision=fp9"], ("train.precision", "bf16, fp16, fp8, fp4")),
            ("plan-nvfp4-hopper", ["cluster=dgx_h100", "train.precision=fp4"], ("train.precision", "cluster=b200")),
            ("plan-mxfp8-hopper", ["cluster=dgx_h100", "train.precision=fp8", "train.fp8_recipe=mxfp8"],
             ("train.fp8_recipe", "cluster=b200")),
            ("plan-formats-none", ["cluster=dgx_a100", "cfp.constraints.precision=[fp8,fp4]"],
             "cfp.constraints.precision"),
            ("plan-formats-deepspeed", ["backend=deepspeed", "cluster=dgx_h100",
                                        "cfp.constraints.precision=[bf16,fp8]"], "cfp.constraints.precision"),
            ("plan-format-outside-set", ["cluster=dgx_h100", "train.precision=fp16",
                                         "cfp.constraints.precision=[bf16,fp8]"], "train.precision"),
            ("plan-graphs-enum", ["cfp.constraints.cuda_graph_impl=[cudagraph]"],
             ("cfp.constraints.cuda_graph_impl", "none, local, transformer_engine")),
            ("plan-graphs-empty", ["cluster=dgx_h100", "cfp.constraints.cuda_graph_impl=[]"],
             "cfp.constraints.cuda_graph_impl"),
            ("plan-graphs-only-full-recompute", ["cluster=dgx_h100", "cfp.recompute=full",
                                                 "cfp.constraints.cuda_graph_impl=[transformer_engine]"],
             "cfp.constraints.cuda_graph_impl"),
            ("plan-graphs-pin-full-recompute", ["model=moe_tiny", "cluster=dgx_h100", "parallel.cuda_graph_impl=local",
                                                "cfp.recompute=full"], "parallel.cuda_graph_impl"),
            ("plan-graph-scope-dropless", ["model=moe_tiny", "cluster=dgx_h100",
                                           "parallel.cuda_graph_impl=transformer_engine",
                                           "parallel.cuda_graph_scope=attn+moe"], "parallel.cuda_graph_scope"),
            ("plan-token-policy-enum", ["cfp.constraints.moe_token_policy=[drop_all]"],
             ("cfp.constraints.moe_token_policy", "dropless, drop, drop_pad")),
            ("plan-token-policy-dense", ["cluster=dgx_h100", "cfp.constraints.moe_token_policy=[dropless]"],
             "cfp.constraints.moe_token_policy"),
            ("plan-token-drop-no-factor", ["model=moe_tiny", "cluster=dgx_h100",
                                           "cfp.constraints.moe_token_policy=[drop]"],
             "cfp.constraints.moe_capacity_factor"),
            ("plan-capacity-factor-negative", ["model=moe_tiny", "cluster=dgx_h100",
                                               "cfp.constraints.moe_capacity_factor=-1"],
             "cfp.constraints.moe_capacity_factor"),
            ("plan-token-policy-flex-pad", ["model=moe_tiny", "cluster=dgx_h100", "model.moe_token_dispatcher=flex",
                                            "cfp.constraints.moe_token_policy=[drop_pad]",
                                            "cfp.constraints.moe_capacity_factor=1.0"],
             "cfp.constraints.moe_token_policy"),
            ("plan-fp8pg-auto", ["cluster=dgx_h100", "parallel.distributed_optimizer=true",
                                 "parallel.fp8_param_gather=true"],
             ("parallel.fp8_param_gather", "train.precision=fp8"))]:
        add(Case(id=cid, command="plan", what="plan " + " ".join(args), names=key if isinstance(key, tuple) else (key,),
                 run=lambda work, a=args: in_process(lambda: plan_main(a, work), timeout_s=120)))
    add(Case(id="plan-file-garbage", command="plan", what="cfp.plan_file naming an existing file that is not JSON",
             names=("plan.json", "cfp.plan_file"),
             run=lambda work: in_process(lambda: plan_main(["cluster=dgx_h100", "cfp.plan_file="
                                                            + str(_plan_variant(work, "garbage", text="{oops"))],
                                                           work), timeout_s=120)))
    add(Case(id="plan-out-is-file", command="plan", what="--out naming an existing regular file",
             names=("--out", "occupied"),
             run=lambda work: in_process(lambda: plan_main(
                 ["cluster=dgx_h100", "--out", str(_touch(work / "occupied"))], work), timeout_s=120)))

    # --- cfp size (python -m cfp_megatron.size) -----------------------------------------------------------------
    for cid, args, key in [
            ("size-no-tokens", ["cluster=dgx_h100"], "train.tokens"),
            ("size-tokens-text", ["train.tokens=lots", "cluster=dgx_h100"], "train.tokens"),
            ("size-tokens-sweep", ["train.tokens=1T,2T", "cluster=dgx_h100"], "train.tokens"),
            ("size-no-cluster", ["train.tokens=1T"], "cluster"),
            ("size-nodes-zero", ["train.tokens=1T", "cluster=dgx_h100", "cluster.nodes=[4,0]"], "cluster.nodes"),
            ("size-nodes-fraction", ["train.tokens=1T", "cluster=dgx_h100", "cluster.nodes=range(0.5,3)"],
             "cluster.nodes"),
            ("size-sweep-model", ["train.tokens=1T", "cluster=dgx_h100", "model=llama3_8b,llama3_70b"], "model"),
            ("size-cluster-local", ["train.tokens=1T", "cluster=local"], "cluster"),
            ("size-cluster-bogus", ["train.tokens=1T", "cluster=[dgx_h100,bogus]"], "cluster"),
            ("size-deepspeed", ["train.tokens=1T", "cluster=dgx_h100", "backend=deepspeed"], "backend"),
            ("size-nodes-range-huge", ["train.tokens=1T", "cluster=dgx_h100", "cluster.nodes=range(1,1000000000)"],
             "cluster.nodes"),
            ("size-nodes-range-step-0", ["train.tokens=1T", "cluster=dgx_h100", "cluster.nodes=range(1,9,0)"],
             "cluster.nodes"),
            ("size-deadline-text", ["train.tokens=1T", "cluster=dgx_h100", "--deadline", "soon"], "--deadline"),
            ("size-price-unknown", ["train.tokens=1T", "cluster=dgx_h100", "--price", "h200=2"], "--price"),
            ("size-jobs-zero", ["train.tokens=1T", "cluster=dgx_h100", "--jobs", "0"], "--jobs")]:
        add(Case(id=cid, command="size", what="cfp size " + " ".join(args), names=(key,),
                 run=lambda work, a=args: in_process(lambda: size_main(a, work), timeout_s=120)))
    add(Case(id="size-module-no-tokens", command="size", what="python -m cfp_megatron.size cluster=dgx_h100",
             names=("train.tokens",), mode="subprocess",
             run=lambda work: run_process([py, "-m", "cfp_megatron.size", "cluster=dgx_h100", "--out",
                                           str(work / "sizing")], work, 120)))
    add(Case(id="size-out-is-file", command="size", what="cfp size --out naming an existing regular file",
             names=("--out", "occupied"),
             run=lambda work: in_process(lambda: size_main(
                 ["train.tokens=1T", "cluster=dgx_h100", "--out", str(_touch(work / "occupied"))], work),
                 timeout_s=120)))

    # --- python -m cfp_megatron.analyze ------------------------------------------------------------------------
    analyze = [py, "-m", "cfp_megatron.analyze"]
    for cid, args, key in [("analyze-model-bogus", ["model=bogus"], "model"),
                           ("analyze-tp-text", ["parallel.tp=abc"], "parallel.tp")]:
        add(Case(id=cid, command="analyze", what="python -m cfp_megatron.analyze " + " ".join(args), names=(key,),
                 mode="subprocess", run=lambda work, a=args: run_process([*analyze, *a], work, 120)))

    def analyze_main(args: list[str]) -> int:
        from cfp_megatron.analyze import main

        return main(args)

    for cid, args, key in [("analyze-mbs-0", ["--micro-batch-size", "0"], "--micro-batch-size"),
                           ("analyze-mbs-neg", ["--micro-batch-size", "-4"], "--micro-batch-size"),
                           ("analyze-layers-huge", ["model.num_layers=200000"], "model.num_layers"),
                           ("analyze-tp-heads", ["parallel.tp=8", "cluster.gpus_per_node=8"], "parallel.tp")]:
        add(Case(id=cid, command="analyze", what="analyze " + " ".join(args), names=(key,),
                 run=lambda work, a=args: in_process(lambda: analyze_main(a), timeout_s=120)))
    add(Case(id="analyze-json-dir", command="analyze", what="--json naming an existing folder", names=("--json",),
             run=lambda work: in_process(lambda: analyze_main(["--json", str(_mkdir(work / "jsondir"))]),
                                         timeout_s=120)))

    # --- python -m cfp_megatron.validate -----------------------------------------------------------------------
    add(Case(id="validate-missing", command="validate", what="python -m cfp_megatron.validate missing.csv",
             names=("missing.csv",), mode="subprocess",
             run=lambda work: run_process([py, "-m", "cfp_megatron.validate", str(work / "missing.csv")], work, 120)))
    add(validate_case("validate-dir", "a folder instead of a CSV", lambda work: [str(_mkdir(work / "csvdir"))],
                      ["csvdir"]))
    add(validate_case("validate-binary", "a binary file", lambda work: [str(runs_csv(work, "bin.csv",
                                                                                       text=bytes(range(256))))],
                      ["bin.csv"]))
    add(validate_case("validate-empty", "an empty file", lambda work: [str(runs_csv(work, "empty.csv", text=""))],
                      ["empty.csv"]))
    add(validate_case("validate-header-only", "a header and no rows",
                      lambda work: [str(runs_csv(work, "header.csv", change=lambda rows: rows.clear()))],
                      ["header.csv"]))
    add(validate_case("validate-no-columns", "a CSV without the run columns",
                      lambda work: [str(runs_csv(work, "other.csv", text="a,b\n1,2\n"))], ["other.csv"]))
    add(validate_case("validate-step-neg", "a row whose step time is negative",
                      lambda work: [str(runs_csv(work, "neg.csv", change=_set_row("step_time_s", "-3")))],
                      ["step time"], report_ok=True))
    add(validate_case("validate-step-nan", "a row whose step time is NaN",
                      lambda work: [str(runs_csv(work, "nan.csv", change=_set_row("step_time_s", "nan")))],
                      ["step time"], report_ok=True))
    add(validate_case("validate-step-text", "a row whose step time is text",
                      lambda work: [str(runs_csv(work, "text.csv", change=_set_row("step_time_s", "fast")))],
                      ["step time"], report_ok=True))
    add(validate_case("validate-layers-text", "a row whose layer count is text",
                      lambda work: [str(runs_csv(work, "layers.csv", change=_set_row("layers", "many")))],
                      ["layers"], report_ok=True))
    add(validate_case("validate-gpus-0", "a row with 0 GPUs",
                      lambda work: [str(runs_csv(work, "gpus.csv", change=_set_row("num_gpus", "0")))],
                      ["gpus", "GPUs"], report_ok=True))
    add(validate_case("validate-layers-huge", "a row with 10^9 layers",
                      lambda work: [str(runs_csv(work, "huge.csv", change=_set_row("layers", "1000000000")))],
                      ["layers"], report_ok=True))
    add(validate_case("validate-bands-exists", "--bands naming an existing file",
                      lambda work: [str(runs_csv(work, "ok.csv")), "--bands", str(_touch(work / "bands.json"))],
                      ["bands.json"]))

    # --- torchrun -m cfp_megatron.profile ----------------------------------------------------------------------
    add(Case(id="profile-model-bogus", command="profile", what="python -m cfp_megatron.profile model=bogus",
             names=("model",), mode="subprocess",
             run=lambda work: run_process([py, "-m", "cfp_megatron.profile", "model=bogus"], work, 120)))

    def profile_main(args: list[str]) -> int:
        from cfp_megatron.profile.cli import main

        return main(args)

    add(Case(id="profile-budget-0", command="profile", what="--budget 0", names=("--budget",),
             run=lambda work: in_process(lambda: profile_main(["--budget", "0"]))))
    add(Case(id="profile-tp-text", command="profile", what="profile parallel.tp=abc", names=("parallel.tp",),
             run=lambda work: in_process(lambda: profile_main(["parallel.tp=abc"]))))
    add(Case(id="profile-layers-huge", command="profile", what="profile model.num_layers=200000",
             names=("model.num_layers",), run=lambda work: in_process(lambda: profile_main(
                 ["model.num_layers=200000"]))))

    # --- ProfileDB files (B1) ----------------------------------------------------------------------------------
    add(db_case("db-missing", "a ProfileDB path that does not exist", lambda work: work / "db" / "db.json"))
    add(db_case("db-dir", "a folder instead of a ProfileDB", lambda work: _mkdir(work / "db" / "db.json")))
    add(db_case("db-not-json", "a ProfileDB that is not JSON", lambda work: _db_file(work, text="{not json")))
    add(db_case("db-empty", "an empty ProfileDB file", lambda work: _db_file(work, text="")))
    add(db_case("db-list", "a JSON list instead of a ProfileDB", lambda work: _db_file(work, text="[]")))
    add(db_case("db-binary", "a binary file", lambda work: _db_file(work, text=bytes(range(256)))))
    add(db_case("db-version", "another schema version",
                lambda work: _db_file(work, lambda d: d.__setitem__("schema_version", 999))))
    add(db_case("db-no-segments", "no segments section",
                lambda work: _db_file(work, lambda d: d.pop("segments"))))
    add(db_case("db-nan", "a segment timing that is NaN",
                lambda work: _db_file(work, lambda d: d["segments"][0].__setitem__("forward_s", math.nan)),
                ("forward_s",)))
    add(db_case("db-neg", "a negative segment timing",
                lambda work: _db_file(work, lambda d: d["segments"][0].__setitem__("backward_s", -1.0)),
                ("backward_s",)))
    add(db_case("db-inf", "an infinite GEMM throughput",
                lambda work: _db_file(work, lambda d: d["gemms"][0].__setitem__("tflops", math.inf)),
                ("tflops",)))
    add(db_case("db-zero-gemm", "a GEMM that took 0 s",
                lambda work: _db_file(work, lambda d: d["gemms"][0].__setitem__("seconds", 0.0)),
                ("seconds",)))
    add(db_case("db-text-figure", "a timing that is text",
                lambda work: _db_file(work, lambda d: d["segments"][0].__setitem__("forward_s", "fast")),
                ("forward_s",)))

    # --- plan files (B1) ---------------------------------------------------------------------------------------
    add(plan_file_case("planfile-missing", "cfp.plan_file that does not exist",
                       lambda work: work / "plans" / "none" / "plan.json"))
    add(plan_file_case("planfile-dir", "cfp.plan_file naming a folder", lambda work: _mkdir(work / "plans" / "dir"),
                       ("dir",)))
    add(plan_file_case("planfile-binary", "a binary plan file",
                       lambda work: _plan_variant(work, "binary", text=bytes(range(256)))))
    add(plan_file_case("planfile-truncated", "a plan.json cut short", lambda work: _plan_variant(
        work, "truncated", text=sample_plan_file(work).read_text()[:80])))
    add(plan_file_case("planfile-empty", "an empty plan.json", lambda work: _plan_variant(work, "empty", text="")))
    add(plan_file_case("planfile-edited", "a plan.json edited by hand (tp changed, hash kept)",
                       lambda work: _plan_variant(work, "edited", lambda d: _edit_plan(d, "tp", 2)),
                       ("hash", "plan.json")))
    add(plan_file_case("planfile-unknown-key", "a plan.json with an unknown key",
                       lambda work: _plan_variant(work, "unknown", lambda d: d.__setitem__("bogus_field", 1)),
                       ("bogus_field",)))
    add(plan_file_case("planfile-tp-0", "a plan.json with parallel tp=0",
                       lambda work: _plan_variant(work, "tp0", lambda d: _edit_plan(d, "tp", 0)), ("tp",)))

    # --- checkpoints (A) ---------------------------------------------------------------------------------------
    add(ckpt_case("ckpt-pointer-text", "latest_checkpointed_iteration.txt holding text",
                  lambda work: _ckpt_dir(work, "text", "abc", [5]), resume=True,
                  names=("latest_checkpointed_iteration.txt",)))
    add(ckpt_case("ckpt-pointer-missing-step", "the pointer names a step folder that is missing",
                  lambda work: _ckpt_dir(work, "gone", "7", [5]), resume=True, names=("iter_0000007",)))
    add(ckpt_case("ckpt-resume-empty", "train.resume=true on an empty folder",
                  lambda work: _ckpt_dir(work, "empty", None), resume=True, names=("train.checkpoint_dir",)))
    add(ckpt_case("ckpt-fresh-over-existing", "a fresh run into a folder holding checkpoints",
                  lambda work: _ckpt_dir(work, "existing", "5", [5]), resume=False, names=("train.checkpoint_dir",)))
    add(ckpt_case("ckpt-no-manifest", "resuming a step folder without a manifest",
                  lambda work: _ckpt_dir(work, "nomanifest", "5", [5]), resume=True, names=("manifest",)))
    add(ckpt_case("ckpt-dir-is-file", "train.checkpoint_dir naming a regular file",
                  lambda work: _touch(work / "ckpt" / "afile"), resume=True, names=("afile", "checkpoint_dir")))

    # --- cache (C) ---------------------------------------------------------------------------------------------
    add(Case(id="cache-lock-held", command="cache", what="another job holds the ProfileDB's write lock",
             names=("lock",), run=_hold_lock))
    add(Case(id="cache-dir-is-file", command="cache", what="CFP_CACHE_DIR naming a regular file",
             names=("CFP_CACHE_DIR", "cache-file"), run=_cache_is_a_file))

    # --- torchrun launch/train.py ------------------------------------------------------------------------------
    for cid, ranks, overrides, key, once in [
            ("train-gbs-huge", 2, ["train.global_batch_size=1073741824"], "train.global_batch_size", None),
            ("train-memory-step", 1, ["train.memory_step=21"], "train.memory_step", None),
            ("train-model-bogus", 2, ["model=bogus"], "model", None),
            ("train-world", 2, ["parallel.tp=3"], "parallel.tp", "cfp-megatron: ConfigError"),
            ("train-plan-garbage", 1, ["+cfp=manual", "cfp.plan_file=/nonexistent/plan.json"], "plan.json",
             None),
            ("train-spec-mlp-only", 2, ["model.spec=tests.custom_layers:mlp_only_spec"], "model.spec", None),
            ("train-spec-pp-whole-block", 2, ["model.spec=tests.custom_layers:whole_model_spec", "parallel.pp=2"],
             "model.spec", None)]:
        add(Case(id=cid, command="train", what=f"torchrun --nproc_per_node={ranks} launch/train.py "
                 + " ".join(overrides), names=(key,), mode="torchrun", once=once,
                 run=lambda work, r=ranks, o=overrides: torchrun(r, o, work)))
    add(Case(id="train-truncated-bin", command="train", what="torchrun --nproc_per_node=1 launch/train.py "
             "data=indexed data.path=[<a truncated .bin>]", names=("truncated",), mode="torchrun",
             run=lambda work: torchrun(1, ["data=indexed", "model.vocab_size=257",
                                           f"data.path=[{damaged_corpus(work, 'trunc-run', _truncate)}]"], work)))
    found += _validate_row_cases()
    found += _memory_cases()
    found += _checkpoint_ownership_cases()
    found += _disk_cases()
    found += _stall_cases()
    found += _hydra_cases()
    found += _input_cases()
    found += _data_cases()
    return found


def _validate_row_cases() -> list[Case]:
    """``validate``'s rows it cannot model faithfully (a BOM, repeated ids, fractional counts, shapes that do not
    divide, absurd sizes, a header that would leave a column unread) and its files (``--bands``, ``--plot``,
    ``--json``) on full and read-only disks: real tmpfs mounts; where this user may not mount, the case says so and
    comes out vague (it proves nothing)."""
    found: list[Case] = []

    def rows(*changes: dict[str, str]) -> Callable[[list[dict]], None]:
        """Change the first rows of the sample, one dict of columns per row."""
        def change(sample: list[dict]) -> None:
            for row, columns in zip(sample, changes, strict=False):
                row.update(columns)
        return change

    def bom(work: Path) -> list[str]:
        plain = runs_csv(work, "plain.csv").read_bytes()
        return [str(runs_csv(work, "bom.csv", text=b"\xef\xbb\xbf" + plain))]

    def header(work: Path, old: str, new: str) -> list[str]:
        text = runs_csv(work, "header.csv").read_text()
        first, rest = text.split("\n", 1)
        return [str(runs_csv(work, f"header-{new}.csv", text=first.replace(old, new, 1) + "\n" + rest))]

    def extra_field(work: Path) -> list[str]:
        path = runs_csv(work, "comma.csv")
        path.write_text(path.read_text().replace(",GPT 3.6B,", ",GPT 3.6B, 2021,", 1))  # a comma left unquoted
        return [str(path)]

    for cid, what, make, names in [
            ("validate-bom", "a CSV saved with a UTF-8 byte-order mark (as spreadsheets save it)", bom,
             ["1  GPT 1.7B"]),
            ("validate-dup-id", "two rows with the same id", lambda work: [str(runs_csv(
                work, "dup.csv", change=rows({}, {"id": "1"})))], ["also the id of"]),
            ("validate-same-file-twice", "the same file passed twice", lambda work: [str(runs_csv(
                work, "twice.csv"))] * 2, ["also the id of"]),
            ("validate-blank-id", "a row with a blank id", lambda work: [str(runs_csv(
                work, "blank-id.csv", change=rows({}, {"id": " "})))], ["the id is blank"]),
            ("validate-gpus-frac", "a row with 32.5 GPUs", lambda work: [str(runs_csv(
                work, "gpus-frac.csv", change=_set_row("num_gpus", "32.5")))], ["num_gpus=32.5"]),
            ("validate-tp-frac", "a row with tp 1.5", lambda work: [str(runs_csv(
                work, "tp-frac.csv", change=_set_row("tp", "1.5")))], ["tp=1.5"]),
            ("validate-batch-frac", "a row with a global batch of 512.5 sequences", lambda work: [str(runs_csv(
                work, "gbs-frac.csv", change=_set_row("global_batch_seqs", "512.5")))], ["global_batch_seqs=512.5"]),
            ("validate-layers-inf", "a row with infinitely many layers", lambda work: [str(runs_csv(
                work, "layers-inf.csv", change=_set_row("layers", "inf")))], ["layers=inf"]),
            ("validate-hidden-heads", "a hidden size (2300) the 24 heads do not divide", lambda work: [str(runs_csv(
                work, "hidden.csv", change=_set_row("hidden", "2300")))], ["column hidden"]),
            ("validate-kv-heads", "5 key/value heads for 24 heads", lambda work: [str(runs_csv(
                work, "kv.csv", change=_set_row("kv_heads", "5")))], ["column kv_heads"]),
            ("validate-tp-heads", "tp 16 on a model of 24 heads", lambda work: [str(runs_csv(
                work, "tp-heads.csv", change=rows({"tp": "16", "dp": "2"})))], ["column tp"]),
            ("validate-gpus-huge", "a row with 2 million GPUs", lambda work: [str(runs_csv(
                work, "gpus-huge.csv", change=rows({"num_gpus": "2000000", "dp": ""})))], ["num_gpus=2000000"]),
            ("validate-memory-absurd", "one GPU running a 65,536-sequence micro-batch", lambda work: [str(runs_csv(
                work, "memory.csv", change=rows({"num_gpus": "1", "dp": "1", "micro_batch": "65536",
                                                 "global_batch_seqs": "65536", "step_time_s": "20000"})))],
             ["GiB per GPU is over"]),
            ("validate-unquoted-comma", "a model name with an unquoted comma (one field too many)", extra_field,
             ["fields where the header has"]),
            ("validate-step-too-fast", "a step time of 1 ns (faster than any GPU could run it)", lambda work: [str(
                runs_csv(work, "fast.csv", change=_set_row("step_time_s", "1e-9")))], ["faster than the hardware"]),
            ("validate-step-in-ms", "a step time of 3530 (milliseconds written in the seconds column)",
             lambda work: [str(runs_csv(work, "ms.csv", change=_set_row("step_time_s", "3530")))],
             ["far slower than any published run"]),
            ("validate-gpu-longer-number", "a row on an RTX A1000 (a workstation card whose name holds A100)",
             lambda work: [str(runs_csv(work, "a1000.csv", change=_set_row("gpu", "NVIDIA RTX A1000")))],
             ["has no hardware preset"]),
            ("validate-moe-no-topk", "a MoE row (moe_experts=8) with moe_topk and moe_expert_ffn blank",
             lambda work: [str(runs_csv(work, "moe-topk.csv", change=rows({"moe_experts": "8", "arch_type": "moe"})))],
             ["moe_topk and moe_expert_ffn blank"]),
            ("validate-moe-no-experts", "arch_type=moe, moe_topk=2, ep=4 and moe_experts blank", lambda work: [str(
                runs_csv(work, "moe-count.csv", change=rows({"arch_type": "moe", "moe_topk": "2", "ep": "4"})))],
             ["but moe_experts is blank"])]:
        found.append(validate_case(cid, what, make, names, report_ok=True))

    def tabs(work: Path) -> list[str]:
        import csv

        path = runs_csv(work, "tabs.csv")
        with path.open(newline="") as fh:
            lines = list(csv.reader(fh))
        return [str(runs_csv(work, "tabs.tsv", text="\n".join("\t".join(line) for line in lines) + "\n"))]

    found.append(validate_case("validate-tab-separated", "a tab-separated file (a spreadsheet's 'text' export)", tabs,
                               ["separated by tabs"]))
    found.append(validate_case("validate-bands-one-source", "--bands over rows of one source (nothing left to fit "
                               "on when it is left out)", lambda work: [str(runs_csv(work, "one-source.csv")),
                                                                         "--bands", str(work / "one-source.json")],
                               ["leaves no rows to fit on"]))
    def fifo(work: Path) -> Path:
        path = work / "csv" / "report.fifo"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            os.mkfifo(path)
        return path

    found.append(validate_case("validate-json-fifo", "--json naming a named pipe nobody writes to",
                               lambda work: [str(runs_csv(work, "fifo.csv")), "--json", str(fifo(work))],
                               ["report.fifo"]))
    found.append(validate_case("validate-json-bands-one-file", "--json and --bands naming the same file",
                               lambda work: [str(runs_csv(work, "same.csv")), "--json", str(work / "same.json"),
                                             "--bands", str(work / "same.json")], ["names the same file"]))
    for cid, what, make, names in [
            ("validate-header-typo", "a header naming micro_batch_size (the schema's micro_batch)",
             lambda work: header(work, "micro_batch", "micro_batch_size"), ["micro_batch_size"]),
            ("validate-header-dup", "a header naming a column twice",
             lambda work: header(work, "params_b", "layers"), ["appears twice"]),
            ("validate-none-good", "every row with fractional GPUs", lambda work: [str(runs_csv(
                work, "none-good.csv", change=lambda sample: [row.update(num_gpus="8.5") for row in sample]))],
             ["no row could be modelled"])]:
        found.append(validate_case(cid, what, make, names))

    def on_tmpfs(options: str, option: str, name: str, *, kept: str | None = None,
                 free: int | None = None) -> Callable[[Path], Result]:
        """``validate`` writing ``option``'s file ``name`` on a tmpfs mounted with ``options``; ``kept``: an earlier
        file there; ``free``: fill the disk, then free this many bytes (room for a name, not for the file)."""
        from cfp_megatron.validate import main

        def run(work: Path) -> Result:
            runs = runs_csv(work, f"tmpfs-{name}.csv")
            folder = _mkdir(work / f"tmpfs-{option.strip('-')}-{'ro' if 'ro' in options.split(',') else 'full'}")
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True,
                                  text=True, check=False)
            if done.returncode != 0:
                return Result(exit_code=1, output=f"not run: cannot mount a tmpfs here ({done.stderr.strip()})")
            try:
                if kept is not None:
                    (folder / name).write_text(kept)
                if free is not None:
                    filler = folder / "filler"
                    with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as fh:
                        while True:
                            fh.write(b"\0" * 4096)
                    os.truncate(filler, max(filler.stat().st_size - free, 0))
                return in_process(lambda: main([str(runs), option, str(folder / name)]))
            finally:
                subprocess.run(["umount", str(folder)], check=False)

        return run

    table = '{"quantile": 0.8, "classes": {}}\n'
    for cid, what, options, option, name, kept, free in [
            ("validate-bands-full", "--bands on a full disk, over an earlier band table", "size=64k", "--bands",
             "bands.json", table, 0),
            ("validate-plot-full", "--plot on a disk with room for the name, not the picture", "size=64k", "--plot",
             "scatter.png", None, 4096),
            ("validate-json-full", "--json on a full disk", "size=64k", "--json", "report.json", None, 0),
            ("validate-bands-ro", "--bands on a read-only disk", "ro,size=64k", "--bands", "bands.json", None, None),
            ("validate-plot-ro", "--plot on a read-only disk", "ro,size=64k", "--plot", "scatter.png", None, None)]:
        found.append(Case(id=cid, command="validate", what=what, names=(name,),
                          run=on_tmpfs(options, option, name, kept=kept, free=free)))
    return found


def _memory_cases() -> list[Case]:
    """Memory on every machine (the host's on CPU, shared by its ranks), impossible pins and a GPU preset trained
    on a machine without a GPU: each refused before profiling and before any process group, naming the cause."""
    found: list[Case] = []

    def train(overrides: Sequence[str], work: Path) -> Result:
        """``launch/train.py``'s checks in-process on one rank, run from ``work`` (its ``outputs/``)."""
        def run() -> object:
            from cfp_megatron.base.compose import compose_config
            from cfp_megatron.planner.entry import train_from_config

            with contextlib.chdir(_mkdir(work / "cwd")):
                return train_from_config(compose_config(["train.steps=1", *overrides]))
        return in_process(run, timeout_s=120)

    for cid, overrides, names in [
            ("mem-auto-8b", ["+cfp=auto", "model=llama3_8b"], ("fits in memory",)),
            ("mem-auto-hbm", ["+cfp=auto", "cluster.hbm_gib=0.001"], ("cluster.hbm_gib",)),
            ("mem-auto-layers", ["+cfp=auto", "model=llama3_8b", "model.num_layers=64"], ("fits in memory",)),
            ("mem-hand-8b", ["model=llama3_8b"], ("the layout tp=1",)),
            ("mem-hand-hbm", ["parallel.tp=1", "cluster.hbm_gib=0.0005"], ("cluster.hbm_gib",)),
            ("mem-hand-reserve", ["model=llama_tiny", "cluster.host_reserve_gib=1000000"],
             ("cluster.host_reserve_gib",)),
            ("pin-auto-mb3", ["+cfp=auto", "cfp.micro_batch=3"], ("cfp.micro_batch",)),
            ("pin-auto-mb-over", ["+cfp=auto", "cfp.micro_batch=96"], ("cfp.micro_batch",)),
            ("pin-auto-sp", ["+cfp=auto", "cfp.sp=true"], ("cfp.sp",)),
            ("pin-auto-primepar", ["+cfp=auto", "cfp.mlp=primepar"], ("cfp.mlp",)),
            ("gpu-preset-cpu", ["cluster=dgx_h100", "cluster.gpus_per_node=1"], ("cluster=local",)),
            ("gpu-preset-cpu-auto", ["+cfp=auto", "cluster=h200", "cluster.gpus_per_node=1"], ("cluster=local",)),
            ("mem-ds-auto-8b", ["backend=deepspeed", "+cfp=auto", "model=llama3_8b"], ("fits in memory",)),
            ("mem-ds-hand-8b", ["backend=deepspeed", "model=llama3_8b", "backend.zero_stage=3"],
             ("the DeepSpeed plan zero3",)),
            ("mem-rank-reserve-over", ["cluster.rank_reserve_gib=100"], ("cluster.rank_reserve_gib=100.0",)),
            ("mem-local-hbm-over", ["model=llama3_8b", "cluster.hbm_gib=100000"],
             ("cluster.hbm_gib=100000.0: is more memory than each rank has on this machine",)),
            ("mem-auto-gpn-world", ["+cfp=auto", "model=llama3_8b", "cluster.gpus_per_node=4"],
             ("but 1 ranks were started",)),
            ("pin-ds-recompute", ["backend=deepspeed", "+cfp=auto", "cfp.recompute=full"],
             ("cfp.recompute=['full']: is a knob of Megatron-Core's layouts",)),
            ("pin-ds-dopt", ["backend=deepspeed", "+cfp=auto", "cfp.distributed_optimizer=false",
                             "backend.zero_stage=2"], ("cfp.distributed_optimizer=[False]",)),
            ("pin-ds-overlap", ["backend=deepspeed", "+cfp=auto", "cfp.overlap=true"], ("cfp.overlap=True",)),
            ("pin-ds-sp-set", ["backend=deepspeed", "+cfp=auto", "cfp.constraints.sp=[true]"],
             ("cfp.constraints.sp=[True]",))]:
        found.append(Case(id=cid, command="train", what="launch/train.py " + " ".join(overrides), names=names,
                          run=lambda work, o=overrides: train(o, work)))
    for cid, args, names in [
            ("mem-plan-dsv3", ["model=deepseek_v3", "cluster=local", "cluster.gpus_per_node=2"], ("fits in memory",)),
            ("mem-plan-70b-40gb", ["model=llama3_70b", "cluster=dgx_a100_40gb", "cluster.nodes=1"],
             ("fits in memory",)),
            ("mem-plan-ranks", ["model=gpt_tiny", "cluster.gpus_per_node=128"], ("cluster.gpus_per_node",)),
            ("pin-plan-mbset", ["cfp.constraints.micro_batch=[3,5]", "--world", "2"], ("cfp.constraints.micro_batch",)),
            ("pin-plan-sp-tp1", ["cfp.sp=true", "cfp.tp=1", "--world", "2"], ("cfp.sp",)),
            ("pin-plan-dopt-tp", ["cfp.distributed_optimizer=true", "cfp.tp=2", "--world", "2"],
             ("cfp.distributed_optimizer",)),
            ("pin-plan-vpp", ["cfp.vpp=2", "cfp.pp=1", "--world", "2"], ("cfp.vpp",)),
            ("pin-plan-pp-tp", ["cluster=dgx_h100", "cfp.tp=4", "cfp.pp=4"], ("cfp.pp",)),
            ("pin-plan-nofit-named", ["model=llama3_8b", "cluster=dgx_h100", "cfp.tp=1", "cfp.recompute=none",
                                      "cfp.micro_batch=8", "train.global_batch_size=64"], ("cfp.tp=1:",)),
            ("pin-plan-set-nofit", ["model=llama3_8b", "cluster=dgx_h100", "cfp.constraints.tp=[1]",
                                    "cfp.constraints.pp=[1]", "cfp.distributed_optimizer=false"],
             ("cfp.constraints.tp=[1]:",)),
            ("mem-plan-world-gpn", ["cluster=dgx_h100", "cluster.gpus_per_node=2", "--world", "4"],
             ("cluster.nodes=1:",)),
            ("mem-plan-ds-hbm", ["backend=deepspeed", "cluster.hbm_gib=0.0001", "--world", "1"],
             ("cluster.hbm_gib=0.0001:",)),
            ("mem-plan-ds-fewest", ["backend=deepspeed", "model=llama3_405b", "cluster=dgx_h100", "cluster.nodes=1",
                                    "train.global_batch_size=1024", "train.seq_length=4096"],
             ("size the cluster to cluster.nodes=2 or more",)),
            ("mem-plan-ds-batch", ["backend=deepspeed", "model=llama3_405b", "cluster=dgx_h100", "cluster.nodes=1"],
             ("train.global_batch_size=8 has none for more ranks",)),
            ("pin-plan-ds-nofit-named", ["backend=deepspeed", "model=llama3_70b", "cluster=dgx_h100",
                                         "train.global_batch_size=64", "train.seq_length=8192", "backend.zero_stage=1",
                                         "cfp.micro_batch=1"], ("remove backend.zero_stage, cfp.micro_batch)",)),
            ("pin-plan-ds-mbset", ["backend=deepspeed", "cfp.constraints.micro_batch=[3]", "--world", "2"],
             ("cfp.constraints.micro_batch",)),
            ("pin-plan-ds-tp", ["backend=deepspeed", "cfp.tp=2", "--world", "2"], ("cfp.tp=[2]:",)),
            ("pin-plan-ds-recompute", ["backend=deepspeed", "cfp.recompute=selective", "--world", "1"],
             ("cfp.recompute=['selective']:",)),
            ("plan-manual-mode", ["+cfp=manual", "--world", "1"], ("cfp='manual':",)),
            ("plan-auto-string", ["cfp.plan=gpt_tiny@localx1x1", "--world", "1"], ("cfp.plan='gpt_tiny@localx1x1':",))]:
        found.append(Case(id=cid, command="plan", what="python -m cfp_megatron.plan " + " ".join(args), names=names,
                          run=lambda work, a=args: in_process(lambda: plan_main(a, work), timeout_s=120)))
    found.append(Case(id="mem-train-8b", command="train", mode="torchrun", names=("fits in memory",),
                      once="cfp-megatron: ConfigError",
                      what="torchrun --nproc_per_node=2 launch/train.py +cfp=auto model=llama3_8b",
                      run=lambda work: torchrun(2, ["+cfp=auto", "model=llama3_8b"], work)))
    shape = ["model=llama3_8b", "model.num_layers=6", "parallel.tp=2", "cluster.nodes=2"]  # 17.8 GiB a rank
    found.append(Case(id="mem-train-nodes-shape", command="train", mode="torchrun", names=("cluster.nodes=2",),
                      once="cfp-megatron: ConfigError",
                      what="torchrun --nproc_per_node=2 launch/train.py " + " ".join(shape) + " (both ranks on "
                           "this host, each planned with all of it)",
                      run=lambda work: torchrun(2, shape, work)))
    return found


def _checkpoint_ownership_cases() -> list[Case]:
    """Checkpoint folders owned and never clobbered (both backends): step folders without their pointer, a folder
    another job holds or wrote, a resume under another model or with nothing left to do, a pointer that is not ASCII
    digits, a broken lock file, and a save on a full disk. Fake folders carry real manifests."""
    from cfp_megatron.engine.checkpoint import LATEST

    found: list[Case] = []

    def fresh(work: Path) -> Path:
        """A checkpoint folder of its own for one case (the cases share ``work``)."""
        return Path(tempfile.mkdtemp(prefix="ckpt-", dir=_mkdir(work / "ownership")))

    def folder(root: Path, step: int, *, ds: bool = False, pointer: bool = True, writer: str | None = None,
               model: object = None, manifest_: bool = True, state: dict | None = None) -> Path:
        from cfp_megatron.base.jsonio import json_plain
        from cfp_megatron.engine import manifest

        name, latest = (f"global_step{step}", "latest") if ds else (f"iter_{step:07d}", LATEST)
        path = _mkdir(root / name)
        (path / "shard.distcp").write_bytes(os.urandom(128))
        if manifest_:
            manifest.write_manifest(path, {"model": json_plain(model) if model is not None else None,
                                           "writer": writer, "state": state})
        if pointer:
            (root / latest).write_text(f"global_step{step}" if ds else f"{step}\n")
        return path

    def check(make: Callable[[Path], Path], *, ds: bool = False, **kw: object) -> Callable[[Path], Result]:
        def run(work: Path) -> Result:
            from cfp_megatron.engine.checkpoint import MEGATRON, check_folder

            scheme = MEGATRON
            if ds:
                from cfp_megatron.backends.deepspeed.checkpoint import SCHEME as scheme
            root = make(fresh(work))
            kw.setdefault("resume", True)
            kw.setdefault("trust_unverified", False)
            return in_process(lambda: check_folder(str(root), scheme, restarted=False, note=print, **kw))
        return run

    def two(root: Path, *, ds: bool = False, pointer: bool = False) -> Path:
        folder(root, 2, ds=ds, pointer=pointer)
        folder(root, 4, ds=ds, pointer=pointer)
        return root

    def gpt_tiny() -> object:
        from cfp_megatron.base.compose import compose_config
        from cfp_megatron.base.config import job_from_config

        return job_from_config(compose_config([])).model

    def model_of(overrides: Sequence[str]) -> object:
        from cfp_megatron.base.compose import compose_config
        from cfp_megatron.base.config import job_from_config

        return job_from_config(compose_config(list(overrides))).model

    def pointer_text(root: Path, text: str | bytes, ds: bool = False) -> Path:
        folder(root, 4, ds=ds)
        (root / ("latest" if ds else LATEST)).write_bytes(text if isinstance(text, bytes) else text.encode())
        return root

    def live_lock(root: Path, host: str | None = None) -> Path:
        from cfp_megatron.engine.checkpoint_lock import LOCK, process_start

        _mkdir(root)
        (root / LOCK).write_text(json.dumps({"job": "other-job", "host": host or socket.gethostname(),
                                             "pid": os.getppid(), "started": process_start(os.getppid()),
                                             "token": "t"}))
        return root

    def lock_check(make: Callable[[Path], Path]) -> Callable[[Path], Result]:
        def run(work: Path) -> Result:
            from cfp_megatron.engine import checkpoint_lock

            root = make(fresh(work))
            return in_process(lambda: checkpoint_lock.check(str(root), note=print))
        return run

    def train(overrides: Sequence[str], make: Callable[[Path], Path]) -> Callable[[Path], Result]:
        def run(work: Path) -> Result:
            from cfp_megatron.base.compose import compose_config
            from cfp_megatron.planner.entry import train_from_config

            root = make(fresh(work))
            with contextlib.chdir(_mkdir(work / "cwd")):
                return in_process(lambda: train_from_config(compose_config(
                    [f"train.checkpoint_dir={root}", "train.resume=true", *overrides])), timeout_s=120)
        return run

    def prepare_foreign_partial(work: Path) -> Result:
        from cfp_megatron.engine.checkpoint import MEGATRON, agree, prepare_save

        root = fresh(work)
        _mkdir(root / "iter_0000004.partial")  # another job's save in flight
        return in_process(lambda: agree(prepare_save(root, root / "iter_0000004", MEGATRON)))

    def publish_over_foreign(work: Path) -> Result:
        from cfp_megatron.engine import manifest

        root = fresh(work)
        final = folder(root, 4, writer="another-job")
        partial = _mkdir(root / "iter_0000004.partial")
        return in_process(lambda: manifest.publish(partial, final, root / LATEST, "4\n", {"writer": "this-job"}))

    def save_on_full_disk(work: Path) -> Result:
        """A save's publishing (manifest, rename, pointer) on a full tmpfs, or a rank's write failing with ENOSPC
        where mounting is not allowed."""
        from cfp_megatron.engine.checkpoint import finish_save

        disk = fresh(work)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                                 capture_output=True).returncode == 0
        try:
            root = _mkdir(disk / "ckpt")
            partial = _mkdir(root / "iter_0000004.partial")
            error: OSError | None = None
            if mounted:
                with contextlib.suppress(OSError), open(partial / "shard.distcp", "wb") as fh:
                    fh.write(os.urandom(1 << 20))
            else:
                error = OSError(28, "No space left on device")
            return in_process(lambda: finish_save(partial, root / "iter_0000004", root / LATEST, "4\n", {}, error))
        finally:
            if mounted:
                subprocess.run(["umount", str(disk)], check=False)

    def torchrun_full_disk(work: Path, ds: bool) -> Result:
        disk = fresh(work)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5000k", "tmpfs", str(disk)],
                          capture_output=True).returncode != 0:
            return Result(exit_code=0, output="mounting a tmpfs is not allowed here")
        try:
            extra = ["backend=deepspeed", "backend.zero_stage=1"] if ds else []
            return torchrun(2, [*extra, "train.save_interval=1", f"train.checkpoint_dir={disk / 'ckpt'}"], work,
                            timeout_s=400)
        finally:
            subprocess.run(["umount", str(disk)], check=False)

    C = "checkpoint"
    for cid, what, run, names, report in [
            ("own-fresh-no-pointer", "a fresh run into a folder whose pointer file was removed (iter_0000002, "
             "iter_0000004 there)", check(two, resume=False, steps=4, save_interval=2), ("iter_0000004",), False),
            ("own-fresh-ds-no-pointer", "a fresh DeepSpeed run into a folder holding global_step folders, no latest",
             check(lambda r: two(r, ds=True), ds=True, resume=False, steps=4), ("global_step4",), False),
            ("own-fresh-only-folder", "a fresh run into a folder holding one step folder without manifest or pointer",
             check(lambda r: (folder(r, 7, pointer=False, manifest_=False), r)[1], resume=False, steps=2),
             ("iter_0000007",), False),
            ("own-resume-no-pointer", "train.resume=true with the pointer removed: the newest verified folder is "
             "resumed, and said", check(two, steps=6, save_interval=2), ("resuming from",), True),
            ("own-resume-none-verifies", "train.resume=true, no pointer, every step folder damaged",
             check(lambda r: (folder(r, 3, pointer=False, manifest_=False), r)[1], steps=6),
             ("iter_0000003",), False),
            ("own-resume-stale-pointer", "the pointer names step 2 while another run's iter_0000004 is there "
             "(the run would save over it)", check(lambda r: (folder(r, 4, writer="x"), folder(r, 2), r)[2],
                                                    steps=6, save_interval=2), ("iter_0000004",), False),
            ("own-ds-stale-pointer", "DeepSpeed: latest names global_step2, another run's global_step6 is there, "
             "train.steps=6", check(lambda r: (folder(r, 6, ds=True), folder(r, 2, ds=True), r)[2], ds=True, steps=6),
             ("global_step6",), False),
            ("own-lock-live", "another live job on this host holds the folder's lock",
             lock_check(live_lock), ("pid",), False),
            ("own-lock-other-host", "a job on another host holds the folder's lock",
             lock_check(lambda r: live_lock(r, "node-b.example")), ("node-b.example",), False),
            ("own-lock-folder", "cfp_lock.json is a folder", lock_check(lambda r: _mkdir(r / "cfp_lock.json").parent),
             ("cfp_lock.json",), False),
            ("own-lock-garbled", "cfp_lock.json holds binary garbage",
             lock_check(lambda r: (_mkdir(r), (r / "cfp_lock.json").write_bytes(b"\x00\xff{"), r)[2]),
             ("cfp_lock.json",), False),
            ("own-lock-incomplete", "cfp_lock.json is JSON without the owner's pid",
             lock_check(lambda r: (_mkdir(r), (r / "cfp_lock.json").write_text('{"job": "j", "host": "h"}'), r)[2]),
             ("cfp_lock.json",), False),
            ("own-partial-in-flight", "a save whose .partial folder another job is writing (no lock of its own)",
             prepare_foreign_partial, ("iter_0000004.partial",), False),
            ("own-publish-foreign", "a save publishing over a step folder another run wrote",
             publish_over_foreign, ("iter_0000004",), False),
            ("own-pointer-superscript", "latest_checkpointed_iteration.txt holding '²' (a digit to str.isdigit)",
             check(lambda r: pointer_text(r, "²")), (LATEST,), False),
            ("own-pointer-arabic", "latest_checkpointed_iteration.txt holding '٣' (Arabic-Indic three)",
             check(lambda r: pointer_text(r, "٣")), (LATEST,), False),
            ("own-pointer-negative", "latest_checkpointed_iteration.txt holding '-1'",
             check(lambda r: pointer_text(r, "-1")), (LATEST,), False),
            ("own-pointer-empty", "latest_checkpointed_iteration.txt empty",
             check(lambda r: pointer_text(r, "")), (LATEST,), False),
            ("own-pointer-binary", "latest_checkpointed_iteration.txt holding binary bytes",
             check(lambda r: pointer_text(r, b"\x00\xff\x04")), (LATEST,), False),
            ("own-ds-pointer-superscript", "DeepSpeed's latest holding 'global_step²'",
             check(lambda r: pointer_text(r, "global_step²", ds=True), ds=True), ("latest",), False),
            ("own-save-full-disk", "a save publishing on a full disk (64k tmpfs)", save_on_full_disk,
             ("disk is full",), False)]:
        found.append(Case(id=cid, command=C, what=what, names=names, run=run, report_ok=report))
    found.append(Case(id="own-model-layers", command=C, names=("model.num_layers",),
                      what="train.resume=true with model.num_layers=8 over a 4-layer checkpoint",
                      run=lambda work: check(lambda r: (folder(r, 4, model=gpt_tiny()), r)[1],
                                             model=model_of(["model.num_layers=8"]), steps=6)(work)))
    for cid, what, overrides, names, report in [
            ("own-model-llama", "launch/train.py model=llama_tiny train.resume=true over a gpt_tiny checkpoint",
             ["model=llama_tiny", "train.steps=8"], ("model.normalization",), False),
            ("own-nothing-left", "launch/train.py train.resume=true train.steps=4 at saved step 4",
             ["train.steps=4"], ("train.steps=4",), True),
            ("own-nothing-left-ds", "launch/train.py backend=deepspeed train.resume=true train.steps=2 at saved "
             "step 4", ["backend=deepspeed", "train.steps=2"], ("train.steps=2",), True)]:
        ds = "backend=deepspeed" in overrides
        found.append(Case(id=cid, command="train", what=what, names=names, report_ok=report,
                          run=train(overrides, lambda r, d=ds: (folder(r, 4, ds=d, model=gpt_tiny()), r)[1])))
    found.extend(_checkpoint_review_cases(folder, fresh, check, lock_check, train, gpt_tiny))
    if os.geteuid() == 0:
        for cid, ds in [("own-train-full-disk", False), ("own-train-full-disk-ds", True)]:
            found.append(Case(id=cid, command="train", mode="torchrun", names=("the disk is full",),
                              what="torchrun --nproc_per_node=2 launch/train.py train.save_interval=1 "
                                   f"{'backend=deepspeed ' if ds else ''}train.checkpoint_dir=<a 5 MB tmpfs>",
                              run=lambda work, d=ds: torchrun_full_disk(work, d)))
    return found


def _checkpoint_review_cases(folder: Callable[..., Path], fresh: Callable[[Path], Path],
                             check: Callable[..., Callable[[Path], Result]],
                             lock_check: Callable[[Callable[[Path], Path]], Callable[[Path], Result]],
                             train: Callable[[Sequence[str], Callable[[Path], Path]], Callable[[Path], Result]],
                             gpt_tiny: Callable[[], object]) -> list[Case]:
    """The second review's checkpoint cases (part of :func:`_checkpoint_ownership_cases`, with its helpers): step
    folders named almost right, a checkpoint folder inside another's step folder or that is no folder, the other
    backend's checkpoints, only unfinished saves, lock and manifest fields of the wrong type or kind, named pipes,
    a resume under another precision, ZeRO stage or data-parallel size, an empty setting, another tool's folder."""
    from cfp_megatron.engine.checkpoint import LATEST

    found: list[Case] = []

    def renamed(root: Path, new: str, *, ds: bool = False) -> Path:
        folder(root, 4, ds=ds, pointer=False, model=gpt_tiny()).rename(root / new)
        return root

    def inside(work: Path) -> Result:
        from cfp_megatron.engine.checkpoint import MEGATRON, check_folder

        root = fresh(work)
        folder(root, 2, model=gpt_tiny())
        return in_process(lambda: check_folder(str(root / "iter_0000002"), MEGATRON, resume=False, restarted=False,
                                               trust_unverified=False, steps=2))

    def place(make: Callable[[Path], object]) -> Callable[[Path], Result]:
        def run(work: Path) -> Result:
            from cfp_megatron.engine.checkpoint import MEGATRON, check_folder

            root = fresh(work) / "ckpt"
            make(root)
            return in_process(lambda: check_folder(str(root), MEGATRON, resume=True, restarted=False,
                                                   trust_unverified=False))
        return run

    def lock_text(root: Path, **changes: object) -> Path:
        from cfp_megatron.engine.checkpoint_lock import LOCK

        fields = {"job": "j", "host": socket.gethostname(), "pid": os.getppid(), "started": None, "token": "t",
                  **changes}
        (_mkdir(root) / LOCK).write_text(json.dumps(fields))
        return root

    def lock_raw(root: Path, make: Callable[[Path], object]) -> Path:
        from cfp_megatron.engine.checkpoint_lock import LOCK

        make(_mkdir(root) / LOCK)
        return root

    def edited(root: Path, edit: Callable[[dict], object]) -> Path:
        from cfp_megatron.engine.manifest import MANIFEST

        path = folder(root, 4, model=gpt_tiny()) / MANIFEST
        raw = json.loads(path.read_text())
        out = edit(raw)
        path.write_text(out if isinstance(out, str) else json.dumps(raw))
        return root

    def fifo_in_place(root: Path, name: str) -> Path:
        from cfp_megatron.engine.manifest import MANIFEST

        step = folder(root, 4, model=gpt_tiny())
        target = step / MANIFEST if name == MANIFEST else root / name
        target.unlink()
        os.mkfifo(target)
        return root

    def other_tool(root: Path) -> Path:
        import torch

        torch.save({"iteration": 4}, _mkdir(root / "iter_0000004" / "mp_rank_00") / "model_optim_rng.pt")
        (root / LATEST).write_text("4\n")
        return root

    def stated(root: Path, state: dict, *, ds: bool = False) -> Path:
        folder(root, 4, ds=ds, model=gpt_tiny(), state=state)
        return root

    eight = ["model.num_layers=8"]
    C = "checkpoint"
    for cid, what, run, names, report in [
            ("own-odd-width", "train.resume=true, the only step folder named iter_00000004 (eight digits)",
             check(lambda r: renamed(r, "iter_00000004")), ("iter_00000004",), False),
            ("own-ds-odd-tag", "DeepSpeed resume, the only step folder named global_step04",
             check(lambda r: renamed(r, "global_step04", ds=True), ds=True), ("global_step04",),
             False),
            ("own-inside-step-folder", "a fresh run whose train.checkpoint_dir is another checkpoint's iter_0000002",
             inside, ("is the step folder",), False),
            ("own-dir-is-file", "train.resume=true, train.checkpoint_dir a file", place(lambda r: r.write_text("x")),
             ("is not a folder",), False),
            ("own-dir-link-loop", "train.resume=true, train.checkpoint_dir a symbolic link loop",
             place(lambda r: (r.symlink_to(r.with_name("b")), r.with_name("b").symlink_to(r))),
             ("leads back to itself",), False),
            ("own-dir-dangling-link", "train.resume=true, train.checkpoint_dir a symbolic link to nothing",
             place(lambda r: r.symlink_to(r.with_name("gone"))), ("does not exist",), False),
            ("own-other-backend-resume", "the Megatron backend resuming a folder of DeepSpeed checkpoints",
             check(lambda r: (folder(r, 4, ds=True), r)[1]), ("backend=deepspeed",), False),
            ("own-other-backend-fresh", "a fresh Megatron run into a folder of DeepSpeed checkpoints",
             check(lambda r: (folder(r, 4, ds=True), r)[1], resume=False, steps=2), ("global_step4",), False),
            ("own-only-partial", "train.resume=true, the folder holding only an unfinished save (iter_0000002.partial)",
             check(lambda r: (_mkdir(r / "iter_0000002.partial"), r)[1]), ("iter_0000002.partial",), False),
            ("own-lock-pid-zero", "cfp_lock.json naming pid 0 (kill(0) signals the caller's own group)",
             lock_check(lambda r: lock_text(r, pid=0)), ("cfp_lock.json",), False),
            ("own-lock-pid-huge", "cfp_lock.json naming pid 2**40", lock_check(lambda r: lock_text(r, pid=1 << 40)),
             ("cfp_lock.json",), False),
            ("own-lock-started-inf", "cfp_lock.json with started 1e400 (infinite)",
             lock_check(lambda r: lock_raw(r, lambda p: p.write_text(json.dumps(
                 {"job": "j", "host": socket.gethostname(), "pid": 1, "started": None, "token": "t"}).replace(
                 "null", "1e400")))),
             ("cfp_lock.json",), False),
            ("own-lock-dup-keys", "cfp_lock.json giving pid twice (a live pid, then a dead one)",
             lock_check(lambda r: lock_raw(r, lambda p: p.write_text(
                 json.dumps({"job": "j", "host": socket.gethostname(), "pid": os.getppid(), "started": None,
                             "token": "t"})[:-1] + ', "pid": 4194000}'))), ("cfp_lock.json",), False),
            ("own-lock-dangling-link", "cfp_lock.json a symbolic link to nothing",
             lock_check(lambda r: lock_raw(r, lambda p: p.symlink_to(p.with_name("gone.json")))),
             ("cfp_lock.json",), False),
            ("own-lock-fifo", "cfp_lock.json a named pipe", lock_check(lambda r: lock_raw(r, os.mkfifo)),
             ("cfp_lock.json",), False),
            ("own-manifest-no-model", "a manifest with its model removed, resumed with model.num_layers=8",
             check(lambda r: edited(r, lambda raw: raw.pop("model")), model=_model(eight)), ("cfp_manifest.json",),
             False),
            ("own-manifest-model-string", "a manifest whose model is the string 'gpt_tiny', model.num_layers=8",
             check(lambda r: edited(r, lambda raw: raw.__setitem__("model", "gpt_tiny")), model=_model(eight)),
             ("cfp_manifest.json",), False),
            ("own-manifest-dup-key", "a manifest giving 'model' twice (the second an 8-layer model)",
             check(lambda r: edited(r, lambda raw: json.dumps(raw)[:-1] + ', "model": {"num_layers": 8}}'),
                   model=_model(eight)), ("cfp_manifest.json",), False),
            ("own-manifest-outside", "a manifest listing /etc/hostname among its files",
             check(lambda r: edited(r, lambda raw: raw["files"].__setitem__(
                 "/etc/hostname", {"size": 1, "digest": "0" * 32}))), ("cfp_manifest.json",), False),
            ("own-manifest-fifo", "cfp_manifest.json a named pipe (train.trust_unverified_checkpoint=true)",
             check(lambda r: fifo_in_place(r, "cfp_manifest.json"), trust_unverified=True),
             ("cfp_manifest.json",), False),
            ("own-pointer-fifo", "latest_checkpointed_iteration.txt a named pipe",
             check(lambda r: fifo_in_place(r, LATEST)), (LATEST,), False)]:
        found.append(Case(id=cid, command=C, what=what, names=names, run=run, report_ok=report))
    fp32 = {"train.precision": "fp32"}
    stage1 = {"train.precision": "fp32", "backend.zero_stage": 1, "data_parallel_size": 2}
    for cid, what, overrides, make, names in [
            ("own-precision", "launch/train.py train.precision=bf16 train.resume=true over an fp32 checkpoint",
             ["train.precision=bf16", "train.steps=6"], lambda r: stated(r, fp32), ("train.precision",)),
            ("own-ds-zero-family", "backend=deepspeed backend.zero_stage=0 resuming a ZeRO-1 checkpoint",
             ["backend=deepspeed", "backend.zero_stage=0", "train.steps=6"], lambda r: stated(r, stage1, ds=True),
             ("backend.zero_stage",)),
            ("own-ds-dp", "backend=deepspeed backend.zero_stage=1 on 1 rank resuming a ZeRO-1 checkpoint of 2 ranks",
             ["backend=deepspeed", "backend.zero_stage=1", "train.steps=6"], lambda r: stated(r, stage1, ds=True),
             ("data-parallel ranks",)),
            ("own-trust-other-tool", "train.trust_unverified_checkpoint=true over Megatron-LM's older mp_rank_00 "
             "format", ["train.trust_unverified_checkpoint=true", "train.steps=6"], other_tool, ("iter_0000004",))]:
        found.append(Case(id=cid, command="train", what=what, names=names, run=train(overrides, make)))
    found.append(Case(id="own-dir-empty-setting", command="config", names=("train.checkpoint_dir",),
                      what="train.checkpoint_dir= (a shell variable not set) train.save_interval=2",
                      run=lambda work: in_process(lambda: check_train_config(["train.checkpoint_dir=",
                                                                               "train.save_interval=2"]))))

    def torchrun_inside(work: Path) -> Result:
        root = fresh(work)
        folder(root, 2, model=gpt_tiny())
        return torchrun(1, [f"train.checkpoint_dir={root / 'iter_0000002'}"], work, timeout_s=240)

    found.append(Case(id="own-train-inside-step-folder", command="train", mode="torchrun", names=("step folder",),
                      what="torchrun --nproc_per_node=1 launch/train.py train.checkpoint_dir=<a checkpoint>/"
                           "iter_0000002", run=torchrun_inside))
    return found


def _model(overrides: Sequence[str]) -> object:
    """The ModelSpec ``overrides`` compose."""
    from cfp_megatron.base.compose import compose_config
    from cfp_megatron.base.config import job_from_config

    return job_from_config(compose_config(list(overrides))).model


class CaseSkipped(Exception):
    """A case that cannot run on this machine (a tmpfs it cannot mount): counted as ``skipped``, never as ``clear``,
    and not a failure of the catalogue (the totals say how many)."""


MOUNT_SIZE = "64k"
"""Size of the tmpfs of a disk case: a few pages."""


@contextlib.contextmanager
def _tmpfs(folder: Path, state: str) -> Iterator[Path]:
    """A :data:`MOUNT_SIZE` tmpfs mounted at ``folder`` for one disk case, unmounted after: ``full`` (filled with
    zeros), ``ro`` (read-only, holding ``kept.json``), ``small`` (empty, filled half-way by a large write) or
    ``tiny`` (one 4 KiB page: the start's checks pass, the first real file fills it). Raises :class:`CaseSkipped`
    where this machine cannot mount (not root, no CAP_SYS_ADMIN)."""
    folder.mkdir(parents=True, exist_ok=True)
    size = "4k" if state == "tiny" else MOUNT_SIZE
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                 capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise CaseSkipped(f"cannot mount a tmpfs here ({err}); needs root with CAP_SYS_ADMIN") from None
    if mounted.returncode != 0:
        raise CaseSkipped(f"cannot mount a tmpfs here ({mounted.stderr.strip() or mounted.returncode}); needs root "
                          "with CAP_SYS_ADMIN")
    try:
        if state == "full":
            with open(folder / "filler", "ab", buffering=0) as fh, contextlib.suppress(OSError):
                while True:
                    fh.write(b"\0" * 4096)
        elif state == "ro":
            (folder / "kept.json").write_text('{"kept": true}\n')
            subprocess.run(["mount", "-o", "remount,ro", str(folder)], capture_output=True, timeout=30, check=True)
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30, check=False)


def _disk_cases() -> list[Case]:
    """Full and read-only disks for each command that writes (real tmpfs mounts; ``skipped`` where mounting is not
    allowed), a lock path that is a folder, and a metrics file cfp-megatron did not create: each one message naming
    the file and the setting or option that chose it, nothing left half-written."""
    found: list[Case] = []

    def on_disk(cid: str, command: str, what: str, names: Sequence[str], state: str,
                run: Callable[[Path, Path], Result], *, mode: str = "in-process", report_ok: bool = False) -> None:
        def case(work: Path) -> Result:
            with _tmpfs(work / f"disk-{cid}", state) as disk:
                return run(disk, work)
        found.append(Case(id=cid, command=command, what=what, names=tuple(names), run=case, mode=mode,
                          report_ok=report_ok))

    def with_cache(cache: Path, fn: Callable[[], object], timeout_s: float = 120.0) -> Result:
        kept = os.environ.get("CFP_CACHE_DIR")
        os.environ["CFP_CACHE_DIR"] = str(cache)
        try:
            return in_process(fn, timeout_s=timeout_s)
        finally:
            if kept is None:
                os.environ.pop("CFP_CACHE_DIR", None)
            else:
                os.environ["CFP_CACHE_DIR"] = kept

    def analyze(args: Sequence[str], cache: Path) -> Result:
        from cfp_megatron.analyze import main

        return with_cache(cache, lambda: main(list(args)))

    def preprocess(disk: Path, work: Path, prefix: str) -> Result:
        from cfp_megatron.data.preprocess import main

        corpus = work / "disk-corpus.jsonl"
        corpus.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(2000)))
        return in_process(lambda: main(["--input", str(corpus), "--output-prefix", str(disk / prefix)]))

    def store() -> object:
        from cfp_megatron.profile.db import ProfileDB, store_db

        return store_db(ProfileDB.from_json(sample_db_json()))

    def profile(args: Sequence[str]) -> int:
        from cfp_megatron.profile.cli import main

        return main(list(args))

    def metrics_fill(disk: Path) -> int:
        from cfp_megatron.engine.metrics import MetricsLog

        log = MetricsLog(disk / "metrics.jsonl", enabled=True)
        for step in range(200):  # a run logging steps while its disk fills: warned once, training goes on
            log.event("step", step=step, padding="x" * 1500)
        return 0

    def train(overrides: Sequence[str], work: Path) -> Result:
        def run() -> object:
            from cfp_megatron.base.compose import compose_config
            from cfp_megatron.planner.entry import train_from_config

            with contextlib.chdir(_mkdir(work / "cwd")):
                return train_from_config(compose_config(["train.steps=1", *overrides]))
        return in_process(run, timeout_s=120)

    def png(disk: Path) -> object:
        from cfp_megatron.base.compose import compose_job
        from cfp_megatron.sim.simulate import simulate
        from cfp_megatron.sim.timeline import write_png

        job = compose_job(["cluster=dgx_a100", "parallel.pp=2"])
        return write_png(simulate(job, job.cluster, None, world_size=8, with_events=True), disk / "timeline.png")

    def run_dir(disk: Path) -> object:
        from cfp_megatron.planner.entry import check_run_dir_arg

        return check_run_dir_arg([f"hydra.run.dir={disk / 'run'}", "model=gpt_tiny"])

    on_disk("disk-plan-out-full", "plan", "plan --world 2 --out <full disk>", ("--out",), "full",
            lambda disk, work: in_process(lambda: plan_main(["--world", "2", "--out", str(disk / "plans")], work)))
    on_disk("disk-plan-out-ro", "plan", "plan --world 2 --out <read-only disk>", ("--out",), "ro",
            lambda disk, work: in_process(lambda: plan_main(["--world", "2", "--out", str(disk)], work)))
    on_disk("disk-plan-file-full", "plan", "plan --world 2 cfp.plan_file=<full disk>/p/plan.json",
            ("cfp.plan_file",), "full",
            lambda disk, work: in_process(lambda: plan_main(["--world", "2", f"cfp.plan_file={disk}/p/plan.json"],
                                                            work)))
    on_disk("disk-plan-subprocess", "plan", "python -m cfp_megatron.plan --world 2 --out <read-only disk>/plans",
            ("--out",), "ro",
            lambda disk, work: run_process([sys.executable, "-m", "cfp_megatron.plan", "--world", "2", "--out",
                                            str(disk / "plans")], work, 120.0), mode="subprocess")
    on_disk("disk-analyze-json-full", "analyze", "analyze --json <full disk>/analysis.json", ("--json",), "full",
            lambda disk, work: analyze(["--json", str(disk / "analysis.json")], work / "cache"))
    on_disk("disk-analyze-json-ro", "analyze", "analyze --json <read-only disk>/kept.json (an earlier result)",
            ("--json",), "ro", lambda disk, work: analyze(["--json", str(disk / "kept.json")], work / "cache"))
    on_disk("disk-analyze-cache-ro", "analyze", "CFP_CACHE_DIR=<read-only disk> analyze --no-cache",
            ("CFP_CACHE_DIR",), "ro",
            lambda disk, work: analyze(["--no-cache", "--json", str(work / "a.json")], disk / "cache"))
    on_disk("disk-preprocess-fills", "data", "preprocess a 290 KB corpus onto a 64 KiB disk (fills mid-write)",
            ("--output-prefix",), "small", lambda disk, work: preprocess(disk, work, "data/corpus"))
    on_disk("disk-preprocess-ro", "data", "preprocess --output-prefix <read-only disk>/corpus",
            ("--output-prefix",), "ro", lambda disk, work: preprocess(disk, work, "corpus"))
    on_disk("disk-profile-export-full", "profile", "profile model=gpt_tiny --export <full disk>/db.json",
            ("--export",), "full",
            lambda disk, work: with_cache(work / "cache", lambda: profile(
                ["model=gpt_tiny", "--export", str(disk / "db.json")])))
    on_disk("disk-profiledb-full", "cache", "CFP_CACHE_DIR=<full disk>: the ProfileDB store", ("CFP_CACHE_DIR",),
            "full", lambda disk, work: with_cache(disk / "cache", store))
    on_disk("disk-profiledb-ro", "cache", "CFP_CACHE_DIR=<read-only disk>: the ProfileDB store", ("CFP_CACHE_DIR",),
            "ro", lambda disk, work: with_cache(disk / "cache", store))
    on_disk("disk-run-dir-full", "train", "launch/train.py hydra.run.dir=<full disk>/run (before Hydra starts)",
            ("hydra.run.dir",), "full", lambda disk, work: in_process(lambda: run_dir(disk)))
    on_disk("disk-train-run-dir-full", "train", "torchrun --nproc_per_node=1 launch/train.py, run folder and cache "
            "on a full disk", ("hydra.run.dir",), "full",
            lambda disk, work: torchrun(1, ["model=gpt_tiny"], disk, timeout_s=180.0), mode="torchrun")
    on_disk("disk-profile-store-fills", "profile", "torchrun --nproc_per_node=2 -m cfp_megatron.profile with "
            "CFP_CACHE_DIR on a 4 KiB disk (the ProfileDB store fills it)", ("CFP_CACHE_DIR",), "tiny",
            lambda disk, work: run_process([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                            f"--master_port={_free_port()}", "-m", "cfp_megatron.profile",
                                            "model=gpt_tiny", "--budget", "20"], disk, 240.0), mode="torchrun")
    on_disk("disk-metrics-ro", "train", "train.metrics_file=<read-only disk>/metrics.jsonl", ("train.metrics_file",),
            "ro", lambda disk, work: train([f"train.metrics_file={disk / 'metrics.jsonl'}"], work))
    on_disk("disk-metrics-fills", "train", "the metrics file's disk fills during training (rank 0's log)",
            ("the metrics file stops here",), "small",
            lambda disk, work: in_process(lambda: metrics_fill(disk)), report_ok=True)
    on_disk("disk-timeline-full", "plan", "the plan's timeline PNG onto a full disk", ("timeline.png",), "full",
            lambda disk, work: in_process(lambda: png(disk)))

    def user_file(work: Path, name: str, text: str) -> Path:
        path = work / "home" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    for cid, name, text in [("metrics-user-notes", "notes.txt", "my notes\n"),
                            ("metrics-user-jsonl", "events.jsonl", '{"event": "step", "loss": 1.0}\n'),
                            ("metrics-user-binary", "model.bin", "\x00\x01binary")]:
        found.append(Case(id=cid, command="train", what=f"train.metrics_file=$HOME/{name} (a file of the user's)",
                          names=("train.metrics_file",),
                          run=lambda work, n=name, t=text: train(
                              [f"train.metrics_file={user_file(work, n, t)}"], work)))

    def fifo(work: Path) -> Path:
        path = work / "home" / "metrics.fifo"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            os.mkfifo(path)
        return path

    found.append(Case(id="metrics-fifo", command="train", what="train.metrics_file=<a named pipe nobody reads>",
                      names=("train.metrics_file",), run=lambda work: train([f"train.metrics_file={fifo(work)}"],
                                                                            work)))

    def lock_folder() -> object:
        from cfp_megatron.profile.db import ProfileDB, db_path, lock_path, store_db

        db = ProfileDB.from_json(sample_db_json())
        lock_path(db_path(db.fingerprint)).mkdir(parents=True, exist_ok=True)  # a folder where the lock file goes
        return store_db(db)

    found.append(Case(id="lock-is-a-folder", command="cache", what="the ProfileDB's lock path is a folder",
                      names=("lock file is a folder",),
                      run=lambda work: with_cache(work / "cache-lock-folder", lock_folder)))

    # Megatron's dataset index cache (GPTDataset's .npy files): beside the data when data.cache_dir is unset
    def indexed(prefix: str, *extra: str) -> Result:
        return in_process(lambda: _build_indexed(["data=indexed", "model.vocab_size=257", f"data.path=[{prefix}]",
                                                  "train.seq_length=32", *extra]), timeout_s=120)

    def data_copy(disk: Path, work: Path) -> str:
        for ext in (".bin", ".idx"):
            shutil.copy(build_corpus(work) + ext, disk / f"corpus{ext}")
        return str(disk / "corpus")

    def on_read_only_data(work: Path, launch: Callable[[str], Result]) -> Result:
        with _tmpfs(work / f"disk-data-ro-{time.monotonic_ns()}", "small") as disk:
            prefix = data_copy(disk, work)
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True, timeout=30, check=True)
            return launch(prefix)

    found.append(Case(id="disk-data-cache-beside-ro", command="data", what="data.path on a read-only disk, "
                      "data.cache_dir unset (Megatron writes its index cache beside the data)",
                      names=("data.cache_dir",), run=lambda work: on_read_only_data(work, indexed)))
    found.append(Case(id="disk-train-data-ro", command="train", mode="torchrun", names=("data.cache_dir",),
                      what="torchrun --nproc_per_node=2 launch/train.py data=indexed, the data on a read-only disk",
                      once="cfp-megatron: ConfigError", run=lambda work: on_read_only_data(
                          work, lambda prefix: torchrun(2, ["data=indexed", "model.vocab_size=257",
                                                            f"data.path=[{prefix}]"], work))))
    on_disk("disk-data-cache-full", "data", "data.cache_dir=<full disk>", ("data.cache_dir",), "full",
            lambda disk, work: indexed(build_corpus(work), f"data.cache_dir={disk / 'cache'}"))
    on_disk("disk-train-data-cache-small", "train", "torchrun --nproc_per_node=2 launch/train.py data=indexed "
            "data.cache_dir=<a 4 KiB disk> (writable, with less room than Megatron's index takes)",
            ("data.cache_dir",),
            "tiny", lambda disk, work: torchrun(2, ["data=indexed", "model.vocab_size=257",
                                                   f"data.path=[{build_corpus(work)}]", "train.steps=200",
                                                   f"data.cache_dir={disk / 'cache'}"], work), mode="torchrun")
    on_disk("disk-data-cache-small", "data", "data.cache_dir=<a 4 KiB disk> (less room than the index takes)",
            ("data.cache_dir",), "tiny",
            lambda disk, work: indexed(build_corpus(work), f"data.cache_dir={disk / 'cache'}", "train.steps=200"))

    def notes(work: Path) -> Path:
        return _touch(work / "home" / "analysis-notes.txt")

    def analyze_into(path: Path, cache: Path) -> Result:
        result = analyze(["--json", str(path)], cache)
        kept = path.read_text() == "occupied\n"
        return result if kept else Result(exit_code=0, output=f"{path} was replaced (lost)\n" + result.output)

    found.append(Case(id="analyze-json-user-file", command="analyze", what="analyze --json $HOME/notes.txt (a file "
                      "of the user's)", names=("left as it is",),
                      run=lambda work: analyze_into(notes(work), work / "cache")))
    return found


def _build_indexed(overrides: Sequence[str]) -> object:
    """An indexed-data config checked as ``launch/train.py`` checks it, then its dataset built as training builds
    it (Megatron's index cache written)."""
    from cfp_megatron.base.compose import compose_config
    from cfp_megatron.base.config import job_from_config
    from cfp_megatron.data.batches import build_samples

    check_train_config(overrides)
    return build_samples(job_from_config(compose_config(list(overrides))))


def _stall_cases() -> list[Case]:
    """A stalled rank (``kill -STOP``), a launcher killed (``kill -9`` of torchrun) and Ctrl-C (SIGINT to one rank,
    to torchrun, to the whole job) in the middle of real torchrun runs: the stall is named by the ranks that waited
    for it (``train.collective_timeout_s`` shortened to 10 s), no rank outlives its launcher, and an interrupt is one
    line naming the step and the last checkpoint (engine/rank_watch.py)."""
    import threading

    def rank_pids(parent: int) -> dict[int, int]:
        """The workers torchrun ``parent`` started, by RANK (read from /proc)."""
        found: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != parent:
                    continue
                variables = (entry / "environ").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            for var in variables:
                if var.startswith(b"RANK="):
                    found[int(var[5:])] = int(entry.name)
        return found

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    def progress_of(port: int, prefix: str, rank: int) -> str:
        """What ``rank`` recorded as its progress in torchrun's store on ``port`` (under the process group's
        ``prefix``; engine/rank_watch.py), or ``""``."""
        import datetime

        import torch.distributed as dist

        with contextlib.suppress(Exception):
            store = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False,
                                                           timeout=datetime.timedelta(seconds=2)))
            key = f"cfp/watch/rank/{rank}"
            if store.check([key]):
                return json.loads(store.get(key))["where"]
        return ""

    def signalled(argv_tail: Callable[[Path], Sequence[str]], *, target: str, sig: signal.Signals,
                  after: str | tuple[str, str], said: str | None = None, then: tuple[str, signal.Signals] | None = None,
                  timeout_s: float = 150.0) -> Callable[[Path], Result]:
        """Start ``torchrun --nproc_per_node=2 argv_tail(work)``; once a line starts with ``after`` (or, for
        ``(prefix, text)``, rank 1's recorded progress holds ``text``), send ``sig`` to ``target`` (``rank0``,
        ``rank1``, ``torchrun``, ``job``: torchrun's process group, as Ctrl-C in a terminal), and 2 s later ``then``'s
        signal to its target; for a stop, once ``said`` is printed, continue the stopped rank (torchrun's SIGTERM
        then ends it at once, not after its 30 s wait)."""
        def run(work: Path) -> Result:
            port = _free_port()
            argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                    *argv_tail(work)]
            start = time.perf_counter()
            proc = subprocess.Popen(argv, cwd=ROOT, env=_env(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)

            def send(who: str, what: signal.Signals) -> None:
                if who == "job":
                    os.killpg(proc.pid, what)
                else:
                    os.kill(proc.pid if who == "torchrun" else ranks[int(who[-1])], what)
            lines: list[str] = []
            reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
            reader.start()

            def wait_for(test: Callable[[], bool], seconds: float) -> bool:
                deadline = time.perf_counter() + seconds
                while time.perf_counter() < deadline:
                    if test():
                        return True
                    time.sleep(0.1)
                return False

            ranks: dict[int, int] = {}
            note = ""
            try:
                ready = (lambda: after[1] in progress_of(port, after[0], 1)) if isinstance(after, tuple) else \
                    (lambda: any(line.startswith(after) for line in list(lines)))
                if not wait_for(lambda: ready() or proc.poll() is not None, timeout_s) or proc.poll() is not None:
                    proc.wait(timeout=5)
                    return Result(exit_code=0, output="".join(lines) + f"\n(drill) the job ended before '{after}'",
                                  seconds=time.perf_counter() - start)
                ranks.update(rank_pids(proc.pid))
                send(target, sig)
                if then is not None:
                    time.sleep(2.0)
                    send(*then)
                if sig == signal.SIGKILL and target == "torchrun":  # the launcher: do its ranks end with it?
                    wait_for(lambda: not any(alive(p) for p in ranks.values()), 15.0)
                    left = sorted(r for r, p in ranks.items() if alive(p))
                    note = (f"(drill) ranks still running 15 s after torchrun was killed: {left}\n" if left else
                            f"(drill) ranks {sorted(ranks)} ended with their launcher\n")
                    proc.wait(timeout=5)
                    return Result(exit_code=0 if left else 1, output=note + "".join(lines),
                                  seconds=time.perf_counter() - start)
                if said is not None and wait_for(lambda: any(said in line for line in list(lines)), timeout_s):
                    os.kill(ranks[int(target[-1])], signal.SIGCONT)
                proc.wait(timeout=timeout_s)
                reader.join(5)
                return Result(exit_code=proc.returncode, output="".join(lines),
                              seconds=time.perf_counter() - start)
            except subprocess.TimeoutExpired:
                return Result(exit_code=None, output="".join(lines), seconds=time.perf_counter() - start)
            finally:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                for pid in ranks.values():
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)

        return run

    def train(name: str, *extra: str, checkpoints: bool = False) -> Callable[[Path], list[str]]:
        """launch/train.py's arguments for a long run in ``work/name`` (saving every 2 steps with ``checkpoints``)."""
        return lambda work: ["launch/train.py", "model=gpt_tiny", "train.steps=1000", "train.collective_timeout_s=10",
                             f"hydra.run.dir={work / name / 'run'}", *extra,
                             *(["train.save_interval=2", f"train.checkpoint_dir={work / name / 'ckpt'}"]
                               if checkpoints else [])]

    def profile(*extra: str) -> Callable[[Path], list[str]]:
        return lambda work: ["-m", "cfp_megatron.profile", "model=gpt_tiny", *extra, "--budget", "120", "--force"]

    def step(n: int) -> str:
        return f"step {n:>5}/1000"

    stalled = "cfp-megatron: RankStalledError"
    rounds = ("/cfp-profile/attempt_0", "profiling round")  # rank 1 in a round: both joined the group
    found: list[Case] = []
    for cid, what, tail, target, after in [
            ("stall-rank1-step", "kill -STOP rank 1 while training", train("r1"), "rank1", step(3)),
            ("stall-rank0-step", "kill -STOP rank 0 (the logging rank) while training", train("r0"), "rank0",
             step(3)),
            ("stall-deepspeed", "kill -STOP rank 1 while training with DeepSpeed ZeRO-1",
             train("ds", "backend=deepspeed", "backend.zero_stage=1"), "rank1", step(3)),
            ("stall-profile", "kill -STOP rank 1 while profiling (torchrun -m cfp_megatron.profile)",
             profile("train.collective_timeout_s=10"), "rank1", rounds)]:
        once = stalled if target == "rank1" else f"{stalled} [rank 1]"  # said by a rank that waited
        found.append(Case(id=cid, command="train" if "profile" not in cid else "profile", what=what,
                          names=(f"rank {target[-1]} (",), mode="torchrun", once=once,
                          run=signalled(tail, target=target, sig=signal.SIGSTOP, after=after, said=stalled)))
    for cid, what, tail, after in [
            ("orphan-train", "kill -9 of torchrun while training", train("orphan"), step(3)),
            ("orphan-profile", "kill -9 of torchrun while profiling", profile(), rounds)]:
        found.append(Case(id=cid, command="train" if "train" in cid else "profile", what=what,
                          names=("ended with their launcher",), mode="torchrun",
                          run=signalled(tail, target="torchrun", sig=signal.SIGKILL, after=after)))
    for cid, what, target, name in [
            ("sigint-rank1", "kill -INT rank 1 after two checkpoints", "rank1", "iter_0000004"),
            ("sigint-torchrun", "kill -INT torchrun after two checkpoints", "torchrun", "iter_0000004"),
            ("sigint-ctrl-c", "Ctrl-C (SIGINT to torchrun and both ranks) after two checkpoints", "job",
             "iter_0000004")]:
        found.append(Case(id=cid, command="train", what=what, names=(name,), mode="torchrun",
                          run=signalled(train(cid, checkpoints=True), target=target, sig=signal.SIGINT,
                                        after=step(5))))
    # issue R review: what a scheduler and a closed terminal send; a stop signal while a rank is blocked in a
    # collective; a file only one rank cannot read (an injected fault: that rank's open() refuses the data file)
    term, hup = "(SIGTERM: sent by a scheduler", "(SIGHUP: the terminal that started the job closed"
    for cid, what, target, sig, tail, name in [
            ("sigterm-torchrun", "SIGTERM to torchrun (a scheduler ending the job) after two checkpoints", "torchrun",
             signal.SIGTERM, train("sigterm-torchrun", checkpoints=True), term),
            ("sigterm-job", "SIGTERM to torchrun and both ranks (a scheduler cancelling the job's processes) after "
             "two checkpoints", "job", signal.SIGTERM, train("sigterm-job", checkpoints=True), term),
            ("sigterm-rank1", "SIGTERM to rank 1 only after two checkpoints", "rank1", signal.SIGTERM,
             train("sigterm-rank1", checkpoints=True), term),
            ("sighup-torchrun", "SIGHUP to torchrun (its terminal closed) after two checkpoints", "torchrun",
             signal.SIGHUP, train("sighup-torchrun", checkpoints=True), hup),
            ("sigterm-deepspeed", "SIGTERM to the whole job training with DeepSpeed ZeRO-1 after two checkpoints",
             "job", signal.SIGTERM, train("sigterm-deepspeed", "backend=deepspeed", "backend.zero_stage=1",
                                          checkpoints=True), term)]:
        found.append(Case(id=cid, command="train", what=what, names=(name,), mode="torchrun",
                          run=signalled(tail, target=target, sig=sig, after=step(5))))
    found.append(Case(id="sigterm-profile", command="profile", what="SIGTERM to torchrun while profiling (torchrun "
                      "-m cfp_megatron.profile)", names=(term,), mode="torchrun",
                      run=signalled(profile(), target="torchrun", sig=signal.SIGTERM, after=rounds)))
    found.append(Case(id="sigterm-stalled-peer", command="train", names=(f"cfp-megatron: interrupted {term}",),
                      what="kill -STOP rank 1, then SIGTERM to torchrun: rank 0 is blocked in a collective, where "
                           "Python runs no signal handler", mode="torchrun",
                      run=signalled(train("sigterm-stalled-peer", "train.collective_timeout_s=120"), target="rank1",
                                    sig=signal.SIGSTOP, after=step(3), then=("torchrun", signal.SIGTERM))))
    lost = ("torchrun stopping this rank after another one failed", "closed its connections without saying why")
    for cid, what, tail, after in [
            ("kill9-rank1-step", "kill -9 of rank 1 while training (the OOM killer)", train("kill9-rank1"), step(5)),
            ("kill9-rank1-profile", "kill -9 of rank 1 while profiling", profile(), rounds)]:
        found.append(Case(id=cid, command="train" if "step" in cid else "profile", what=what, names=lost,
                          mode="torchrun", run=signalled(tail, target="rank1", sig=signal.SIGKILL, after=after)))
    found.append(Case(id="rank1-cannot-read-data", command="train", names=("FileAccessError [rank 1]",),
                      what="torchrun --nproc_per_node=2 launch/train.py data=indexed: rank 1 alone cannot read the "
                           ".bin (permission denied)", mode="torchrun", once="cfp-megatron: FileAccessError [rank 1]",
                      run=_one_rank_denied))
    return found


_DENY_ON_RANK1 = """import builtins, os
if os.environ.get("RANK") == "1":
    _open, _os_open = builtins.open, os.open
    def _check(path):
        if str(os.fspath(path)).endswith({suffix!r}):
            raise PermissionError(13, "Permission denied", os.fspath(path))
    def _denied(file, *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)):
            _check(file)
        return _open(file, *args, **kwargs)
    def _os_denied(path, *args, **kwargs):
        _check(path)
        return _os_open(path, *args, **kwargs)
    builtins.open, os.open = _denied, _os_denied
"""
"""A ``sitecustomize`` that makes ``open`` refuse, on rank 1 only, the files whose path ends in ``suffix``."""


def _one_rank_denied(work: Path) -> Result:
    """``torchrun --nproc_per_node=2 launch/train.py data=indexed`` where rank 1 alone cannot open the ``.bin`` (its
    ``open`` refuses it, as a file another host cannot read): the error is that rank's, said once, at once."""
    prefix = build_corpus(work)
    inject = _mkdir(work / "rank1-denied")
    (inject / "sitecustomize.py").write_text(_DENY_ON_RANK1.format(suffix=Path(prefix).name + ".bin"))
    env = _env(work)
    env["PYTHONPATH"] = f"{inject}{os.pathsep}{env['PYTHONPATH']}"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
            "launch/train.py", "data=indexed", f"data.path=[{prefix}]", "train.steps=2",
            f"hydra.run.dir={work / f'run-{time.monotonic_ns()}'}"]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=240, start_new_session=True)
    return Result(exit_code=done.returncode, output=done.stdout, seconds=time.perf_counter() - start)


def _hydra_cases() -> list[Case]:
    """Hydra's own failures on ``launch/train.py``'s command line (and the CLIs'): each one error naming the key and
    the fix, said once, exit status 2, before Hydra runs; a group removed or emptied and an empty run folder refused;
    a key given twice said (the last wins, a wrapper may append one)."""
    found: list[Case] = []

    def command_line(argv: Sequence[str], work: Path) -> Result:
        """``launch/train.py``'s check of its command line on one rank (then its run folder's), from ``work``."""
        def run() -> object:
            from cfp_megatron.planner.entry import check_run_dir_arg
            from cfp_megatron.planner.hydra_args import check_command_line

            with contextlib.chdir(_mkdir(work / "cwd")):
                check_command_line(list(argv))
                check_run_dir_arg(list(argv))
            return 0
        return in_process(run)

    def sweep_on_ranks(argv: Sequence[str], world: int) -> Result:
        from cfp_megatron.planner.hydra_args import check_hydra_args, read_hydra_args

        return in_process(lambda: check_hydra_args(read_hydra_args(argv), world_size=world))

    needs = "every job needs one"
    for cid, argv, names in [
            ("hydra-cfp-without-group", ["cfp.tp=2"], ("+cfp=auto cfp.tp=2",)),
            ("hydra-cfp-constraint-without-group", ["cfp.constraints.tp=[2,4]"], ("+cfp=auto",)),
            ("hydra-cfp-pin-typo", ["+cfp=auto", "cfp.tpp=2"], ("write cfp.tp=2",)),
            ("hydra-key-typo", ["train.step=5"], ("write train.steps=5",)),
            ("hydra-group-typo", ["trian.steps=5"], ("write train.steps=5",)),
            ("hydra-model-dashes", ["model=llama3-8b"], ("write model=llama3_8b",)),
            ("hydra-cluster-gpu-name", ["cluster=h100"], ("write cluster=dgx_h100",)),
            ("hydra-key-prefix", ["train.seq=64"], ("write train.seq_length=64",)),
            ("hydra-key-without-group", ["hidden_size=64"], ("write model.hidden_size=64",)),
            ("hydra-model-null", ["model=null"], (needs,)),
            ("hydra-model-removed", ["~model"], (needs,)),
            ("hydra-model-removed-by-name", ["~model=gpt_tiny"], (needs,)),
            ("hydra-model-empty", ["model="], (needs,)),
            ("hydra-cluster-removed", ["~cluster"], (needs,)),
            ("hydra-parallel-null", ["parallel=null"], (needs,)),
            ("hydra-train-removed", ["~train"], (needs,)),
            ("hydra-data-blank", ["data=' '"], (needs,)),
            ("hydra-backend-null", ["backend=null"], (needs,)),
            ("hydra-option-path", ["model=../gpt_tiny"], ("is not an option of config group 'model'",)),
            ("hydra-option-file-name", ["model=llama_tiny.yaml"], ("write model=llama_tiny",)),
            ("hydra-option-list", ["model=[gpt_tiny,llama_tiny]"], ("not a list",)),
            ("hydra-plus-on-group", ["+model=llama_tiny"], ("drop the +: model=llama_tiny",)),
            ("hydra-plus-on-key", ["+train.steps=5"], ("drop the +: train.steps=5",)),
            ("hydra-plus-unknown-key", ["+model.foo=1"], ("model.foo",)),
            ("hydra-cfp-without-plus", ["cfp=auto"], ("write +cfp=auto",)),
            ("hydra-cfp-added-twice", ["+cfp=auto", "+cfp=manual"], ("adds the cfp group a second time",)),
            ("hydra-cfp-removed-unadded", ["~cfp"], ("drop ~cfp",)),
            ("hydra-key-removed", ["~model.num_layers"], ("model.num_layers",)),
            ("hydra-double-equals", ["model.num_layers==3"], ("write model.num_layers=3",)),
            ("hydra-open-quote", ["model.num_layers='3"], ("opens a quote",)),
            ("hydra-no-value", ["model.num_layers"], ("model.num_layers=<value>",)),
            ("hydra-split-value", ["data.path=a", "b"], ("b='b'",)),
            ("hydra-sweep-without-m", ["model=gpt_tiny,llama_tiny"], ("add -m",)),
            ("hydra-sweep-bad-option", ["-m", "model=gpt_tiny,gpt_tini"], ("in the sweep's job model=gpt_tini",)),
            ("hydra-unknown-flag", ["--fast", "train.steps=2"], ("--fast",)),
            ("hydra-bad-cfg-choice", ["--cfg", "jobs"], ("'jobs'",)),
            ("hydra-own-key-typo", ["hydra.run.dri=x"], ("write hydra.run.dir=x",)),
            ("hydra-launcher-absent", ["hydra/launcher=joblib"], ("hydra/launcher='joblib'",)),
            ("hydra-run-dir-empty", ["hydra.run.dir="], ("hydra.run.dir='': is empty",)),
            ("hydra-run-dir-blank", ["hydra.run.dir='  '"], ("hydra.run.dir='  ': is empty",)),
            ("hydra-sweep-dir-empty", ["-m", "hydra.sweep.dir="], ("hydra.sweep.dir='': is empty",)),
            ("hydra-config-name-typo", ["--config-name", "confg"], ("write --config-name config",)),
            ("hydra-config-path-missing", ["--config-path", "/nonexistent/conf"], ("--config-path='/nonexistent",)),
            ("hydra-config-dir-missing", ["-cd", "/nonexistent"], ("--config-dir='/nonexistent'",)),
            ("hydra-config-name-key-typo", ["--config-name", "config", "train.step=5"], ("write train.steps=5",)),
            ("hydra-home-unquoted", ["train.checkpoint_dir=~/ck"], ("write the full path: train.checkpoint_dir=",)),
            ("hydra-run-dir-home-quoted", ["hydra.run.dir='~/runs'"], ("write the full path: hydra.run.dir=",)),
            ("hydra-chdir", ["hydra.job.chdir=true"], ("a resume would not find",))]:
        found.append(Case(id=cid, command="train", what="launch/train.py " + " ".join(argv), names=names,
                          run=lambda work, a=argv: command_line(a, work)))
    found.append(Case(id="hydra-key-twice", command="train", what="launch/train.py train.steps=3 train.steps=4",
                      names=("train.steps is given 2 times",), report_ok=True,
                      run=lambda work: command_line(["train.steps=3", "train.steps=4"], work)))
    found.append(Case(id="hydra-multirun-ranks", command="train", names=("one torchrun per job",),
                      what="torchrun --nproc_per_node=2 launch/train.py -m train.steps=1,2 (checked on 2 ranks)",
                      run=lambda work: sweep_on_ranks(["-m", "train.steps=1,2"], 2)))
    for cid, overrides, names in [
            ("hydra-checkpoint-dir-empty", ["train.checkpoint_dir=''"], ("train.checkpoint_dir='': is empty",)),
            ("hydra-metrics-file-blank", ["train.metrics_file='  '"], ("train.metrics_file='  ': is empty",)),
            ("hydra-home-quoted", ["train.checkpoint_dir='~/ck'"], ("write the full path: train.checkpoint_dir=",)),
            ("hydra-home-in-list", ["data=indexed", "data.path=['~/corpus']"], ("write the full path: data.path=[",))]:
        found.append(config_case(cid, overrides, names))
    for cid, overrides, names in [
            ("cluster-cpu-device-name-gpu", ["cluster.device_name=H100"], ("drop cluster.device_name=H100",)),
            ("cluster-cpu-generation-gpu", ["cluster.generation=hopper"], ("drop cluster.generation=hopper",)),
            ("cluster-backend-nccl-on-cpu", ["cluster.backend=nccl"], ("set cluster.backend=gloo",)),
            ("deepspeed-fp16-on-cpu", ["backend=deepspeed", "train.precision=fp16"],
             ("train.precision='fp16': is not supported by DeepSpeed's accelerator here",))]:
        found.append(Case(id=cid, command="train", what="launch/train.py " + " ".join(overrides) + " (no GPU)",
                          names=names, run=lambda work, o=overrides: in_process(lambda: _train_here(o, work))))
    for cid, args, names in [
            ("hydra-plan-run-dir", ["hydra.run.dir=/tmp/somewhere"], ("hydra.run.dir='/tmp/somewhere': configures",)),
            ("hydra-plan-chdir", ["model=llama3_8b", "hydra.job.chdir=true"], ("would ignore it",))]:
        found.append(Case(id=cid, command="plan", what="python -m cfp_megatron.plan " + " ".join(args), names=names,
                          run=lambda work, a=args: in_process(lambda: plan_main(a, work))))
    py = sys.executable
    for cid, argv, names in [
            ("hydra-plan-typo", [py, "-m", "cfp_megatron.plan", "trian.steps=5"], ("train.steps",)),
            ("hydra-analyze-model-removed", [py, "-m", "cfp_megatron.analyze", "~model"], (needs,))]:
        found.append(Case(id=cid, command=argv[2].rpartition(".")[2], what=" ".join(["python", *argv[1:]]),
                          names=names, mode="subprocess", run=lambda work, a=argv: run_process(a, work, 180)))
    for cid, overrides, names in [("hydra-train-typo", ["train.step=5"], ("write train.steps=5",)),
                                  ("hydra-train-cfp-without-group", ["cfp.tp=2"], ("+cfp=auto",)),
                                  ("hydra-train-config-name", ["--config-name", "confg"],
                                   ("write --config-name config",))]:
        found.append(Case(id=cid, command="train", what="torchrun --nproc_per_node=2 launch/train.py "
                          + " ".join(overrides), names=names, mode="torchrun", once="cfp-megatron: ConfigError",
                          run=lambda work, o=overrides: torchrun(2, o, work)))
    return found


def _train_here(overrides: Sequence[str], work: Path) -> object:
    """``launch/train.py``'s pipeline in-process on this machine (one step; skipped where a GPU is present: the
    cases are about a machine without one)."""
    import torch

    from cfp_megatron.base.compose import compose_config
    from cfp_megatron.planner.entry import train_from_config

    if torch.cuda.is_available():
        raise CaseSkipped("this machine has a GPU")
    return train_from_config(compose_config(["train.steps=1", f"hydra.run.dir={work / 'here'}", *overrides]))


def _input_cases() -> list[Case]:
    """Issue R, inputs checked where they enter: token ids against the vocabulary and each ``.idx`` header field
    named as itself (data); a plan applied only to the job it was made for, typed settings held or refused, never
    dropped; plan.json's content hash required, duplicate keys and named pipes refused (planfile, train)."""
    found: list[Case] = []

    def header(offset: int, value: bytes) -> Callable[[Path, Path], None]:
        def damage(bin_path: Path, idx_path: Path) -> None:
            data = bytearray(idx_path.read_bytes())
            data[offset:offset + len(value)] = value
            idx_path.write_bytes(bytes(data))
        return damage

    def token(value: int, *, code: int | None = None) -> Callable[[Path, Path], None]:
        def damage(bin_path: Path, idx_path: Path) -> None:
            data = bytearray(bin_path.read_bytes())
            data[100:102] = value.to_bytes(2, "little")
            bin_path.write_bytes(bytes(data))
            if code is not None:
                header(17, bytes([code]))(bin_path, idx_path)
        return damage

    def fifo_bin(bin_path: Path, idx_path: Path) -> None:
        bin_path.unlink()
        os.mkfifo(bin_path)

    for cid, what, names, damage in [
            ("data-dtype-code", "an .idx whose dtype code was changed (uint16 -> int32)", ("dtype code",),
             header(17, bytes([4]))),
            ("data-dtype-code-narrow", "an .idx whose dtype code was changed (uint16 -> uint8)", ("dtype code",),
             header(17, bytes([1]))),
            ("data-dtype-unknown", "an .idx with dtype code 42, which Megatron does not know", ("dtype code",),
             header(17, bytes([42]))),
            ("data-dtype-float", "an .idx whose dtype code says float32", ("dtype code",), header(17, bytes([7]))),
            ("data-idx-version", "an .idx whose version field says 3", ("version",),
             header(9, (3).to_bytes(8, "little"))),
            ("data-idx-count", "an .idx whose sequence count was changed", ("sequences",),
             header(18, (7).to_bytes(8, "little"))),
            ("data-bin-longer", "a .bin longer than its .idx indexes (another corpus' .idx)", (".bin", ".idx"),
             lambda b, i: b.write_bytes(b.read_bytes() * 2)),
            ("data-ids-over-vocab", "token id 60000 in the data, model.vocab_size=257", ("model.vocab_size",),
             token(60000)),
            ("data-ids-padding-rows", "token id 300 in the data (inside the padded embedding), vocab 257",
             ("model.vocab_size",), token(300)),
            ("data-ids-negative", "a signed dtype code reading ids as negative", ("negative",),
             token(60000, code=3)),
            ("data-bin-fifo", "a named pipe where the .bin belongs", ("named pipe",), fifo_bin)]:
        found.append(data_case(cid, what, names, lambda work, c=cid, d=damage:
                               [f"data.path=[{damaged_corpus(work, c, d)}]"]))
    found.append(Case(id="train-data-ids-over-vocab", command="train", mode="torchrun", names=("model.vocab_size",),
                      what="torchrun --nproc_per_node=1 launch/train.py data=indexed (ids up to 60000) "
                           "model.vocab_size=257", once="cfp-megatron: ConfigError",
                      run=lambda work: torchrun(1, ["data=indexed", "model.vocab_size=257", "train.seq_length=32",
                                                    f"data.path=[{damaged_corpus(work, 'ids-run', token(60000))}]"],
                                                work)))

    # --- plan files and what a plan is applied to ---------------------------------------------------------------
    def plan_for(work: Path, name: str, *overrides: str, world: int = 1) -> Path:
        from cfp_megatron.base.compose import compose_config
        from cfp_megatron.base.config import job_from_config
        from cfp_megatron.plan.artifact import Plan, save_plan

        path = work / "plans" / name / "plan.json"
        if not path.exists():
            job = job_from_config(compose_config(["model=gpt_tiny", *overrides]))
            save_plan(Plan.from_job(job, world_size=world, prediction=None, inputs_fingerprint="bench"), path)
        return path

    def launch(overrides: Sequence[str], world: int = 1) -> object:
        """``launch/train.py`` up to its plan, in-process, with ``overrides`` as the typed command line."""
        import dataclasses

        from hydra import compose, initialize_config_dir
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import open_dict

        from cfp_megatron.base.cfp_spec import cfp_from_config
        from cfp_megatron.base.compose import CONF_DIR, compose_config, register_configs
        from cfp_megatron.base.config import job_from_config
        from cfp_megatron.base.launch_env import LaunchEnv
        from cfp_megatron.planner.launch_plan import resolve_launch_plan

        register_configs()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            hydra_cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
        with open_dict(hydra_cfg):
            hydra_cfg.hydra.runtime.output_dir = "/nonexistent-run-dir"
        HydraConfig.instance().set_config(hydra_cfg)
        try:
            cfg = compose_config(list(overrides))
            env = dataclasses.replace(LaunchEnv.read(), world_size=world, rank=0)
            return resolve_launch_plan(job_from_config(cfg), cfp_from_config(cfg), env, None)
        finally:
            HydraConfig.instance().cfg = None

    def launch_case(cid: str, what: str, names: Sequence[str], overrides: Callable[[Path], list[str]],
                    world: int = 1) -> Case:
        return Case(id=cid, command="planfile" if cid.startswith("plan") else "train", what=what, names=tuple(names),
                    run=lambda work: in_process(lambda: launch(overrides(work), world)))

    four = "train.global_batch_size=16"
    for cid, what, names, extra in [
            ("plan-other-layers", "a 4-layer plan.json applied with model.num_layers=8", ("model.num_layers",),
             ["model.num_layers=8"]),
            ("plan-other-model", "a gpt_tiny plan.json applied with model=llama_tiny", ("model",),
             ["model=llama_tiny"]),
            ("plan-other-optimizer", "a plan made for adam applied with train.optimizer=sgd", ("train.optimizer",),
             ["train.optimizer=sgd"]),
            ("plan-typed-batch", "train.global_batch_size=4 typed with a plan of 16", ("train.global_batch_size",),
             ["train.global_batch_size=4"]),
            ("plan-typed-seq", "train.seq_length=128 typed with a plan of 64", ("train.seq_length",),
             ["train.seq_length=128"]),
            ("plan-typed-precision", "train.precision=bf16 typed with an fp32 plan", ("train.precision",),
             ["train.precision=bf16"]),
            ("plan-typed-parallel", "parallel.recompute=full typed with a plan without recomputation",
             ("parallel.recompute",), ["parallel.recompute=full"]),
            ("plan-pin-differs", "cfp.tp=2 typed with a plan of tp=1", ("cfp.tp",), ["cfp.tp=2"])]:
        found.append(launch_case(cid, what, names, lambda work, e=extra: [
            "+cfp=manual", f"cfp.plan_file={plan_for(work, 'fp32-16', four, 'train.precision=fp32')}", *e]))
    for cid, what, names, overrides in [
            ("auto-parallel-and-pin", "+cfp=auto cfp.tp=1 parallel.tp=2", ("parallel.tp",),
             ["+cfp=auto", "cfp.tp=1", "parallel.tp=2"]),
            ("auto-parallel-typed", "+cfp=auto parallel.pp=2 (the search would replace it)", ("cfp.pp",),
             ["+cfp=auto", "parallel.pp=2"]),
            ("auto-micro-batch-typed", "+cfp=auto train.micro_batch_size=4", ("cfp.micro_batch",),
             ["+cfp=auto", "train.micro_batch_size=4"]),
            ("manual-pin-contradicts", "+cfp=manual cfp.pp=2 (parallel.pp=1 trains as given)", ("cfp.pp",),
             ["+cfp=manual", "cfp.pp=2"])]:
        found.append(launch_case(cid, what, names, lambda work, o=overrides: list(o), world=2))

    def without_content_hash(data: dict) -> None:
        del data["content_hash"]

    def zero_plan_json(work: Path, **change: object) -> Path:
        data = json.loads((ROOT / "tests" / "data" / "zero_plan_schema1.json").read_text())  # a schema-1 plan
        for key, value in change.items():
            (data["plan"] if key in data["plan"] else data)[key] = value
        path = work / "plans" / f"zero-{'-'.join(change)}" / "zero_plan.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2))
        return path

    def twice(work: Path) -> Path:
        text = sample_plan_file(work).read_text()
        path = _plan_variant(work, "twice", text=text.replace('"seq_length": ', '"seq_length": 4096,\n  "seq_length": ',
                                                              1))
        return path

    def pipe(work: Path) -> Path:
        path = work / "plans" / "fifo" / "plan.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            os.mkfifo(path)
        return path

    found += [
        plan_file_case("planfile-no-content-hash", "a current plan.json with its content_hash deleted",
                       lambda work: _plan_variant(work, "nohash", without_content_hash), ("content_hash",)),
        plan_file_case("planfile-inputs-edited", "a plan.json whose recorded model.num_layers was edited",
                       lambda work: _plan_variant(work, "inputs", lambda d: d["inputs"].__setitem__(
                           "model.num_layers", 8)), ("content hash",)),
        plan_file_case("planfile-duplicate-key", "a plan.json giving seq_length twice (4096, then its own)",
                       twice, ("seq_length",)),
        plan_file_case("planfile-fifo", "cfp.plan_file naming a named pipe (nothing writes to it)", pipe,
                       ("named pipe",)),
        plan_file_case("planfile-zero-edited", "an earlier zero_plan.json with its zero_stage edited to 3",
                       lambda work: zero_plan_json(work, zero_stage=3), ("zero_stage",)),
        plan_file_case("planfile-zero-hash", "an earlier zero_plan.json with another hash",
                       lambda work: zero_plan_json(work, hash="0123456789abcdef"), ("hash mismatch",)),
    ]

    # --- a plan under another backend or cluster shape; what +cfp=manual does not read; edited fields ----------
    def given(overrides: Sequence[str], world: int = 1) -> object:
        """``launch/train.py`` up to its plan with the hooks of the backend the config names (both backends) and
        rank 0's notes printed, ``overrides`` as the typed command line."""
        from hydra import compose, initialize_config_dir
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import open_dict

        from cfp_megatron.base.backend_spec import backend_from_config
        from cfp_megatron.base.cfp_spec import cfp_from_config
        from cfp_megatron.base.compose import CONF_DIR, compose_config, register_configs
        from cfp_megatron.base.config import job_from_config
        from cfp_megatron.base.launch_env import LaunchEnv
        from cfp_megatron.planner.backends import launch_hooks
        from cfp_megatron.planner.launch_plan import given_plan

        class Say:
            def print(self, text: str, **_: object) -> None:
                print(text)

        register_configs()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            hydra_cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
        with open_dict(hydra_cfg):
            hydra_cfg.hydra.runtime.output_dir = "/nonexistent-run-dir"
        HydraConfig.instance().set_config(hydra_cfg)  # typed_keys() sees ``overrides``
        try:
            cfg = compose_config(list(overrides))
            backend = backend_from_config(cfg)
            env = LaunchEnv(rank=0, world_size=world, local_rank=0, local_world_size=world, restart_count=0,
                            under_torchrun=False)
            return given_plan(job_from_config(cfg), cfp_from_config(cfg), env, Say(), hooks=launch_hooks(backend.name),
                              backend=backend)
        finally:
            HydraConfig.instance().cfg = None

    zero_file = ROOT / "tests" / "data" / "zero_plan_schema1.json"  # ZeRO 2, optimizer offload, bucket 1000, 4 ranks
    for cid, what, names, overrides, world in [
            ("plan-megatron-as-deepspeed", "a Megatron plan.json applied with backend=deepspeed",
             ("is a plan for backend=megatron",), lambda work: [f"cfp.plan_file={plan_for(work, 'base')}",
                                                               "backend=deepspeed"], 1),
            ("plan-zero-as-megatron", "an earlier zero_plan.json applied without backend=deepspeed",
             ("is a plan for backend=deepspeed",), lambda work: [f"cfp.plan_file={zero_file}"], 4),
            ("plan-zero-stage-typed", "backend.zero_stage=3 typed beside a ZeRO-2 plan", ("backend.zero_stage=3",),
             lambda work: [f"cfp.plan_file={zero_file}", "backend=deepspeed", "backend.zero_stage=3"], 4),
            ("plan-zero-offload-typed", "backend.offload_optimizer=false typed beside a plan that offloads",
             ("backend.offload_optimizer=False",),
             lambda work: [f"cfp.plan_file={zero_file}", "backend=deepspeed", "backend.offload_optimizer=false"], 4),
            ("plan-zero-bucket-typed", "backend.bucket_elements=5000 typed beside a plan of 1000",
             ("backend.bucket_elements=5000",),
             lambda work: [f"cfp.plan_file={zero_file}", "backend=deepspeed", "backend.bucket_elements=5000"], 4),
            ("plan-other-nodes", "a plan for 2 nodes of 1 rank applied on 1 node of 2", ("cluster.nodes=1",),
             lambda work: [f"cfp.plan_file={plan_for(work, 'nodes-2', 'cluster.nodes=2', world=2)}"], 2),
            ("plan-set-differs", "cfp.constraints.tp=[2] typed beside a plan of tp=1", ("cfp.constraints.tp=[2]",),
             lambda work: [f"cfp.plan_file={plan_for(work, 'base')}", "cfp.constraints.tp=[2]"], 1),
            ("plan-max-mb-differs", "cfp.constraints.max_micro_batch=1 beside a plan of micro-batch 2",
             ("cfp.constraints.max_micro_batch=1",),
             lambda work: [f"cfp.plan_file={plan_for(work, 'base')}", "cfp.constraints.max_micro_batch=1"], 1),
            ("plan-search-only-setting", "cfp.top_k=3 typed beside a plan (only the search reads it)",
             ("cfp.top_k=3",), lambda work: [f"cfp.plan_file={plan_for(work, 'base')}", "cfp.top_k=3"], 1),
            ("plan-headroom-typed", "cfp.constraints.memory_headroom=0.5 typed beside a plan",
             ("cfp.constraints.memory_headroom=0.5",),
             lambda work: [f"cfp.plan_file={plan_for(work, 'base')}", "cfp.constraints.memory_headroom=0.5"], 1),
            ("manual-set-contradicts", "+cfp=manual cfp.constraints.pp=[2] (parallel.pp=1 trains as given)",
             ("cfp.constraints.pp=[2]",), lambda work: ["cfp.constraints.pp=[2]"], 2),
            ("manual-budget-typed", "+cfp=manual cfp.profile_budget_s=30 (nothing is profiled)",
             ("cfp.profile_budget_s=30",), lambda work: ["cfp.profile_budget_s=30"], 1),
            ("plan-string-world", "a plan string for 2 ranks on 1", ("cfp.plan: the plan of cfp.plan is for 2",),
             lambda work: ["cfp.plan='gpt_tiny@localx1x2:tp=1,sp=0,pp=1,vpp=1,cp=1,ep=1,etp=1,dp=2,mb=2,gbs=8,"
                           "seq=64,ppf=null,ppl=null,rc=none,rcn=1,rcm=uniform,do=0,ogr=0,opg=0,gf32=1,"
                           "order=tp-cp-ep-dp-pp,mlp=megatron,mlpn=null,prec=auto'"], 1)]:
        found.append(Case(id=cid, command="planfile", what=what, names=names,
                          run=lambda work, o=overrides, w=world: in_process(lambda: given(["+cfp=manual", *o(work)],
                                                                                          w))))
    found.append(Case(id="plan-string-no-inputs", command="planfile", report_ok=True,
                      what="a plan string (it records no model settings) applied with model.num_layers=8",
                      names=("records no model settings",),
                      run=lambda work: in_process(lambda: given([
                          "+cfp=manual", "model.num_layers=8", "cfp.plan='gpt_tiny@localx1x1:tp=1,sp=0,pp=1,vpp=1,"
                          "cp=1,ep=1,etp=1,dp=1,mb=2,gbs=8,seq=64,ppf=null,ppl=null,rc=none,rcn=1,rcm=uniform,do=0,"
                          "ogr=0,opg=0,gf32=1,order=tp-cp-ep-dp-pp,mlp=megatron,mlpn=null,prec=auto'"]))))
    found.append(launch_case("auto-plan-string", "+cfp=auto cfp.plan=<a plan string> (the search would ignore it)",
                             ("cfp.plan=",), lambda work: ["+cfp=auto", "cfp.plan='gpt_tiny@localx1x1:tp=1'"]))

    def rehashed(change: Callable[[dict], object]) -> Callable[[Path], Path]:
        """The sample plan.json changed by ``change``, its content hash written again (a generator's file, or a
        careful editor's: only the reader's own checks stand)."""
        def make(work: Path) -> Path:
            from cfp_megatron.plan.artifact import CONTENT_HASH_KEY, content_hash

            data = json.loads(sample_plan_file(work).read_text())
            change(data)
            data.pop(CONTENT_HASH_KEY, None)
            data[CONTENT_HASH_KEY] = content_hash(data)
            return _plan_variant(work, f"rehashed-{time.monotonic_ns()}", text=json.dumps(data, indent=2))
        return make

    def device(work: Path) -> Path:
        path = work / "plans" / "devzero" / "plan.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_symlink():
            os.symlink("/dev/zero", path)
        return path

    def text_of(edit: Callable[[str], str | bytes], name: str) -> Callable[[Path], Path]:
        return lambda work: _plan_variant(work, name, text=edit(sample_plan_file(work).read_text()))

    import gzip
    found += [
        plan_file_case("planfile-tp-bool", "a plan.json with parallel.tp true (content hash recomputed)",
                       rehashed(lambda d: d["parallel"].__setitem__("tp", True)), ("parallel.tp=True",)),
        plan_file_case("planfile-tp-text", "a plan.json with parallel.tp \"2\" (content hash recomputed)",
                       rehashed(lambda d: d["parallel"].__setitem__("tp", "2")), ("parallel.tp='2'",)),
        plan_file_case("planfile-zero-list", "a plan.json whose zero options are a list (content hash recomputed)",
                       rehashed(lambda d: d.update(backend="deepspeed", zero=[2])), ("zero must be a mapping",)),
        plan_file_case("planfile-requires-text", "a plan.json whose requires is one string (content hash "
                       "recomputed)", rehashed(lambda d: d.__setitem__("requires", "transformer-engine")),
                       ("requires='transformer-engine'",)),
        plan_file_case("planfile-schema-text", "a plan.json with schema_version \"2\"",
                       rehashed(lambda d: d.__setitem__("schema_version", "2")), ("schema_version",)),
        plan_file_case("planfile-hash-null", "a plan.json with content_hash null",
                       lambda work: _plan_variant(work, "hash-null", lambda d: d.__setitem__("content_hash", None)),
                       ("content hash mismatch",)),
        plan_file_case("planfile-nested-dup", "a plan.json giving parallel.tp twice",
                       text_of(lambda t: t.replace('"parallel": {', '"parallel": {\n    "tp": 3,', 1), "nested-dup"),
                       ("'tp' appears twice",)),
        plan_file_case("planfile-deep", "a file of 100,000 nested brackets",
                       lambda work: _plan_variant(work, "deep", text="[" * 100_000 + "]" * 100_000),
                       ("nested too deeply",)),
        plan_file_case("planfile-huge-number", "a plan.json whose schema_version has 5,000 digits",
                       lambda work: _plan_variant(work, "digits", text='{"schema_version": ' + "9" * 5000 + "}"),
                       ("a number that cannot be read",)),
        plan_file_case("planfile-trailing-text", "a plan.json with notes typed after its closing brace",
                       text_of(lambda t: t + "\nnotes: ran this on Tuesday\n", "trailing"),
                       ("more text follows",)),
        plan_file_case("planfile-gzip", "a gzip-compressed plan.json",
                       text_of(lambda t: gzip.compress(t.encode()), "gzip"), ("not UTF-8",)),
        plan_file_case("planfile-devzero", "cfp.plan_file a symbolic link to /dev/zero", device, ("a device",)),
    ]
    found.append(Case(id="train-plan-other-layers", command="train", mode="torchrun", names=("model.num_layers",),
                      what="torchrun --nproc_per_node=1 launch/train.py +cfp=manual cfp.plan_file=<4-layer plan> "
                           "model.num_layers=8", once="cfp-megatron: ConfigError",
                      run=lambda work: torchrun(1, ["+cfp=manual", f"cfp.plan_file={plan_for(work, 'run-4')}",
                                                    "model.num_layers=8"], work)))
    return found


def _data_cases() -> list[Case]:
    """Issue R's second review, data: ``data.path`` as a Megatron blend (weights that do not pair, are not positive,
    a prefix twice), indexed-only settings with synthetic data, a training split shorter than one sample, ids over
    the vocabulary in the last document only, negative ids of a signed dtype, Megatron's index cache where a file is;
    and the tokenizer's tool (``data.preprocess``): a prefix that is a folder or ends in ``.bin``, the corpus as its
    own output, a lone surrogate escape, a named pipe as the input."""
    found: list[Case] = []

    def corpus(work: Path, name: str, docs: list[list[int]], dtype: str = "uint16") -> str:
        import numpy
        import torch
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        prefix = work / "data" / name
        if not Path(f"{prefix}.idx").exists():
            prefix.parent.mkdir(parents=True, exist_ok=True)
            builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.dtype(dtype).type)
            for doc in docs:
                builder.add_document(torch.tensor(doc, dtype=torch.int64), [len(doc)])
            builder.finalize(f"{prefix}.idx")
        return str(prefix)

    def pipe(work: Path) -> str:
        path = work / "pre" / "corpus.fifo.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            os.mkfifo(path)
        return str(path)

    late = [[65 + i % 20] * 200 for i in range(29)] + [[70] * 198 + [5000, 70]]
    signed = [[65] * 200 for _ in range(29)] + [[65, -7] + [65] * 198]
    for cid, what, names, overrides in [
            ("data-blend-unpaired", "data.path=[0.3,<prefix>,0.7] (a weight without its prefix)",
             ("mixes weights",), lambda work: [f"data.path=[0.3,{build_corpus(work)},0.7]"]),
            ("data-blend-weight-0", "data.path=[0,<a>,1,<b>] (a weight of 0)", ("weight 0",),
             lambda work: [f"data.path=[0,{build_corpus(work)},1,{corpus(work, 'late', late)}]"]),
            ("data-blend-weight-neg", "data.path=[-2,<a>,1,<b>] (a negative weight)", ("weight -2",),
             lambda work: [f"data.path=[-2,{build_corpus(work)},1,{corpus(work, 'late', late)}]"]),
            ("data-blend-percent", "data.path=[30%,<a>,70%,<b>] (weights as percentages)", ("percentages",),
             lambda work: [f"data.path=[30%,{build_corpus(work)},70%,{corpus(work, 'late', late)}]"]),
            ("data-tokenizer-fifo", "data.tokenizer_path naming a named pipe", ("named pipe",),
             lambda work: [f"data.path=[{build_corpus(work)}]", "data.tokenizer=huggingface",
                           f"data.tokenizer_path={pipe(work)}"]),
            ("data-blend-twice", "data.path=[<prefix>,<prefix>/] (one dataset twice)", ("twice",),
             lambda work: [f"data.path=[{build_corpus(work)},{build_corpus(work)}/]"]),
            ("data-short-split", "a one-document corpus of 61 tokens, train.seq_length=64", ("fewer than one sample",),
             lambda work: [f"data.path=[{corpus(work, 'short', [[65] * 61])}]"]),
            ("data-ids-last-document", "token id 5000 in the last document only, model.vocab_size=257",
             ("model.vocab_size",), lambda work: [f"data.path=[{corpus(work, 'late', late)}]"]),
            ("data-ids-negative-int32", "a negative id in int32 data (as a tool writing signed ids leaves it)",
             ("negative token ids",), lambda work: [f"data.path=[{corpus(work, 'signed', signed, 'int32')}]"]),
            ("data-cache-dir-is-file", "data.cache_dir naming a regular file", ("data.cache_dir",),
             lambda work: [f"data.path=[{build_corpus(work)}]", f"data.cache_dir={_touch(work / 'cache-file')}"])]:
        found.append(data_case(cid, what, names, overrides))
    found.append(Case(id="data-synthetic-with-path", command="data", what="data.path=[<prefix>] without data=indexed",
                      names=("data=indexed",), run=lambda work: in_process(lambda: check_train_config(
                          [f"data.path=[{build_corpus(work)}]"]))))

    def preprocess(args: Callable[[Path], list[str]]) -> Callable[[Path], Result]:
        from cfp_megatron.data.preprocess import main

        return lambda work: in_process(lambda: main(args(work)))

    def jsonl(work: Path, name: str, text: str) -> str:
        path = work / "pre" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return str(path)

    ok = '{"text": "a document"}\n'
    for cid, what, names, args in [
            ("preprocess-prefix-folder", "--output-prefix data/ (a folder: it would write data/.bin)",
             ("names a folder",), lambda work: ["--input", jsonl(work, "ok.jsonl", ok), "--output-prefix",
                                                f"{work}/pre/out/"]),
            ("preprocess-prefix-bin", "--output-prefix corpus.bin (it would write corpus.bin.bin)", ("ends in .bin",),
             lambda work: ["--input", jsonl(work, "ok.jsonl", ok), "--output-prefix", f"{work}/pre/corpus.bin"]),
            ("preprocess-input-is-output", "--input corpus.bin --output-prefix corpus --overwrite (the corpus would "
             "be replaced)", ("one of the files this run writes",),
             lambda work: ["--input", jsonl(work, "own.bin", ok), "--output-prefix", f"{work}/pre/own",
                           "--overwrite"]),
            ("preprocess-input-fifo", "--input naming a named pipe", ("named pipe",),
             lambda work: ["--input", pipe(work), "--output-prefix", f"{work}/pre/fifo-out"])]:
        found.append(Case(id=cid, command="data", what=f"preprocess {what}", names=tuple(names),
                          run=preprocess(args)))
    found.append(Case(
        id="preprocess-lone-surrogate", command="data", mode="subprocess", names=("lone UTF-16 surrogate",),
        what="python -m cfp_megatron.data.preprocess on a JSONL whose text holds \\ud800 without its pair",
        run=lambda work: run_process([sys.executable, "-m", "cfp_megatron.data.preprocess", "--input",
                                      jsonl(work, "surrogate.jsonl", '{"text": "ok"}\n{"text": "x \\ud800"}\n'),
                                      "--output-prefix", str(work / "pre" / "surrogate")], work, 120.0)))
    return found


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("occupied\n")
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _edit_plan(data: dict, key: str, value: object) -> None:
    """Set ``key`` of the plan's parallel layout wherever the JSON keeps it."""
    parallel = data.get("parallel")
    if isinstance(parallel, dict):
        parallel[key] = value
    else:
        data[key] = value


# ----------------------------------------------------------------------------------------------------- running
def run_cases(selected: Sequence[Case], work: Path, *, echo: bool = True) -> list[Verdict]:
    """Run ``selected`` in ``work`` and classify each."""
    verdicts = []
    for case in selected:
        outcome = None
        try:
            result = case.run(work)
        except CaseSkipped as why:  # cannot run on this machine: said as such, neither clear nor a failure
            result, outcome = Result(exit_code=None, output=f"skipped: {why}"), SKIPPED
        except Exception:  # noqa: BLE001 - a fixture failed: report it as the case's traceback
            result = Result(exit_code=1, output="bench fixture failed:\n" + traceback.format_exc())
        verdict = Verdict(case=case, result=result, outcome=outcome or classify(case, result))
        verdicts.append(verdict)
        if echo:
            print(f"{verdict.outcome:9s} {result.seconds:6.1f}s {case.command:10s} {case.id}", file=sys.stderr)
    return verdicts


def render(verdicts: Sequence[Verdict]) -> None:
    """A rich table of every case, then the totals."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=200 if not sys.stdout.isatty() else None)
    table = Table(title=f"Bad inputs and faults ({len(verdicts)} cases)")
    for col in ("#", "command", "case", "outcome", "what the user gets"):
        table.add_column(col, overflow="fold")
    style = {"clear": "green", "vague": "yellow", "traceback": "red", "hang": "red", "silent": "red",
             SKIPPED: "yellow"}
    for i, v in enumerate(verdicts, 1):
        table.add_row(str(i), v.case.command, escape(v.case.what),
                      f"[{style[v.outcome]}]{v.outcome}[/]", escape(v.message[:160]))
    console.print(table)
    console.print(totals_line(verdicts))
    for v in verdicts:
        if v.outcome != "clear":
            console.print(f"[bold]{v.outcome}[/] {v.case.id}: {escape(v.case.what)}\n  "
                          f"{escape(v.message[:300])}", highlight=False)


def totals_line(verdicts: Sequence[Verdict]) -> str:
    """``N cases: a clear, b vague, ...``."""
    counts = Counter(v.outcome for v in verdicts)
    skipped = f", {counts[SKIPPED]} {SKIPPED} (cannot run on this machine)" if counts.get(SKIPPED) else ""
    return f"{len(verdicts)} cases: " + ", ".join(f"{counts.get(o, 0)} {o}" for o in OUTCOMES) + skipped


def markdown(verdicts: Sequence[Verdict]) -> str:
    """The catalogue section: totals, then one table row per case."""
    lines = [CATALOGUE_START, "", f"**{totals_line(verdicts)}** (`python bench/bad_inputs.py`, "
             f"{time.strftime('%Y-%m-%d')}).", "",
             "| # | command | bad input or fault | outcome | what the user gets |", "|---|---|---|---|---|"]
    for i, v in enumerate(verdicts, 1):
        what = v.case.what.replace("|", "\\|")
        message = v.message[:220].replace("|", "\\|")
        lines.append(f"| {i} | {v.case.command} | `{what}` | {v.outcome} | {message} |")
    lines += ["", CATALOGUE_END]
    return "\n".join(lines)


def write_markdown(path: Path, verdicts: Sequence[Verdict]) -> None:
    """Replace the catalogue section of ``path`` (between its markers), or append one."""
    section = markdown(verdicts)
    text = path.read_text() if path.exists() else "# Bad inputs and faults\n\n"
    if CATALOGUE_START in text and CATALOGUE_END in text:
        head, _, rest = text.partition(CATALOGUE_START)
        _, _, tail = rest.partition(CATALOGUE_END)
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated commands or case ids to run")
    parser.add_argument("--no-torchrun", action="store_true", help="skip the launch/train.py runs")
    parser.add_argument("--markdown", default=None, help="write the catalogue section of this markdown file")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    selected = cases()
    if args.only:
        wanted = set(args.only.split(","))
        selected = [c for c in selected if c.command in wanted or c.id in wanted]
    if args.no_torchrun:
        selected = [c for c in selected if c.mode != "torchrun"]
    if args.list:
        for c in selected:
            print(f"{c.id:28s} {c.command:10s} {c.mode:10s} {c.what}")
        print(f"{len(selected)} cases")
        return 0
    with tempfile.TemporaryDirectory(prefix="cfp-bad-inputs-") as tmp:
        start = time.perf_counter()
        verdicts = run_cases(selected, Path(tmp))
        wall = time.perf_counter() - start
    render(verdicts)
    print(f"wall time {wall:.0f} s")
    if args.markdown:
        write_markdown(Path(args.markdown), verdicts)
        print(f"catalogue written to {args.markdown}")
    return 0 if all(v.outcome in ("clear", SKIPPED) for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
