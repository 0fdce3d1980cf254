"""The package's import rules beyond import-linter's layer contract (``lint-imports``, run by ``.ci/run``): a project
import inside a function is only there to load a heavy library (torch, Megatron-Core, DeepSpeed) late, never to hide
a cycle, so planning, validation and the command-line tools start without them."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cfp_megatron"
HEAVY = frozenset({"torch", "megatron", "deepspeed"})


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def _parse() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), filename=str(p)) for p in PACKAGE.rglob("*.py")}


MODULES = _parse()


def _top_level_imports(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(heavy libraries, project modules) a module imports when it is loaded (``TYPE_CHECKING`` blocks skipped)."""
    heavy, project = set(), set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for stmt in node.body if isinstance(node, ast.Try) else [node]:
            if isinstance(stmt, ast.Import):
                names = [a.name for a in stmt.names]
            elif isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module:
                names = [stmt.module] + [f"{stmt.module}.{a.name}" for a in stmt.names]
            else:
                continue
            heavy |= {n.split(".")[0] for n in names} & HEAVY
            project |= {n for n in names if n in MODULES}
    return heavy, project


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


@cache
def loads_heavy(module: str) -> bool:
    """Whether importing ``module`` loads torch, Megatron-Core or DeepSpeed (its packages' ``__init__`` included)."""
    seen, todo = {module}, [module]
    while todo:
        current = todo.pop()
        heavy, project = _top_level_imports(MODULES[current])
        if heavy:
            return True
        for m in project | set(_parents(current)):
            if m in MODULES and m not in seen:
                seen.add(m)
                todo.append(m)
    return False


def _function_level_imports(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(
                        "cfp_megatron"):
                    target = node.module
                    if all(f"{target}.{a.name}" in MODULES for a in node.names):  # submodules of a package
                        found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
                    else:
                        found.append((node.lineno, target))
    return found


def test_project_imports_inside_functions_only_defer_heavy_libraries() -> None:
    wrong = []
    for module, tree in MODULES.items():
        for line, target in _function_level_imports(tree):
            if target not in MODULES:
                wrong.append(f"{module}:{line} imports {target}, which is no module")
            elif not loads_heavy(target):
                wrong.append(f"{module}:{line} imports {target} inside a function, but it loads no heavy library: "
                             "import it at the top (a cycle it would make means a layer is wrong)")
            elif loads_heavy(module):
                wrong.append(f"{module}:{line} defers {target}, but {module} loads a heavy library already")
    assert not wrong, "\n".join(wrong)


def test_planning_and_the_command_line_tools_start_without_heavy_libraries() -> None:
    light = ["cfp_megatron.base.compose", "cfp_megatron.sim.simulate", "cfp_megatron.search.search",
             "cfp_megatron.plan", "cfp_megatron.planner.plan_cli", "cfp_megatron.planner.entry",
             "cfp_megatron.profile.cli", "cfp_megatron.validate", "cfp_megatron.backends.deepspeed.search"]
    assert [m for m in light if loads_heavy(m)] == []
    assert loads_heavy("cfp_megatron.engine.step")  # the rule above has something to tell apart
