"""The README and the docs site: every command they show composes against the real conf/ and passes the checks a
launch runs before any process group (nothing trains), links between pages resolve, the generated configuration
reference is current, and the site builds with ``mkdocs build --strict`` where mkdocs is installed."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from cfp_megatron.base.backend_spec import backend_from_config
from cfp_megatron.base.cfp_spec import CfpMode, cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.planner.job_checks import validate_job, validate_rest
from cfp_megatron.planner.launch_plan import check_constraints

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

USER_FILE_KEYS = {"data.path", "data.tokenizer_path", "backend.config_file"}
"""Settings that name a file the page has the user make first (a corpus, a DeepSpeed config): their
'file not found' issue is not a fault of the snippet."""

HYDRA_TOOLS = {"cfp_megatron.plan", "cfp_megatron.analyze", "cfp_megatron.profile"}
"""``python -m`` tools whose arguments are Hydra overrides."""


@dataclass(frozen=True)
class Command:
    """One command shown in a page."""

    page: str
    line: int
    text: str
    expect_error: bool
    """Shown failing (a ``$ `` prompt in an output block that names a ConfigError)."""


_CMD = re.compile(r"^(python -m cfp_megatron(\.[a-z_]+)+(\s|$)|torchrun .*launch/train\.py|torchrun .*-m cfp_megatron"
                  r"|cfp(-| )(plan|analyze|validate|profile)\b)")


def _commands(path: Path) -> list[Command]:
    """Commands in fenced blocks (continuation lines joined, comments cut) and in inline code spans."""
    text = path.read_text()
    found: list[Command] = []
    fences = list(re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M))
    for fence in fences:
        lang, body = fence.group(1), fence.group(2)
        start = text.count("\n", 0, fence.start()) + 2
        output = lang not in ("", "bash", "sh", "shell", "console")
        lines = body.split("\n")
        i = 0
        while i < len(lines):
            first, line = i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            line = line.strip()
            if output:  # only the prompt lines of an output block are commands
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            line = re.sub(r"\s+#.*$", "", line)
            if _CMD.match(line):
                found.append(Command(path.name, start + first, line, output and "ConfigError" in body))
    outside = text
    for fence in reversed(fences):
        outside = outside[:fence.start()] + "\n" * fence.group(0).count("\n") + outside[fence.end():]
    for span in re.finditer(r"`([^`\n]+)`", outside):
        if _CMD.match(span.group(1)):
            found.append(Command(path.name, outside.count("\n", 0, span.start()) + 1, span.group(1), False))
    return found


CATALOGUE = "faults.md"
"""The fault catalogue (written by ``bench/bad_inputs.py``): its commands are the bad inputs, each shown with the
error it gets, so they are not composed as working commands."""
COMMANDS = [c for page in PAGES if page.name != CATALOGUE for c in _commands(page)]


def _check(command: Command) -> None:
    """Compose the command's overrides and run the checks its tool runs before any process group."""
    words = [w for w in shlex.split(command.text.split("|")[0]) if w not in ("[", "]")]
    words = [w.strip("[]") if w.startswith("[") and w.endswith("]") and "=" not in w else w for w in words]
    if words[0] == "python":
        module = words[2]
        assert importlib.util.find_spec(module) is not None, f"no module {module}"
        if module not in HYDRA_TOOLS:
            return
        tool, args = module, words[3:]
    elif words[0] == "torchrun":
        module = words[words.index("-m") + 1] if "-m" in words else None
        tool = module or "train"
        script = next((i for i, w in enumerate(words) if w.endswith("launch/train.py") or w == module), None)
        assert script is not None, "no launch/train.py or -m module"
        args = words[script + 1:]
    else:
        pytest.skip(f"console script {words[0]} (checked through its python -m form)")
    overrides = [a for a in args if not a.startswith("-") and ("=" in a or a.startswith("+"))]
    if tool == "cfp_megatron.plan" and not any(o.lstrip("+").startswith("cfp=") for o in overrides):
        overrides.insert(0, "+cfp=auto")  # as the plan tool does
    try:
        cfg = compose_config(overrides)
        job, cfp, backend = job_from_config(cfg), cfp_from_config(cfg), backend_from_config(cfg)
        if tool == "train":
            flags = dict(re.findall(r"--(nproc_per_node|nnodes)[= ](\d+)", command.text))
            world = int(flags.get("nproc_per_node", 1)) * int(flags.get("nnodes", 1))
        else:
            world = job.cluster.nodes * (job.cluster.gpus_per_node or 4)
        if tool == "cfp_megatron.plan" or (tool == "train" and cfp.mode is CfpMode.auto):
            validate_rest(job)
            if not backend.is_deepspeed:
                check_constraints(job, world, cfp)
        elif tool == "train" and cfp.mode is CfpMode.off and not backend.is_deepspeed:
            validate_job(job, world)
        else:
            validate_rest(job)
    except ConfigError as err:
        if all(issue.key in USER_FILE_KEYS for issue in err.issues):
            return
        if command.expect_error:
            return
        raise
    assert not command.expect_error, "the page shows this command failing, but it passes the checks"


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.page}:{c.line}" for c in COMMANDS])
def test_command_composes_and_validates(command: Command) -> None:
    _check(command)


