"""The data package: tokenizers, the preprocessing tool, and the micro-batch stream the runtime trains on.

A small corpus is written to a temporary directory, turned into Megatron's indexed dataset by the preprocessing tool
(in process, and once as ``python -m``), and read back through ``build_micro_batches``. The checks compare real
content: the files hold exactly the documents' bytes plus end-of-document ids, every sample is a window of those
documents, the union of the data-parallel ranks' micro-batches is the single-rank global batch, and a resumed stream
equals the uninterrupted one.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

import cfp_megatron
from cfp_megatron.base.config import DataKind, DataSpec, JobSpec, ModelSpec, TokenizerKind, TrainSpec, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.data import (
    ByteTokenizer,
    build_micro_batches,
    build_tokenizer,
    micro_batch_sample_ids,
    num_microbatches,
)
from cfp_megatron.data.preprocess import DataFileExistsError, main, preprocess, read_documents
from cfp_megatron.data.synthetic import MAX_STRIDE

REPO_ROOT = Path(cfp_megatron.__file__).resolve().parent.parent
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega café naïve").split()
FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


def make_documents(n: int, seed: int = 0) -> list[str]:
    """``n`` paragraphs of 5-60 words, some spanning two lines, with non-ASCII characters."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 60))]
        cut = rng.randint(1, len(words) - 1)
        docs.append(" ".join(words[:cut]) + ("\n" if rng.random() < 0.3 else " ") + " ".join(words[cut:]))
    return docs


def write_text_corpus(path: Path, docs: list[str]) -> Path:
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def documents() -> list[str]:
    return make_documents(40)


@pytest.fixture
def prefix(tmp_path: Path, documents: list[str]) -> str:
    corpus = write_text_corpus(tmp_path / "corpus.txt", documents)
    out = str(tmp_path / "data" / "corpus")
    preprocess(str(corpus), out, tokenizer=ByteTokenizer())
    return out


def indexed_job(paths: list[str], tmp_path: Path, **train: int) -> JobSpec:
    settings = {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 32, "steps": 6, "seed": 7}
    settings.update(train)
    return JobSpec(model=ModelSpec(vocab_size=257), train=TrainSpec(**settings),
                   data=DataSpec(kind=DataKind.indexed, path=paths, cache_dir=str(tmp_path / "cache")))


def synthetic_job(**train: int) -> JobSpec:
    settings = {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 48, "steps": 6, "seed": 11}
    settings.update(train)
    return job_from_config({"model": {"vocab_size": 100}, "train": settings, "data": {"kind": "synthetic"}})


def take(iterator, n: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for _ in range(n):
        out.append(next(iterator))
    return out


def global_batches(job: JobSpec, dp_size: int, steps: int, start_step: int = 0) -> list[dict[str, torch.Tensor]]:
    """Per step, the micro-batches of all ``dp_size`` ranks put back in global sample-id order."""
    n_micro = num_microbatches(job.train, dp_size)
    per_rank = [take(build_micro_batches(job, dp_rank=r, dp_size=dp_size, start_step=start_step), steps * n_micro)
                for r in range(dp_size)]
    out = []
    for s in range(steps):
        # micro-batch j of rank r holds ids (j*dp_size + r)*MBS ... : j-major, rank-minor is id order
        parts = [per_rank[r][s * n_micro + j] for j in range(n_micro) for r in range(dp_size)]
        out.append({k: torch.cat([p[k] for p in parts]) for k in FIELDS})
    return out


def assert_batches_equal(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


# ---------------------------------------------------------------------------------------------------------- tokenizer


def test_byte_tokenizer_matches_utf8_and_megatron_needs() -> None:
    tok = ByteTokenizer()
    text = "naïve café\n"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.detokenize([*ids, tok.eod]) == text
    assert (tok.vocab_size, tok.eod, tok.pad, tok.bos) == (257, 256, -1, None)
    assert len(tok.vocab) == 257 and tok.vocab["<|endoftext|>"] == 256
    json.dumps(tok.unique_identifiers)  # Megatron hashes it into cache file names


# -------------------------------------------------------------------------------------------------------- preprocess


def test_preprocess_writes_documents_with_eod(tmp_path: Path, documents: list[str], prefix: str) -> None:
    dataset = IndexedDataset(prefix)
    assert len(dataset) == len(documents)
    for i, doc in enumerate(documents):
        assert dataset[i].tolist() == [*doc.encode("utf-8"), 256]
    assert dataset.index.dtype == numpy.uint16


def test_read_documents_splits_paragraphs_on_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "c.txt"
    path.write_text("\n\none\ntwo\n\n\n  \nthree\n\nfour", encoding="utf-8")
    assert list(read_documents(str(path))) == ["one\ntwo", "three", "four"]


def test_preprocess_cli_reads_jsonl(tmp_path: Path) -> None:
    docs = ["first document", "second, with ünïcode", "third\nhas two lines"]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"body": d, "id": i}) for i, d in enumerate(docs)) + "\n", encoding="utf-8")
    out = tmp_path / "out" / "corpus"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "cfp_megatron.data.preprocess", "--input", str(corpus), "--output-prefix", str(out),
         "--json-key", "body"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "documents 3" in result.stdout
    assert f"data.path=[{out}]" in result.stdout
    dataset = IndexedDataset(str(out))
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[*d.encode("utf-8"), 256] for d in docs]


