"""Export: a trained model for use outside runner (`mode=export trainer.resume=<run dir | checkpoint>`).

Into `<run_dir>/export/` (and the MLflow run's `export/` artifacts when tracking is on):
- model.safetensors: the weights, tied tensors stored once (safetensors.torch.save_model; load_model re-ties);
- model.yaml: the model's `_target_` with its arguments and those the data decided (sizes, vocabulary),
  so `hydra.utils.instantiate` rebuilds it, plus the input it takes and where the weights came from;
- example_inputs.safetensors: one batch of the source run's validation data, by argument name;
- model.pt2: a `torch.export` program (batch size free where the model allows), where the model exports.
Reading them back needs no runner code beyond the model's own module: see HOW_TO_LOAD.
"""
from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml

from runner.engine import checkpoint, run_weights
from runner.engine.run_data import build_data
from runner.files import fsync_directory
from runner.tasks.batches import example_inputs  # noqa: F401  (part of this module's API: what export writes)

from runner.engine.components import build_model
from runner.specs import components
from runner.specs.run import RunSpec, SpecError

log = logging.getLogger(__name__)

HOW_TO_LOAD = """\
# How to load this model without runner (only the model's own module must be importable):
#   import yaml, torch, hydra.utils, safetensors.torch
#   model = hydra.utils.instantiate(yaml.safe_load(open("model.yaml"))["model"]).eval()
#   safetensors.torch.load_model(model, "model.safetensors")
#   inputs = safetensors.torch.load_file("example_inputs.safetensors")   # one batch, by argument name
#   outputs = model(**inputs)
# or, where model.pt2 was written (no model code needed at all):
#   outputs = torch.export.load("model.pt2").module()(**inputs)
"""
_PLAIN = (bool, int, float, str, type(None))


def run(spec: RunSpec) -> Path:
    """mode=export: the model of the checkpoint `trainer.resume` names, written to <run_dir>/export and,
    when tracking is on, logged to a new MLflow run tagged with its source. Returns the export directory."""
    from runner.tracking.tracker import build_tracker

    if not spec.trainer.resume:
        raise SpecError("trainer.resume: null; mode=export exports a trained model: "
                        "give trainer.resume=<run dir | checkpoint>")
    from runner.results.source import misfit, source_spec

    # a run dir, checkpoint file or MLflow run id, refused before any MLflow run exists; the model is the trained
    # run's with what was typed now on top (as eval and predict build it), so a typed model key is used or refused
    merged, source = source_spec(spec)
    try:  # loaded before the MLflow run starts: weights that do not fit leave no FAILED run behind
        exportable = Exportable.of(source.weights, merged)
    except SpecError as e:
        raise SpecError(misfit(merged, source, e)) from None
    tracker = build_tracker(spec)
    tracker.start(spec)
    try:
        out = write_export(exportable, Path(spec.run_dir) / "export")
        info = yaml.safe_load((out / "model.yaml").read_text())["source"]
        tracker.set_tags({"runner.exported_from_checkpoint": str(source.path),
                          "runner.exported_weights": source.weights.source,
                          **({"runner.exported_from_run": info["mlflow_run_id"]} if info.get("mlflow_run_id") else {})})
        tracker.log_artifact(out)  # a directory: its files land under the run's export/ artifacts
    except BaseException as e:  # Ctrl-C, SIGTERM/SIGHUP (preemption.Stopped is a KeyboardInterrupt): KILLED
        tracker.finish("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise
    tracker.finish("FINISHED")
    return out


def export_checkpoint(source: str | Path, out_dir: str | Path, program: bool = True, which: str = "tested",
                      average: str = "auto") -> Path:
    """Export the model of a checkpoint file, or of a run directory's weights (`which`, `average`: by default
    those its test metrics came from: runner/engine/run_weights.py), into out_dir (`program=False`: no
    torch.export program, which takes seconds to trace)."""
    return export_weights(run_weights.read(source, which, average), out_dir, program)


def export_weights(weights: run_weights.RunWeights, out_dir: str | Path, program: bool = True) -> Path:
    """Export the model of a trained run's chosen weights into out_dir."""
    return write_export(Exportable.of(weights), out_dir, program)


class Exportable(NamedTuple):
    """A trained model with its weights loaded, its spec and data, ready to write."""
    model: torch.nn.Module
    spec: RunSpec
    data: Any
    weights: run_weights.RunWeights

    @classmethod
    def of(cls, weights: run_weights.RunWeights, spec: RunSpec | None = None) -> "Exportable":
        """The model `spec` builds (the run's own spec, by default) holding `weights`; a SpecError where they
        do not fit."""
        if spec is None and not weights.spec:
            raise SpecError(f"trainer.resume: {weights.path} holds no run spec, so its model cannot be rebuilt for "
                            "export")
        spec = spec or RunSpec.from_yaml(weights.spec)
        data = build_data(spec)
        model = build_model(spec, data)
        weights.load_into(model)
        return cls(model.eval(), spec, data, weights)


def write_export(exportable: Exportable, out_dir: str | Path, program: bool = True) -> Path:
    """The export's files into out_dir."""
    model, spec, data, weights = exportable
    inputs = example_inputs(spec, data, model)
    final = Path(out_dir)
    # written into a directory beside it and renamed into place once whole: a kill leaves the earlier export or
    # none, never one without model.yaml or with a truncated model.pt2
    out = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        _write_export(model, inputs, spec, data, weights, out, program)
        _replace_directory(out, final)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    log.info("exported the %s weights of %s to %s (%s)", weights.source, weights.path, final,
             ", ".join(sorted(p.name for p in final.iterdir())))
    return final


def _write_export(model: torch.nn.Module, inputs: dict[str, torch.Tensor], spec: RunSpec, data: Any,
                  weights: run_weights.RunWeights, out: Path, program: bool) -> None:
    """The export's files into `out`: the weights, example inputs, the torch.export program, model.yaml last."""
    import safetensors.torch

    write_safetensors(model, out / "model.safetensors")
    safetensors.torch.save_file({k: v.contiguous() for k, v in inputs.items()}, str(out / "example_inputs.safetensors"))
    program = _export_program(model, inputs, out / "model.pt2", spec.model.target) if program else "not asked for"
    record = {
        "model": {"_target_": spec.model.target, "_convert_": "all", **spec.model.params, **_data_decided(spec, data)},
        "inputs": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in inputs.items()},
        "torch_export": program,
        "source": {"checkpoint": str(weights.path), "step": weights.step, "weights": weights.source,
                   "mlflow_run_id": weights.state.get("mlflow_run_id") or None},
    }
    (out / "model.yaml").write_text(HOW_TO_LOAD + yaml.safe_dump(record, sort_keys=False))
    for written in out.iterdir():  # on disk before the rename makes them the export
        with open(written, "rb") as f:
            os.fsync(f.fileno())


