"""A stalled rank named, Ctrl-C said in one line, ranks that die with their launcher (engine/rank_watch.py): the
naming and the saying in-process on a real torch store; the parent-death signal and the SIGINT handler in small
subprocesses. The torchrun runs with real signals are drills (tests/test_stall_drill.py)."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.engine import rank_watch
from cfp_megatron.planner import entry, rank_errors

REPO = Path(__file__).resolve().parent.parent
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "20000ms for recv operation to complete")
PEER_GONE = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
             "[127.0.0.1]:42119. This is typically caused by a remote worker crashing.")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh module state (no store, nothing recorded) and short waits."""
    monkeypatch.setattr(rank_watch, "_state", rank_watch._Watch())
    monkeypatch.setattr(rank_watch, "GRACE_S", 0.3)
    monkeypatch.setattr(rank_watch, "PEER_WAIT_S", 0.3)


def _as_rank(store: dist.Store, rank: int, world: int, where: str, *, pid: int = 4242) -> None:
    """Record ``where`` for ``rank`` as that rank's own process would (host and pid are its own there)."""
    rank_watch.watch(store, rank=rank, world=world, timeout_s=20.0)
    rank_watch.at(where)
    if pid != os.getpid():
        import json
        record = json.loads(store.get(f"cfp/watch/rank/{rank}"))
        store.set(f"cfp/watch/rank/{rank}", json.dumps({**record, "pid": pid, "host": "node7"}))


@pytest.mark.parametrize("value", [0, -5, 0.5, float("nan"), float("inf"), 10**9])
def test_the_collective_timeout_is_bounded(value: float) -> None:
    with pytest.raises(ConfigError) as caught:
        compose_job([f"train.collective_timeout_s={value}"])
    assert caught.value.keys == ["train.collective_timeout_s"]


def test_the_collective_timeout_defaults_to_torch_s_ten_minutes() -> None:
    assert compose_job([]).train.collective_timeout_s == 600
    assert compose_job(["train.collective_timeout_s=20"]).train.collective_timeout_s == 20


def test_timeouts_are_told_from_other_failures() -> None:
    assert rank_watch.is_collective_timeout(RuntimeError(GLOO_TIMEOUT))
    assert rank_watch.is_collective_timeout(RuntimeError("Application timeout caused pair closure"))
    assert rank_watch.is_collective_timeout(dist.DistBackendError(
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, "
        "Timeout(ms)=600000) ran for 600012 milliseconds before timing out."))
    try:  # raised from a timeout, as a wrapper in Megatron or the project would
        try:
            raise RuntimeError(GLOO_TIMEOUT)
        except RuntimeError as inner:
            raise ValueError("the step failed") from inner
    except ValueError as outer:
        assert rank_watch.is_collective_timeout(outer)
    assert not rank_watch.is_collective_timeout(RuntimeError(PEER_GONE))
    assert not rank_watch.is_collective_timeout(ValueError("Timed out waiting"))  # not a runtime error


def test_the_stalled_rank_is_named_with_its_host_pid_and_step(fresh: None) -> None:
    store = dist.HashStore()
    _as_rank(store, 1, 2, "step 8 of 20", pid=4321)  # then stopped: it never marks itself waiting
    _as_rank(store, 0, 2, "step 8 of 20")
    err = rank_watch.explained(RuntimeError(GLOO_TIMEOUT))
    assert isinstance(err, rank_watch.RankStalledError)
    text = str(err)
    assert re.match(r"rank 1 \(host node7, pid 4321\) in step 8 of 20 \(for \d+ s\) stopped answering: rank 0 "
                    r"waited 20 s \(train.collective_timeout_s\) for it in a collective of step 8 of 20", text), text
    assert "Timed out waiting 20000ms for recv operation to complete" in text and "unbound_buffer" not in text
    assert "raise train.collective_timeout_s (now 20)" in text
    assert err.turn is not None and err.turn.mine
    assert rank_watch.exit_status(err) == 2


