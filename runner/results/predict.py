"""`mode=predict`: the trained model's predictions for a split, a folder of images or a text file, written
to <run_dir>/predictions.csv (or .jsonl) and logged to MLflow with the run.

What a prediction is belongs to the task (runner/tasks/): per input its id and the task's columns
(`Task.prediction_rows`: a classifier's class and probabilities, a regression's value), with the target's
where a split is predicted; a task that predicts from prompts (a language model) continues each line of a
text file by `predict.max_new_tokens` tokens (`Task.generate`): greedy at temperature 0, else sampled
(top-k) from a generator seeded by `seed`, so a prediction is repeatable. The weights are the run's
(`weights.which`, `weights.average`: runner/engine/run_weights.py)."""
from __future__ import annotations

import csv
import io
import json
import re
import sys
from pathlib import Path
from typing import Iterator

import torch

from runner.files import atomic_write
from runner.results.source import load_engine, source_spec, tracked
from runner.engine.run_data import build_data
from runner.specs.fields import SpecError
from runner.tasks import batches


def run(spec):
    from runner.engine.engine import RunResult

    spec, source = source_spec(spec)
    engine = load_engine(spec, source)  # what can be refused is, before this run's records exist
    path, step = source.path, source.weights.step
    rows = predictions(engine, spec)
    tracker = tracked(spec, source, "predicted")
    try:
        rows = list(rows)
        out = write(rows, Path(spec.run_dir) / f"predictions.{spec.predict.format}")
        tracker.log_artifact(out)
        tracker.finish("FINISHED")
    except BaseException as e:
        tracker.finish("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise
    print(f"runner: predicted {len(rows)} inputs with the {source.weights.source} weights of {path}\n  wrote {out}\n"
          f"  {tracker.describe()}",
          file=sys.stdout, flush=True)
    return RunResult(float("nan"), {}, {}, {}, step, 0.0)


def predictions(engine, spec) -> Iterator[dict]:
    """The rows to write, read lazily; an input this model cannot read is refused here, before any is."""
    given = spec.predict.input
    if getattr(engine.task, "predicts_from", "inputs") == "prompts":
        if given is None or Path(given).is_dir():
            raise SpecError(f"predict.input: {given!r}: task {spec.task.target} continues prompts; give a text file "
                            "with one prompt a line")
        return generated(engine, spec, Path(given))
    if given is None:
        return predicted(engine, ((None, raw) for raw in engine.eval_loaders[spec.predict.split]), with_labels=True)
    if Path(given).is_dir():
        return predicted(engine, image_batches(spec, Path(given)), with_labels=False)
    return predicted(engine, text_batches(spec, Path(given)), with_labels=False)


@torch.no_grad()
def predicted(engine, loader, with_labels: bool) -> Iterator[dict]:
    """Per input its id and the task's prediction columns (Task.prediction_rows)."""
    index = 0
    for ids, raw in loader:  # ids: the inputs' names, or None for their index
        batch = batches.to_device(batches.split_batch(raw), engine.device)
        try:
            with engine.precision.autocast():
                logits = batches.logits_of(batches.call_model(engine.model, batch, engine.pass_labels))
        except UNREADABLE as e:
            raise unreadable(engine, ids[0] if ids is not None else index, e) from None
        if logits is None:
            raise SpecError(f"mode: predict needs the model's outputs; {engine.spec.model.target} returns only its own "
                            "loss")
        try:
            rows = engine.task.prediction_rows(logits, batch.labels if with_labels else None)
        except NotImplementedError as e:
            raise SpecError(f"task: {e}") from None
        for i, row in enumerate(rows):
            yield {"id": ids[i] if ids is not None else index, **row}
            index += 1


def image_batches(spec, folder: Path) -> Iterator[tuple[list[str], tuple]]:
    """Batches of the folder's images, decoded and transformed as the data's val split decodes its own."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    val = build_data(spec).val
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
            images = torch.stack([transform(_decoded(decode, f, folder)) for f in chunk])
            yield [str(f.relative_to(folder)) for f in chunk], (images, torch.zeros(len(chunk), dtype=torch.long))

    return read()


def text_batches(spec, file: Path) -> Iterator[tuple[list[int], dict]]:
    """Batches of the file's lines (one text a line; blank lines skipped, ids are line numbers), encoded as
    the dataset encodes its own texts (its `encode_texts`: its tokenizer, its [CLS] prefix, its max_length)."""
    data = build_data(spec)
    encode_texts = getattr(data, "encode_texts", None)
    if encode_texts is None:
        raise SpecError(f"predict.input: {str(file)!r} is a file; a classifier of dataset {spec.dataset.target} reads "
                        "a folder of images (a text classifier reads a text file, one text a line), or predict.split "
                        "with predict.input=null")
    numbered = _lines(file)
    texts, size = encode_texts([line for _, line in numbered]), spec.dataset.batch_size

    def read() -> Iterator[tuple[list[int], dict]]:
        for start in range(0, len(numbered), size):
            chunk = range(start, min(start + size, len(numbered)))
            yield [numbered[i][0] for i in chunk], data.collate([texts[i] for i in chunk])

    return read()


def generated(engine, spec, file: Path) -> Iterator[dict]:
    data = build_data(spec)
    tokenizer = data.tokenizer
    generator = torch.Generator(engine.device).manual_seed(spec.seed)
    context = getattr(engine.module, "max_length", None) or data.max_length
    p = spec.predict
    for number, line in _lines(file):
        if tokenizer is not None:
            prompt = tokenizer.encode(line).ids
        else:  # token ids without a tokenizer (synthetic data): the line is the ids
            try:
                prompt = [int(t) for t in line.split()]
            except ValueError:
                raise SpecError(f"predict.input: line {number + 1} of {file} is {line[:40]!r}; this dataset has no "
                                "tokenizer, so a prompt is token ids separated by spaces") from None
        try:
            new = engine.task.generate(engine.model, prompt, p.max_new_tokens, p.temperature, p.top_k, generator, context)
        except UNREADABLE as e:
            raise unreadable(engine, f"line {number + 1}", e) from None
        text = tokenizer.decode(new) if tokenizer is not None else " ".join(map(str, new))
        yield {"id": number, "input": line, "generated": text, "tokens": new}


UNREADABLE = (RuntimeError, ValueError, TypeError, IndexError)  # what a model raises on inputs of a shape or kind it cannot read


def unreadable(engine, first, e: Exception) -> SpecError:
    """The model's complaint about the inputs as one line naming predict.input and where it began."""
    reason = str(e).splitlines()[0] if str(e) else ""
    return SpecError(f"predict.input: the model {engine.spec.model.target} cannot read these inputs (at {first}): "
                     f"{type(e).__name__}: {reason}")


def _lines(file: Path) -> list[tuple[int, str]]:
    """The file's non-blank lines with their index; a file that is not text, or holds none, is refused."""
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"predict.input: {str(file)!r} is not a UTF-8 text file (byte {e.object[e.start]:#04x} at offset "
                        f"{e.start}); give a text file with one input a line") from None
    numbered = [(n, line) for n, line in enumerate(text.splitlines()) if line.strip()]
    if not numbered:
        raise SpecError(f"predict.input: {str(file)!r} holds no text; give a text file with one input a line")
    return numbered


