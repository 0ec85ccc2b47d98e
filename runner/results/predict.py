"""`mode=predict`: the trained model's predictions for a split, a folder of images or a text file, written
to <run_dir>/predictions.csv (or .jsonl) and logged to MLflow with the run.

A classifier writes per input its id, predicted class and class probabilities (a split's rows also carry
the true label); a language model continues each line of a text file (one prompt a line) by
`predict.max_new_tokens` tokens: greedy at temperature 0, else sampled (top-k) from a generator seeded by
`seed`, so a prediction is repeatable."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Iterator

import torch

from runner.spec import components
from runner.spec.fields import SpecError
from runner.results.modes import load_engine, source_spec, tracked
from runner.tasks import batches
from runner.tasks.language_modeling import LanguageModeling


def run(spec):
    from runner.engine.engine import RunResult

    spec, path, source_run = source_spec(spec)
    engine, step = load_engine(spec, path)  # what can be refused is, before this run's records exist
    rows = predictions(engine, spec)
    tracker = tracked(spec, source_run, path, "predicted")
    try:
        rows = list(rows)
        out = write(rows, Path(spec.run_dir) / f"predictions.{spec.predict.format}")
        tracker.log_artifact(out)
        tracker.finish("FINISHED")
    except BaseException as e:
        tracker.finish("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise
    print(f"runner: predicted {len(rows)} inputs with {path} (step {step})\n  wrote {out}\n  {tracker.describe()}",
          file=sys.stdout, flush=True)
    return RunResult(float("nan"), {}, {}, {}, step, 0.0)


def predictions(engine, spec) -> Iterator[dict]:
    """The rows to write, read lazily; an input this model cannot read is refused here, before any is."""
    given = spec.predict.input
    if isinstance(engine.task, LanguageModeling):
        if given is None or Path(given).is_dir():
            raise SpecError(f"predict.input: {given!r}: a language model continues prompts; give a text file with one "
                            "prompt a line")
        return generated(engine, spec, Path(given))
    if given is None:
        return classified(engine, ((None, raw) for raw in engine.eval_loaders[spec.predict.split]), with_labels=True)
    if Path(given).is_dir():
        return classified(engine, image_batches(spec, Path(given)), with_labels=False)
    return classified(engine, text_batches(spec, Path(given)), with_labels=False)


@torch.no_grad()
def classified(engine, loader, with_labels: bool) -> Iterator[dict]:
    index = 0
    for ids, raw in loader:  # ids: the inputs' names, or None for their index
        batch = batches.to_device(batches.split_batch(raw), engine.device)
        with engine.precision.autocast():
            logits = batches.logits_of(batches.call_model(engine.model, batch, engine.pass_labels))
        probs = torch.softmax(logits.float(), dim=-1).cpu()
        labels = batch.labels.cpu() if with_labels else None
        for i, p in enumerate(probs):
            row = {"id": ids[i] if ids is not None else index, "predicted": int(p.argmax())}
            if labels is not None:
                row["label"] = int(labels[i])
            yield {**row, "probabilities": [round(float(v), 6) for v in p]}
            index += 1


def image_batches(spec, folder: Path) -> Iterator[tuple[list[str], tuple]]:
    """Batches of the folder's images, decoded and transformed as the data's val split decodes its own."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    val = components.build_data(spec).val
    decode, transform = getattr(val, "decode", None), getattr(val, "transform", None)
    if decode is None or transform is None:
        raise SpecError(f"predict.input: {str(folder)!r} is a folder of images, but dataset {spec.dataset.target} does "
                        "not read image files; use it with an image-file dataset (dataset=imagefolder)")
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMG_EXTENSIONS)
    if not files:
        raise SpecError(f"predict.input: {str(folder)!r} holds no images ({', '.join(IMG_EXTENSIONS)})")
    size = spec.dataset.batch_size

    def read() -> Iterator[tuple[list[str], tuple]]:
        for start in range(0, len(files), size):
            chunk = files[start:start + size]
            images = torch.stack([transform(decode(str(f))) for f in chunk])
            yield [str(f.relative_to(folder)) for f in chunk], (images, torch.zeros(len(chunk), dtype=torch.long))

    return read()