def test_preprocess_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = write_text_corpus(tmp_path / "a.txt", ["old one", "old two"])
    second = write_text_corpus(tmp_path / "b.txt", ["new"])
    out = str(tmp_path / "corpus")
    preprocess(str(first), out, tokenizer=ByteTokenizer())
    saved = {ext: Path(out + ext).read_bytes() for ext in (".bin", ".idx")}

    with pytest.raises(DataFileExistsError, match="--overwrite"):
        preprocess(str(second), out, tokenizer=ByteTokenizer())
    assert main(["--input", str(second), "--output-prefix", out]) == 2
    assert "refusing" in capsys.readouterr().err
    assert {ext: Path(out + ext).read_bytes() for ext in (".bin", ".idx")} == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "corpus.bin", "corpus.idx"]  # no temps

    assert main(["--input", str(second), "--output-prefix", out, "--overwrite"]) == 0
    dataset = IndexedDataset(out)
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[*b"new", 256]]


def test_preprocess_missing_input_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        preprocess(str(tmp_path / "nope.jsonl"), str(tmp_path / "out"), tokenizer=ByteTokenizer())
    assert err.value.keys == ["--input"]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("prefix", "key", "says"), [
    ("out/", "--output-prefix", "names a folder, not the files' prefix"),
    ("out/corpus.bin", "--output-prefix", "it would write {root}/out/corpus.bin.bin"),
    ("out/corpus.idx", "--output-prefix", "e.g. --output-prefix {root}/out/corpus."),
    ("in", "--input", "is {root}/in.bin, one of the files this run writes"),
])
def test_preprocess_refuses_an_output_prefix_that_is_not_one(tmp_path: Path, prefix: str, key: str,
                                                             says: str) -> None:
    corpus = write_text_corpus(tmp_path / "in.bin", ["a document"])  # a corpus saved under the data file's name
    with pytest.raises(ConfigError) as err:
        preprocess(str(corpus), f"{tmp_path}/{prefix}", tokenizer=ByteTokenizer(), overwrite=True)
    assert err.value.keys == [key] and says.format(root=tmp_path) in str(err.value)
    assert corpus.read_text() == "a document\n" and sorted(p.name for p in tmp_path.iterdir()) == ["in.bin"]


