"""``poptorch.ipu_print_tensor``: an identity op that prints its tensor (and, in the backward
pass, its gradient) to stderr while the compiled program runs, in Poplar's layout.

Layout: ``title: `` then the tensor, each dimension in brackets; a dimension of scalars on one
line (wrapped at ``max_line_width``), higher dimensions one sub-tensor per line, indented by
depth. Above ``summarise_threshold`` elements only ``edge_items`` at each end of every dimension
are shown, with ``...`` between. ``digits`` significant digits, all elements padded to one width.
"""

import math
import sys
from dataclasses import dataclass

import numpy as np
import torch

FLOAT_FORMATS = ("auto", "fixed", "scientific", "none")


@torch.library.custom_op("ipu_backend::print_tensor", mutates_args=())
def print_tensor(x: torch.Tensor, title: str, print_gradient: bool, summarise_threshold: int,
                  edge_items: int, max_line_width: int, digits: int, float_format: str,
                  separator: str, open_bracket: str, close_bracket: str) -> torch.Tensor:
    return x.clone()          # outside a compiled model: an identity, as PopTorch on the CPU


@print_tensor.register_fake
def _(x, *args):
    return torch.empty_like(x)


print_tensor.register_autograd(lambda ctx, grad: (grad,) + (None,) * 10)
PRINT_TENSOR = torch.ops.ipu_backend.print_tensor.default


@dataclass(frozen=True)
class PrintFormat:
    """How :func:`format_tensor` lays a tensor out (``ipu_print_tensor``'s arguments)."""

    summarise_threshold: int = 1000
    edge_items: int = 3
    max_line_width: int = 80
    digits: int = 4
    float_format: str = "auto"
    separator: str = ", "
    open_bracket: str = "("
    close_bracket: str = ")"


def _float_text(values: np.ndarray, fmt: PrintFormat) -> list[str]:
    if fmt.digits == 0 or fmt.float_format == "none":
        return [repr(float(v)) for v in values]
    finite = np.abs(values[np.isfinite(values)])
    largest = float(finite.max()) if finite.size else 0.0
    smallest = float(finite[finite > 0].min()) if (finite > 0).any() else 0.0
    scientific = fmt.float_format == "scientific" or (
        fmt.float_format == "auto" and (largest >= 10 ** fmt.digits or 0 < smallest < 1e-4))
    if scientific:
        return [f"{v:.{max(fmt.digits - 1, 0)}e}" for v in values]
    whole_digits = max(1, int(math.floor(math.log10(largest))) + 1) if largest >= 1 else 1
    return [f"{v:.{max(fmt.digits - whole_digits, 0)}f}" for v in values]


def _texts(array: np.ndarray, fmt: PrintFormat) -> np.ndarray:
    """Each element as text, padded to one width (when ``digits`` asks for alignment)."""
    flat = array.reshape(-1)
    if array.dtype == np.bool_:
        texts = ["true" if v else "false" for v in flat]
    elif np.issubdtype(array.dtype, np.floating):
        texts = _float_text(flat.astype(np.float64), fmt)
    else:
        texts = [str(int(v)) for v in flat]
    if fmt.digits and texts:
        width = max(len(t) for t in texts)
        texts = [t.rjust(width) for t in texts]
    return np.array(texts, dtype=object).reshape(array.shape)


def _shown(length: int, summarise: bool, edge_items: int) -> list[int | None]:
    """Indices shown along one dimension; None stands for the elided middle."""
    if summarise and length > 2 * edge_items:
        return list(range(edge_items)) + [None] + list(range(length - edge_items, length))
    return list(range(length))


def _lines(texts: np.ndarray, depth: int, summarise: bool, fmt: PrintFormat) -> list[str]:
    indent = " " * depth
    if texts.ndim == 1:
        pieces = ["..." if i is None else texts[i] for i in _shown(len(texts), summarise, fmt.edge_items)]
        lines, line = [], indent + fmt.open_bracket
        for index, piece in enumerate(pieces):
            piece += fmt.close_bracket if index == len(pieces) - 1 else fmt.separator
            full = fmt.max_line_width and len(line) + len(piece) > fmt.max_line_width
            if index and full:
                lines.append(line.rstrip())
                line = indent + "  "
            line += piece
        if not pieces:
            line += fmt.close_bracket
        return lines + [line]
    lines = [indent + fmt.open_bracket]
    for i in _shown(texts.shape[0], summarise, fmt.edge_items):
        lines += [indent + " ..."] if i is None else _lines(texts[i], depth + 1, summarise, fmt)
    return lines + [indent + fmt.close_bracket]


def format_tensor(title: str, array: np.ndarray, fmt: PrintFormat) -> str:
    """``title: `` and ``array`` in Poplar's print layout (see the module docstring)."""
    array = np.asarray(array)
    texts = _texts(array, fmt)
    summarise = 0 < fmt.summarise_threshold < array.size
    body = "\n".join(_lines(texts, 0, summarise, fmt)) if array.ndim else str(texts.item())
    return f"{title}: {body}" if title else body


def printer(title: str, fmt: PrintFormat):
    """A host callback that prints a tensor under ``title`` to stderr."""
    def show(array):
        print(format_tensor(title, np.asarray(array), fmt), file=sys.stderr, flush=True)

    return show
