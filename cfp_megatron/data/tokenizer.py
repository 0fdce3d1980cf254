"""Tokenizers for the indexed dataset and its preprocessing tool.

Both classes subclass Megatron-Core's ``MegatronTokenizerBase`` (``megatron.core.tokenizers``, the type that
``GPTDatasetConfig.tokenizer`` names in 0.16.1) and provide what ``GPTDataset`` reads from a tokenizer:

- ``eod``: the end-of-document id (``GPTDataset`` reads it for the loss/position masks);
- ``vocab_size``: the number of ids (``GPTDatasetConfig`` derives the token dtype code from it);
- ``pad``: an id that never occurs in the data (padding of short samples is masked out of the loss); ``-1``, Megatron's
  own fallback, when the vocabulary has no pad token distinct from ``eod``;
- ``unique_identifiers``: a JSON-serialisable mapping; Megatron hashes it into the names of its index cache files.

``tokenize`` returns plain ids (no BOS/EOS added): :mod:`cfp_megatron.data.preprocess` appends ``eod`` to each
document itself.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

from megatron.core.tokenizers import MegatronTokenizerBase

from cfp_megatron.base.config import DataSpec, TokenizerKind
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.files import regular_file_problem

NO_PAD_ID = -1
"""Pad id for vocabularies without a dedicated pad token: Megatron's ``_PAD_TOKEN_ID``, never present in the data."""

EOD_CANDIDATES: tuple[str, ...] = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
"""Token strings tried, in order, as the end-of-document token of a Hugging Face tokenizer."""

PAD_CANDIDATES: tuple[str, ...] = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")
"""Token strings tried, in order, as the pad token of a Hugging Face tokenizer."""

BOS_CANDIDATES: tuple[str, ...] = ("<s>", "<|begin_of_text|>", "<bos>", "<|bos|>", "[BOS]")
"""Token strings tried, in order, as the beginning-of-sequence token of a Hugging Face tokenizer."""


