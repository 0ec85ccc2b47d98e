"""Language-modelling corpora: text files tokenized once into a memory-mapped token file, cut into blocks.

The token stream is cached under `<root>/.cache/<hash>/` (`tokens.bin`, numpy uint16 or uint32, plus
`meta.json`, written last, so a cache directory with a meta file is complete). Train, validation and
test are contiguous token ranges in that order; the tokenizer is trained on the training text only.
With no files given, the corpus is the Python standard library's own sources, which exist on every
machine, so a language model trains with no download.
"""
from __future__ import annotations

import errno
import glob
import json
import math
import os
import sysconfig
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
from filelock import FileLock
from torch.utils.data import Dataset

from runner.data.splits import TokenSplits
from runner.data.tokenize import (encode, eos_id, file_fingerprint, load_or_train_tokenizer, load_tokenizer,
                                  pad_id_and_vocab, stable_hash, tokenizer_file)
from runner.files import atomic_write

_FORMAT = "corpus-1"  # bumped when the cache layout or the way text becomes tokens changes
_CHUNK_CHARS = 1 << 20  # long files are encoded in pieces of about this size, in parallel
_BATCH_CHARS = 8 << 20  # characters tokenized per batch: bounds memory on corpora of any size
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def corpus(files: Optional[list[str]] = None, root: str = "datasets", block_size: int = 256,
           vocab_size: int = 4096, tokenizer: Optional[str] = None, val_fraction: float = 0.05,
           test_fraction: float = 0.05, max_chars: Optional[int] = 5_000_000) -> TokenSplits:
    """Next-token blocks of the text in `files` (paths or globs; None: the Python standard library).

    A sample i of a split is `{"input_ids": tokens[i*T:(i+1)*T], "labels": tokens[i*T+1:(i+1)*T+1]}`
    with T = block_size: blocks do not overlap, so an epoch reads each token once. Files are read in
    the order given (each glob sorted) up to `max_chars` characters (None: all), documents separated by
    an end-of-text token. `tokenizer` is a tokenizer.json or a pretrained model's directory; None trains a byte-level BPE of `vocab_size`.
    """
    if block_size < 1:
        raise ValueError(f"block_size: {block_size} is out of range; allowed: >= 1")
    for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0 <= value < 1:
            raise ValueError(f"{name}: {value:g} is out of range; allowed: 0 <= {name} < 1")
    if val_fraction + test_fraction >= 1:
        raise ValueError(f"val_fraction: {val_fraction:g} + test_fraction {test_fraction:g} leave no training "
                         "text; allowed: a sum below 1")
    if max_chars is not None and max_chars < 1:
        raise ValueError(f"max_chars: {max_chars} is out of range; allowed: >= 1, or null for all the text")
    paths = resolve_files(files)
    key = stable_hash(_FORMAT, [file_fingerprint(p) for p in paths], max_chars, vocab_size,
                      file_fingerprint(tokenizer_file(tokenizer)) if tokenizer and tokenizer_file(tokenizer).is_file() else tokenizer,
                      val_fraction, test_fraction)
    cache = Path(root) / ".cache" / key
    try:
        meta = _read_meta(cache)
        if meta is None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            # one process builds; another one building the same corpus waits here, then reuses it
            with FileLock(str(cache) + ".lock"):
                meta = _read_meta(cache)
                if meta is None:
                    cache.mkdir(exist_ok=True)
                    try:
                        meta = _build(cache, key, paths, max_chars, vocab_size, tokenizer, val_fraction,
                                      test_fraction)
                    except BaseException:
                        if not any(cache.iterdir()):
                            cache.rmdir()  # a refused build (bad input) leaves no empty cache behind
                        raise
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):  # a read-only file system is not a PermissionError
            raise
        raise ValueError(f"root: cannot write the token cache under {Path(root) / '.cache'} "
                         f"({err.strerror.lower()}); give a writable root") from None
    bounds = np.cumsum([0] + meta["split_tokens"])
    if (bounds[1] - 1) // block_size < 1:
        raise ValueError(f"block_size: {block_size} needs at least {block_size + 1} training tokens; the "
                         f"training split has {bounds[1]}: lower block_size or give more text")
    tokens = cache / "tokens.bin"
    train, val, test = (TokenBlocks(tokens, meta["dtype"], int(bounds[i]), int(bounds[i + 1] - bounds[i]), block_size)
                        for i in range(3))
    return TokenSplits(train, val, test, input_shape=(block_size,), vocab_size=meta["vocab_size"],
                       pad_token_id=meta["pad_token_id"], max_length=block_size,
                       tokenizer=load_tokenizer(str(cache / "tokenizer.json")))