def test_preprocess_reads_a_bom_and_refuses_a_lone_surrogate_by_line(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second \\ud83d"}\n')
    with pytest.raises(ConfigError) as err:
        preprocess(str(corpus), str(tmp_path / "out"), tokenizer=ByteTokenizer())
    assert err.value.keys == ["--input"] and f"{corpus}:2" in str(err.value)
    assert "lone UTF-16 surrogate" in str(err.value)
    corpus.write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second \\ud83d\\ude00"}\n')  # the pair: one emoji
    summary = preprocess(str(corpus), str(tmp_path / "out"), tokenizer=ByteTokenizer())
    dataset = IndexedDataset(summary.output_prefix)
    assert [dataset[i].tolist() for i in range(2)] == [[*b"first", 256], [*"second \U0001f600".encode(), 256]]
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    with pytest.raises(ConfigError, match="is a folder, not a file"):
        preprocess(str(folder), str(tmp_path / "other"), tokenizer=ByteTokenizer())


# ----------------------------------------------------------------------------------------------------- indexed data


def test_indexed_batches_are_windows_of_the_documents(tmp_path: Path, documents: list[str], prefix: str) -> None:
    job = indexed_job([prefix], tmp_path)
    batches = take(build_micro_batches(job, dp_rank=0, dp_size=1), 4 * job.train.steps)
    whole = [[*d.encode("utf-8"), 256] for d in documents]
    stream = b"".join(bytes(d[:-1]) + b"\x00" for d in whole)  # documents separated by a byte absent from the text
    seen = set()
    for batch in batches:
        for k, dtype in (("tokens", torch.int64), ("labels", torch.int64), ("loss_mask", torch.float32),
                         ("position_ids", torch.int64)):
            assert batch[k].shape == (2, 32) and batch[k].dtype == dtype, k
        assert "attention_mask" not in batch
        assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
        assert torch.equal(batch["loss_mask"], torch.ones(2, 32))
        assert torch.equal(batch["position_ids"], torch.arange(32).expand(2, 32))
        for row_tokens, row_labels in zip(batch["tokens"], batch["labels"], strict=True):
            window = [*row_tokens.tolist(), int(row_labels[-1])]  # seq + 1 consecutive tokens
            seen.add(tuple(window))
            pieces = bytes(0 if t == 256 else t for t in window).split(b"\x00")
            for j, piece in enumerate(pieces):
                if 0 < j < len(pieces) - 1:  # between two EODs: a whole document
                    assert (b"\x00" + piece + b"\x00") in (b"\x00" + stream)
                else:
                    assert piece in stream
    assert len(seen) > len(batches)  # real, varied content


def test_indexed_train_split_uses_only_its_documents(tmp_path: Path, documents: list[str], prefix: str) -> None:
    job = indexed_job([prefix], tmp_path)
    job = JobSpec(model=job.model, train=job.train, data=DataSpec(kind=DataKind.indexed, path=[prefix], split="50,49,1",
                                                                  cache_dir=str(tmp_path / "cache")))
    first_half = b"\x00".join(d.encode("utf-8") for d in documents[:20])
    second_half_only = [d.encode("utf-8") for d in documents[20:] if d.encode("utf-8") not in first_half]
    assert second_half_only
    for batch in build_micro_batches(job, dp_rank=0, dp_size=1):  # whole stream; it ends
        for row_tokens, row_labels in zip(batch["tokens"], batch["labels"], strict=True):
            window = bytes(0 if t == 256 else t for t in [*row_tokens.tolist(), int(row_labels[-1])])
            for piece in window.split(b"\x00"):
                assert piece in first_half


def test_empty_training_split_is_a_config_error_not_a_hang(tmp_path: Path) -> None:
    out = str(tmp_path / "one")
    doc = "a single document, long enough to fill one sample"
    preprocess(str(write_text_corpus(tmp_path / "one.txt", [doc])), out, tokenizer=ByteTokenizer())
    job = indexed_job([out], tmp_path)
    data = DataSpec(kind=DataKind.indexed, path=[out], split="50,50,0", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as err:
        build_micro_batches(JobSpec(model=job.model, train=job.train, data=data), dp_rank=0, dp_size=1)
    assert err.value.keys == ["data.split"]
    # validation/test weights on a corpus too small to give them a document: only the training split is built
    data = DataSpec(kind=DataKind.indexed, path=[out], split="98,1,1", cache_dir=str(tmp_path / "cache"))
    batch = next(build_micro_batches(JobSpec(model=job.model, train=job.train, data=data), dp_rank=0, dp_size=1))
    window = bytes(0 if t == 256 else t for t in batch["tokens"][0].tolist())
    assert window in (doc.encode() + b"\x00") * 3  # epochs of the one document, end-of-document ids between


def test_corrupt_index_names_data_path(tmp_path: Path, prefix: str) -> None:
    Path(prefix + ".idx").write_bytes(b"not an index")
    with pytest.raises(ConfigError) as err:
        build_micro_batches(indexed_job([prefix], tmp_path), dp_rank=0, dp_size=1)
    assert err.value.keys == ["data.path"]


@pytest.mark.parametrize("two_prefixes", [False, True])
def test_indexed_dp_ranks_partition_the_global_batch(tmp_path: Path, prefix: str, two_prefixes: bool) -> None:
    paths = [prefix]
    if two_prefixes:
        other = write_text_corpus(tmp_path / "other.txt", make_documents(25, seed=1))
        paths.append(str(tmp_path / "data" / "other"))
        preprocess(str(other), paths[1], tokenizer=ByteTokenizer())
    job = indexed_job(paths, tmp_path)
    reference = global_batches(job, dp_size=1, steps=4)
    assert not torch.equal(reference[0]["tokens"], reference[1]["tokens"])
    assert_batches_equal(global_batches(job, dp_size=2, steps=4), reference)
    assert_batches_equal(global_batches(job, dp_size=4, steps=4), reference)


def test_indexed_resume_equals_uninterrupted_stream(tmp_path: Path, prefix: str) -> None:
    job = indexed_job([prefix], tmp_path)
    full = list(build_micro_batches(job, dp_rank=1, dp_size=2))
    n_micro = num_microbatches(job.train, 2)
    assert len(full) >= job.train.steps * n_micro and len(full) % n_micro == 0  # whole steps, then it ends
    resumed = list(build_micro_batches(job, dp_rank=1, dp_size=2, start_step=3))
    assert_batches_equal(resumed, full[3 * n_micro:])


def test_missing_data_path_names_the_key_and_the_fix(tmp_path: Path) -> None:
    job = indexed_job([str(tmp_path / "absent" / "corpus")], tmp_path)
    with pytest.raises(ConfigError) as err:
        build_micro_batches(job, dp_rank=0, dp_size=1)  # raised at the call, not at the first next()
    assert err.value.keys == ["data.path"]
    assert "python -m cfp_megatron.data.preprocess" in str(err.value)
    assert not (tmp_path / "cache").exists()  # nothing heavy happened


def test_data_path_with_extension_suggests_the_prefix(tmp_path: Path, prefix: str) -> None:
    job = indexed_job([prefix + ".bin"], tmp_path)
    with pytest.raises(ConfigError, match="drop the extension") as err:
        build_micro_batches(job, dp_rank=0, dp_size=1)
    assert err.value.keys == ["data.path"]


def test_tokenizer_must_fit_model_vocab(tmp_path: Path, prefix: str) -> None:
    job = JobSpec(model=ModelSpec(vocab_size=256), train=TrainSpec(),
                  data=DataSpec(kind=DataKind.indexed, path=[prefix]))
    with pytest.raises(ConfigError) as err:
        build_micro_batches(job, dp_rank=0, dp_size=1)
    assert err.value.keys == ["model.vocab_size"]
    assert "data.tokenizer=byte" in str(err.value) and "257" in str(err.value)


def test_all_problems_reported_together(tmp_path: Path) -> None:
    job = JobSpec(model=ModelSpec(vocab_size=256), train=TrainSpec(global_batch_size=6, micro_batch_size=2),
                  data=DataSpec(kind=DataKind.indexed, path=[str(tmp_path / "x")]))
    with pytest.raises(ConfigError) as err:
        build_micro_batches(job, dp_rank=0, dp_size=2)
    assert sorted(err.value.keys) == ["data.path", "model.vocab_size", "train.global_batch_size"]


def test_huggingface_tokenizer_end_to_end(tmp_path: Path, documents: list[str]) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator(documents, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<pad>", "<|endoftext|>"]))
    tok_path = tmp_path / "tokenizer.json"
    hf.save(str(tok_path))
    corpus = write_text_corpus(tmp_path / "corpus.txt", documents)
    out = str(tmp_path / "hf")
    assert main(["--input", str(corpus), "--output-prefix", out, "--tokenizer", "huggingface",
                 "--tokenizer-path", str(tok_path)]) == 0
    eod = hf.token_to_id("<|endoftext|>")
    dataset = IndexedDataset(out)
    assert dataset[0].tolist() == [*hf.encode(documents[0]).ids, eod]

    vocab = hf.get_vocab_size()
    data = DataSpec(kind=DataKind.indexed, path=[out], tokenizer=TokenizerKind.huggingface,
                    tokenizer_path=str(tok_path), cache_dir=str(tmp_path / "cache"))
    job = JobSpec(model=ModelSpec(vocab_size=vocab), train=TrainSpec(seq_length=16, steps=2), data=data)
    batch = next(build_micro_batches(job, dp_rank=0, dp_size=1))
    assert int(batch["tokens"].max()) < vocab
    assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])

    missing = JobSpec(model=ModelSpec(vocab_size=vocab), train=TrainSpec(),
                      data=DataSpec(kind=DataKind.indexed, path=[out], tokenizer=TokenizerKind.huggingface,
                                    tokenizer_path=str(tmp_path / "none.json")))
    with pytest.raises(ConfigError) as err:
        build_micro_batches(missing, dp_rank=0, dp_size=1)
    assert err.value.keys == ["data.tokenizer_path"]


def test_huggingface_without_tokenizers_package_names_the_setting(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    tok_path = tmp_path / "tokenizer.json"
    tok_path.write_text("{}", encoding="utf-8")
    data = DataSpec(kind=DataKind.indexed, path=[str(tmp_path / "corpus")], tokenizer=TokenizerKind.huggingface,
                    tokenizer_path=str(tok_path))
    with pytest.raises(ConfigError, match="pip install tokenizers") as err:
        build_tokenizer(data)
    assert err.value.keys == ["data.tokenizer_path"]


# -------------------------------------------------------------------------------------------------- synthetic data


def test_sample_ids_follow_megatron_pretraining_sampler() -> None:
    ids = [list(micro_batch_sample_ids(1, j, dp_rank=r, dp_size=2, global_batch_size=8, micro_batch_size=2))
           for j in range(2) for r in range(2)]
    assert ids == [[8, 9], [10, 11], [12, 13], [14, 15]]


def test_synthetic_is_layout_independent_and_resumable() -> None:
    job = synthetic_job()
    reference = global_batches(job, dp_size=1, steps=3)
    assert_batches_equal(global_batches(job, dp_size=2, steps=3), reference)
    assert_batches_equal(global_batches(job, dp_size=4, steps=3), reference)
    assert_batches_equal(global_batches(job, dp_size=2, steps=2, start_step=1), reference[1:])
    other_seed = global_batches(synthetic_job(seed=12), dp_size=1, steps=1)
    assert not torch.equal(other_seed[0]["tokens"], reference[0]["tokens"])


def test_synthetic_sequences_are_structured() -> None:
    job = synthetic_job()
    batches = take(build_micro_batches(job, dp_rank=0, dp_size=1), 12)
    distinct = {tuple(row.tolist()) for batch in batches for row in batch["tokens"]}
    assert len(distinct) > 20  # 24 samples, each from its own generator
    strides = set()
    for batch in batches:
        assert batch["tokens"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
        assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
        assert int(batch["tokens"].min()) >= 0 and int(batch["tokens"].max()) < 100  # model.vocab_size=100
        for row_t, row_l in zip(batch["tokens"], batch["labels"], strict=True):
            seq = torch.cat([row_t, row_l[-1:]])
            stride = int((seq[1] - seq[0]) % 100)
            assert 1 <= stride <= MAX_STRIDE
            assert torch.equal(torch.diff(seq) % 100, torch.full((48,), stride))  # t_k = (a + b*k) mod V
            strides.add(stride)
    assert strides == set(range(1, MAX_STRIDE + 1))


def test_batch_geometry_error_names_global_batch_size() -> None:
    job = synthetic_job(global_batch_size=6, micro_batch_size=2)
    with pytest.raises(ConfigError) as err:
        build_micro_batches(job, dp_rank=0, dp_size=2)
    assert err.value.keys == ["train.global_batch_size"]
    with pytest.raises(ValueError, match="dp_rank=2"):
        build_micro_batches(synthetic_job(), dp_rank=2, dp_size=2)


# ------------------------------------------------------------------------------------------------ torch.distributed

DIST_SCRIPT = '''
import sys, torch, torch.distributed as dist
from cfp_megatron.base.config import DataKind, DataSpec, JobSpec, ModelSpec, TrainSpec
from cfp_megatron.data import build_micro_batches

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    paths, cache, out = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
    job = JobSpec(model=ModelSpec(vocab_size=257),
                  train=TrainSpec(global_batch_size=8, micro_batch_size=2, seq_length=32, steps=4, seed=7),
                  data=DataSpec(kind=DataKind.indexed, path=paths, cache_dir=cache))
    torch.save(list(build_micro_batches(job, dp_rank=rank, dp_size=world)), f"{out}.{rank}.pt")
    dist.destroy_process_group()
'''


@pytest.mark.slow
def test_indexed_build_under_torchrun_matches_single_process(tmp_path: Path, prefix: str) -> None:
    """Two gloo ranks build the blend collectively (rank 0 first, then the cache); their union is the global batch."""
    other = write_text_corpus(tmp_path / "other.txt", make_documents(25, seed=1))
    paths = [prefix, str(tmp_path / "data" / "other")]
    preprocess(str(other), paths[1], tokenizer=ByteTokenizer())
    script = tmp_path / "run.py"
    script.write_text(DIST_SCRIPT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
         ",".join(paths), str(tmp_path / "dist_cache"), str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"out.{r}.pt") for r in range(2)]
    job = indexed_job(paths, tmp_path, steps=4)
    reference = list(build_micro_batches(job, dp_rank=0, dp_size=1))
    assert len(ranks[0]) == len(ranks[1]) == len(reference) // 2 == 8
    regrouped = [ranks[r][2 * s + j] for s in range(4) for j in range(2) for r in range(2)]
    assert_batches_equal(regrouped, reference)


# ------------------------------------------------------------------------- issue R: blends, sizes, settings unread

def _corpus_of(tmp_path: Path, name: str, letter: str, docs: int = 30) -> str:
    out = str(tmp_path / name)
    preprocess(str(write_text_corpus(tmp_path / f"{name}.txt", [letter * 60] * docs)), out, tokenizer=ByteTokenizer())
    return out


def test_megatron_weight_prefix_pairs_blend_in_proportion_to_the_weights(tmp_path: Path) -> None:
    a, b = _corpus_of(tmp_path, "a", "a"), _corpus_of(tmp_path, "b", "b")
    data = DataSpec(kind=DataKind.indexed, path=["1", a, "3", b], cache_dir=str(tmp_path / "cache"))
    assert data.blend.prefixes == (a, b) and data.blend.weights == (1.0, 3.0)
    job = JobSpec(model=ModelSpec(vocab_size=257), train=TrainSpec(global_batch_size=8, micro_batch_size=2,
                                                                   seq_length=32, steps=50), data=data)
    samples = build_micro_batches(job, dp_rank=0, dp_size=1)
    rows = [row.tolist() for batch in take(samples, 200) for row in batch["tokens"]]
    assert all((ord("a") in row) != (ord("b") in row) for row in rows)  # each sample from one of the two
    share = sum(ord("b") in row for row in rows) / len(rows)
    assert 0.65 < share < 0.85  # 3 of 4 samples from b (same-sized corpora: by size it would be one half)


@pytest.mark.parametrize(("path", "says"), [
    (["0.3", "P", "0.7"], "mixes weights (0.3, 0.7) and prefixes"),
    (["P", "0.5", "Q"], "mixes weights (0.5) and prefixes"),
    (["-1", "P", "2", "Q"], "the weight -1 of P is not a positive number"),
    (["0", "P", "1", "Q"], "the weight 0 of P is not a positive number"),
    (["P", "P/"], "names the dataset P/ twice (also as P)"),
    (["1", "P", "1", "./P"], "names the dataset ./P twice"),
    (["30%", "P", "70%", "Q"], "gives weights as percentages (30%, 70%)"),
])
def test_a_blend_that_is_neither_form_is_refused_by_data_path(path: list[str], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        DataSpec(kind=DataKind.indexed, path=path)
    assert set(err.value.keys) == {"data.path"} and says in str(err.value)


def test_settings_only_indexed_data_reads_are_refused_with_synthetic_data() -> None:
    with pytest.raises(ConfigError) as err:
        DataSpec(path=["/data/corpus"], cache_dir="/tmp/cache")
    assert err.value.keys == ["data.kind"]
    assert "data.path, data.cache_dir are set, which only indexed data reads" in str(err.value)
    assert "add data=indexed" in str(err.value)
    DataSpec()  # the defaults are synthetic data's


def test_a_split_shorter_than_one_sample_is_refused_and_epochs_are_said(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    short = _corpus_of(tmp_path, "short", "s", docs=1)  # 61 tokens
    with pytest.raises(ConfigError) as err:
        build_micro_batches(indexed_job([short], tmp_path, seq_length=64), dp_rank=0, dp_size=1)
    assert err.value.keys == ["data.path"]
    assert "holds 61 tokens, fewer than one sample of train.seq_length + 1 = 65" in str(err.value)
    next(build_micro_batches(indexed_job([short], tmp_path, seq_length=32, steps=2), dp_rank=0, dp_size=1))
    assert "read its training split's 61 tokens 8.39 times" in capsys.readouterr().err  # 2 x 8 x 32 tokens
