"""Tokenizers for the text datasets: a user's `tokenizer.json`, or a byte-level BPE trained here, offline.

A trained tokenizer is cached under a name derived from everything that decides it (the training text
or a caller's key, the vocabulary size, the `tokenizers` version), so a dataset trains it once; a file
lock makes concurrent builds wait for the first one, and the file appears by an atomic rename, so no
process ever reads a half-written tokenizer.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator, Optional

import tokenizers
from filelock import FileLock
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from runner.files import atomic_write

PAD, UNK, CLS, EOS = "<pad>", "<unk>", "<cls>", "<eos>"
SPECIAL_TOKENS = [PAD, UNK, CLS, EOS]
# every byte is in the base alphabet, so a byte-level BPE needs these on top and never emits <unk>
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)

# the spellings of the same roles in common tokenizer.json files (BERT, GPT-2, Llama, ...)
_PAD_NAMES = (PAD, "[PAD]", "<|pad|>", "<|padding|>")
_EOS_NAMES = (EOS, "<|endoftext|>", "</s>", "<|end_of_text|>", "[SEP]")

# the vocabulary files a slow (non-fast) tokenizer saves, from which transformers builds a fast one
_VOCAB_FILES = ("vocab.txt", "vocab.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")

# Bumped whenever the training recipe below changes, so old cache files are not reused.
_RECIPE = "byte-bpe-1"


def load_or_train_tokenizer(tokenizer: Optional[str], texts: Iterable[str], vocab_size: int, cache_dir: Path,
                            *, key: Optional[str] = None) -> Tokenizer:
    """The tokenizer at path `tokenizer` (see load_tokenizer), else a byte-level BPE trained on `texts`.

    Pass only the training split's texts. The trained tokenizer is cached in `cache_dir` under a hash of
    the texts and `vocab_size`; a caller that already has a content hash of the texts passes it as `key`,
    and then `texts` is only iterated (lazily) when training is needed. `vocab_size` is ignored for a
    given `tokenizer`. Any padding or truncation stored in a given file is switched off: the datasets
    truncate and pad themselves.
    """
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size: {vocab_size} is too small for a byte-level BPE; allowed: >= {MIN_VOCAB}")
    if key is None:
        texts = list(texts)
        key = texts_digest(texts)
    name = hashlib.sha256(f"{_RECIPE}|{tokenizers.__version__}|{vocab_size}|{key}".encode()).hexdigest()[:16]
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"bpe-{name}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    # the lock makes a second process wait for the first one's training rather than repeat it
    with FileLock(str(path) + ".lock"):
        if not path.is_file():
            tok = _train(texts, vocab_size)
            atomic_write(path, tok.to_str())
    return Tokenizer.from_file(str(path))


def load_tokenizer(tokenizer: str) -> Tokenizer:
    """The tokenizer a `tokenizer.json` file holds, or a save_pretrained directory (a pretrained model's:
    its tokenizer.json, or the fast tokenizer transformers makes from its vocabulary files), padding
    and truncation switched off: the datasets truncate and pad themselves."""
    path = Path(tokenizer)
    if path.is_dir():
        tok = _from_directory(path, tokenizer)
    elif path.is_file():
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust side raises a bare Exception for a malformed file
            raise ValueError(f"tokenizer: {tokenizer} is not a readable tokenizer.json "
                             f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    else:
        raise ValueError(f"tokenizer: {tokenizer} does not exist; give a tokenizer.json, a pretrained model's "
                         "directory, or null to train one on the training split")
    tok.no_padding()
    tok.no_truncation()
    return tok


def tokenizer_file(tokenizer: str) -> Path:
    """The file whose content decides a given tokenizer (for cache keys): a directory's tokenizer.json."""
    path = Path(tokenizer)
    return path / "tokenizer.json" if path.is_dir() else path


def _from_directory(path: Path, tokenizer: str) -> Tokenizer:
    if (path / "tokenizer.json").is_file():
        return load_tokenizer(str(path / "tokenizer.json"))
    if not any((path / name).is_file() for name in _VOCAB_FILES):
        raise ValueError(f"tokenizer: {tokenizer} holds no tokenizer (no tokenizer.json or vocabulary files); save "
                         "the model's tokenizer there with tokenizer.save_pretrained, or give a tokenizer.json")
    try:  # vocabulary files only (vocab.txt, merges.txt, ...): transformers builds the fast tokenizer
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, use_fast=True).backend_tokenizer
    except Exception as err:  # ImportError, OSError (no tokenizer files), or a slow-only tokenizer
        raise ValueError(f"tokenizer: {tokenizer} holds no tokenizer (no tokenizer.json; {type(err).__name__}); "
                         "save the model's tokenizer there with tokenizer.save_pretrained, or give a "
                         "tokenizer.json") from None


def _train(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=UNK))
    # byte-level: lossless on any text (decode(encode(t)) == t), no normalization, no unknown characters
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    _quiet_fork_warning()
    tok.train_from_iterator(_nonempty(texts), trainer=trainer)
    return tok


def _nonempty(texts: Iterable[str]) -> Iterator[str]:
    return (t for t in texts if t)


def encode(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text (with the tokenizer's own post-processing, if it has any), in parallel."""
    _quiet_fork_warning()
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=True)]


def _quiet_fork_warning() -> None:
    # The Rust pool warns in every DataLoader worker forked after it ran unless the variable is set;
    # the workers never tokenize (ids are computed once, up front), so the warning would only be noise.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")


def special_id(tok: Tokenizer, names: tuple[str, ...]) -> Optional[int]:
    for name in names:
        idx = tok.token_to_id(name)
        if idx is not None:
            return idx
    return None


def pad_id_and_vocab(tok: Tokenizer) -> tuple[int, int]:
    """(pad_token_id, vocab_size) for a model: a tokenizer without a padding token gets one appended."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    pad = special_id(tok, _PAD_NAMES)
    if pad is None:
        # a fresh id rather than a real token's, so an embedding's padding_idx never silences a real token
        return vocab, vocab + 1
    return pad, vocab


def eos_id(tok: Tokenizer) -> Optional[int]:
    return special_id(tok, _EOS_NAMES)


def cls_prefix(tok: Tokenizer) -> list[int]:
    """`[<cls>]` for a tokenizer trained here (it has no post-processor); a given tokenizer adds its own."""
    idx = tok.token_to_id(CLS)
    return [idx] if idx is not None and tok.post_processor is None else []


def file_fingerprint(path: Path) -> str:
    """What identifies a file's content for a cache key cheaply: its resolved path, size and mtime."""
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"




def texts_digest(texts: Iterable[str]) -> str:
    """A content hash of a sequence of texts."""
    digest = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        # the length prefix keeps ["ab", "c"] and ["a", "bc"] apart
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def stable_hash(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
