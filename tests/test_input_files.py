"""Issue R, inputs checked where they enter (files side): an indexed dataset's token ids against the vocabulary
(the training split scanned, or a bounded scan that says what it covered), every ``.idx`` header field named as
itself (magic, version, dtype code, counts), and only regular files read where a user names one (data paths, plan
files, ProfileDB files, runs CSVs, DeepSpeed configs): a named pipe is refused, not waited on."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import cfp_megatron.data.indexed as indexed
from cfp_megatron.base.backend_spec import load_config
from cfp_megatron.base.config import DataKind, DataSpec, JobSpec, ModelSpec, TrainSpec
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.files import DuplicateKeyError, json_loads_unique, read_user_file, regular_file_problem
from cfp_megatron.data.indexed import validate_indexed
from cfp_megatron.data.preprocess import preprocess
from cfp_megatron.data.tokenizer import ByteTokenizer
from cfp_megatron.profile.db import read_db
from cfp_megatron.profile.errors import ProfileDBError
from cfp_megatron.validate import InputFileError, read_rows


@pytest.fixture(autouse=True)
def _no_hang() -> Iterator[None]:
    """A read that waits on a named pipe fails the test instead of hanging the suite."""
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("a read waited on a named pipe"))
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("corpus")
    (root / "c.txt").write_text("\n\n".join(f"document number {i} " * 5 for i in range(40)))
    prefix = str(root / "base")
    preprocess(str(root / "c.txt"), prefix, tokenizer=ByteTokenizer())
    return prefix


def _variant(corpus: str, tmp_path: Path, idx: Callable[[bytearray], object] | None = None,
             bin_: Callable[[bytearray], object] | None = None) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = str(tmp_path / "data")
    for ext, change in ((".idx", idx), (".bin", bin_)):
        data = bytearray(Path(corpus + ext).read_bytes())
        if change is not None:
            data = change(data) or data
        Path(out + ext).write_bytes(bytes(data))
    return out


def _job(prefix: str, vocab: int = 257) -> JobSpec:
    return JobSpec(model=ModelSpec(vocab_size=vocab),
                   train=TrainSpec(global_batch_size=8, micro_batch_size=2, seq_length=32, steps=2),
                   data=DataSpec(kind=DataKind.indexed, path=[prefix], split="100,0,0"))


def _refused(prefix: str, vocab: int = 257) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate_indexed(_job(prefix, vocab))
    return info.value


def _byte(offset: int, value: int) -> Callable[[bytearray], None]:
    return lambda data: data.__setitem__(offset, value)


def _u64(offset: int, value: int) -> Callable[[bytearray], None]:
    return lambda data: data.__setitem__(slice(offset, offset + 8), struct.pack("<Q", value))


def _token(i: int, value: int) -> Callable[[bytearray], None]:
    return lambda data: data.__setitem__(slice(2 * i, 2 * i + 2), struct.pack("<H", value))


# ------------------------------------------------------------------------------------------------ the .idx header

@pytest.mark.parametrize(("code", "name"), [(4, "int32"), (1, "uint8"), (5, "int64")])
def test_a_changed_dtype_code_is_named_as_such(corpus: str, tmp_path: Path, code: int, name: str) -> None:
    err = _refused(_variant(corpus, tmp_path, idx=_byte(17, code)))
    text = str(err)
    assert err.keys == ["data.path"] and "truncated" not in text
    assert f"dtype code {code} ({name}" in text and "as code 3 (int16) or 8 (uint16) writes them" in text
    assert "dtype code (byte 17) was changed" in text and "8 uint16" in text  # the codes Megatron knows
    assert "python -m cfp_megatron.data.preprocess" in text


def test_a_changed_dtype_code_of_a_one_document_corpus_is_told_by_the_bin_size(tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_text("just one document here")
    preprocess(str(tmp_path / "one.txt"), str(tmp_path / "one"), tokenizer=ByteTokenizer())
    prefix = _variant(str(tmp_path / "one"), tmp_path / "changed", idx=_byte(17, 4))
    text = str(_refused(prefix))
    assert "dtype code 4 (int32)" in text and "2 bytes per token, as code 3 (int16) or 8 (uint16)" in text
    assert "truncated" not in text


@pytest.mark.parametrize(("change", "says"), [
    (_byte(17, 99), "dtype code 99 \\(byte 17\\), which Megatron-Core does not know \\(its codes: 1 uint8"),
    (_byte(17, 6), "dtype code 6 \\(float64\\), not an integer type"),
    (_u64(9, 2), "index version 2 \\(bytes 9-16\\); Megatron-Core reads version 1"),
    (lambda d: d.__setitem__(slice(0, 3), b"XYZ"), "is not a Megatron index: it starts with"),
    (_u64(18, 39), "counts 39 sequences and 41 document boundaries, which take 830 bytes, but the file holds 842"),
    (_u64(26, 40), "counts 40 sequences and 40 document boundaries"),
    (lambda d: d.__setitem__(slice(34, 38), struct.pack("<i", -5)), "negative sequence length"),
])
def test_each_header_field_is_named_as_itself(corpus: str, tmp_path: Path, change: Callable, says: str) -> None:
    err = _refused(_variant(corpus, tmp_path, idx=change))
    assert err.keys == ["data.path"]
    assert re.search(says, str(err)), str(err)


def test_bin_and_idx_of_different_lengths(corpus: str, tmp_path: Path) -> None:
    short = _refused(_variant(corpus, tmp_path, bin_=lambda d: d[:-10]))
    assert "the .bin is truncated" in str(short)
    longer = _refused(_variant(corpus, tmp_path, bin_=lambda d: d + b"\0\0" * 10))
    assert "indexes only 7,580" in str(longer) and "not written together" in str(longer)


# ------------------------------------------------------------------------------------------------ the token ids

def test_ids_the_model_cannot_embed_are_refused_with_the_largest(corpus: str, tmp_path: Path) -> None:
    err = _refused(_variant(corpus, tmp_path, bin_=_token(50, 60000)))
    text = str(err)
    assert err.keys == ["model.vocab_size"] and "largest token id 60,000" in text
    assert "all 3,790 tokens of the training split" in text and "cannot be embedded" in text
    assert "model.vocab_size=60001 or more" in text


def test_ids_in_the_padding_rows_are_refused_too(corpus: str, tmp_path: Path) -> None:
    text = str(_refused(_variant(corpus, tmp_path, bin_=_token(50, 300))))
    assert "ids 257-300 fall in the rows Megatron adds only to pad the embedding" in text
    assert "padded size 384" in text and "never predicts them" in text
    validate_indexed(_job(str(tmp_path / "data"), vocab=301))  # the fix works


def test_negative_ids_point_at_the_signed_code(corpus: str, tmp_path: Path) -> None:
    err = _refused(_variant(corpus, tmp_path, idx=_byte(17, 3), bin_=_token(50, 60000)))
    assert err.keys == ["data.path"] and "negative token ids (down to -5536)" in str(err)
    assert "dtype code 8 (the unsigned type of the same size)" in str(err)


def test_a_large_split_is_scanned_in_blocks_that_say_what_they_covered(corpus: str, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(indexed, "SCAN_BYTES", 400)
    monkeypatch.setattr(indexed, "_SCAN_BLOCK", 100)
    monkeypatch.setattr(indexed, "_SCANS", {})
    prefix = _variant(corpus, tmp_path, bin_=_token(3789, 60000))  # the last token: the last block reads it
    text = str(_refused(prefix))
    assert "largest token id 60,000" in text and "of the training split's 3,790 tokens (evenly spaced blocks" in text
    monkeypatch.setattr(indexed, "_SCANS", {})
    validate_indexed(_job(_variant(corpus, tmp_path / "ok")))
    validate_indexed(_job(str(tmp_path / "ok" / "data")))
    err = capsys.readouterr().err
    assert err.count("the rest of the split is not checked") == 1  # said once, the scan reused
    assert len(indexed._SCANS) == 1


# ----------------------------------------------------------------------------------------- only regular files

def test_read_user_file_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe")
    for path, says in ((fifo, "named pipe (FIFO), not a regular file"), (tmp_path, "is a folder, not a file"),
                       (tmp_path / "absent", "does not exist"), (tmp_path / "bin.dat", "is not UTF-8 text")):
        with pytest.raises(ConfigError, match=says.replace("(", "\\(").replace(")", "\\)")) as info:
            read_user_file(path, "some.key")
        assert info.value.keys == ["some.key"]
    assert "named pipe" in (regular_file_problem(fifo) or "") and regular_file_problem(tmp_path / "bin.dat") is None


def test_duplicate_json_keys_are_refused_by_name() -> None:
    with pytest.raises(DuplicateKeyError, match="'b' appears twice"):
        json_loads_unique('{"a": {"b": 1, "b": 2}}')
    assert json_loads_unique('{"a": {"b": 1}, "b": 2}') == {"a": {"b": 1}, "b": 2}


def test_data_profile_runs_and_deepspeed_files_refuse_a_named_pipe(corpus: str, tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "data.bin")
    os.link(corpus + ".idx", tmp_path / "data.idx")
    err = _refused(str(tmp_path / "data"))
    assert err.keys == ["data.path"] and "named pipe" in str(err)
    os.mkfifo(tmp_path / "db.json")
    with pytest.raises(ProfileDBError, match="named pipe"):
        read_db(tmp_path / "db.json")
    os.mkfifo(tmp_path / "runs.csv")
    with pytest.raises(InputFileError, match="named pipe"):
        read_rows(tmp_path / "runs.csv")
    os.mkfifo(tmp_path / "ds.json")
    with pytest.raises(ConfigError, match="named pipe") as info:
        load_config(str(tmp_path / "ds.json"), key="backend.config_file")
    assert info.value.keys == ["backend.config_file"]
    (tmp_path / "twice.json").write_text(json.dumps({"a": 1})[:-1] + ', "a": 2}')
    with pytest.raises(ProfileDBError, match="'a' appears twice"):
        read_db(tmp_path / "twice.json")


def test_a_tokenizer_json_that_is_a_named_pipe_is_refused_not_read(tmp_path: Path) -> None:
    from cfp_megatron.data.tokenizer import HuggingFaceTokenizer

    os.mkfifo(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match="is a named pipe") as info:
        HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))
    assert info.value.keys == ["data.tokenizer_path"]


def test_validate_outputs_and_analyze_json_refuse_a_named_pipe_without_reading_it(tmp_path: Path) -> None:
    from cfp_megatron.analyze import RESULT_KEYS
    from cfp_megatron.base.files import own_json_problem
    from cfp_megatron.validation.outputs import check_bands_path, check_json_path

    os.mkfifo(tmp_path / "out.json")  # nobody writes to it: reading it to see what it holds would wait forever
    for problem in (check_json_path(str(tmp_path / "out.json")), check_bands_path(str(tmp_path / "out.json")),
                    own_json_problem(tmp_path / "out.json", "--json", RESULT_KEYS, "an analysis")):
        assert problem is not None and "exists and is not" in problem and "left as it is" in problem