def test_pages_show_the_main_commands() -> None:
    """The README keeps the set-up, the main job and the test command CI runs."""
    readme = (ROOT / "README.md").read_text()
    for line in ('pip install torch==2.13.0 && pip install -e ".[dev,deepspeed,docs]"',
                 "torchrun --nproc_per_node=4 launch/train.py +cfp=auto", "python -m pytest -q"):
        assert line in readme
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()
    assert len(COMMANDS) > 30, "the command scan found too few commands: is the pattern broken?"


def test_a_bad_command_is_caught() -> None:
    """The check fails on a command whose overrides do not validate (so the parametrized test can fail)."""
    with pytest.raises(ConfigError, match="parallel.tp"):
        _check(Command("x", 1, "torchrun --nproc_per_node=2 launch/train.py parallel.tp=3", False))
    with pytest.raises(Exception, match="parallel.tpp|tpp"):
        _check(Command("x", 1, "torchrun --nproc_per_node=2 launch/train.py parallel.tpp=2", False))


def _links(path: Path) -> list[tuple[str, str]]:
    """(target file, anchor) of every relative Markdown link to a .md page."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return [(m.group(1), m.group(2) or "") for m in re.finditer(r"\]\(([^)#\s]+\.md)(?:#([^)\s]+))?\)", text)
            if "://" not in m.group(1)]


def _anchors(path: Path) -> set[str]:
    """The heading ids mkdocs gives a page (Python-Markdown's toc slugify)."""
    ids = set()
    for heading in re.findall(r"^#+\s+(.*)$", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M),
                              re.M):
        slug = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
        ids.add(re.sub(r"[-\s]+", "-", slug))
    return ids


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_links_between_pages_resolve(page: Path) -> None:
    for target, anchor in _links(page):
        linked = (page.parent / target).resolve()
        assert linked.is_file(), f"{page.name} links to {target}, which does not exist"
        if anchor:
            assert anchor in _anchors(linked), f"{page.name} links to {target}#{anchor}: no such heading"


def test_nav_lists_every_page() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert f" {page.name}" in nav, f"docs/{page.name} is not in mkdocs.yml's nav"


def test_config_reference_is_current() -> None:
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "tools" / "gen_config_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    page = (ROOT / "docs" / "config-reference.md").read_text()
    assert page == gen.render(), "docs/config-reference.md is out of date: run python tools/gen_config_reference.py"
    assert "`parallel.tp`" in page and "`cfp.constraints.memory_headroom`" in page


_INCLUDE = re.compile(r'^[ \t]*-{2}8<-{2}[ \t]+"([^"]+)"', re.M)
"""A pymdownx.snippets include line: ``--8<-- "docs/figures/<bench>.md"`` (paths from the repository root)."""

_DATED = re.compile(r"^\*Generated by `python bench/[\w/.-]+\.py[^`]*` "
                    r"on \d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC, .*\bcores\b")
"""The first line a bench's ``--markdown`` writes (bench/snippet.py): the command, the date and the machine."""


def _include_problems(page: Path, root: Path) -> list[str]:
    """What is wrong with the snippets ``page`` includes: a missing file, or one without the command, date and
    machine line a bench writes first."""
    problems = []
    for target in _INCLUDE.findall(page.read_text()):
        path = root / target
        if not path.is_file():
            problems.append(f"{page.name} includes {target}, which does not exist (run the bench with --markdown)")
        elif not _DATED.match(path.read_text().split("\n", 1)[0]):
            problems.append(f"{page.name} includes {target}, whose first line gives no command, date and machine")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_included_figures_exist_and_are_dated(page: Path) -> None:
    assert not _include_problems(page, ROOT)


def test_figure_check_catches_missing_and_undated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The include check fails on a missing snippet and on one typed by hand, and accepts what a bench writes."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "search.py"), "--markdown", "docs/figures/search.md"])
    spec = importlib.util.spec_from_file_location("bench_snippet", ROOT / "bench" / "snippet.py")
    snippet = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(snippet)
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "typed.md").write_text("| case | seconds |\n|---|---:|\n| a | 0.65 |\n")
    snippet.write(tmp_path / "figures" / "bench.md", snippet.header(), ["| case | seconds |"])
    page = tmp_path / "page.md"
    page.write_text('# Page\n\n--8<-- "figures/typed.md"\n\n--8<-- "figures/gone.md"\n\n--8<-- "figures/bench.md"\n')
    problems = _include_problems(page, tmp_path)
    assert len(problems) == 2, problems
    assert "typed.md" in problems[0] and "no command, date" in problems[0]
    assert "gone.md" in problems[1] and "does not exist" in problems[1]
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == ["bench.md", "typed.md"], "temporary left"