def test_of_four_ranks_the_ones_that_did_not_wait_are_named(fresh: None) -> None:
    store = dist.HashStore()
    for rank, where in ((2, "the save of step 4's checkpoint"), (3, "the save of step 4's checkpoint")):
        _as_rank(store, rank, 4, where, pid=100 + rank)
    store.set("cfp/watch/waiting/1", "the save of step 4's checkpoint")  # rank 1 timed out too
    _as_rank(store, 0, 4, "the save of step 4's checkpoint")
    text = str(rank_watch.stalled(RuntimeError(GLOO_TIMEOUT)))
    assert re.match(r"rank 2 \(host node7, pid 102\) in the save of step 4's checkpoint \(for \d+ s\); rank 3 "
                    r"\(host node7, pid 103\) in the save of step 4's checkpoint \(for \d+ s\) stopped answering: "
                    r"ranks 0, 1 waited 20 s", text), text


def test_a_second_waiting_rank_leaves_the_saying_to_the_first(fresh: None) -> None:
    store = dist.HashStore()
    _as_rank(store, 0, 2, "step 3 of 9")
    first = rank_watch.stalled(RuntimeError(GLOO_TIMEOUT))
    second = rank_watch.stalled(RuntimeError(GLOO_TIMEOUT))
    assert first.turn is not None and first.turn.mine
    assert second.turn is not None and not second.turn.mine


def test_without_a_store_the_waiting_rank_says_what_it_knows(fresh: None) -> None:
    rank_watch.at("profiling round collectives, step 3 of 40 (all_reduce 1 MiB)")
    text = str(rank_watch.explained(RuntimeError(GLOO_TIMEOUT)))
    assert "within 600 s (train.collective_timeout_s) while rank 0 was in profiling round collectives, step 3" in text


def test_an_interrupt_names_the_step_and_the_last_checkpoint(fresh: None) -> None:
    rank_watch.at("step 6 of 20")
    assert str(rank_watch.explained(KeyboardInterrupt())) == (
        "interrupted (SIGINT) at step 6 of 20; no checkpoint was saved by this run.")
    rank_watch.saved("/ck/iter_0000004")
    err = rank_watch.explained(KeyboardInterrupt())
    assert str(err) == ("interrupted (SIGINT) at step 6 of 20; the last checkpoint is /ck/iter_0000004 (continue "
                        "from it with train.resume=true).")
    assert rank_watch.exit_status(err) == 130


def test_a_rank_whose_peer_was_interrupted_follows_quietly(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.HashStore()
    _as_rank(store, 0, 2, "step 6 of 20")
    lost = rank_watch.explained(RuntimeError(PEER_GONE))  # a peer that was killed or crashed: said once, in a line
    assert isinstance(lost, rank_watch.RankLostError) and lost.turn is not None and lost.turn.mine
    assert "a peer of rank 0 closed its connections without saying why while rank 0 was in step 6 of 20" in str(lost)
    monkeypatch.setattr(rank_watch, "_state", rank_watch._Watch())
    store = dist.HashStore()
    _as_rank(store, 0, 2, "step 6 of 20")
    store.add("cfp/watch/interrupted/claimed", 1)  # the interrupted peer claimed the saying
    err = rank_watch.explained(RuntimeError(PEER_GONE))
    assert isinstance(err, rank_watch.RunInterrupted) and err.turn is not None and not err.turn.mine


def test_the_turn_holder_says_it_and_the_others_do_not(fresh: None) -> None:
    store = dist.HashStore()
    env = LaunchEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, restart_count=0, under_torchrun=True)
    mine = rank_watch.RankStalledError("rank 0 stopped answering.", turn=rank_watch.Turn.claim(store, "stalled"))
    theirs = rank_watch.RankStalledError("rank 0 stopped answering.", turn=rank_watch.Turn.claim(store, "stalled"))
    out = io.StringIO()
    assert rank_errors.report_error(mine, env, stream=out)
    assert "RankStalledError [rank 1]" in out.getvalue() and "rank 0 stopped answering." in out.getvalue()
    quiet = io.StringIO()
    assert not rank_errors.report_error(theirs, env, stream=quiet)  # said already: nothing more
    assert quiet.getvalue() == ""


def test_a_turn_never_said_is_said_by_the_waiting_rank(fresh: None) -> None:
    store = dist.HashStore()
    rank_watch.Turn.claim(store, "stalled")  # claimed by a rank that then died before saying it
    err = rank_watch.RankStalledError("rank 0 stopped answering.", turn=rank_watch.Turn.claim(store, "stalled"))
    out = io.StringIO()
    assert rank_errors.report_error(err, LaunchEnv.read(), stream=out, wait_s=0.2)
    assert "rank 0 stopped answering." in out.getvalue()


