"""Numeric precision: autocast, loss scaling, parameter dtype; each checked against the device first."""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, ContextManager

if TYPE_CHECKING:
    from runner.tasks import Batch

import torch

from runner.specs.precision import PrecisionSpec
from runner.specs.run import SpecError

log = logging.getLogger(__name__)

_NO_AUTOCAST = contextlib.nullcontext()  # reusable: entering it has no state
# the call torch.autograd.backward ends in (the C++ engine, with the context its device threads read);
# private to torch, so where a version lacks it every backward goes through the public call
_run_backward = getattr(getattr(torch.autograd, "graph", None), "_engine_run_backward", None)


class Precision:
    """What one precision option means for the step loop.

    fp32: nothing. tf32: TF32 matmuls/convs on Ampere+ GPUs. fp16: float16 autocast with a
    GradScaler. bf16: bfloat16 autocast, fp32 parameters. bf16_true: bfloat16 parameters (no
    autocast, no master copy). fp8: float8 matmuls through torchao on GPUs of compute capability 8.9+.
    """

    def __init__(self, spec: PrecisionSpec, device: torch.device, sharded: bool = False, dp_degree: int = 1):
        self.name = spec.name
        self.device = device
        _check_supported(spec.name, device)
        self.autocast_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(spec.name)
        self.autocasts = self.autocast_dtype is not None or spec.name == "fp8"  # whether autocast() enters torch's
        # Under FSDP2 the MixedPrecisionPolicy casts the sharded fp32 parameters for compute
        # (and reduces gradients in fp32); autocast still covers the ops between layers.
        self.param_dtype = self.autocast_dtype if sharded else None
        self.scaler = None
        if spec.name == "fp16":
            # FSDP2 too: its gradients are DTensors, whose inf check is reduced across ranks, so
            # torch.amp's GradScaler (not FSDP1's ShardedGradScaler) is the one to use (torchtitan's docs)
            # Each rank's loss is scaled by dp_degree / units, as DDP and FSDP average the ranks' gradients: its
            # fp16 backward carries dp_degree x the scaler's scale, and would overflow (and skip a step) where
            # one process does not. The scaler holds scale / dp_degree, so the backward sees one process's
            # values (the same overflows, skips and backoffs) and unscaling still leaves the true gradient;
            # checkpoints hold the scale in one process's units, so a resume on another dp degree keeps it.
            self._dp_degree = dp_degree
            self.scaler = torch.amp.GradScaler(device.type, init_scale=spec.init_scale / dp_degree)
        self.skipped_steps = 0
        self.casts_batches = spec.name in ("bf16_true", "fp8")  # whether prepare_batch changes a batch
        self._scale: float | None = None  # the scaler's scale as the last step left it (read once a step)
        self._gradient: tuple[float, torch.Tensor] | None = None  # the last backward's scale, as a tensor
        if spec.name == "tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.name == "bf16_true":
            return model.to(torch.bfloat16)
        if self.name == "fp8":
            from torchao.float8 import convert_to_float8_training

            # torchao's fp8 GEMMs need dims divisible by 16; other layers stay in bf16 autocast
            model = convert_to_float8_training(
                model, module_filter_fn=lambda m, _: isinstance(m, torch.nn.Linear)
                and m.in_features % 16 == 0 and m.out_features % 16 == 0)
            converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
            if not converted:
                raise SpecError("precision: fp8 found no Linear layer with both dims divisible by 16 in this model; "
                                "use precision=bf16")
            log.info("fp8: %d Linear layers train with float8 matmuls", converted)
            return model
        return model

    def prepare_batch(self, batch: "Batch") -> "Batch":
        if not self.casts_batches:  # nothing to cast or pad
            return batch
        from runner.tasks import IGNORE, Batch

        inputs, labels = batch.inputs, batch.labels
        if self.name == "bf16_true":
            def cast(t):
                return t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

            inputs = {k: cast(v) for k, v in inputs.items()} if isinstance(inputs, dict) else cast(inputs)
        if self.name == "fp8" and isinstance(inputs, torch.Tensor) and len(labels) % 16 and not labels.is_floating_point():
            # fp8 GEMMs need the batch dim divisible by 16: pad a ragged batch with samples whose
            # label the loss ignores, so the sum over real samples is unchanged
            pad = 16 - len(labels) % 16
            inputs = torch.cat([inputs, inputs.new_zeros((pad, *inputs.shape[1:]))])
            labels = torch.cat([labels, labels.new_full((pad, *labels.shape[1:]), IGNORE)])
        return Batch(inputs, labels, batch.empty)

    def autocast(self) -> ContextManager:
        if not self.autocasts:
            return _NO_AUTOCAST
        return torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.bfloat16)  # fp8: bf16 between its GEMMs

    def backward(self, loss: torch.Tensor, scale: float | torch.Tensor = 1.0) -> None:
        """The gradients of loss x scale. Without a loss scaler, `scale` goes to autograd as the loss's own
        gradient: the values backward of the product gives (its gradient is `scale`), without the product's
        op in the forward and its node in the backward."""
        if self.scaler:
            self.scaler.scale(loss * scale).backward()
            return
        if isinstance(scale, torch.Tensor):
            loss.backward(scale.to(loss.dtype))
            return
        cached = self._gradient
        if cached is None or cached[0] != scale or cached[1].dtype != loss.dtype or cached[1].device != loss.device:
            # a fill, not a copy from the host: nothing waits for the kernels queued before it
            cached = self._gradient = (scale, torch.full((), scale, dtype=loss.dtype, device=loss.device))
        if _run_backward is not None and type(loss) is torch.Tensor and loss.dim() == 0:
            # what loss.backward(gradient) ends in, less its Python checks of a gradient made right here to
            # the loss's shape, dtype and device (~15 us: a tenth of a tiny step); a subclass (DTensor) goes
            # the whole way, through its __torch_function__
            _run_backward((loss,), (cached[1],), False, False, (), allow_unreachable=True, accumulate_grad=True)
            return
        loss.backward(cached[1])

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping or reading the grad norm, gradients must be in true units."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; returns False when the scaler skipped it for inf/nan gradients."""
        if not self.scaler:
            optimizer.step()
            return True
        # the scale before this step is the one the last step left: one read of it (a device sync) per step
        scale = self._scale if self._scale is not None else self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        self._scale = self.scaler.get_scale()
        stepped = self._scale >= scale
        self.skipped_steps += not stepped
        return stepped

    def state_dict(self) -> dict:
        scaler = None
        if self.scaler:
            scaler = self.scaler.state_dict()
            if "scale" in scaler:  # absent before the scaler's first scale()
                scaler["scale"] *= self._dp_degree
        return {"scaler": scaler, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state.get("scaler"):
            scaler = dict(state["scaler"])
            if "scale" in scaler:
                scaler["scale"] /= self._dp_degree
            self.scaler.load_state_dict(scaler)
            self._scale = None
        self.skipped_steps = state.get("skipped_steps", 0)


def _check_supported(name: str, device: torch.device) -> None:
    cuda = device.type == "cuda"
    if name == "tf32" and not (cuda and torch.cuda.get_device_capability(device)[0] >= 8):
        raise SpecError(f"precision: tf32 needs an NVIDIA GPU of the Ampere generation or newer; "
                        f"this run is on {_describe(device)}: use precision=fp32 or precision=bf16")
    if name in ("bf16", "bf16_true") and cuda and not torch.cuda.is_bf16_supported():
        raise SpecError(f"precision: {name} is not supported on {_describe(device)}: use precision=fp16 or fp32")
    if name == "fp16" and device.type == "cpu" and not _cpu_fp16_works():
        raise SpecError("precision: fp16 autocast does not run on this CPU build of torch: use precision=bf16 or fp32")
    if name == "fp8":
        if not (cuda and torch.cuda.get_device_capability(device) >= (8, 9)):
            raise SpecError(f"precision: fp8 needs an NVIDIA GPU of compute capability 8.9+ (H100, L4, RTX 4090); "
                            f"this run is on {_describe(device)}: use precision=bf16")
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            raise SpecError("precision: fp8 training needs torchao: pip install torchao, or use precision=bf16") from None


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
    return "the CPU"


def _cpu_fp16_works() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2))
        return True
    except RuntimeError:
        return False