def test_pages_include_the_bench_figures() -> None:
    """The benchmarks page takes its figures from the benches' snippets."""
    included = _INCLUDE.findall((ROOT / "docs" / "benchmarks.md").read_text())
    for name in ("search", "validate"):
        assert f"docs/figures/{name}.md" in included


@pytest.mark.skipif(shutil.which("mkdocs") is None, reason="mkdocs is not installed (pip install -e '.[docs]')")
def test_site_builds_strict(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


MAIN_JOB_PAGES = ("README.md", "getting-started.md")
"""The pages whose first ``text`` block after the main job's command is its output."""

CONDITIONAL_RECORDS = {"warning"}
"""Records the main job prints only sometimes (a plan check more than 10% off)."""

_RECORD = re.compile(r"^(step) +\d+/\d+ \||^([a-z][a-z_]*)(?: \| |$)")


def record_shapes(output: str) -> dict[str, str]:
    """The console records in ``output`` (a run's, or a page's excerpt of one) by name: ``line`` for one printed as
    ``name | key value | ...``, ``block`` for one printed as its name alone and an indented line per field. Lines
    that are not records (``cfp:`` lines, warnings, ``...``) are skipped."""
    found: dict[str, str] = {}
    lines = output.splitlines()
    for index, line in enumerate(lines):
        match = _RECORD.match(line)
        if not match:
            continue
        name = match.group(1) or match.group(2)
        following = lines[index + 1] if index + 1 < len(lines) else ""
        if line == name and not following.startswith("  "):
            continue  # a bare word, not a record
        found[name] = "block" if line == name else "line"
    return found


def main_job_excerpt(page: str) -> str:
    """The main job's output as ``page`` shows it: the first ``text`` block after its command."""
    path = ROOT / (page if page == "README.md" else f"docs/{page}")
    text = path.read_text()
    start = text.index("torchrun --nproc_per_node=4 launch/train.py +cfp=auto")
    return re.search(r"^```text\n(.*?)^```", text[start:], re.S | re.M).group(1)


def test_record_shapes_reads_both_kinds_of_record() -> None:
    output = ("cfp: planned plan x\nstart\n  model  gpt_tiny\nstep     1/20 | loss 5.9 | 91 ms\nmemory\n  step  12\n"
              "plan_check_plot | path p.png\n...\nend | step 20\nwarnings\n")
    assert record_shapes(output) == {"start": "block", "step": "line", "memory": "block", "plan_check_plot": "line",
                                     "end": "line"}


@pytest.mark.parametrize("page", MAIN_JOB_PAGES)
def test_main_job_excerpts_agree_with_the_line_by_line(page: str) -> None:
    """The README's and getting-started's excerpts of the main job show its records as getting-started's
    "Line by line" explains them (each there, printed the same way); the run itself is compared with the excerpt
    in tests/test_launch_plan.py."""
    shown = record_shapes(main_job_excerpt(page))
    full = record_shapes(main_job_excerpt("getting-started.md"))
    assert shown and all(full.get(name) == shape for name, shape in shown.items()), (shown, full)
    text = (ROOT / "docs" / "getting-started.md").read_text()
    explained = text[text.index("Line by line."):text.index("A layout given by hand")]
    for name in {**full, **dict.fromkeys(CONDITIONAL_RECORDS)}:
        assert f"- `{name}" in explained, f"getting-started's line by line does not explain {name!r}"


def test_concepts_counts_its_stages() -> None:
    text = (ROOT / "docs" / "concepts.md").read_text()
    said = re.search(r"flows through (\w+) stages", text).group(1)
    numbers = {"five": 5, "six": 6, "seven": 7, "eight": 8}
    assert numbers[said] == len(re.findall(r"^\d+\. \*\*", text, re.M))


def test_readme_stays_a_short_manual() -> None:
    """The README is read first: at most 120 lines and 1,200 words; measurement history belongs on
    docs/benchmarks.md (a README that quotes more than a couple of dated runs has become a log)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 120 and len(text.split()) <= 1200
    assert len(re.findall(r"\b20\d\d-\d\d-\d\d\b", text)) <= 2


def test_the_set_up_line_installs_every_extra() -> None:
    """The README's first ``pip install -e ".[...]"`` installs every extra of pyproject.toml, so the test command
    that follows it skips nothing for a missing extra (mkdocs for the site, deepspeed, tokenizers)."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    setup = re.search(r'pip install -e "\.\[([\w,-]+)\]"', (ROOT / "README.md").read_text())
    assert setup, "the README shows no pip install -e \".[...]\""
    named = setup.group(1).split(",")
    installed = {req for name in named for req in extras[name]}
    missing = {name: [r for r in reqs if r not in installed] for name, reqs in extras.items()}
    assert not any(missing.values()), f"the README's set-up line leaves out {missing}"
