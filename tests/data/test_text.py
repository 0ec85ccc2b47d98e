"""runner/data/text.py and tokenize.py: IMDB-layout trees and CSV/JSONL tables written to disk, tokenized once."""
from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.data import DataLoader

from runner.data import text as text_mod
from runner.data import tokenize as tok_mod
from runner.data.text import imdb, table
from runner.data.tokenize import load_or_train_tokenizer

GOOD = "wonderful superb moving brilliant charming delightful masterpiece touching".split()
BAD = "boring awful dull clumsy tedious dreadful mess pointless".split()
COMMON = "the film plot actors story scenes it was a and of with this movie".split()


def review(rng: random.Random, words: list[str], n: int) -> str:
    body = " ".join(rng.choice(words + COMMON) for _ in range(n))
    return body.capitalize() + ".<br /><br />" + rng.choice(["Ten stars!", "Never again.", "Well..."])


def write_imdb(root: Path, n_train: int = 20, n_test: int = 8) -> dict[str, dict[str, list[str]]]:
    """aclImdb's layout: train/{neg,pos,unsup}, test/{neg,pos}, plus the loose files the real archive has."""
    rng = random.Random(0)
    written: dict[str, dict[str, list[str]]] = {}
    for split, n in (("train", n_train), ("test", n_test)):
        for label, words in (("neg", BAD), ("pos", GOOD)):
            folder = root / "aclImdb" / split / label
            folder.mkdir(parents=True)
            texts = [review(rng, words, rng.randint(5, 40)) for _ in range(n)]
            for i, t in enumerate(texts):
                (folder / f"{i}_{rng.randint(1, 10)}.txt").write_text(t, encoding="utf-8")
            written.setdefault(split, {})[label] = texts
    unsup = root / "aclImdb" / "train" / "unsup"
    unsup.mkdir()
    for i in range(10):  # a word only unsup uses, often enough that BPE would learn it if it saw unsup
        (unsup / f"{i}_0.txt").write_text("quuxzorp " * 50, encoding="utf-8")
    (root / "aclImdb" / "train" / "urls_pos.txt").write_text("http://example.invalid/1\n")
    return written


def tokenizer_in(root: Path) -> Tokenizer:
    [path] = (root / ".cache" / "tokenizers").glob("bpe-*.json")
    return Tokenizer.from_file(str(path))


def test_imdb_reads_the_layout_ignores_unsup_and_round_trips(tmp_path: Path) -> None:
    written = write_imdb(tmp_path)
    splits = imdb(root=str(tmp_path), max_length=512, vocab_size=300, val_fraction=0.25, split_seed=3)
    assert (splits.num_classes, splits.max_length, splits.input_shape) == (2, 512, (512,))
    assert (len(splits.train), len(splits.val), len(splits.test)) == (30, 10, 16)
    tok = tokenizer_in(tmp_path)
    assert splits.vocab_size == tok.get_vocab_size() and splits.pad_token_id == tok.token_to_id("<pad>")
    assert not any("quux" in t or "zorp" in t for t in tok.get_vocab()), "tokenizer saw train/unsup"
    cls = tok.token_to_id("<cls>")

    def decoded(ds) -> list[tuple[str, int]]:
        out = []
        for i in range(len(ds)):
            item = ds[i]
            assert item["input_ids"].dtype == torch.long and item["labels"].shape == ()
            assert item["input_ids"][0] == cls
            out.append((tok.decode(item["input_ids"].tolist()), int(item["labels"])))
        return out

    labelled = {(t, label) for label, name in enumerate(["neg", "pos"]) for t in written["train"][name]}
    train, val = decoded(splits.train), decoded(splits.val)
    assert set(train) | set(val) == labelled and not set(train) & set(val)
    assert sorted(label for _, label in val) == [0] * 5 + [1] * 5, "validation is stratified"
    assert {(t, label) for t, label in decoded(splits.test)} == \
        {(t, label) for label, name in enumerate(["neg", "pos"]) for t in written["test"][name]}


