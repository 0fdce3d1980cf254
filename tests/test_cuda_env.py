"""The CUDA environment the runtime sets for its ranks: defaults only where the user set nothing."""

from __future__ import annotations

import pytest

from cfp_megatron.base.cuda_env import RUNTIME_ENV, alloc_conf, expandable_segments, set_runtime_env


def test_an_empty_environment_gets_both_defaults() -> None:
    env: dict[str, str] = {}
    set_runtime_env(env)
    assert env == dict(RUNTIME_ENV)
    assert expandable_segments(env)


@pytest.mark.parametrize("var", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"])
def test_the_users_allocator_settings_are_kept(var: str) -> None:
    env = {var: "max_split_size_mb:512", "CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    set_runtime_env(env)
    assert env == {var: "max_split_size_mb:512", "CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    assert alloc_conf(env) == "max_split_size_mb:512"
    assert not expandable_segments(env)


@pytest.mark.parametrize(("conf", "expandable"), [
    ("expandable_segments:True", True),
    ("max_split_size_mb:128, expandable_segments:True", True),
    ("expandable_segments:True,graph_capture_record_stream_reuse:True", True),
    ("expandable_segments:False", False),
    ("expandable_segments:True,expandable_segments:False", False),
    ("", False),
])
def test_expandable_segments_are_read_as_pytorch_parses_them(conf: str, expandable: bool) -> None:
    assert expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": conf}) is expandable


def test_the_newer_variable_is_read_first() -> None:
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert not expandable_segments(env)