def _replace_directory(new: Path, final: Path) -> None:
    """`new` renamed to `final`; an earlier export there is moved aside first and removed after."""
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(new, final)
    fsync_directory(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def load_exported(directory: str | Path) -> torch.nn.Module:
    """The exported model, rebuilt from model.yaml with its weights (what HOW_TO_LOAD spells out)."""
    import safetensors.torch
    from hydra.utils import instantiate

    directory = Path(directory)
    model = instantiate(yaml.safe_load((directory / "model.yaml").read_text())["model"]).eval()
    safetensors.torch.load_model(model, str(directory / "model.safetensors"))
    return model


def _data_decided(spec: RunSpec, data: Any) -> dict[str, Any]:
    """What the data gave the model (build_model's rule), where YAML can hold it; a tokenizer object cannot
    and is left out with a note."""
    try:
        names = inspect.signature(components.load_target("model", spec.model.target)).parameters
    except (TypeError, ValueError):
        return {}
    decided = {}
    for name in components.DATA_DECIDED:
        value = getattr(data, name, None)
        if name not in names or value is None:
            continue
        if isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value):
            decided[name] = list(value)
        elif isinstance(value, _PLAIN):
            decided[name] = value
        else:
            log.warning("export: model.yaml lacks %s (a %s, not storable as YAML); pass it yourself when rebuilding",
                        name, type(value).__name__)
    return decided


def _export_program(model: torch.nn.Module, inputs: dict[str, torch.Tensor], path: Path, target: str) -> str:
    """model.pt2 with the batch size left free where the model allows; one line saying why not where it fails."""
    from torch.export import Dim

    shapes = {k: {0: Dim.AUTO} for k in inputs}
    try:
        program = torch.export.export(model, (), dict(inputs), dynamic_shapes=shapes)
        torch.export.save(program, str(path))
        return path.name
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        log.warning("export: %s could not be exported as a torch.export program (%s: %s); "
                    "model.safetensors and model.yaml are written", target, type(e).__name__, reason)
        path.unlink(missing_ok=True)
        return f"not written: {type(e).__name__}: {reason}"


def main(argv: list[str] | None = None) -> int:
    """`python -m runner.results.export <run dir | checkpoint> [--out DIR]`: export without an MLflow run."""
    parser = argparse.ArgumentParser(prog="python -m runner.results.export", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a run directory (its newest good checkpoint) or a checkpoint file")
    parser.add_argument("--out", help="where to write (default: <run dir>/export)")
    parser.add_argument("--which", choices=run_weights.WHICH, default="tested",
                        help="a run directory's weights: those its test came from (default), its best or its last")
    parser.add_argument("--average", choices=run_weights.AVERAGES, default="auto",
                        help="the raw weights or an average the run kept (default: the one its objective measures)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    source = Path(args.source)
    run_dir = source if source.is_dir() and not checkpoint.is_folder(source) else source.parent.parent if source.parent.name == "checkpoints" else source.parent
    out = Path(args.out) if args.out else run_dir / "export"
    try:
        print(export_checkpoint(source, out, which=args.which, average=args.average))
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())


_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                       torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def write_safetensors(model: torch.nn.Module, path: Path) -> None:
    """The model's state dict as one safetensors file, written tensor by tensor: safetensors' own save_model first
    turns every tensor into bytes (the whole state twice in memory); here each tensor's bytes go to the file from
    its own storage. A tied parameter is written once, its other names in the metadata, as save_model does (so
    safetensors' load_model reads it back)."""
    from safetensors.torch import _remove_duplicate_names

    state = model.state_dict()
    metadata: dict[str, str] = {}
    for kept, removed in _remove_duplicate_names(state).items():
        for name in removed:
            metadata[name] = kept
            del state[name]
    # widest elements first, as safetensors orders them: every tensor's data starts aligned to its element size
    state = dict(sorted(state.items(), key=lambda item: (-item[1].element_size(), item[0])))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in state.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for t in state.values():
            local = t.detach().cpu().contiguous().reshape(-1)
            if local.numel():
                f.write(memoryview(local.view(torch.uint8).numpy()))