def test_truncation_padding_and_attention_mask(tmp_path: Path) -> None:
    write_imdb(tmp_path)
    splits = imdb(root=str(tmp_path), max_length=12, vocab_size=300)
    lengths = [len(splits.train[i]["input_ids"]) for i in range(len(splits.train))]
    assert max(lengths) == 12 and all(1 <= n <= 12 for n in lengths)
    full = imdb(root=str(tmp_path), max_length=512, vocab_size=300)
    for i in range(len(splits.train)):  # truncation keeps the head of the same ids
        assert torch.equal(splits.train[i]["input_ids"], full.train[i]["input_ids"][:12])
    items = [full.train[i] for i in range(5)]
    batch = full.collate(items)
    longest = max(len(it["input_ids"]) for it in items)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (5, longest)
    assert batch["labels"].tolist() == [int(it["labels"]) for it in items]
    for row, it in enumerate(items):
        n = len(it["input_ids"])
        assert torch.equal(batch["input_ids"][row, :n], it["input_ids"])
        assert (batch["input_ids"][row, n:] == full.pad_token_id).all()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (longest - n)
    # through worker processes: the dataset and the collate pickle, batches equal in-process ones
    loader = DataLoader(full.train, batch_size=5, collate_fn=full.collate, num_workers=2)
    first = next(iter(loader))
    assert all(torch.equal(first[k], batch[k]) for k in batch)


def test_tokenizer_is_trained_once_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_imdb(tmp_path)
    first = imdb(root=str(tmp_path), max_length=64, vocab_size=300)
    [path] = (tmp_path / ".cache" / "tokenizers").glob("bpe-*.json")
    stamp = path.stat().st_mtime_ns

    def no_training(*_a, **_k):
        raise AssertionError("retrained although the cache holds this tokenizer")

    def no_encoding(*_a, **_k):
        raise AssertionError("re-encoded although the token ids are cached")

    monkeypatch.setattr(tok_mod, "_train", no_training)
    monkeypatch.setattr(text_mod, "encode", no_encoding)
    second = imdb(root=str(tmp_path), max_length=64, vocab_size=300)
    assert path.stat().st_mtime_ns == stamp
    assert all(torch.equal(first.train[i]["input_ids"], second.train[i]["input_ids"]) for i in range(len(first.train)))
    with pytest.raises(AssertionError, match="retrained"):  # a different vocabulary is a different tokenizer
        imdb(root=str(tmp_path), max_length=64, vocab_size=301)


def test_tokenizer_round_trips_any_text(tmp_path: Path) -> None:
    texts = ["Héllo wörld — ünïcode ✓ 日本語 text\n\ttabs  and  spaces ", "emoji 🙂🙃 and <br /> tags"] * 5
    tok = load_or_train_tokenizer(None, texts, 300, tmp_path)
    for t in texts + ["never seen: ζ∑ 🚀 \r\n end"]:
        assert tok.decode(tok.encode(t).ids) == t
    assert tok.token_to_id("<unk>") not in tok.encode("ζ∑ 🚀").ids  # byte-level: nothing is unknown


def write_csv(path: Path, rows: list[tuple[str, str]], header=("text", "label")) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def test_table_csv_string_labels_are_sorted_to_ids(tmp_path: Path) -> None:
    rng = random.Random(1)
    names = ["spam", "ham", "eggs"]
    rows = [(f'{rng.choice(COMMON)} "quoted, with comma"\nsecond line {i}', names[i % 3]) for i in range(30)]
    write_csv(tmp_path / "train.csv", rows)
    splits = table(train_file=str(tmp_path / "train.csv"), root=str(tmp_path), vocab_size=300,
                   val_fraction=0.2, test_fraction=0.2)
    assert splits.num_classes == 3 and (len(splits.train), len(splits.val), len(splits.test)) == (18, 6, 6)
    tok = tokenizer_in(tmp_path)
    ids = {"eggs": 0, "ham": 1, "spam": 2}
    seen = set()
    for ds in (splits.train, splits.val, splits.test):
        for i in range(len(ds)):
            text = tok.decode(ds[i]["input_ids"].tolist())
            label = dict(rows)[text]
            assert int(ds[i]["labels"]) == ids[label]
            seen.add(text)
    assert seen == {t for t, _ in rows}


