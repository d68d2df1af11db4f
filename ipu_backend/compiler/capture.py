"""Capture a module, or one of its step methods, as a core-ATen graph with torch.export."""

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx.traceback
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from ipu_backend.compiler.sources import traceback_location
from ipu_backend.errors import Error


@dataclass(frozen=True)
class LogCall:
    """One ``self.log`` made by a step: its name, keyword arguments and, for a Python number,
    its constant value (tensor values become outputs of the program)."""

    name: str
    kwargs: dict = field(default_factory=dict)
    constant: Any = None

    @property
    def is_tensor(self) -> bool:
        return self.constant is None


class _LogRecorder:
    """Stands in for ``LightningModule.log``/``log_dict`` while a step is traced."""

    def __init__(self):
        self.calls: list[LogCall] = []
        self.tensors: list[torch.Tensor] = []

    def reset(self):
        """Forget earlier traces; in place, since export restores attributes a forward reassigns."""
        self.calls.clear()
        self.tensors.clear()

    def log(self, name, value, **kwargs):
        if isinstance(value, torch.Tensor):
            self.calls.append(LogCall(name, kwargs))
            self.tensors.append(value)
        elif isinstance(value, (int, float, bool)):
            self.calls.append(LogCall(name, kwargs, constant=value))
        else:
            raise Error(f"self.log({name!r}, ...) got a {type(value).__name__}; inside a compiled "
                        "step log a tensor or a number (for a torchmetrics object, log the tensor "
                        "its update or forward returns)")

    def log_dict(self, dictionary, **kwargs):
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)


def _is_lightning_module(module: torch.nn.Module) -> bool:
    return any(cls.__name__ == "LightningModule" for cls in type(module).__mro__)


@contextlib.contextmanager
def _recording_logs(module: torch.nn.Module, recorder: _LogRecorder):
    if not _is_lightning_module(module):
        yield
        return
    object.__setattr__(module, "log", recorder.log)
    object.__setattr__(module, "log_dict", recorder.log_dict)
    try:
        yield
    finally:
        del module.log, module.log_dict


class StepCall(torch.nn.Module):
    """Exports ``module.<method>(*args)`` and returns ``(result, logged tensors)``."""

    def __init__(self, module: torch.nn.Module, method: str):
        super().__init__()
        self.module = module
        self.method = method
        self.recorder = _LogRecorder()

    def forward(self, *args):
        self.recorder.reset()
        with _recording_logs(self.module, self.recorder):
            result = getattr(self.module, self.method)(*args)
        return result, list(self.recorder.tensors)


def export(module: torch.nn.Module, args: tuple) -> torch.export.ExportedProgram:
    """torch.export (non-strict) decomposed to core ATen, with errors a user can act on."""
    try:
        # preserve_node_meta keeps torch.fx.traceback.annotate(...) tags (pipeline blocks) on nodes.
        with torch.fx.traceback.preserve_node_meta():
            exported = torch.export.export(module, tuple(args), strict=False)
    except GuardOnDataDependentSymNode as error:
        where = traceback_location(error.__traceback__) or "unknown source line"
        raise Error(
            f"the program branches on the value of a tensor at {where}. A compiled program is "
            "traced once, so Python control flow cannot depend on tensor data. Use torch.where "
            "for element-wise choices, or torch.cond(pred, true_fn, false_fn, operands) to "
            "branch (it lowers to lax.cond).") from error
    return exported.run_decompositions(decomp_table=_core_aten_decompositions())


@functools.cache
def _core_aten_decompositions() -> dict:
    """torch's default core-ATen table, materialized once (it costs ~0.2 s per export otherwise).
    ``detach`` is kept: decomposed, it becomes a plain ``alias`` and gradients would flow through."""
    table = dict(torch.export.default_decompositions().items())
    table.pop(torch.ops.aten.detach.default, None)
    return table
