"""Quiet, honest output: Megatron-Core's expected "not installed" warnings are filtered one by one and said once,
other warnings still show, our own non-leaf ``.grad`` warning is gone at its cause, and records print as aligned
lines."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import megatron.core
import pytest
import torch

from cfp_megatron.compat import quiet
from cfp_megatron.compat.optimizer import retain_shard_grads
from cfp_megatron.engine.metrics import record_lines

ROOT = Path(__file__).resolve().parents[1]
_NO_KERNELS = bool(quiet.missing_kernels())


def _upstream_warnings(pattern: str) -> list[tuple[str, str]]:
    """(module, message) of every ``warnings.warn("...")`` in Megatron-Core's source whose text matches."""
    root = Path(megatron.core.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        if not re.search(pattern, text):
            continue
        module = "megatron.core." + ".".join(path.relative_to(root).with_suffix("").parts)
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "warn" and node.args):
                parts = [v.value for v in ast.walk(node.args[0]) if isinstance(v, ast.Constant)
                         and isinstance(v.value, str)]
                message = "".join(parts)
                if re.search(pattern, message):
                    found.append((module, message))
    return found


@pytest.mark.skipif(not _NO_KERNELS, reason="Transformer Engine and Apex are installed: nothing is filtered")
def test_every_upstream_not_installed_warning_is_filtered_and_others_are_not() -> None:
    upstream = _upstream_warnings(r"(Apex|Transformer Engine and Apex) (is|are) not installed")
    assert len(upstream) >= 4  # Megatron-Core 0.16.1 has seven
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        note = quiet.quiet_expected_warnings()
        for module, message in upstream:
            warnings.warn_explicit(message, UserWarning, "x.py", 1, module=module)
        warnings.warn_explicit("Transformer Engine and Apex are not installed. Falling back to local code",
                               UserWarning, "x.py", 1, module="someone.else")  # not Megatron's: shown
        warnings.warn_explicit("CUDA out of memory, something real", UserWarning, "x.py", 1, module="megatron.core.x")
    assert [str(w.message) for w in seen] == ["Transformer Engine and Apex are not installed. Falling back to local "
                                              "code", "CUDA out of memory, something real"]
    assert note is not None and note.startswith("cfp: running without ") and "\n" not in note


def test_analyze_says_it_once_and_shows_no_upstream_warning(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    proc = subprocess.run([sys.executable, "-m", "cfp_megatron.analyze", "model=gpt_tiny", "--json",
                           str(tmp_path / "a.json")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    output = proc.stdout + proc.stderr
    assert "not installed" not in output and "UserWarning" not in output, output[:3000]
    if _NO_KERNELS:
        assert output.count("cfp: running without") == 1


def test_non_leaf_shard_views_of_the_distributed_optimizer_read_grad_without_a_warning() -> None:
    param = torch.nn.Parameter(torch.zeros(8))
    shard = param.view(-1)[2:6]  # what Megatron-Core's distributed optimizer holds for an fp32 parameter

    class Distributed:  # the attribute Megatron's DistributedOptimizer keeps them in
        shard_fp32_groups = [[shard]]

    class Chained:
        chained_optimizers = [Distributed()]

    with warnings.catch_warnings(record=True) as before:
        warnings.simplefilter("always")
        assert shard.grad is None
    assert any("not a leaf Tensor" in str(w.message) for w in before)  # what the training printed per rank
    assert retain_shard_grads(Chained()) == 1
    with warnings.catch_warnings(record=True) as after:
        warnings.simplefilter("always")
        assert shard.grad is None
        shard.grad = torch.ones(4)  # as Megatron assigns it before the step
    assert not after and retain_shard_grads(Chained()) == 0
    assert param.grad is None  # nothing reaches the parameter itself


def test_memory_record_prints_as_aligned_lines() -> None:
    ranks = [{"rank": r, "step": 5, "peak_bytes": 4984392 + r, "device_max_allocated_bytes": None,
              "breakdown": {"parameters": 563712, "gradients": 563712, "activations": 2965516,
                            "temporary": 327680, "optimizer": 563772}} for r in range(4)]
    lines = record_lines("memory", {"step": 5, "ranks": ranks, "peak_bytes_max": 4984395.0})
    assert lines[0] == "memory"
    assert all("{" not in line and "'" not in line and len(line) < 100 for line in lines)
    assert re.fullmatch(r"  peak_bytes_max\s+4\.75 MiB", lines[2])
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["rank"])
    table = lines[header:header + 5]
    assert table[0].split() == ["rank", "peak_bytes", "parameters", "gradients", "activations", "temporary",
                                "optimizer"]  # step equals the record's, device bytes are None on CPU: left out
    starts = [[m.start() for m in re.finditer(r"\S+( \S+)?", row)] for row in table]
    assert all(s == starts[0] for s in starts), table  # every column starts where its header does
    assert table[1].split()[:3] == ["0", "4.75", "MiB"]
    assert record_lines("end", {"step": 3}) == ["end | step 3"]