def test_table_jsonl_with_val_and_test_files_and_int_labels(tmp_path: Path) -> None:
    def write(name: str, n: int, labels: list[int]) -> list[dict]:
        records = [{"review": f"{' '.join(GOOD if y else BAD)} number {i}", "stars": y, "other": None}
                   for i, y in zip(range(n), labels * n)]
        (tmp_path / name).write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
        return records

    train = write("train.jsonl", 12, [0, 2])  # integer labels are ids: 2 classes used, 3 ids
    write("val.jsonl", 4, [2])
    write("test.jsonl", 5, [0])
    splits = table(train_file=str(tmp_path / "train.jsonl"), val_file=str(tmp_path / "val.jsonl"),
                   test_file=str(tmp_path / "test.jsonl"), text_column="review", label_column="stars",
                   root=str(tmp_path), vocab_size=300, max_length=16)
    assert splits.num_classes == 3 and (len(splits.train), len(splits.val), len(splits.test)) == (12, 4, 5)
    assert [int(splits.train[i]["labels"]) for i in range(12)] == [r["stars"] for r in train]
    assert {int(splits.val[i]["labels"]) for i in range(4)} == {2}
    assert {int(splits.test[i]["labels"]) for i in range(5)} == {0}


def test_given_tokenizer_without_pad_gets_a_fresh_pad_id(tmp_path: Path) -> None:
    vocab = {w: i for i, w in enumerate(["[UNK]"] + sorted(set(COMMON + GOOD + BAD + ["number"] + list("0123456789"))))}
    wl = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    wl.enable_padding(length=99)  # stored in the file; the datasets must switch it off
    wl.save(str(tmp_path / "tokenizer.json"))
    write_csv(tmp_path / "t.csv", [(f"the film was {w} {i}", str(i % 2)) for i, w in enumerate(GOOD * 2)])
    splits = table(train_file=str(tmp_path / "t.csv"), tokenizer=str(tmp_path / "tokenizer.json"),
                   root=str(tmp_path), val_fraction=0.25)
    assert (splits.vocab_size, splits.pad_token_id) == (len(vocab) + 1, len(vocab))
    item = splits.train[0]
    assert len(item["input_ids"]) == 5 and (item["input_ids"] < len(vocab)).all()
    assert not (tmp_path / ".cache").exists() or not list((tmp_path / ".cache").rglob("bpe-*.json"))


def one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and message
    return message


def test_bad_input_is_one_line_naming_the_key(tmp_path: Path) -> None:
    assert one_line_error(imdb, root=str(tmp_path / "nowhere")).startswith("root: ")
    write_csv(tmp_path / "t.csv", [("a b c", "x"), ("d e f", "y")] * 5)
    (tmp_path / "t.jsonl").write_text('{"text": "a", "label": 1}\n{"text": "b"}\n')
    (tmp_path / "t.txt").write_text("a,b\n")
    path = str(tmp_path / "t.csv")
    assert one_line_error(table).startswith("train_file: not set")
    assert one_line_error(table, train_file=str(tmp_path / "missing.csv")).startswith("train_file: ")
    assert one_line_error(table, train_file=path, val_file=str(tmp_path / "v.csv")).startswith("val_file: ")
    msg = one_line_error(table, train_file=path, text_column="body", root=str(tmp_path))
    assert msg.startswith("text_column: 'body'") and "text, label" in msg
    assert one_line_error(table, train_file=path, label_column="y").startswith("label_column: 'y'")
    assert one_line_error(table, train_file=str(tmp_path / "t.jsonl")).startswith("label_column: 'label' is missing on line 2")
    assert one_line_error(table, train_file=str(tmp_path / "t.txt")).startswith("train_file: ")
    assert one_line_error(table, train_file=path, root=str(tmp_path), vocab_size=100).startswith("vocab_size: 100")
    assert one_line_error(table, train_file=path, tokenizer=str(tmp_path / "no.json")).startswith("tokenizer: ")
    assert one_line_error(table, train_file=path, tokenizer=path).startswith("tokenizer: ")
    assert one_line_error(table, train_file=path, max_length=0).startswith("max_length: 0")
    assert one_line_error(table, train_file=path, val_fraction=1.5).startswith("val_fraction: 1.5")
    assert text_mod.IMDB_MD5 and text_mod.IMDB_URL.endswith("aclImdb_v1.tar.gz")