def test_ctrl_c_in_training_is_one_line_and_status_130(fresh: None, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(cfg: object) -> list:
        rank_watch.at("step 3 of 20")
        raise KeyboardInterrupt

    monkeypatch.setattr(entry, "train_from_config", interrupted)
    monkeypatch.setattr(rank_errors, "exit_now", lambda status: sys.exit(status))  # not os._exit in pytest
    with pytest.raises(SystemExit) as caught:
        entry.main_with_errors(None)
    assert caught.value.code == 130
    err = capsys.readouterr().err
    assert err.strip() == "cfp-megatron: interrupted (SIGINT) at step 3 of 20; no checkpoint was saved by this run."


def test_a_timed_out_collective_in_training_is_one_message(fresh: None, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    def stalls(cfg: object) -> list:
        rank_watch.at("step 8 of 20")
        raise RuntimeError(GLOO_TIMEOUT)

    monkeypatch.setattr(entry, "train_from_config", stalls)
    monkeypatch.setattr(rank_errors, "exit_now", lambda status: sys.exit(status))
    with pytest.raises(SystemExit) as caught:
        entry.main_with_errors(None)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "RankStalledError" in err and "train.collective_timeout_s" in err and "Traceback" not in err


def test_other_failures_still_reach_the_user_unchanged(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(cfg: object) -> list:
        raise RuntimeError("a bug")

    monkeypatch.setattr(entry, "train_from_config", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        entry.main_with_errors(None)


_CHILD = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
from cfp_megatron.engine import rank_watch
rank_watch.tie_to_launcher()
child = os.fork()  # as Megatron forks its checkpoint writers: a Ctrl-C is its rank's to handle
if child == 0:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)
    print("writer survived", flush=True)
    os._exit(0)
os.waitpid(child, 0)
try:
    print("tied", flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    os.kill(os.getpid(), signal.SIGINT)  # the same Ctrl-C again, as torchrun forwards it
    time.sleep(0.3)
    print("still here", flush=True)
"""


def _launcher(tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    """A stand-in for torchrun's agent: a process that starts one 'rank' (with torchrun's variables) and waits;
    returns it and the rank's pid."""
    script = tmp_path / "launcher.py"
    script.write_text("import subprocess, sys, time\n"
                      f"p = subprocess.Popen([sys.executable, '-c', {_CHILD.format(repo=str(REPO))!r}])\n"
                      "print(p.pid, flush=True)\n"
                      "p.wait()\n")
    env = {**os.environ, "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "test"}
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    assert launcher.stdout is not None
    pid = int(launcher.stdout.readline())
    assert launcher.stdout.readline().strip() == "writer survived"
    assert launcher.stdout.readline().strip() == "tied"
    return launcher, pid


def _gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_every_group_waits_at_most_the_collective_timeout(fresh: None) -> None:
    import datetime

    import torch

    from cfp_megatron.engine.distributed import bound_every_group, init_default_group

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    store = dist.HashStore()
    init_default_group("gloo", store, 0, 1, datetime.timedelta(seconds=20))
    try:
        def timeout(group: dist.ProcessGroup) -> datetime.timedelta:
            return group._get_backend(torch.device("cpu")).options._timeout

        assert timeout(dist.group.WORLD) == datetime.timedelta(seconds=20)  # joined under 10 minutes, then 20 s
        assert store.check(["cfp/watch/rank/0"])  # progress recorded from the start
        other = dist.new_group([0])  # as DeepSpeed makes its groups: torch's 30 minutes
        assert timeout(other) == datetime.timedelta(minutes=30)
        bound_every_group(20.0)
        assert timeout(other) == datetime.timedelta(seconds=20)
    finally:
        dist.destroy_process_group()


class _Cmdline:
    def __init__(self, text: bytes) -> None:
        self.text = text

    def read_bytes(self) -> bytes:
        return self.text


@pytest.mark.parametrize(("parent", "init", "gone"), [
    (4321, b"/sbin/init\0", False),  # the launcher is alive
    (1, b"/sbin/init\0splash\0", True),  # reparented to init: the launcher died before the rank could tie to it
    (1, b"/usr/bin/python3\0/usr/local/bin/torchrun\0--nproc_per_node=8\0", False)])  # torchrun is process 1
def test_a_rank_whose_launcher_is_gone_is_told_from_one_under_torchrun_as_pid_1(
        parent: int, init: bytes, gone: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_watch, "Path", lambda path: _Cmdline(init))
    assert rank_watch._launcher_gone(parent) is gone


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_dies_with_its_launcher(tmp_path: Path) -> None:
    launcher, rank = _launcher(tmp_path)
    try:
        launcher.kill()  # kill -9 of torchrun
        launcher.wait()
        assert _gone(rank), "the rank outlived its launcher"
    finally:
        if not _gone(rank, 0.1):
            os.kill(rank, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_second_ctrl_c_does_not_break_the_first_one_s_way_out(tmp_path: Path) -> None:
    launcher, rank = _launcher(tmp_path)
    try:
        os.kill(rank, signal.SIGINT)
        out, _ = launcher.communicate(timeout=30)
        assert out.split() == ["interrupted", "still", "here"]
    finally:
        launcher.kill()
        if not _gone(rank, 0.1):
            os.kill(rank, signal.SIGKILL)


_LOST_INTERRUPT = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
from cfp_megatron.engine import rank_watch
rank_watch.tie_to_launcher()
os.register_at_fork(after_in_parent=lambda: time.sleep(0.5))  # as logging's lock release after a fork
try:
    signal.setitimer(signal.ITIMER_REAL, 0.1)
    signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))  # Ctrl-C while it forks
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    time.sleep(5)
    print("lost", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_an_interrupt_lost_where_python_ignores_exceptions_is_raised_again() -> None:
    # A Ctrl-C that lands in an at-fork callback (Megatron's checkpoint save forks its writers) is "ignored" by
    # Python: without the unraisable hook the rank printed "Exception ignored in ... KeyboardInterrupt" and trained on.
    env = {**os.environ, "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "test"}
    run = subprocess.run([sys.executable, "-c", _LOST_INTERRUPT.format(repo=str(REPO))], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "interrupted", run.stdout + run.stderr
    assert "Exception ignored" not in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_sigterm_and_sighup_name_their_sender_and_end_with_128_plus_the_signal(fresh: None) -> None:
    rank_watch.at("step 6 of 20")
    rank_watch.saved("/ck/iter_0000004")
    term = rank_watch.interrupted(signal.SIGTERM)
    assert str(term).startswith("interrupted (SIGTERM: sent by a scheduler ending the job, by kill, or by torchrun "
                                "stopping this rank after another one failed) at step 6 of 20; the last checkpoint is "
                                "/ck/iter_0000004")
    assert rank_watch.exit_status(term) == 143
    hup = rank_watch.interrupted(signal.SIGHUP)
    assert "(SIGHUP: the terminal that started the job closed" in str(hup) and rank_watch.exit_status(hup) == 129


def test_a_peer_that_follows_an_interrupted_rank_names_that_rank_s_signal(fresh: None) -> None:
    store = dist.HashStore()
    _as_rank(store, 1, 2, "step 6 of 20")
    rank_watch._state.signum = signal.SIGTERM  # rank 1 was sent SIGTERM: it claims the saying
    assert rank_watch._interrupt_turn() is not None
    rank_watch._state.signum, rank_watch._state.interrupt = signal.SIGINT, None  # rank 0 got no signal itself
    _as_rank(store, 0, 2, "step 6 of 20")
    err = rank_watch.explained(RuntimeError(PEER_GONE))
    assert isinstance(err, rank_watch.RunInterrupted) and err.signum == signal.SIGTERM
    assert "(SIGTERM:" in str(err) and err.turn is not None and not err.turn.mine


def test_a_rank_torchrun_stops_after_another_said_why_exits_quietly(fresh: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.HashStore()
    _as_rank(store, 0, 2, "step 8 of 20")
    rank_watch._state.pid = os.getpid()
    monkeypatch.setattr(rank_watch, "exit_now", lambda status: sys.exit(status))  # not os._exit in pytest
    with pytest.raises(KeyboardInterrupt):  # nobody said anything: this rank says it was stopped
        rank_watch._interrupt_once(signal.SIGTERM, None)
    assert store.check(["cfp/watch/interrupted/claimed"])
    other = dist.HashStore()
    monkeypatch.setattr(rank_watch, "_state", rank_watch._Watch())
    _as_rank(other, 1, 2, "step 8 of 20")
    rank_watch.explained(rank_watch.RankStalledError("rank 0 stopped answering."))  # rank 1 says it, and ends
    rank_watch._state.interrupted = False  # as on rank 0, which then gets torchrun's SIGTERM
    rank_watch._state.pid = os.getpid()
    with pytest.raises(SystemExit) as quiet:
        rank_watch._interrupt_once(signal.SIGTERM, None)
    assert quiet.value.code == 143 and not other.check(["cfp/watch/interrupted/claimed"])


_BLOCKED = """
import datetime, os, signal, sys, threading
sys.path.insert(0, {repo!r})
import torch.distributed as dist
from cfp_megatron.engine import rank_watch
rank_watch.tie_to_launcher()
assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # before the process group: as the system does
rank_watch.STOP_GRACE_S = 1.0
store = dist.HashStore()
rank_watch.watch(store, rank=0, world=1, timeout_s=20.0)
rank_watch.at("step 2 of 9")
threading.Timer(1.0, lambda: print("blocked", flush=True)).start()  # once the main thread waits
try:
    store.wait(["never"], datetime.timedelta(seconds=120))  # as a collective whose peer stalled: no handler runs
    print("lost", flush=True)
except KeyboardInterrupt:
    print("handled by the main thread: it was not blocked yet", flush=True)
"""


def test_a_stop_signal_while_blocked_in_a_collective_is_said_by_the_stop_watch() -> None:
    """Python runs the handler only once the blocking call returns (here: after 2 minutes, in a job: after
    train.collective_timeout_s, when torchrun has killed the rank 30 s after its SIGTERM, without a word)."""
    env = {**os.environ, "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "test"}
    proc = subprocess.Popen([sys.executable, "-c", _BLOCKED.format(repo=str(REPO))], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "blocked"
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143 and out.strip() == "", out + err
    assert err.strip() == ("cfp-megatron: interrupted (SIGTERM: sent by a scheduler ending the job, by kill, or by "
                           "torchrun stopping this rank after another one failed) at step 2 of 9; no checkpoint was "
                           "saved by this run."), err


def test_a_file_a_rank_cannot_use_is_one_error_naming_it_and_where(fresh: None) -> None:
    from cfp_megatron.base.files import FileAccessError

    rank_watch.at("step 3 of 9")
    err = rank_watch.explained(PermissionError(13, "Permission denied", "/data/corpus.bin"))
    assert isinstance(err, FileAccessError)
    assert str(err).startswith("/data/corpus.bin cannot be used: permission denied (in step 3 of 9). Fix: make it "
                               "readable to this user on this host")
    try:  # raised from it, as Megatron's dataset builders re-raise
        try:
            raise FileNotFoundError(2, "No such file or directory", "/ck/iter_0000004/common.pt")
        except FileNotFoundError as inner:
            raise RuntimeError("loading failed") from inner
    except RuntimeError as outer:
        assert "/ck/iter_0000004/common.pt cannot be used: it is not there" in str(rank_watch.explained(outer))
    assert rank_watch.explained(OSError("no file named")) is None  # not a file's failure: the traceback stands
    assert rank_watch.explained(IsADirectoryError(21, "Is a directory", "/x")) is None


def test_an_error_once_the_group_exists_is_said_by_the_first_rank_that_meets_it(fresh: None,
                                                                                monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    store = dist.HashStore()
    _as_rank(store, 1, 2, "step 3 of 9")
    err = rank_watch.explained(ConfigError([]))  # met by rank 1 only
    turn = rank_watch.turn_of(err)
    assert turn is not None and turn.mine and store.check(["cfp/watch/ended"])
    env1 = LaunchEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, restart_count=0, under_torchrun=True)
    out = io.StringIO()
    assert rank_errors.report_error(err, env1, stream=out)  # at once: not after waiting for its node's first rank
    assert out.getvalue().startswith("cfp-megatron: ConfigError [rank 1]")
    monkeypatch.setattr(rank_watch, "_state", rank_watch._Watch())  # rank 0, whose collective lost its peer
    _as_rank(store, 0, 2, "step 3 of 9")
    peer = rank_watch.explained(RuntimeError(PEER_GONE))
    assert isinstance(peer, rank_watch.SaidOnce) and "another rank ended the job" in str(peer)
    env0 = LaunchEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, restart_count=0, under_torchrun=True)
    quiet = io.StringIO()
    assert not rank_errors.report_error(peer, env0, stream=quiet) and quiet.getvalue() == ""
