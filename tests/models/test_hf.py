"""runner/models/hf.py: HuggingFace models built offline, from a config or a save_pretrained directory."""
from __future__ import annotations

import contextlib
import io
import logging
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported anywhere: nothing may reach the network

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from hydra.utils import get_method

from runner.models.hf import hf_model
from runner.specs.run import SpecError
from runner.specs.registry import CONF_DIR

pytest.importorskip("transformers")

TINY_DISTILBERT = {"dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64}
TINY_GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 2}
DATA = {"vocab_size": 50, "max_length": 12, "pad_token_id": 0}


def from_yaml(name: str, config: dict | None = None, **data):
    """The model a conf/model/<name>.yaml builds, its `config` updated by `config`."""
    kwargs = yaml.safe_load((CONF_DIR / "model" / f"{name}.yaml").read_text())
    build = get_method(kwargs.pop("_target_"))
    kwargs["config"] = {**kwargs["config"], **(config or {})}
    return build(**kwargs, **data)


def tiny_classifier(num_classes: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    return from_yaml("distilbert", TINY_DISTILBERT, num_classes=num_classes, **DATA)


def test_distilbert_yaml_is_the_real_distilbert_shape() -> None:
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = from_yaml("distilbert", num_classes=2, vocab_size=30522, max_length=512, pad_token_id=0)
    cfg = model.model.config
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.hidden_dim, cfg.max_position_embeddings) == (768, 6, 12, 3072, 512)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6) == 67  # distilbert-base-uncased + a 2-class head


def test_random_init_takes_the_data_values_and_trains_with_a_padding_mask() -> None:
    model = tiny_classifier(num_classes=3)
    cfg = model.model.config
    assert (cfg.vocab_size, cfg.pad_token_id, cfg.num_labels) == (50, 0, 3)
    assert cfg.max_position_embeddings == 512  # the YAML's room for longer inputs is kept
    assert hf_model(config=TINY_DISTILBERT, **DATA).model.config.max_position_embeddings == 12  # else the data's
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]])
    mask = (ids != 0).long()
    labels = torch.tensor([2, 0])
    model.train()
    out = model(ids, attention_mask=mask, labels=labels)
    assert out.logits.shape == (2, 3)
    assert torch.allclose(out.loss, F.cross_entropy(out.logits, labels))
    out.loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert no_grad == [], no_grad

    # the mask is honoured: extra padding leaves the (dropout-free) logits of a sequence unchanged
    model.eval()
    short = model(ids[1:, :3], attention_mask=mask[1:, :3]).logits
    padded = model(ids[1:], attention_mask=mask[1:]).logits
    assert torch.allclose(short, padded, atol=1e-5)
    assert not torch.allclose(short, model(ids[1:]).logits, atol=1e-5)  # unmasked padding does change them