def _decoded(decode, file: Path, folder: Path):
    """One image as the dataset decodes its own; a file it cannot decode (corrupt, truncated) is named."""
    try:
        return decode(str(file))
    except (OSError, ValueError, RuntimeError, SyntaxError) as e:  # PIL's (an OSError) or torchvision's decoder's
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        reason = re.sub(r"^\w+, \S+:\d+, ", "", reason)  # torchvision's "decode_image, <source file>:<line>, " prefix
        raise SpecError(f"predict.input: {str(file.relative_to(folder))!r} in {str(folder)!r} is not an image that can "
                        f"be read ({reason}); remove or replace it") from None


def write(rows: list[dict], path: Path) -> Path:
    """The predictions' file, whole or not at all (written beside and renamed: a kill leaves no truncated file)."""
    if path.suffix == ".jsonl":
        atomic_write(path, "".join(json.dumps(row) + "\n" for row in rows))
        return path
    text = io.StringIO(newline="")
    writer = None
    for row in rows:
        flat = {}
        for key, value in row.items():
            if key == "tokens":  # the generated text holds them
                continue
            if isinstance(value, list):  # probabilities: p_0, p_1, ...; several outputs: predicted_0, ...
                flat.update({f"{'p' if key == 'probabilities' else key}_{i}": v for i, v in enumerate(value)})
            else:
                flat[key] = value
        if writer is None:
            writer = csv.DictWriter(text, fieldnames=list(flat))
            writer.writeheader()
        writer.writerow(flat)
    atomic_write(path, text.getvalue())
    return path
