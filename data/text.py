"""Text classification: IMDB reviews in their on-disk layout, or any CSV / JSONL file of texts and labels.

Texts are tokenized once, when the splits are built, and kept as one flat id array per split, so an
epoch (or a DataLoader worker) only slices arrays. Items are `{"input_ids": LongTensor[L], "labels":
LongTensor[]}`, truncated to `max_length`; `PadCollate` pads each batch to its longest item.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from runner.data.splits import TokenSplits, split_indices
from runner.data.tokenize import cls_prefix, encode, load_or_train_tokenizer, pad_id_and_vocab, texts_digest
from runner.files import atomic_write

IMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
IMDB_MD5 = "7c2ac02c03563afcf9b574c7e56c153a"
_IMDB_SKIP = {"unsup"}  # unlabelled reviews in aclImdb/train: not a class
_INT = re.compile(r"-?\d+")


class TokenizedTexts(Dataset):
    """Token id sequences (one flat array plus offsets: cheap to pickle to workers) and their labels."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray, labels: np.ndarray) -> None:
        self.ids, self.offsets, self.labels = ids, offsets, np.asarray(labels, dtype=np.int64)

    @classmethod
    def pack(cls, sequences: list[list[int]], labels: np.ndarray) -> "TokenizedTexts":
        offsets = np.concatenate([[0], np.cumsum([len(s) for s in sequences], dtype=np.int64)])
        # int32 halves the memory of a large set; items are widened to int64 one at a time
        ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in sequences]) if sequences else np.zeros(0, np.int32)
        return cls(ids, offsets, labels)

    def subset(self, idx: np.ndarray) -> "TokenizedTexts":
        return TokenizedTexts.pack([self.ids[self.offsets[i]:self.offsets[i + 1]] for i in idx], self.labels[idx])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = range(len(self))[index]  # negative indices and IndexError as for a list
        ids = self.ids[self.offsets[index]:self.offsets[index + 1]]
        return {"input_ids": torch.from_numpy(ids.astype(np.int64)), "labels": torch.tensor(self.labels[index])}


