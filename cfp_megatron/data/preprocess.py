"""Tokenize a text corpus into Megatron's indexed dataset format (``PREFIX.bin`` + ``PREFIX.idx``).

Usage::

    python -m cfp_megatron.data.preprocess --input corpus.jsonl --output-prefix data/corpus \\
        [--tokenizer byte|huggingface --tokenizer-path tokenizer.json] [--json-key text] [--overwrite]

The input is JSON lines (one object per line, text under ``--json-key``) when its name ends in ``.jsonl``,
``.json`` or ``.ndjson``, otherwise plain text with one document per blank-line-separated paragraph (``--format``
overrides the guess). Each document is tokenized, followed by the tokenizer's end-of-document id, and written with
``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``. The files are written under temporary names and
renamed at the end, so an interrupted run leaves no half-written dataset, and existing files are never replaced
without ``--overwrite``. Train on the result with ``data.kind=indexed data.path=[PREFIX]``.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from cfp_megatron.base.config import TokenizerKind
from cfp_megatron.base.errors import CfpError, ConfigError, ConfigIssue
from cfp_megatron.base.files import WriteLocation, check_write_locations, regular_file_problem, write_error
from cfp_megatron.data.tokenizer import ByteTokenizer, Tokenizer, make_tokenizer

BATCH_DOCUMENTS = 1024
"""Documents tokenized per batch."""


class InputFormat(enum.Enum):
    """How the input file is split into documents."""

    auto = "auto"
    """JSON lines for ``.jsonl``/``.json``/``.ndjson`` names, plain text otherwise."""
    jsonl = "jsonl"
    """One JSON object per line; the text is under the JSON key."""
    text = "text"
    """Plain text; documents are separated by one or more blank lines."""


class DataFileExistsError(CfpError, FileExistsError):
    """The output files exist and overwriting them was not asked for."""


@dataclass(frozen=True, kw_only=True)
class PreprocessSummary:
    """What one preprocessing run wrote."""

    input_path: str
    """The corpus read."""
    output_prefix: str
    """Prefix of the written files (the value for ``data.path``)."""
    documents: int
    """Documents written."""
    empty_documents: int
    """Documents skipped because they had no tokens."""
    tokens: int
    """Tokens written, end-of-document ids included."""
    tokenizer: str
    """Tokenizer kind."""
    vocab_size: int
    """Tokenizer vocabulary size (``model.vocab_size`` must be at least this)."""
    dtype: str
    """Token dtype in the ``.bin`` file."""

    @property
    def bin_path(self) -> str:
        """The data file."""
        return get_bin_path(self.output_prefix)

    @property
    def idx_path(self) -> str:
        """The index file."""
        return get_idx_path(self.output_prefix)

    def render(self) -> str:
        """A short human-readable summary."""
        per_doc = self.tokens / self.documents if self.documents else 0.0
        lines = [
            f"read      {self.input_path}",
            f"wrote     {self.bin_path} ({os.path.getsize(self.bin_path):,} bytes)",
            f"          {self.idx_path} ({os.path.getsize(self.idx_path):,} bytes)",
            f"documents {self.documents:,} (+{self.empty_documents:,} empty, skipped)",
            f"tokens    {self.tokens:,} incl. end-of-document ({per_doc:.1f} per document), dtype {self.dtype}",
            f"tokenizer {self.tokenizer}, vocabulary {self.vocab_size:,}",
            f"train on  data.kind=indexed data.path=[{self.output_prefix}] data.tokenizer={self.tokenizer}",
        ]
        return "\n".join(lines)


def _resolve_format(path: str, fmt: InputFormat) -> InputFormat:
    if fmt is not InputFormat.auto:
        return fmt
    return InputFormat.jsonl if path.lower().endswith((".jsonl", ".json", ".ndjson")) else InputFormat.text


def _lines(path: str) -> Iterator[tuple[int, str]]:
    try:
        stream = open(path, "rb")  # noqa: SIM115 - closed below; a read error is the input's, not the output's
    except OSError as err:
        raise ConfigError(ConfigIssue(key="--input", value=path, problem=f"cannot be read ({err.strerror or err}).",
                                      fix="check the path and its permissions.")) from None
    with stream:
        number = 0
        while True:
            try:
                raw = stream.readline()
            except OSError as err:
                raise ConfigError(ConfigIssue(key="--input", value=f"{path}:{number + 1}",
                                              problem=f"cannot be read ({err.strerror or err}).",
                                              fix="check the file and the disk holding it.")) from None
            if not raw:
                return
            number += 1
            try:  # a byte-order mark (as Windows editors save UTF-8) is not part of the first document
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(ConfigIssue(key="--input", value=f"{path}:{number}", problem=f"is not UTF-8 ({err}).",
                                              fix="convert the file to UTF-8.")) from err


def read_documents(path: str, *, fmt: InputFormat = InputFormat.auto, json_key: str = "text") -> Iterator[str]:
    """The documents of ``path`` in file order (see the module docstring for the formats)."""
    problem = regular_file_problem(path)
    if problem is not None:  # absent, a folder, or a named pipe (which would block the read forever)
        raise ConfigError(ConfigIssue(key="--input", value=path, problem=problem,
                                      fix="pass a .jsonl file with a text field, or a .txt file."))
    if _resolve_format(path, fmt) is InputFormat.jsonl:
        for number, line in _lines(path):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(ConfigIssue(key="--input", value=f"{path}:{number}",
                                              problem=f"is not valid JSON ({err.msg}).",
                                              fix="write one JSON object per line, or pass --format text.")) from err
            text = record.get(json_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ConfigError(ConfigIssue(key="--json-key", value=json_key,
                                              problem=f"line {number} of {path} has no string field {json_key!r}.",
                                              fix="pass the field that holds the text as --json-key."))
            yield _encodable(text, f"{path}:{number}")
        return
    paragraph: list[str] = []
    for _, line in _lines(path):
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            yield "".join(paragraph).rstrip("\r\n")
            paragraph = []
    if paragraph:
        yield "".join(paragraph).rstrip("\r\n")


def _encodable(text: str, where: str) -> str:
    """``text``, or a :class:`ConfigError` naming ``where`` when it holds a lone UTF-16 surrogate (JSON's
    ``\\ud800`` escape without its pair): not a character, so no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ConfigError(ConfigIssue(
            key="--input", value=where, problem=f"holds {text[err.start]!r} at character {err.start} of its text: a "
            "lone UTF-16 surrogate (a \\uXXXX escape without the other half of its pair), which is not a "
            "character and has no UTF-8 encoding.",
            fix="repair the escape (the character itself, or both halves of its surrogate pair), or remove it.",
        )) from None
    return text


