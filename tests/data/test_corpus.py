"""runner/data/corpus.py: token corpora from real text files, memory-mapped, cached once, built by racing processes."""
from __future__ import annotations

import json
import math
import os
import pickle
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

import runner
from runner.data import corpus as corpus_mod
from runner.data import tokenize as tok_mod
from runner.data.corpus import corpus, stdlib_files, unigram_entropy

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_texts(folder: Path, n_files: int = 3, words: int = 1500, seed: int = 0) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    texts = []
    for i in range(n_files):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(words // 7)]
        texts.append(f"# document {i} ünïcode ✓\n" + "\n".join(lines) + "\n")
        (folder / f"doc{i}.txt").write_text(texts[-1], encoding="utf-8")
    return texts


def cache_dir(root: Path) -> Path:
    [meta] = (root / ".cache").glob("*/meta.json")
    return meta.parent


def test_blocks_tile_each_split_and_labels_are_inputs_shifted(tmp_path: Path) -> None:
    texts = write_texts(tmp_path / "txt")
    splits = corpus(files=[str(tmp_path / "txt" / "*.txt")], root=str(tmp_path), block_size=16, vocab_size=300,
                    val_fraction=0.1, test_fraction=0.1)
    assert (splits.max_length, splits.input_shape, splits.num_classes) == (16, (16,), None)
    meta = json.loads((cache_dir(tmp_path) / "meta.json").read_text())
    parts = (splits.train, splits.val, splits.test)
    assert [p.length for p in parts] == meta["split_tokens"] and sum(meta["split_tokens"]) == meta["tokens"]
    assert splits.train.start == 0 and splits.val.start == splits.train.length
    assert splits.test.start + splits.test.length == meta["tokens"], "test is the end of the stream"
    assert 0.08 < splits.val.length / meta["tokens"] < 0.12
    for part in parts:
        tokens = torch.from_numpy(part.tokens().astype(np.int64))
        n = len(part)
        assert n == (part.length - 1) // 16 and n > 0
        xs = torch.cat([part[i]["input_ids"] for i in range(n)])
        ys = torch.cat([part[i]["labels"] for i in range(n)])
        assert torch.equal(xs, tokens[:n * 16]) and torch.equal(ys, tokens[1:n * 16 + 1])
        assert part[-1]["input_ids"].dtype == torch.long and torch.equal(part[-1]["input_ids"], part[n - 1]["input_ids"])
        with pytest.raises(IndexError):
            part[n]
    # the whole stream decodes back to the files, in glob order, with an end-of-text token after each
    tok = Tokenizer.from_file(str(splits.train.tokenizer_path))
    stream = np.memmap(cache_dir(tmp_path) / "tokens.bin", dtype=meta["dtype"], mode="r").tolist()
    assert tok.decode(stream) == "".join(texts)
    assert stream.count(tok.token_to_id("<eos>")) == 3 and stream[-1] == tok.token_to_id("<eos>")
    assert splits.pad_token_id == tok.token_to_id("<pad>") and splits.vocab_size == tok.get_vocab_size()
    assert meta["dtype"] == "uint16"
    assert math.isclose(meta["train_unigram_entropy_nats"], unigram_entropy(splits.train.tokens()))


def test_tokenizer_trained_on_training_text_only(tmp_path: Path) -> None:
    write_texts(tmp_path / "txt", n_files=2)
    # the last file (held out by the fractions) repeats a word the training text never has
    (tmp_path / "txt" / "zz_last.txt").write_text("heldoutword " * 300)
    corpus(files=[str(tmp_path / "txt" / "*.txt")], root=str(tmp_path), block_size=8, vocab_size=400,
           val_fraction=0.2, test_fraction=0.2)
    meta = json.loads((cache_dir(tmp_path) / "meta.json").read_text())
    assert 300 * 12 < meta["chars"] * 0.4, "the whole last file is held out"
    vocab = Tokenizer.from_file(str(cache_dir(tmp_path) / "tokenizer.json")).get_vocab()
    assert not any("heldout" in t for t in vocab)


def test_second_build_reuses_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_texts(tmp_path / "txt")
    args = dict(files=[str(tmp_path / "txt" / "*.txt")], root=str(tmp_path), block_size=32, vocab_size=300)
    first = corpus(**args)
    stamps = {p.name: p.stat().st_mtime_ns for p in cache_dir(tmp_path).iterdir()}

    def fail(*_a, **_k):
        raise AssertionError("rebuilt although the cache is complete")

    monkeypatch.setattr(tok_mod, "_train", fail)
    monkeypatch.setattr(corpus_mod, "encode", fail)
    second = corpus(**args)
    assert {p.name: p.stat().st_mtime_ns for p in cache_dir(tmp_path).iterdir()} == stamps
    assert torch.equal(first.train[3]["input_ids"], second.train[3]["input_ids"])
    (tmp_path / "txt" / "doc1.txt").write_text("changed text\n" * 100)  # a changed file is a new corpus
    with pytest.raises(AssertionError, match="rebuilt"):
        corpus(**args)


RACER = r"""
import hashlib, sys, time
from pathlib import Path
from runner.data.corpus import corpus
files, me, other, root = sys.argv[1:]
Path(me).touch()
deadline = time.time() + 120
while not Path(other).exists() and time.time() < deadline:  # start building together
    time.sleep(0.005)
s = corpus(files=[files], root=root, block_size=32, vocab_size=500)
print(len(s.train), len(s.val), len(s.test), hashlib.sha256(s.train.tokens().tobytes()).hexdigest())
"""


def test_two_processes_building_one_cache_both_succeed(tmp_path: Path) -> None:
    write_texts(tmp_path / "txt", n_files=4, words=3000)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(runner.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path / "txt" / "*.txt"), str(tmp_path / f"ready{i}"),
                               str(tmp_path / f"ready{1 - i}"), str(tmp_path / "ds")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    assert outs[0][0] == outs[1][0] and int(outs[0][0].split()[0]) > 0
    cache = cache_dir(tmp_path / "ds")
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")], "no temporary file left behind"
    assert len(list((tmp_path / "ds" / ".cache").glob("*/meta.json"))) == 1


def test_workers_get_a_small_pickle_and_map_the_file_themselves(tmp_path: Path) -> None:
    write_texts(tmp_path / "txt")
    splits = corpus(files=[str(tmp_path / "txt" / "*.txt")], root=str(tmp_path), block_size=16, vocab_size=300)
    expected = [splits.train[i] for i in range(8)]  # opens the memmap in this process
    assert len(pickle.dumps(splits.train)) < 1000
    loader = DataLoader(splits.train, batch_size=4, num_workers=2)
    batches = [b for _, b in zip(range(2), loader)]
    assert torch.equal(torch.cat([b["input_ids"] for b in batches]), torch.stack([e["input_ids"] for e in expected]))
    assert torch.equal(torch.cat([b["labels"] for b in batches]), torch.stack([e["labels"] for e in expected]))


def test_stdlib_default_builds_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*_a, **_k):
        raise AssertionError("tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    files = stdlib_files()
    rel = [p.relative_to(files[0].parent).as_posix() for p in files]
    assert "os.py" in rel and not [r for r in rel if "site-packages" in r or "/test/" in f"/{r}" or "/tests/" in f"/{r}"]
    started = time.perf_counter()
    splits = corpus(root=str(tmp_path), max_chars=200_000, block_size=64, vocab_size=1024)
    seconds = time.perf_counter() - started
    meta = json.loads((cache_dir(tmp_path) / "meta.json").read_text())
    assert meta["chars"] == 200_000 and len(splits.train) > 100 and len(splits.val) > 0 and len(splits.test) > 0
    tok = Tokenizer.from_file(str(splits.train.tokenizer_path))
    head = tok.decode(splits.train.tokens()[:2000].tolist())
    assert head == Path(files[0]).read_text(encoding="utf-8")[:len(head)], "the corpus is the first stdlib file first"
    entropy = unigram_entropy(splits.train.tokens())
    print(f"\nstdlib 200k chars: {meta['tokens']} tokens in {seconds:.1f}s, train unigram entropy {entropy:.3f} nats")
    assert 3.0 < entropy < math.log(splits.vocab_size)


def test_unigram_entropy_in_nats() -> None:
    assert unigram_entropy(np.array([0, 0, 1, 1])) == pytest.approx(math.log(2))
    assert unigram_entropy(np.array([5, 6, 7, 9] * 10, dtype=np.uint16)) == pytest.approx(math.log(4))
    assert unigram_entropy(np.array([3, 3, 3])) == 0.0


def one_line_error(**kwargs) -> str:
    with pytest.raises(ValueError) as info:
        corpus(**kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_bad_input_is_one_line_naming_the_key(tmp_path: Path) -> None:
    write_texts(tmp_path / "txt", n_files=1, words=100)
    good = str(tmp_path / "txt" / "*.txt")
    root = str(tmp_path / "ds")
    assert one_line_error(files=[str(tmp_path / "none" / "*.txt")], root=root).startswith("files: ")
    assert "is a directory" in one_line_error(files=[str(tmp_path / "txt")], root=root)
    assert one_line_error(files=[], root=root).startswith("files: []")
    assert one_line_error(files=[good], root=root, block_size=0).startswith("block_size: 0")
    assert one_line_error(files=[good], root=root, block_size=100_000, vocab_size=300).startswith("block_size: 100000")
    assert one_line_error(files=[good], root=root, val_fraction=0.5, test_fraction=0.5).startswith("val_fraction: ")
    assert one_line_error(files=[good], root=root, max_chars=0).startswith("max_chars: 0")
    assert one_line_error(files=[good], root=root, vocab_size=10).startswith("vocab_size: 10")
    assert one_line_error(files=[good], root=root, tokenizer=str(tmp_path / "no.json")).startswith("tokenizer: ")
    (tmp_path / "empty.txt").write_text("")
    assert one_line_error(files=[str(tmp_path / "empty.txt")], root=root).startswith("files: ")
    leftovers = [d for d in (tmp_path / "ds" / ".cache").iterdir() if d.is_dir() and not (d / "meta.json").is_file()]
    assert not leftovers, "a refused build leaves no half-made cache"


@pytest.mark.slow
def test_full_stdlib_default_numbers(tmp_path: Path) -> None:
    """The default `task=language_modeling` corpus: prints its size, build time and unigram entropy."""
    started = time.perf_counter()
    splits = corpus(root=str(tmp_path))
    built = time.perf_counter() - started
    started = time.perf_counter()
    corpus(root=str(tmp_path))
    cached = time.perf_counter() - started
    meta = json.loads((cache_dir(tmp_path) / "meta.json").read_text())
    entropy = unigram_entropy(splits.train.tokens())
    print(f"\nstdlib default: {meta['chars']} chars -> {meta['tokens']} tokens {meta['split_tokens']}, "
          f"built in {built:.1f}s, cached build {cached:.2f}s, train unigram entropy {entropy:.3f} nats "
          f"({entropy / math.log(2):.3f} bits)")
    assert len(splits.train) == (meta["split_tokens"][0] - 1) // 256 and entropy > 4.0