class TokenBlocks(Dataset):
    """Non-overlapping blocks of one split's token range, read through a memmap opened lazily, so a
    DataLoader worker receives a few numbers when pickled and maps the file itself."""

    def __init__(self, path: Path, dtype: str, start: int, length: int, block_size: int) -> None:
        self.path, self.dtype, self.start, self.length, self.block_size = Path(path), dtype, start, length, block_size
        self.tokenizer_path = Path(path).parent / "tokenizer.json"
        self._tokens: Optional[np.memmap] = None

    def __len__(self) -> int:
        # the last block's labels need one token past it, so `length - 1` tokens can start blocks
        return max(0, (self.length - 1) // self.block_size)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"block {index} out of range for {n} blocks")
        a = self.start + (index % n) * self.block_size
        window = torch.from_numpy(self.tokens_all()[a:a + self.block_size + 1].astype(np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}

    def tokens_all(self) -> np.memmap:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._tokens

    def tokens(self) -> np.ndarray:
        """This split's whole token range (a read-only memmap view)."""
        return self.tokens_all()[self.start:self.start + self.length]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the token frequencies: the loss of a model that ignores context."""
    return _entropy(np.bincount(np.asarray(tokens, dtype=np.int64)))


def _entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / max(1, counts.sum())
    return float(-(p * np.log(p)).sum())


def stdlib_files() -> list[Path]:
    """The Python standard library's .py sources, sorted, without test suites and installed packages."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, names in os.walk(stdlib):
        # pruned while walking: site-packages alone can hold far more files than the library itself
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        rel = Path(folder).relative_to(stdlib)
        found += [((rel / n).as_posix(), Path(folder) / n) for n in names
                  if n.endswith(".py") and not n.startswith("test_")]
    return [path for _, path in sorted(found)]


def resolve_files(files: Optional[list[str]]) -> list[Path]:
    if files is None:
        paths = stdlib_files()
        if not paths:
            raise ValueError(f"files: null means the Python standard library, but "
                             f"{sysconfig.get_paths()['stdlib']} holds no .py files; give text files")
        return paths
    if isinstance(files, (str, os.PathLike)):
        files = [str(files)]
    if not files:
        raise ValueError("files: [] names no file; give paths or globs, or null for the Python standard library")
    paths: list[Path] = []
    for pattern in files:
        matches = sorted(glob.glob(os.path.expanduser(str(pattern)), recursive=True))
        if not matches:
            raise ValueError(f"files: {pattern!r} matches no file")
        for match in matches:
            if Path(match).is_dir():
                raise ValueError(f"files: {match!r} is a directory; give files or a glob such as '{match}/**/*.txt'")
            if _is_binary(Path(match)):
                raise ValueError(f"files: {match!r} is not a text file (it holds binary data); give text files")
            paths.append(Path(match))
    return paths


def _is_binary(path: Path) -> bool:
    """NUL bytes or bytes that are not UTF-8 at the start of the file: read as text (errors replaced), it would
    train a tokenizer on noise."""
    try:
        with open(path, "rb") as f:
            head = f.read(8192)
    except OSError:
        return False  # reading it later says why
    if b"\0" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start < len(head) - 4  # a character cut at the end of the sample is not binary
    return False


def _read_meta(cache: Path) -> Optional[dict]:
    meta = cache / "meta.json"
    return json.loads(meta.read_text()) if meta.is_file() else None


def _documents(paths: list[Path], max_chars: Optional[int]) -> Iterator[str]:
    left = math.inf if max_chars is None else max_chars
    for path in paths:
        if left <= 0:
            return
        text = path.read_text(encoding="utf-8", errors="replace")
        if max_chars is not None:
            text = text[:left]
        left -= len(text)
        yield text


def _pieces(paths: list[Path], max_chars: Optional[int], cut: int) -> Iterator[tuple[str, bool, bool]]:
    """(text, in_training_split, ends_a_document): the documents in order, cut at character `cut`
    between training and held-out text, long ones in newline-aligned pieces for parallel encoding."""
    seen = 0
    for doc in _documents(paths, max_chars):
        parts = [(doc, seen + len(doc) <= cut)] if seen >= cut or seen + len(doc) <= cut else \
            [(doc[:cut - seen], True), (doc[cut - seen:], False)]
        seen += len(doc)
        for i, (text, is_train) in enumerate(parts):
            chunks = list(_chunks(text))
            for j, chunk in enumerate(chunks):
                yield chunk, is_train, i == len(parts) - 1 and j == len(chunks) - 1


def _chunks(text: str) -> Iterator[str]:
    start = 0
    while len(text) - start > _CHUNK_CHARS:
        end = text.find("\n", start + _CHUNK_CHARS) + 1 or len(text)
        yield text[start:end]
        start = end
    yield text[start:]


def _build(cache: Path, key: str, paths: list[Path], max_chars: Optional[int], vocab_size: int,
           tokenizer: Optional[str], val_fraction: float, test_fraction: float) -> dict:
    for stale in cache.glob(".*.tmp"):  # left by a killed build: no other builder runs while we hold the lock
        stale.unlink(missing_ok=True)
    total = sum(len(doc) for doc in _documents(paths, max_chars))
    if total == 0:
        raise ValueError(f"files: the {len(paths)} file(s) given hold no text")
    cut = math.ceil(total * (1 - val_fraction - test_fraction))
    train_text = (text for text, is_train, _ in _pieces(paths, max_chars, cut) if is_train)
    tok = load_or_train_tokenizer(tokenizer, train_text, vocab_size, cache, key=key)
    atomic_write(cache / "tokenizer.json", tok.to_str())
    pad, vocab = pad_id_and_vocab(tok)
    eos = eos_id(tok)
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    tmp = cache / f".tokens.bin.{os.getpid()}.tmp"
    n_train = n_total = 0
    counts = np.zeros(vocab, dtype=np.int64)
    try:
        with open(tmp, "wb") as out:
            for batch in _batches(_pieces(paths, max_chars, cut)):
                for ids, (_, is_train, ends_doc) in zip(encode(tok, [text for text, _, _ in batch]), batch):
                    if ends_doc and eos is not None:
                        ids.append(eos)
                    arr = np.asarray(ids, dtype=dtype)
                    arr.tofile(out)
                    n_total += len(arr)
                    if is_train:
                        n_train += len(arr)
                        counts += np.bincount(arr, minlength=vocab)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, cache / "tokens.bin")
    finally:
        tmp.unlink(missing_ok=True)
    held = n_total - n_train
    n_val = round(held * val_fraction / (val_fraction + test_fraction)) if held else 0
    meta = {"format": _FORMAT, "files": len(paths), "chars": total, "tokens": n_total,
            "split_tokens": [n_train, n_val, held - n_val], "dtype": np.dtype(dtype).name,
            "vocab_size": vocab, "pad_token_id": pad, "eos_token_id": eos,
            "train_unigram_entropy_nats": _entropy(counts)}
    atomic_write(cache / "meta.json", json.dumps(meta, indent=1))
    return meta


def _batches(pieces: Iterator[tuple[str, bool, bool]]) -> Iterator[list[tuple[str, bool, bool]]]:
    batch: list[tuple[str, bool, bool]] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece[0])
        if size >= _BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