def _batches(documents: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in documents:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _check_prefix(input_path: str, output_prefix: str) -> None:
    """A :class:`ConfigError` for an ``--output-prefix`` that is not a prefix (a folder, with no file name; with
    ``.bin``/``.idx``, which would write ``corpus.bin.bin``), or whose files would be ``--input`` itself."""
    name = os.path.basename(output_prefix)
    stem, ext = os.path.splitext(output_prefix)
    problem = ("names a folder, not the files' prefix: the dataset would be the hidden files .bin and .idx in it"
               if name in ("", ".", "..") else
               f"ends in {ext}: the files are PREFIX.bin and PREFIX.idx, so it would write {output_prefix}.bin and "
               f"{output_prefix}.idx" if ext in (".bin", ".idx") else None)
    if problem is not None:
        example = os.path.join(output_prefix, "corpus") if name in ("", ".", "..") else stem
        raise ConfigError(ConfigIssue(key="--output-prefix", value=output_prefix, problem=f"{problem}.",
                                      fix=f"give the path without an extension, e.g. --output-prefix {example}."))
    for target in (get_bin_path(output_prefix), get_idx_path(output_prefix)):
        if os.path.exists(target) and os.path.exists(input_path) and os.path.samefile(input_path, target):
            raise ConfigError(ConfigIssue(key="--input", value=input_path,
                                          problem=f"is {target}, one of the files this run writes: the corpus "
                                                  "would be replaced by its own tokens.",
                                          fix="pass the text corpus (.jsonl or .txt) as --input, or another "
                                              "--output-prefix."))


def _check_not_existing(output_prefix: str, overwrite: bool) -> None:
    existing = [p for p in (get_bin_path(output_prefix), get_idx_path(output_prefix)) if os.path.exists(p)]
    if existing and not overwrite:
        raise DataFileExistsError(
            f"--output-prefix={output_prefix!r}: {' and '.join(existing)} already exist(s); refusing to replace them. "
            "Fix: choose another --output-prefix, or pass --overwrite to replace them."
        )


def preprocess(input_path: str, output_prefix: str, *, tokenizer: Tokenizer, json_key: str = "text",
               fmt: InputFormat = InputFormat.auto, overwrite: bool = False) -> PreprocessSummary:
    """Tokenize ``input_path`` with ``tokenizer`` and write ``output_prefix.bin``/``.idx``.

    Raises :class:`DataFileExistsError` before reading anything when either file exists and ``overwrite`` is false,
    :class:`ConfigError` for unreadable input or a corpus without documents, and
    :class:`~cfp_megatron.base.files.FileWriteError` (naming ``--output-prefix``) when the disk refuses the output
    (full, read-only, no permission). Both files are written under temporary names beside the targets and renamed
    only once both are complete, so the old files (if any) stay as they were and nothing half-written is left.
    """
    _check_prefix(input_path, output_prefix)
    _check_not_existing(output_prefix, overwrite)
    documents = read_documents(input_path, fmt=fmt, json_key=json_key)
    # a full or read-only disk said before the corpus is read, not after
    check_write_locations([WriteLocation(key="--output-prefix", path=Path(output_prefix).absolute().parent,
                                         folder=True)])
    bin_path, idx_path = get_bin_path(output_prefix), get_idx_path(output_prefix)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    eod = tokenizer.eod
    n_docs = n_empty = n_tokens = 0
    console = Console(stderr=True)
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                        transient=True, disable=not console.is_terminal)
    tmp_bin = tmp_idx = ""
    writing = bin_path  # the output an OSError is about
    builder: IndexedDatasetBuilder | None = None
    try:
        parent = os.path.dirname(os.path.abspath(output_prefix))
        os.makedirs(parent, exist_ok=True)
        name = os.path.basename(output_prefix)
        fd_bin, tmp_bin = tempfile.mkstemp(dir=parent, prefix=f".{name}.", suffix=".bin.tmp")
        os.close(fd_bin)
        fd_idx, tmp_idx = tempfile.mkstemp(dir=parent, prefix=f".{name}.", suffix=".idx.tmp")
        os.close(fd_idx)
        umask = os.umask(0)
        os.umask(umask)
        for tmp in (tmp_bin, tmp_idx):  # mkstemp makes 0600 files; give the dataset ordinary permissions
            os.chmod(tmp, 0o666 & ~umask)
        with progress:
            task = progress.add_task("tokenizing", total=None)
            builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
            for batch in _batches(documents, BATCH_DOCUMENTS):
                for ids in tokenizer.tokenize_batch(batch):
                    if not ids:
                        n_empty += 1
                        continue
                    ids.append(eod)
                    builder.add_document(torch.from_numpy(numpy.asarray(ids, dtype=numpy.int64)), [len(ids)])
                    n_docs += 1
                    n_tokens += len(ids)
                progress.update(task, description=f"tokenizing: {n_docs:,} documents, {n_tokens:,} tokens")
            builder.data_file.flush()  # the .bin's last bytes: a full disk is about the .bin
            writing = idx_path
            builder.finalize(tmp_idx)
        if n_docs == 0:
            raise ConfigError(ConfigIssue(key="--input", value=input_path, problem="contains no non-empty documents.",
                                          fix="check the file, --format and --json-key."))
        _check_not_existing(output_prefix, overwrite)  # nothing appeared meanwhile
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    except OSError as err:
        if isinstance(err, CfpError):  # DataFileExistsError
            raise
        raise write_error(err, writing, "--output-prefix") from None
    finally:
        if builder is not None:
            with contextlib.suppress(OSError):  # flushing it again fails the same way: the file is removed below
                builder.data_file.close()
        for tmp in (tmp_bin, tmp_idx):
            if tmp and os.path.exists(tmp):
                os.remove(tmp)
    kind = TokenizerKind.byte if isinstance(tokenizer, ByteTokenizer) else TokenizerKind.huggingface
    return PreprocessSummary(input_path=input_path, output_prefix=output_prefix, documents=n_docs,
                             empty_documents=n_empty, tokens=n_tokens, tokenizer=kind.value,
                             vocab_size=tokenizer.vocab_size, dtype=numpy.dtype(dtype).name)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(prog="python -m cfp_megatron.data.preprocess",
                                     description="Tokenize a corpus into Megatron's indexed dataset (.bin/.idx).")
    parser.add_argument("--input", required=True, help=".jsonl (one JSON object per line) or .txt (paragraphs)")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", choices=[k.value for k in TokenizerKind], default=TokenizerKind.byte.value)
    parser.add_argument("--tokenizer-path", default=None, help="tokenizer.json for --tokenizer huggingface")
    parser.add_argument("--json-key", default="text", help="field holding the text in JSON lines (default: text)")
    parser.add_argument("--format", choices=[f.value for f in InputFormat], default=InputFormat.auto.value)
    parser.add_argument("--overwrite", action="store_true", help="replace existing PREFIX.bin/PREFIX.idx")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the tool; returns the exit status (0 on success, 2 on a user error)."""
    args = build_parser().parse_args(argv)
    try:
        tokenizer = make_tokenizer(TokenizerKind(args.tokenizer), args.tokenizer_path, path_key="--tokenizer-path")
        summary = preprocess(args.input, args.output_prefix, tokenizer=tokenizer, json_key=args.json_key,
                             fmt=InputFormat(args.format), overwrite=args.overwrite)
    except CfpError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(summary.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
