"""HuggingFace transformers models: sequence classification or causal LM, from a local directory or a config.

`transformers` is imported only when a model is built, so runner works without it installed. Nothing is
downloaded: a `path` must be a local directory written by `save_pretrained` (runs are offline; fetch a
hub model once elsewhere and save it), and it is opened with `local_files_only=True`.

The returned module wraps the HF model as `.model`, so parameter names read `model.<HF name>` (freeze
patterns: `model.distilbert.embeddings.*`); runner.engine.finetune.load_weights maps HF's own names onto it.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

TASKS = ("sequence_classification", "causal_lm")
# the vocabulary files a slow (non-fast) tokenizer saves, from which transformers builds a fast one
VOCAB_FILES = ("vocab.txt", "vocab.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
_NO_TRANSFORMERS = "model: hf needs the transformers package: pip install transformers"


class HFModel(nn.Module):
    """forward(input_ids, attention_mask=None, labels=None) -> the HF output: `.logits`, and `.loss` with labels.

    Causal LM labels are the next tokens already (the data shifts them, see OPEN_WORLD.md), so the loss
    is taken here on unshifted labels: HF's own causal-LM loss shifts once more and would train the
    model to predict two tokens ahead. -100 labels do not count in either task.
    """

    def __init__(self, model: nn.Module, task: str):
        super().__init__()
        self.model = model
        self.task = task

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None) -> Any:
        if self.task == "sequence_classification":
            return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        # use_cache=False: training never reuses the key/value cache, building it only costs memory
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        if labels is None:
            return out
        loss = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        return type(out)(loss=loss, **{k: v for k, v in out.items() if k != "loss"})


def hf_model(task: Literal["sequence_classification", "causal_lm"] = "sequence_classification",
             path: Optional[str] = None, config: Optional[dict] = None, architecture: str = "distilbert",
             num_classes: Optional[int] = None, vocab_size: Optional[int] = None,
             max_length: Optional[int] = None, pad_token_id: Optional[int] = None,
             tokenizer: Optional[Any] = None) -> nn.Module:
    """A HuggingFace model for `task`, loaded from `path` or randomly initialised from `config`.

    Without `path`: `AutoConfig.for_model(architecture, **config)`, then the data's vocabulary size,
    longest sequence (max_position_embeddings, at least), padding id and number of classes. With `path`:
    the saved model, `config` overriding its settings (dropout, ...); a classification head for another
    number of classes is re-initialised (`ignore_mismatched_sizes`). Parameters are fp32 whatever the
    file holds: the precision option decides the compute dtype. `tokenizer` (from the data): the
    `tokenizers.Tokenizer` that made the ids; with `path`, it must be the saved model's own, since
    pretrained embeddings mean nothing for the ids of another vocabulary.
    """
    if task not in TASKS:
        raise ValueError(f"task: {task!r} is not allowed; allowed: {', '.join(TASKS)}")
    for name, value in (("num_classes", num_classes), ("vocab_size", vocab_size), ("max_length", max_length)):
        if value is not None and value < 1:
            raise ValueError(f"{name}: {value} is not allowed; allowed: at least 1")
    try:
        import transformers
    except ImportError:
        raise ValueError(_NO_TRANSFORMERS) from None
    overrides = dict(config or {})
    if path is None:
        cfg = _fresh_config(transformers, architecture, overrides, vocab_size, max_length)
    else:
        cfg = _saved_config(transformers, path, overrides, vocab_size, max_length, tokenizer)
    if pad_token_id is not None:
        cfg.pad_token_id = pad_token_id
    if task == "sequence_classification" and num_classes is not None:
        cfg.num_labels = num_classes
    auto = (transformers.AutoModelForSequenceClassification if task == "sequence_classification"
            else transformers.AutoModelForCausalLM)
    try:
        if path is None:
            model = auto.from_config(cfg)
        else:
            with _quiet(transformers):
                model, loading = auto.from_pretrained(path, config=cfg, local_files_only=True, ignore_mismatched_sizes=True,
                                                      dtype=torch.float32, output_loading_info=True)
            _say_what_loaded(path, loading)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise ValueError(f"task: {task} is not available for architecture {cfg.model_type!r} "
                             f"(transformers has no {auto.__name__} for it); allowed: another task or architecture") from None
        raise
    return HFModel(model, task)


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """transformers prints a progress bar and a table of every key it did not load on each load (the
    classification head of every fine-tuning run among them); runner says the same in one line instead."""
    tlog = transformers.utils.logging
    verbosity, bar = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        tlog.set_verbosity(verbosity)
        if bar:
            tlog.enable_progress_bar()


def _say_what_loaded(path: str, loading: dict[str, Any]) -> None:
    """One line for the weights the folder did not provide (newly initialised: a task's new head) and one
    for the folder's weights the model has no place for; nothing when every weight matched."""
    def names(keys: Any) -> str:
        keys = sorted(k if isinstance(k, str) else k[0] for k in keys)  # mismatched keys come with their shapes
        return ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")

    fresh = [*loading.get("missing_keys", ()), *loading.get("mismatched_keys", ())]
    if fresh:
        log.info("model: %d weight(s) not in %s are newly initialised: %s", len(fresh), path, names(fresh))
    unused = loading.get("unexpected_keys", ())
    if unused:
        log.warning("model: %d weight(s) in %s have no place in this model and are left out: %s",
                    len(unused), path, names(unused))


def _fresh_config(transformers: Any, architecture: str, overrides: dict[str, Any], vocab_size: Optional[int],
                  max_length: Optional[int]) -> Any:
    if architecture not in transformers.CONFIG_MAPPING:
        raise ValueError(f"architecture: {architecture!r} is not a transformers model type; allowed: one of "
                         f"transformers.CONFIG_MAPPING, e.g. distilbert, bert, roberta, gpt2, llama")
    cfg = transformers.AutoConfig.for_model(architecture)
    _check_keys(cfg, overrides, architecture)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    if vocab_size is not None:
        cfg.vocab_size = vocab_size  # the data's tokenizer decides the embedding table
        for special in ("bos_token_id", "eos_token_id"):
            # defaults name ids of the architecture's own tokenizer (gpt2: 50256), meaningless for a smaller one
            if special not in overrides and isinstance(getattr(cfg, special, None), int) and getattr(cfg, special) >= vocab_size:
                setattr(cfg, special, None)
    if max_length is not None and hasattr(cfg, "max_position_embeddings"):
        if "max_position_embeddings" not in overrides:
            cfg.max_position_embeddings = max_length
        _check_positions(cfg, max_length, "config.max_position_embeddings: gives")
    return cfg


def _saved_config(transformers: Any, path: str, overrides: dict[str, Any], vocab_size: Optional[int],
                  max_length: Optional[int], tokenizer: Optional[Any]) -> Any:
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        what = "does not exist" if not directory.exists() else "holds no config.json"
        raise ValueError(f"path: {path!r} {what}; allowed: a local directory written by save_pretrained "
                         f"(nothing is downloaded)")
    cfg = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    _check_keys(cfg, overrides, cfg.model_type)
    defaults = transformers.AutoConfig.for_model(cfg.model_type)
    for key, value in overrides.items():
        saved = getattr(cfg, key, None)
        if key in WEIGHT_SHAPES and value != saved:
            if value == getattr(defaults, key, None):  # a preset's size (the architecture's default): the folder's wins
                log.info("config.%s=%s: the pretrained model at %s has %s=%s; using its own", key, value, path, key, saved)
                continue
            raise ValueError(f"config.{key}: {value} differs from the pretrained model at {path} ({key}={saved}), whose "
                             f"weights have that size; allowed: {saved}, or no model.path (random weights)")
        setattr(cfg, key, value)
    saved_vocab = getattr(cfg, "vocab_size", None)
    if tokenizer is not None:
        _check_tokenizer(path, tokenizer, saved_vocab)
    if vocab_size is not None and saved_vocab is not None and vocab_size > saved_vocab:
        raise ValueError(f"vocab_size: the data's tokenizer has {vocab_size} tokens, the model at {path} embeds "
                         f"{saved_vocab}; allowed: at most {saved_vocab} (use the model's own tokenizer)")
    positions = getattr(cfg, "max_position_embeddings", None)
    if max_length is not None and isinstance(positions, int) and positions < max_length:  # the data's length to lower
        raise ValueError(f"max_length: the data's sequences of {max_length} tokens are longer than the {positions} "
                         f"positions of the pretrained model at {path}; allowed: at most {positions}")
    return cfg


# config keys that size a pretrained model's weights: a different value would re-initialise them at random
WEIGHT_SHAPES = {"dim", "n_layers", "n_heads", "hidden_dim", "max_position_embeddings", "vocab_size", "hidden_size",
                 "num_hidden_layers", "num_attention_heads", "intermediate_size", "n_embd", "n_layer", "n_head",
                 "n_positions", "n_inner", "num_key_value_heads", "type_vocab_size", "head_dim"}


def _check_tokenizer(path: str, tokenizer: Any, saved_vocab: Optional[int]) -> None:
    """Refuse ids from a vocabulary that is not the pretrained model's (a tokenizer trained on the data)."""
    own = _own_tokenizer(Path(path).expanduser())
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if own is not None:
        if own.get_vocab(with_added_tokens=True) == tokenizer.get_vocab(with_added_tokens=True):
            return
        theirs = f"the model's own {own.get_vocab_size(with_added_tokens=True)}"
    elif size == saved_vocab:
        return  # no tokenizer saved beside the model: a vocabulary of its embedding's size is all one can check
    else:
        theirs = f"it embeds {saved_vocab} and keeps no tokenizer"
    raise ValueError(f"tokenizer: the data's token ids are not those of the pretrained model at {path} (the data's "
                     f"tokenizer has {size} tokens, {theirs}); allowed: the model's own tokenizer, tokenizer={path}")


def _own_tokenizer(directory: Path) -> Any:
    if (directory / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(directory / "tokenizer.json"))
    if not any((directory / name).is_file() for name in VOCAB_FILES):
        return None
    try:  # vocabulary files only: transformers builds the fast tokenizer from them
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, use_fast=True).backend_tokenizer
    except Exception:  # no tokenizer files at all
        return None


def _check_keys(cfg: Any, overrides: dict[str, Any], architecture: str) -> None:
    # HF configs take any keyword silently, so a typo (n_layer for n_layers) would build the default shape
    allowed = set(cfg.to_dict()) | set(getattr(cfg, "attribute_map", {})) | {"num_labels"}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ValueError(f"config: {', '.join(map(repr, unknown))} not a setting of {architecture}; allowed: "
                         f"{', '.join(sorted(k for k in allowed if not k.startswith('_')))}")


def _check_positions(cfg: Any, max_length: int, prefix: str) -> None:
    positions = getattr(cfg, "max_position_embeddings", None)
    if isinstance(positions, int) and positions < max_length:
        raise ValueError(f"{prefix} {positions} positions, fewer than the data's longest sequence "
                         f"({max_length} tokens); allowed: at least {max_length}")
