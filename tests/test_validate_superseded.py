"""``python -m cfp_megatron.validate``: a row its own source re-measured (``validation/superseded.yaml``) is printed
with the reason but set apart from the headline MAPE, the class figures and the bands; a malformed entry, or one
that does not describe its row, is a clear error."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from cfp_megatron.validate import main, predict_rows, read_rows
from cfp_megatron.validation import superseded
from cfp_megatron.validation.data import ValidationDataError
from cfp_megatron.validation.report import rows_by_id
from cfp_megatron.validation.rows import PUBLISHED_RUNS

FIELDS = ["id", "source", "source_detail", "model", "layers", "hidden", "heads", "seq_len", "gpu", "num_gpus", "tp",
          "pp", "dp", "micro_batch", "global_batch_seqs", "step_time_s"]
ROW = {"id": "1", "source": "Some lab benchmark page", "source_detail": "24.01 container", "model": "GPT 1.7B",
       "layers": "24", "hidden": "2304", "heads": "24", "seq_len": "2048", "gpu": "A100-80GB", "num_gpus": "32",
       "tp": "1", "pp": "1", "dp": "32", "micro_batch": "1", "global_batch_seqs": "512", "step_time_s": "3.5"}
ENTRY = """version: 1
superseded:
  - name: GPT 1.7B, 24.01
    row: "2"
    row_source: Some lab
    figure_column: step_time_s
    measured: 7.0
    container: "24.01"
    same: {num_gpus: 32, tp: 1, micro_batch: 1}
    remeasured: {container: "24.01.01", figure: 3.6}
    where: the page's two tables, lines 10 and 20
    source: the page at commit abc
"""


def _files(tmp_path: Path, entry: str, monkeypatch) -> Path:
    path = tmp_path / "runs.csv"
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows([ROW, {**ROW, "id": "2", "step_time_s": "7.0"}])
    (tmp_path / "superseded.yaml").write_text(entry)
    monkeypatch.setattr(superseded, "SUPERSEDED_FILE", tmp_path / "superseded.yaml")
    return path


def test_a_superseded_row_is_printed_apart_and_leaves_the_figures(tmp_path: Path, monkeypatch, capsys) -> None:
    path = _files(tmp_path, ENTRY, monkeypatch)
    report = tmp_path / "report.json"
    assert main([str(path), "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s+2\s+GPT 1.7B .* s$", out, re.MULTILINE)  # in the table, marked
    section = out.split("superseded by their source's re-measurement")[1]
    assert re.search(r"^\s+2\s+GPT 1.7B\s+superseded by its source: .*24.01.01 container at 3.6 step_time_s "
                     r"against this row's 7 \(24.01; 0.51x\); the page's two tables", section, re.MULTILINE)
    assert re.search(r"^dense\s+1\s", out, re.MULTILINE)  # the class figures count the kept row only
    assert out.strip().endswith("over 1 rows") and "MAPE over all 2 modelled rows" in out
    data = json.loads(report.read_text())
    kept, apart = (next(r for r in data["rows"] if r["id"] == rid) for rid in ("1", "2"))
    assert kept["superseded"] is None and apart["superseded"].startswith("superseded by its source")
    assert data["mape"] == round(abs(kept["error_pct"]), 3) and data["classes"]["dense"]["rows"] == 1
    assert data["mape_all"] == round((abs(kept["error_pct"]) + abs(apart["error_pct"])) / 2, 3)
    assert data["coverage"]["modelled"] == 2


def test_an_entry_applies_only_to_its_source_and_must_describe_its_row(tmp_path: Path, monkeypatch) -> None:
    path = _files(tmp_path, ENTRY.replace("row_source: Some lab", "row_source: Another lab"), monkeypatch)
    results, _ = predict_rows(read_rows(path))
    assert superseded.set_apart(results, rows_by_id(read_rows(path))) == {}  # same id, another source: not this run
    for wrong, said in (("measured: 7.0", "step_time_s='7.0' where the entry says 6.5"),
                        ('container: "24.01"', "does not name the container 24.02"),
                        ("tp: 1,", "tp='1' where the entry says 2")):
        fixed = {"measured: 7.0": "measured: 6.5", 'container: "24.01"': 'container: "24.02"', "tp: 1,": "tp: 2,"}
        _files(tmp_path, ENTRY.replace(wrong, fixed[wrong]), monkeypatch)
        with pytest.raises(ValidationDataError, match=re.escape(said) + r".*Fix: correct the entry"):
            superseded.set_apart(results, rows_by_id(read_rows(path)))


@pytest.mark.parametrize(("change", "said"), [
    (("    where: the page's two tables, lines 10 and 20\n", ""), "has no where"),
    (("measured: 7.0", "measured: -7"), "has measured=-7, not a positive number"),
    (("figure_column: step_time_s", "figure_column: speed"), "has figure_column='speed', not one of"),
    (('remeasured: {container: "24.01.01", figure: 3.6}', "remeasured: 3.6"), "has remeasured=3.6, not a dict"),
    (("    source: the page at commit abc\n", ""), "names no source"),
])
def test_a_malformed_entry_is_a_clear_error(tmp_path: Path, monkeypatch, capsys, change, said) -> None:
    path = _files(tmp_path, ENTRY.replace(*change), monkeypatch)
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "superseded.yaml: entry 1 ('GPT 1.7B, 24.01')" in err and said in err and "Fix:" in err


def test_the_shipped_entries_describe_their_rows() -> None:
    rows = [row for path in PUBLISHED_RUNS for row in read_rows(path)]
    results, _ = predict_rows([row for row in rows if row.get("id") in {"80", "85"}])
    found = superseded.set_apart(results, rows_by_id(rows))
    # row 85's own layout re-measured in 26.02.01; row 80's layout has no re-measurement of its own, so it stays
    assert list(found) == ["85"] and "26.02.01 container at 9058" in found["85"]
