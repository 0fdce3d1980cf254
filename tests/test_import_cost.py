"""The cold analysis stage's import helpers (compat/import_cost.py): ``torch.compile`` deferred to the first call
with the same arguments (eager under a dispatch mode, as TorchDynamo runs it there), the collector restored."""

from __future__ import annotations

import gc
import sys
import types
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cfp_megatron.compat.import_cost import collector_paused, deferred_torch_compile, heavy_imports


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return func(*args, **(kwargs or {}))


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, dict[str, Any]]]:
    """``torch.compile`` replaced by a recorder: each call's function and keywords; the compiled function doubles."""
    calls: list[tuple[Any, dict[str, Any]]] = []

    def fake_compile(model: Any = None, **kwargs: Any) -> Any:
        calls.append((model, kwargs))
        return lambda *a, **k: 2 * model(*a, **k)

    monkeypatch.setattr(torch, "compile", fake_compile)
    return calls


def test_a_decoration_compiles_at_the_first_call_with_its_arguments(compiles: list) -> None:
    with deferred_torch_compile():
        @torch.compile(dynamic=False)
        def add_one(x: int) -> int:
            return x + 1

        plain = torch.compile
    assert plain is not torch.compile  # restored on exit
    assert compiles == [] and add_one.__name__ == "add_one"  # nothing compiled at decoration
    assert add_one(1) == 4 and add_one(2) == 6  # compiled once, then reused
    assert len(compiles) == 1 and compiles[0][1] == {"dynamic": False}


def test_under_a_dispatch_mode_the_function_runs_eagerly_and_compiles_nothing(compiles: list) -> None:
    with deferred_torch_compile():
        square = torch.compile(lambda x: x * x)
    with _Passthrough():
        assert torch.equal(square(torch.tensor(3)), torch.tensor(9))
    assert compiles == []
    assert torch.equal(square(torch.tensor(3)), torch.tensor(18)) and len(compiles) == 1


def test_a_module_is_compiled_at_once(compiles: list) -> None:
    module = torch.nn.Identity()
    with deferred_torch_compile():
        torch.compile(module)
    assert compiles == [(module, {})]


def test_the_collector_is_restored_and_heavy_imports_is_a_no_op_once_megatron_is_imported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "megatron.core", sys.modules.get("megatron.core") or types.ModuleType("m"))
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with collector_paused():
        assert not gc.isenabled()
        with heavy_imports():
            assert not gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == frozen
