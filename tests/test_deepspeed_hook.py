"""A model handed to deepspeed.initialize through the hook is captured, and DeepSpeed then trains it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher import free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")]


def test_deepspeed_initialize_hook_captures_then_trains_with_zero1() -> None:
    script = Path(__file__).resolve().parent / "scripts" / "deepspeed_hook_run.py"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # One block kind (4 identical residual blocks: LayerNorm 64 + Linear 32x32+32) and the rest recorded once.
    assert result["kinds"]["block"] == 64 + 32 * 32 + 32
    assert result["sequence"].count("block") == 4
    assert result["zero_stage"] == 1
    assert result["losses"][-1] < result["losses"][0]