def test_the_same_seed_gives_the_same_model() -> None:
    a, b, c = tiny_classifier(seed=1), tiny_classifier(seed=1), tiny_classifier(seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_a_saved_model_loads_from_path_with_equal_outputs(tmp_path: Path) -> None:
    model = tiny_classifier(num_classes=3).eval()
    model.model.save_pretrained(tmp_path / "saved")
    loaded = hf_model(path=str(tmp_path / "saved"), num_classes=3, **DATA).eval()
    ids = torch.randint(1, 50, (4, 12))
    assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert all(p.dtype == torch.float32 for p in loaded.parameters())


def test_path_with_another_number_of_classes_keeps_the_backbone_and_renews_the_head(
        tmp_path: Path, capfd: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture) -> None:
    """And says so in one line, not in transformers' progress bar and table of keys (issue 26: console noise)."""
    model = tiny_classifier(num_classes=3)
    with contextlib.redirect_stderr(io.StringIO()):
        model.model.save_pretrained(tmp_path / "saved")
    capfd.readouterr()
    with caplog.at_level(logging.INFO):
        loaded = hf_model(path=str(tmp_path / "saved"), num_classes=5, **DATA)
    printed = "".join(capfd.readouterr())
    assert "LOAD REPORT" not in printed and "Loading weights" not in printed and "MISSING" not in printed, printed
    said = [r.getMessage() for r in caplog.records if r.name.endswith("models.hf")]
    assert said == [f"model: 2 weight(s) not in {tmp_path / 'saved'} are newly initialised: classifier.bias, "
                    "classifier.weight"], said
    assert loaded.model.classifier.weight.shape == (5, 32)
    before = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        if not name.startswith("model.classifier."):
            assert torch.equal(p, before[name]), name


def test_path_config_overrides_settings(tmp_path: Path) -> None:
    tiny_classifier().model.save_pretrained(tmp_path / "saved")
    loaded = hf_model(path=str(tmp_path / "saved"), config={"dropout": 0.0}, num_classes=3, **DATA)
    assert loaded.model.config.dropout == 0.0


def test_causal_lm_logits_and_a_loss_on_labels_the_data_already_shifted() -> None:
    torch.manual_seed(0)
    model = hf_model(task="causal_lm", architecture="gpt2", config=TINY_GPT2, **DATA)
    tokens = torch.randint(1, 50, (3, 13))
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    y[0, -4:] = -100  # padding labels do not count
    out = model(x, labels=y)
    assert out.logits.shape == (3, 12, 50)
    expected = F.cross_entropy(out.logits.reshape(-1, 50), y.reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss, expected)
    # HF's own loss would shift the labels once more (predicting two tokens ahead)
    assert not torch.allclose(out.loss, model.model(input_ids=x, labels=y).loss)
    assert model.model.config.bos_token_id is None  # gpt2's 50256 is not a token of a 50-token vocabulary
    out.loss.backward()
    assert model.model.transformer.wte.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"config": {**TINY_DISTILBERT, "n_layer": 3}}, "config: 'n_layer' not a setting of distilbert"),
    ({"architecture": "distilbertt"}, "architecture: 'distilbertt' is not a transformers model type"),
    ({"task": "causal_lm"}, "task: causal_lm is not available for architecture 'distilbert'"),
    ({"task": "regression"}, "task: 'regression' is not allowed; allowed: sequence_classification, causal_lm"),
    ({"config": {**TINY_DISTILBERT, "max_position_embeddings": 8}},
     "config.max_position_embeddings: gives 8 positions, fewer than the data's longest sequence (12 tokens)"),
    ({"path": "distilbert-base-uncased"}, "path: 'distilbert-base-uncased' does not exist; allowed: a local directory"),
    ({"num_classes": 0}, "num_classes: 0 is not allowed; allowed: at least 1"),
])
def test_bad_settings_fail_in_one_line_naming_the_parameter(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        hf_model(**{"config": TINY_DISTILBERT, **DATA, **kwargs})
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


def test_a_saved_model_too_short_or_too_small_for_the_data_is_refused(tmp_path: Path) -> None:
    hf_model(config=TINY_DISTILBERT, num_classes=3, **DATA).model.save_pretrained(tmp_path / "saved")
    # the data's length is what to lower (dataset.max_length, or a corpus's block_size): the key the message leads with
    with pytest.raises(ValueError, match=r"^max_length: the data's sequences of 20 tokens are longer than the 12 "
                                         r"positions of the pretrained model at .*; allowed: at most 12$"):
        hf_model(path=str(tmp_path / "saved"), num_classes=3, vocab_size=50, max_length=20)
    with pytest.raises(ValueError, match=r"^vocab_size: the data's tokenizer has 60 tokens, the model at .* embeds 50"):
        hf_model(path=str(tmp_path / "saved"), num_classes=3, vocab_size=60, max_length=12)
    with pytest.raises(ValueError, match=r"^path: .* holds no config.json"):
        hf_model(path=str(tmp_path))


def test_without_transformers_the_message_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    with pytest.raises(ValueError, match=r"^model: hf needs the transformers package: pip install transformers$"):
        hf_model(config=TINY_DISTILBERT, **DATA)


# --- a pretrained model reads the data through its own tokenizer ------------------------------------

REVIEWS = [("a good film with great acting and a fine story", 1), ("bad film with awful acting and a dull story", 0),
           ("great story and good fun", 1), ("dull and bad and awful", 0)] * 20


def write_reviews(path: Path) -> Path:
    """A CSV of short labelled reviews (dataset=text_classification's train_file)."""
    path.write_text("text,label\n" + "".join(f"{text},{label}\n" for text, label in REVIEWS))
    return path


def pretrained_dir(path: Path) -> Path:
    """A tiny DistilBERT as save_pretrained writes it, beside its own WordPiece tokenizer (tokenizer.json and
    the files tokenizer.save_pretrained writes): what a downloaded model directory holds, made offline."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator([t for t, _ in REVIEWS] + ["the movie was ok"],
                            trainers.WordPieceTrainer(vocab_size=80, special_tokens=specials, show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]").save_pretrained(path)
    torch.manual_seed(0)
    model = hf_model(config=TINY_DISTILBERT, num_classes=2, vocab_size=tok.get_vocab_size(), max_length=64, pad_token_id=0)
    with contextlib.redirect_stderr(io.StringIO()):  # save_pretrained's progress bar: noise in a test's stderr
        model.model.save_pretrained(path)
    return path


def test_a_pretrained_model_reads_the_data_through_its_own_tokenizer_by_default(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from runner.engine.components import build_model
    from runner.specs import components
    from runner.engine.run_data import build_data
    from tests.conftest import compose_spec

    model_dir, reviews = pretrained_dir(tmp_path / "distilbert"), write_reviews(tmp_path / "reviews.csv")
    args = ["model=hf", f"model.path={model_dir}", "dataset=text_classification", f"dataset.train_file={reviews}",
            f"dataset.root={tmp_path / 'datasets'}", "dataset.max_length=32"]
    spec = components.resolved_spec(compose_spec(args, tmp_path / "run"))
    assert spec.dataset.params["tokenizer"] == str(model_dir)  # the default follows model.path, and is logged so
    data = build_data(spec)
    own = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = [data.train[i]["input_ids"].tolist() for i in range(len(data.train))]
    assert own.encode(REVIEWS[0][0]).ids in ids  # [CLS] ... [SEP] in the model's own vocabulary
    assert (data.vocab_size, data.pad_token_id) == (own.get_vocab_size(), own.token_to_id("[PAD]"))
    build_model(spec, data)  # its own ids: accepted
    # ids of a tokenizer trained on the reviews are not the pretrained embeddings' ids: one line, naming the key
    trained = components.resolved_spec(compose_spec([*args, "dataset.tokenizer=null"], tmp_path / "run"))
    with pytest.raises(SpecError) as info:
        build_model(trained, build_data(trained))
    assert str(info.value).startswith(f"dataset.tokenizer: the data's token ids are not those of the pretrained model "
                                      f"at {model_dir} (the data's tokenizer has ")
    assert str(info.value).endswith(f"allowed: the model's own tokenizer, tokenizer={model_dir}")
    # the preset is right by default: given a pretrained DistilBERT, its reviews are read with its tokenizer
    preset = compose_spec(["experiment=imdb_distilbert", f"model.path={model_dir}"], tmp_path / "run")
    assert preset.dataset.params["tokenizer"] == str(model_dir)
    assert compose_spec(["experiment=imdb_distilbert"], tmp_path / "run").dataset.params["tokenizer"] is None


def test_a_model_directory_without_tokenizer_files_checks_the_vocabulary_size(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    hf_model(config=TINY_DISTILBERT, num_classes=3, **DATA).model.save_pretrained(tmp_path / "saved")
    fifty = Tokenizer(models.WordLevel({f"w{i}": i for i in range(50)}, unk_token="w1"))
    hf_model(path=str(tmp_path / "saved"), num_classes=3, tokenizer=fifty, **DATA)
    other = Tokenizer(models.WordLevel({f"w{i}": i for i in range(40)}, unk_token="w1"))
    with pytest.raises(ValueError, match=r"^tokenizer: the data's token ids are not those of the pretrained model at .* "
                                         r"\(the data's tokenizer has 40 tokens, it embeds 50 and keeps no tokenizer\)"):
        hf_model(path=str(tmp_path / "saved"), num_classes=3, tokenizer=other, **{**DATA, "vocab_size": 40})


def test_a_pretrained_folder_keeps_its_own_sizes_under_the_presets_config_and_a_typed_mismatch_is_refused(
        tmp_path: Path) -> None:
    """experiment=imdb_distilbert's config is DistilBERT's 768 x 6: with model.path=<a 32-wide, 2-layer folder>
    the folder's sizes win and its weights load as saved (before: a 768 x 6 model, every weight re-initialised
    at random, shown only by transformers' mismatch table); a size that differs from the folder's is one line."""
    from transformers import AutoModelForSequenceClassification

    from tests.conftest import compose_spec

    model_dir = pretrained_dir(tmp_path / "distilbert")
    preset = compose_spec(["experiment=imdb_distilbert", f"model.path={model_dir}"], tmp_path / "run")
    config = preset.model.params["config"]
    assert (config["dim"], config["n_layers"]) == (768, 6)
    data = {"vocab_size": 80, "max_length": 32, "pad_token_id": 0, "num_classes": 2}
    model = hf_model(path=str(model_dir), config=config, **data).model
    assert (model.config.dim, model.config.n_layers, model.config.dropout) == (32, 2, config["dropout"])
    saved = AutoModelForSequenceClassification.from_pretrained(model_dir, local_files_only=True).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name  # every weight as saved, the head included (2 classes)
    with pytest.raises(ValueError) as info:
        hf_model(path=str(model_dir), config={**config, "dim": 64}, **data)
    assert str(info.value) == (f"config.dim: 64 differs from the pretrained model at {model_dir} (dim=32), whose weights "
                               "have that size; allowed: 32, or no model.path (random weights)")
