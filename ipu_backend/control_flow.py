"""PopTorch's on-device control flow: ``poptorch.for_loop`` and ``poptorch.cond``.

Inside a compiled model, ``for_loop`` traces its body once and runs it as ``lax.fori_loop``
(``compiler/loops.py``), and ``cond`` becomes ``torch.cond``, lowered to ``lax.cond``. Called
outside a compiled model (plain torch), both run eagerly with the same results. Unlike
PopTorch, which refuses both in a ``trainingModel``, gradients flow through them (JAX
differentiates the loop and the branch), with torch's numbers.
"""

import torch

from ipu_backend.compiler import loops
from ipu_backend.compiler.capture import capturing


def _as_list(outputs) -> list:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def for_loop(count: int, body, inputs: list) -> list:
    """Run ``body`` ``count`` times on the device, each trip's outputs the next one's inputs
    (``body`` takes and returns as many tensors as ``inputs`` holds, with the same shapes and
    dtypes). Inputs are passed by value: ``body`` may update them in place without changing
    ``inputs``. Returns the last trip's outputs, as a list."""
    if not isinstance(inputs, list):
        raise ValueError("poptorch.for_loop expects input tensors (inputs) to be a list of "
                         "tensors. (Object is not list)")
    for index, tensor in enumerate(inputs):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError("poptorch.for_loop expects input tensors (inputs) to be a list of "
                             f"tensors. (Object contained in list at index {index} is not "
                             "torch.tensor)")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"poptorch.for_loop expects count to be an int >= 0, got {count!r}")
    if capturing():
        return loops.mark_loop(inputs, body, count)
    values = [t.clone() for t in inputs]
    for _ in range(count):
        values = _as_list(body(*values))
        loops.check_outputs(inputs, values)
    return values


def cond(condition: torch.Tensor, then_body, then_inps: list, else_body, else_inps: list) -> list:
    """``then_body(*then_inps)`` if ``condition`` (a one-element bool tensor) is true, else
    ``else_body(*else_inps)``, decided on the device. Both bodies return the same number of
    tensors, of the same shapes and dtypes; tensors of the enclosing ``forward`` may be used
    inside them. Returns the outputs as a list."""
    if not isinstance(then_inps, list) or not isinstance(else_inps, list):
        raise ValueError("poptorch.cond expects then_inps and else_inps tensors to be a list of "
                         "tensors. (Object is not list)")
    if not capturing():
        return _as_list(then_body(*then_inps) if condition else else_body(*else_inps))
    split = len(then_inps)

    def branch(body, operands):
        # Copies: torch.cond's branches may neither return nor update their operands.
        return tuple(out.clone() for out in _as_list(body(*(t.clone() for t in operands))))

    outputs = torch.cond(condition.reshape(()).to(torch.bool),
                         lambda *ops: branch(then_body, ops[:split]),
                         lambda *ops: branch(else_body, ops[split:]),
                         tuple(then_inps) + tuple(else_inps))
    return list(outputs)