class ByteTokenizer(MegatronTokenizerBase):
    """UTF-8 bytes as ids 0..255 and an end-of-document id 256 (vocabulary 257). Needs no files."""

    EOD_ID = 256
    """End-of-document id."""

    def __init__(self) -> None:
        super().__init__(path="", config={})

    def tokenize(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`tokenize` for each text."""
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Any) -> str:
        """Decode byte ids as UTF-8 (invalid sequences become U+FFFD); special and pad ids are dropped."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @property
    def vocab(self) -> dict[str, int]:
        """Token string to id: byte ``i`` is the Latin-1 character ``chr(i)``; ``<|endoftext|>`` is the EOD id."""
        table = {chr(i): i for i in range(256)}
        table["<|endoftext|>"] = self.EOD_ID
        return table

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Id to token string."""
        return {i: s for s, i in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        """257: 256 byte values plus EOD."""
        return 257

    @property
    def eod(self) -> int:
        """End-of-document id (256)."""
        return self.EOD_ID

    @property
    def eos(self) -> int:
        """Same as :attr:`eod`."""
        return self.EOD_ID

    @property
    def pad(self) -> int:
        """No pad token in the vocabulary: Megatron's out-of-vocabulary pad id ``-1``."""
        return NO_PAD_ID

    @property
    def bos(self) -> None:
        """No beginning-of-sequence token."""
        return None

    @property
    def unique_identifiers(self) -> OrderedDict[str, Any]:
        """What identifies this tokenizer in Megatron's cache file names."""
        return OrderedDict([("class", f"{type(self).__module__}.{type(self).__qualname__}"), ("vocab_size", 257)])

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        """Not supported (pretraining tokenizer)."""
        raise NotImplementedError("ByteTokenizer has no chat template.")


def _import_tokenizers(path: str, path_key: str) -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(ConfigIssue(
            key=path_key, value=path, problem="reading a tokenizer.json needs the `tokenizers` package, which is not "
                                              "installed.",
            fix="pip install tokenizers (or pip install 'cfp-megatron[tokenizers]'), or use data.tokenizer=byte.",
        )) from None
    return tokenizers


class HuggingFaceTokenizer(MegatronTokenizerBase):
    """A local ``tokenizer.json`` read with the ``tokenizers`` package (no network access, no ``transformers``)."""

    def __init__(self, path: str, *, eod_token: str | None = None, path_key: str = "data.tokenizer_path") -> None:
        """Load ``path``. ``eod_token`` names the end-of-document token; by default the first of
        :data:`EOD_CANDIDATES` in the vocabulary. ``path_key`` is the setting named in errors."""
        problem = regular_file_problem(path)
        if problem is not None:  # absent, a folder, a named pipe (the Rust reader would wait on it forever)
            raise ConfigError(ConfigIssue(key=path_key, value=path, problem=problem,
                                          fix="point it at a local tokenizer.json (Hugging Face tokenizers format)."))
        tokenizers = _import_tokenizers(path, path_key)
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as err:  # the Rust side raises a plain Exception
            raise ConfigError(ConfigIssue(
                key=path_key, value=path, problem=f"is not a readable tokenizer.json ({err}).",
                fix="use a tokenizer.json saved by the Hugging Face tokenizers library.",
            )) from err
        super().__init__(path=os.path.abspath(path), config={})
        candidates = (eod_token,) if eod_token is not None else EOD_CANDIDATES
        eod = self._first_id(candidates)
        if eod is None:
            raise ConfigError(ConfigIssue(
                key=path_key, value=path,
                problem=f"has no end-of-document token (looked for {list(candidates)}).",
                fix="use a tokenizer whose vocabulary has one of these tokens, or pass its name as eod_token.",
            ))
        self._eod: int = eod
        pad = self._first_id(PAD_CANDIDATES)
        padding = self._tok.padding
        if pad is None and padding is not None:
            pad = int(padding["pad_id"])
        self._pad: int = pad if pad is not None and pad != eod else NO_PAD_ID
        self._bos: int | None = self._first_id(BOS_CANDIDATES)

    def _first_id(self, tokens: tuple[str | None, ...]) -> int | None:
        for token in tokens:
            if token is not None:
                token_id = self._tok.token_to_id(token)
                if token_id is not None:
                    return int(token_id)
        return None

    def tokenize(self, text: str) -> list[int]:
        """Ids of ``text`` without added special tokens."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`tokenize` for each text, encoded in parallel by the ``tokenizers`` library."""
        return [list(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids: Any) -> str:
        """Text of ``ids`` (special tokens kept, pad ids dropped)."""
        return self._tok.decode([int(i) for i in ids if int(i) >= 0], skip_special_tokens=False)

    @property
    def vocab(self) -> dict[str, int]:
        """Token string to id, added tokens included."""
        return dict(self._tok.get_vocab(with_added_tokens=True))

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Id to token string."""
        return {i: s for s, i in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eod(self) -> int:
        """End-of-document id."""
        return self._eod

    @property
    def eos(self) -> int:
        """Same as :attr:`eod`."""
        return self._eod

    @property
    def pad(self) -> int:
        """Pad id, or ``-1`` when the vocabulary has no pad token distinct from :attr:`eod`."""
        return self._pad

    @property
    def bos(self) -> int | None:
        """Beginning-of-sequence id, or ``None``."""
        return self._bos

    @property
    def unique_identifiers(self) -> OrderedDict[str, Any]:
        """What identifies this tokenizer in Megatron's cache file names."""
        return OrderedDict([("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                            ("tokenizer_path", self.path), ("vocab_size", self.vocab_size), ("eod", self._eod)])

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        """Not supported (pretraining tokenizer)."""
        raise NotImplementedError("HuggingFaceTokenizer has no chat template.")


Tokenizer = ByteTokenizer | HuggingFaceTokenizer
"""The tokenizers this package builds."""


def make_tokenizer(kind: TokenizerKind, path: str | None = None, *, path_key: str = "data.tokenizer_path") -> Tokenizer:
    """Build the tokenizer of ``kind``; ``path`` is the ``tokenizer.json`` of the Hugging Face kind. ``path_key`` is the
    setting named in errors (a Hydra key, or a command-line flag)."""
    if kind is TokenizerKind.byte:
        return ByteTokenizer()
    if kind is TokenizerKind.huggingface:
        if path is None:
            raise ConfigError(ConfigIssue(key=path_key, value=None, problem="the huggingface tokenizer needs a file.",
                                          fix=f"set {path_key} to a local tokenizer.json."))
        return HuggingFaceTokenizer(path, path_key=path_key)
    raise ConfigError(ConfigIssue(key="data.tokenizer", value=kind, problem="is not a known tokenizer.",
                                  fix=f"use one of {[k.value for k in TokenizerKind]}."))


def build_tokenizer(data: DataSpec) -> Tokenizer:
    """The tokenizer ``data`` names (``data.tokenizer``, ``data.tokenizer_path``)."""
    return make_tokenizer(data.tokenizer, data.tokenizer_path)