def text_batches(spec, file: Path) -> Iterator[tuple[list[int], dict]]:
    """Batches of the file's lines (one text a line; blank lines skipped, ids are line numbers), encoded as
    the dataset encodes its own texts: its tokenizer, its [CLS] prefix, cut at its max_length."""
    from runner.data.text import TokenizedTexts
    from runner.data.tokenize import cls_prefix, encode

    data = components.build_data(spec)
    tokenizer = getattr(data, "tokenizer", None)
    if tokenizer is None:
        raise SpecError(f"predict.input: {str(file)!r} is a file; a classifier of dataset {spec.dataset.target} reads "
                        "a folder of images (a text classifier reads a text file, one text a line), or predict.split "
                        "with predict.input=null")
    numbered = [(n, line) for n, line in enumerate(file.read_text().splitlines()) if line.strip()]
    if not numbered:
        raise SpecError(f"predict.input: {str(file)!r} holds no text (one text a line)")
    prefix, size = cls_prefix(tokenizer), spec.dataset.batch_size
    ids = [(prefix + e)[:data.max_length] for e in encode(tokenizer, [line for _, line in numbered])]
    texts = TokenizedTexts.pack(ids, [0] * len(ids))

    def read() -> Iterator[tuple[list[int], dict]]:
        for start in range(0, len(numbered), size):
            chunk = range(start, min(start + size, len(numbered)))
            yield [numbered[i][0] for i in chunk], data.collate([texts[i] for i in chunk])

    return read()


def generated(engine, spec, file: Path) -> Iterator[dict]:
    data = components.build_data(spec)
    tokenizer = data.tokenizer
    generator = torch.Generator(engine.device).manual_seed(spec.seed)
    context = getattr(engine.module, "max_length", None) or data.max_length
    p = spec.predict
    for number, line in enumerate(file.read_text().splitlines()):
        if not line.strip():
            continue
        if tokenizer is not None:
            prompt = tokenizer.encode(line).ids
        else:  # token ids without a tokenizer (synthetic data): the line is the ids
            try:
                prompt = [int(t) for t in line.split()]
            except ValueError:
                raise SpecError(f"predict.input: line {number + 1} of {file} is {line[:40]!r}; this dataset has no "
                                "tokenizer, so a prompt is token ids separated by spaces") from None
        new = generate(engine.model, prompt, p.max_new_tokens, p.temperature, p.top_k, generator, context)
        text = tokenizer.decode(new) if tokenizer is not None else " ".join(map(str, new))
        yield {"id": number, "input": line, "generated": text, "tokens": new}


@torch.no_grad()
def generate(model, prompt: list[int], max_new_tokens: int, temperature: float, top_k: int | None,
             generator: torch.Generator, context: int | None = None) -> list[int]:
    """The new token ids after `prompt`, one forward per token over the last `context` tokens (nanoGPT's loop)."""
    device = next(model.parameters()).device
    x = torch.tensor([prompt], device=device)
    for _ in range(max_new_tokens):
        logits = batches.logits_of(model(x if context is None else x[:, -context:]))[:, -1, :].float()
        if temperature == 0:
            token = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        x = torch.cat([x, token], dim=1)
    return x[0, len(prompt):].tolist()


def write(rows: list[dict], path: Path) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return path
    with path.open("w", newline="") as f:
        writer = None
        for row in rows:
            flat = {k: v for k, v in row.items() if k not in ("probabilities", "tokens")}
            flat.update({f"p_{i}": v for i, v in enumerate(row.get("probabilities", []))})
            if writer is None:
                writer = csv.DictWriter(f, fieldnames=list(flat))
                writer.writeheader()
            writer.writerow(flat)
    return path
