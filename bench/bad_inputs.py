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
* ``silent``: exit 0 (or no error in-process) without the problem named: a result computed from a bad input.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS_CSV = ROOT.parent / "shared" / "data" / "published_runs.csv"
OUTCOMES = ("clear", "vague", "traceback", "hang", "silent")
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
    """The command or area: config, plan, analyze, validate, profile, data, profiledb, planfile, checkpoint, cache,
    train."""
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
                     lambda line: "error" in line.lower() or "could not" in line.lower()):
            for line in lines:
                if test(line):
                    return line.removeprefix("- ")
        return lines[0] if lines else ""


LAUNCHER_ERROR = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
"""The exception torchrun's own agent raises, with its traceback, whenever a worker exits non-zero: torch's code,
printed after the workers' output, so it is not counted against the project."""


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
            if end < len(lines) and lines[end].startswith(LAUNCHER_ERROR):
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
    with RUNS_CSV.open(newline="") as f:
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
        ("cfp-allowed-0", ["+cfp=auto", "cfp.constraints.tp=[0]"], "cfp.constraints.tp"),
        ("cfp-check-neg", ["+cfp=auto", "cfp.check_after_steps=-1"], "cfp.check_after_steps"),
        ("ds-zero-5", ["backend=deepspeed", "backend.zero_stage=5"], "backend.zero_stage"),
        ("ds-bucket-0", ["backend=deepspeed", "backend.bucket_elements=0"], "backend.bucket_elements"),
    ]
    for cid, overrides, key in names:
        add(config_case(cid, overrides, [key]))

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
                           ("plan-world-text", ["--world", "abc"], "--world")]:
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
            ("plan-seq-huge", ["cluster=dgx_h100", "train.seq_length=100000000"], "train.seq_length")]:
        add(Case(id=cid, command="plan", what="plan " + " ".join(args), names=(key,),
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
             None)]:
        add(Case(id=cid, command="train", what=f"torchrun --nproc_per_node={ranks} launch/train.py "
                 + " ".join(overrides), names=(key,), mode="torchrun", once=once,
                 run=lambda work, r=ranks, o=overrides: torchrun(r, o, work)))
    add(Case(id="train-truncated-bin", command="train", what="torchrun --nproc_per_node=1 launch/train.py "
             "data=indexed data.path=[<a truncated .bin>]", names=("truncated",), mode="torchrun",
             run=lambda work: torchrun(1, ["data=indexed", "model.vocab_size=257",
                                           f"data.path=[{damaged_corpus(work, 'trunc-run', _truncate)}]"], work)))
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
        try:
            result = case.run(work)
        except Exception:  # noqa: BLE001 - a fixture failed: report it as the case's traceback
            result = Result(exit_code=1, output="bench fixture failed:\n" + traceback.format_exc())
        verdict = Verdict(case=case, result=result, outcome=classify(case, result))
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
    style = {"clear": "green", "vague": "yellow", "traceback": "red", "hang": "red", "silent": "red"}
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
    return f"{len(verdicts)} cases: " + ", ".join(f"{counts.get(o, 0)} {o}" for o in OUTCOMES)


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
    return 0 if all(v.outcome == "clear" for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