class PadCollate:
    """Batches items to `input_ids` [B, L] padded with `pad_token_id` to the batch's longest item,
    `attention_mask` [B, L] (1 on tokens, 0 on padding) and `labels` [B]."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        seqs = [item["input_ids"] for item in items]
        lengths = torch.tensor([len(s) for s in seqs])
        input_ids = pad_sequence(seqs, batch_first=True, padding_value=self.pad_token_id)
        mask = (torch.arange(input_ids.shape[1]) < lengths[:, None]).long()
        return {"input_ids": input_ids, "attention_mask": mask, "labels": torch.stack([i["labels"] for i in items])}


def imdb(root: str = "datasets", max_length: int = 256, vocab_size: int = 8000, tokenizer: Optional[str] = None,
         val_fraction: float = 0.1, split_seed: int = 0, download: bool = False) -> TokenSplits:
    """IMDB reviews from `<root>/aclImdb/<split>/<label>/*.txt` (or `<root>/<split>/<label>/*.txt`).

    Labels are the sorted folder names of train (neg, pos); `train/unsup` is ignored. Validation is
    carved from train by `val_fraction` (stratified, by `split_seed`); test is the official test set.
    """
    base = _imdb_base(Path(root))
    if base is None and download:
        from torchvision.datasets.utils import download_and_extract_archive  # only needed with a network
        download_and_extract_archive(IMDB_URL, download_root=str(root), md5=IMDB_MD5)
        base = _imdb_base(Path(root))
    if base is None:
        raise ValueError(f"root: {root} holds no IMDB reviews (expected {root}/aclImdb/train/<label>/*.txt or "
                         f"{root}/train/<label>/*.txt); set download=true to fetch them (needs a network)")
    label_dirs = sorted(d.name for d in (base / "train").iterdir() if d.is_dir() and d.name not in _IMDB_SKIP)
    if not label_dirs:
        raise ValueError(f"root: {base / 'train'} has no label folders (such as neg/ and pos/) of .txt reviews")
    train_texts, train_labels = _read_label_tree(base / "train", label_dirs)
    test_texts, test_labels = _read_label_tree(base / "test", label_dirs) if (base / "test").is_dir() else ([], [])
    extra = sorted({d.name for d in (base / "test").glob("*") if d.is_dir()} - set(label_dirs) - _IMDB_SKIP) \
        if (base / "test").is_dir() else []
    if extra:
        raise ValueError(f"root: {base / 'test'} has label folders {', '.join(extra)} that train lacks; "
                         f"train has {', '.join(label_dirs)}")
    return _classification(train_texts, np.array(train_labels), None, None, test_texts, np.array(test_labels),
                           num_classes=len(label_dirs), max_length=max_length, vocab_size=vocab_size,
                           tokenizer=tokenizer, val_fraction=val_fraction, test_fraction=0.0,
                           split_seed=split_seed, cache_dir=Path(root) / ".cache")


def table(train_file: Optional[str] = None, val_file: Optional[str] = None, test_file: Optional[str] = None,
          text_column: str = "text", label_column: str = "label", root: str = "datasets", max_length: int = 256,
          vocab_size: int = 8000, tokenizer: Optional[str] = None, val_fraction: float = 0.1,
          test_fraction: float = 0.0, split_seed: int = 0) -> TokenSplits:
    """Texts and labels from .csv, .tsv or .jsonl files (one JSON object per line).

    Integer labels are class ids as they are; any other labels are sorted and numbered from 0. Without
    `val_file` (`test_file`), validation (test) is carved from train by `val_fraction` (`test_fraction`).
    The tokenizer cache lives under `<root>/.cache`.
    """
    if train_file is None:
        raise ValueError("train_file: not set; give the path of a .csv, .tsv or .jsonl file "
                         f"with columns {text_column!r} and {label_column!r}")
    tables = {name: _read_table(name, path, text_column, label_column)
              for name, path in (("train_file", train_file), ("val_file", val_file), ("test_file", test_file))
              if path is not None}
    raw = [label for _, labels in tables.values() for label in labels]
    if all(_INT.fullmatch(label) for label in raw):
        ids = {label: int(label) for label in raw}
        if min(ids.values()) < 0:
            raise ValueError(f"label_column: label {min(ids.values())} is negative; integer labels are class "
                             "ids, allowed: 0, 1, 2, ...")
        num_classes = max(ids.values()) + 1
    else:
        ids = {label: i for i, label in enumerate(sorted(set(raw)))}
        num_classes = len(ids)
    split = {name: (texts, np.array([ids[label] for label in labels], dtype=np.int64))
             for name, (texts, labels) in tables.items()}
    empty: tuple[list[str], np.ndarray] = ([], np.zeros(0, dtype=np.int64))
    return _classification(*split["train_file"], *split.get("val_file", (None, None)),
                           *split.get("test_file", empty), num_classes=num_classes, max_length=max_length,
                           vocab_size=vocab_size, tokenizer=tokenizer,
                           val_fraction=0.0 if val_file is not None else val_fraction,
                           test_fraction=0.0 if test_file is not None else test_fraction,
                           split_seed=split_seed, cache_dir=Path(root) / ".cache")


def _classification(train_texts: list[str], train_labels: np.ndarray, val_texts: Optional[list[str]],
                    val_labels: Optional[np.ndarray], test_texts: list[str], test_labels: np.ndarray, *,
                    num_classes: int, max_length: int, vocab_size: int, tokenizer: Optional[str],
                    val_fraction: float, test_fraction: float, split_seed: int, cache_dir: Path) -> TokenSplits:
    if max_length < 1:
        raise ValueError(f"max_length: {max_length} is out of range; allowed: >= 1")
    for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0 <= value < 1:
            raise ValueError(f"{name}: {value:g} is out of range; allowed: 0 <= {name} < 1")
    train_idx, val_idx, test_idx = (i.numpy() for i in split_indices(
        torch.from_numpy(train_labels), val_fraction, test_fraction, split_seed))
    # the tokenizer sees the training split only: validation and test text stay unseen
    try:
        tok = load_or_train_tokenizer(tokenizer, [train_texts[i] for i in train_idx], vocab_size,
                                      cache_dir / "tokenizers")
    except PermissionError as err:
        raise ValueError(f"root: cannot write the tokenizer cache under {cache_dir} ({err.strerror}); "
                         "give a writable root") from None
    pad, vocab = pad_id_and_vocab(tok)
    prefix = cls_prefix(tok)
    # a digest of the tokenizer's whole definition: the same texts under another tokenizer are other ids
    tok_key = hashlib.sha256(tok.to_str().encode()).hexdigest()

    def tokenized(texts: list[str], labels: np.ndarray) -> TokenizedTexts:
        key = hashlib.sha256(f"{tok_key}|{prefix}|{max_length}|{texts_digest(texts)}".encode()).hexdigest()[:20]
        path = cache_dir / "token-ids" / f"{key}.npz"
        if path.is_file():
            with np.load(path) as cached:
                return TokenizedTexts(cached["ids"], cached["offsets"], labels)
        data = TokenizedTexts.pack([(prefix + ids)[:max_length] for ids in encode(tok, texts)], labels)
        # cached on disk because encoding is the slow part (IMDB: over a minute of CPU per run otherwise);
        # concurrent writers produce the same bytes and each renames atomically
        buffer = io.BytesIO()
        np.savez(buffer, ids=data.ids, offsets=data.offsets)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, buffer.getvalue())
        except PermissionError:
            pass  # the ids are in memory; a read-only cache only costs the next run the encoding
        return data

    pool = tokenized(train_texts, train_labels)
    train, carved_val, carved_test = (pool.subset(idx) for idx in (train_idx, val_idx, test_idx))
    val = carved_val if val_texts is None else tokenized(val_texts, val_labels)
    test = tokenized(test_texts, test_labels) if len(test_texts) else carved_test

    def encode_texts(texts: list[str]) -> TokenizedTexts:
        return TokenizedTexts.pack([(prefix + ids)[:max_length] for ids in encode(tok, texts)], np.zeros(len(texts)))

    return TokenSplits(train, val, test, input_shape=(max_length,), num_classes=num_classes, vocab_size=vocab,
                       pad_token_id=pad, max_length=max_length, collate=PadCollate(pad), tokenizer=tok,
                       encode_texts=encode_texts)


def _imdb_base(root: Path) -> Optional[Path]:
    for base in (root / "aclImdb", root):
        if (base / "train").is_dir():
            return base
    return None


def _read_label_tree(split_dir: Path, labels: list[str]) -> tuple[list[str], list[int]]:
    texts, ids = [], []
    for label_id, label in enumerate(labels):
        files = sorted((split_dir / label).glob("*.txt")) if (split_dir / label).is_dir() else []
        texts += [f.read_text(encoding="utf-8", errors="replace") for f in files]
        ids += [label_id] * len(files)
    if not texts:
        raise ValueError(f"root: {split_dir} holds no reviews in {', '.join(labels)} (expected <label>/*.txt)")
    return texts, ids


def _read_table(key: str, file: str, text_column: str, label_column: str) -> tuple[list[str], list[str]]:
    """(texts, labels as strings) of one file; every problem named in one line."""
    path = Path(file)
    if not path.is_file():
        raise ValueError(f"{key}: {file} is not a file")
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ",")
            columns = list(reader.fieldnames or [])
            for key_name, column in (("text_column", text_column), ("label_column", label_column)):
                if column not in columns:
                    raise ValueError(f"{key_name}: {column!r} is not a column of {file}; "
                                     f"its columns: {', '.join(columns) or 'none'}")
            rows = [(row[text_column], row[label_column], reader.line_num) for row in reader]
    elif suffix in (".jsonl", ".ndjson"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for line_num, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{key}: line {line_num} of {file} is not JSON ({err.msg})") from None
                for key_name, column in (("text_column", text_column), ("label_column", label_column)):
                    if not isinstance(record, dict) or column not in record:
                        raise ValueError(f"{key_name}: {column!r} is missing on line {line_num} of {file}")
                rows.append((record[text_column], record[label_column], line_num))
    else:
        raise ValueError(f"{key}: {file} has an unknown format {suffix or '(no suffix)'!r}; "
                         "allowed: .csv, .tsv, .jsonl")
    if not rows:
        raise ValueError(f"{key}: {file} holds no rows")
    texts, labels = [], []
    for text, label, line_num in rows:
        if text is None or label is None or (isinstance(label, str) and not label.strip()):
            which = "text_column" if text is None else "label_column"
            raise ValueError(f"{which}: line {line_num} of {file} has no value")
        texts.append(text if isinstance(text, str) else str(text))
        labels.append(label.strip() if isinstance(label, str) else json.dumps(label))
    return texts, labels
