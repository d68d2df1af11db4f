"""PopTorch's ops and helpers for use inside a model's ``forward``: printing, planning hints,
serialized matrix products, dynamic slices, the CTC beam search decoder, name scopes and
``isRunningOnIpu``.

Planning hints (``nop``, ``set_available_memory``, ``set_overlap_for_input/output``) and the
serialization asked of ``serializedMatMul`` are recorded in the compile report
(``Options.enableProfiling``); they change no number on emulated IPUs.
"""

import torch
import torch.utils._pytree as torch_pytree

from ipu_backend.compiler import ctc_decoding, dynamic_slicing, hints
from ipu_backend.compiler.capture import capturing
from ipu_backend.compiler.host_calls import HostFunction, host_call
from ipu_backend.compiler.tensor_print import FLOAT_FORMATS, print_tensor
from ipu_backend.enums import MatMulSerializationMode, MultiConvPlanType, OverlapMode
from ipu_backend.errors import Error


def isRunningOnIpu() -> bool:  # noqa: N802
    """True while the model is being compiled for the (emulated) IPUs, False when it runs as a
    plain torch module: ``if poptorch.isRunningOnIpu(): ...`` chooses IPU-only code."""
    return capturing()


class CPU:
    """``poptorch.CPU(layer_to_call, ID)``: calling it inside a compiled model runs
    ``layer_to_call`` (a function or module of tensors) on the host, with the values the program
    computed, each time the program runs (once per replica and micro-batch); outside a compiled
    model it is a plain call. For inference models, as in PopTorch: a loss whose gradient goes
    through it is refused."""

    def __init__(self, layer_to_call, ID: str):  # noqa: N803
        if isinstance(layer_to_call, torch.nn.Module):
            layer_to_call.requires_grad_(False)
        self._ID = ID
        self._host = HostFunction(layer_to_call, ID)

    def __call__(self, *inputs):
        if not capturing():
            return self._host.function(*inputs)
        if not all(isinstance(x, torch.Tensor) for x in inputs):
            raise Error(f"poptorch.CPU op {self._ID!r} takes tensors only; got "
                        f"{[type(x).__name__ for x in inputs]}")
        outputs = host_call(list(inputs), self._host.key)
        return outputs[0] if self._host.single else outputs


def ipu_print_tensor(tensor: torch.Tensor, title: str = "", print_gradient: bool = True,
                     summarise_threshold: int = 1000, edge_items: int = 3, max_line_width: int = 80,
                     digits: int = 4, float_format: str = "auto", separator: str = ", ",
                     open_bracket: str = "(", close_bracket: str = ")") -> torch.Tensor:
    """Print ``tensor`` (to stderr, under ``title``) each time the compiled model computes it,
    and its gradient (under ``title + "_gradient"``) in the backward pass if ``print_gradient``.
    Returns ``tensor`` unchanged: use the result in place of the input so the print stays in the
    program. Outside a compiled model it prints nothing, as PopTorch on the CPU."""
    if not isinstance(tensor, torch.Tensor):
        raise Error(f"ipu print tensor must take a torch.tensor argument. {type(tensor)} is not "
                    "supported.")
    if float_format not in FLOAT_FORMATS:
        raise Error(f"ipu_print_tensor: float_format must be one of {FLOAT_FORMATS}, got "
                    f"{float_format!r}")
    return print_tensor(tensor, title, bool(print_gradient), summarise_threshold, edge_items,
                         max_line_width, digits, float_format, separator, open_bracket,
                         close_bracket)


def nop(tensor: torch.Tensor) -> torch.Tensor:
    """An identity that Poplar never optimises away (a debugging aid); recorded in the report."""
    if not isinstance(tensor, torch.Tensor):
        raise Error(f"nop must take a torch.tensor argument. {type(tensor)} is not supported.")
    return hints.hint(tensor, "nop", "")


def set_available_memory(tensor: torch.Tensor, available_memory_proportion: float) -> torch.Tensor:
    """Ask the planner to keep the temporary memory of the operation producing ``tensor`` below
    this proportion of an IPU's memory (0 to 1). Returns ``tensor``; recorded in the report."""
    if not isinstance(tensor, torch.Tensor):
        raise Error("You may only set available memory for torch.tensor values. "
                    f"{type(tensor)} is not supported.")
    proportion = available_memory_proportion
    if isinstance(proportion, bool) or not isinstance(proportion, (int, float)) or not 0 <= proportion <= 1:
        raise Error("set_available_memory: available_memory_proportion must be a number between "
                    f"0 and 1, got {proportion!r}")
    return hints.hint(tensor, "available_memory_proportion", repr(float(proportion)))


def _overlap(tensors, mode: OverlapMode, kind: str, what: str):
    if not isinstance(mode, OverlapMode):
        raise Error(f"poptorch.set_overlap_for_{kind}: mode must be a poptorch.OverlapMode, got {mode!r}")

    def mark(tensor):
        if not isinstance(tensor, torch.Tensor):
            raise Error(f"You may only set overlap for torch.tensor {what}. {type(tensor)} is not "
                        "supported.")
        return hints.hint(tensor, f"overlap_for_{kind}", mode.name)

    return torch_pytree.tree_map(mark, tensors)


def set_overlap_for_input(input_tensors, mode: OverlapMode):
    """Overlap the host-to-IPU copy of these inputs (a tensor, or tuples/lists/dicts of tensors)
    with computation. Returns them; recorded in the report."""
    return _overlap(input_tensors, mode, "input", "inputs")


def set_overlap_for_output(output_tensors, mode: OverlapMode):
    """Overlap the IPU-to-host copy of these outputs with computation. Returns them; recorded in
    the report."""
    return _overlap(output_tensors, mode, "output", "outputs")


_SERIALIZED_DIMS = {  # mode -> (lhs dim split, rhs dim split); None: not split
    MatMulSerializationMode.InputChannels: (-2, None),
    MatMulSerializationMode.ReducingDim: (-1, -2),
    MatMulSerializationMode.OutputChannels: (None, -1),
}


def serializedMatMul(lhs: torch.Tensor, rhs: torch.Tensor, mode: MatMulSerializationMode,  # noqa: N802
                     factor: int = 0, keep_precision: bool = False) -> torch.Tensor:
    """``lhs @ rhs`` computed as ``factor`` smaller products, one after the other: over the rows
    of ``lhs`` (``InputChannels``), the reduced dimension (``ReducingDim``, partial products then
    summed, in float32 for half inputs when ``keep_precision``) or the columns of ``rhs``
    (``OutputChannels``); ``Disabled`` is a plain matmul. ``factor`` must divide that dimension."""
    if not isinstance(keep_precision, bool):
        raise Error(f"serializedMatMul: keep_precision must be a bool, got {keep_precision!r}")
    if isinstance(factor, bool) or not isinstance(factor, int):
        raise Error(f"serializedMatMul: factor must be an int, got {factor!r}")
    if not isinstance(mode, MatMulSerializationMode):
        raise Error(f"serializedMatMul: mode must be a poptorch.MatMulSerializationMode, got {mode!r}")
    if mode is MatMulSerializationMode.Disabled:
        return torch.matmul(lhs, rhs)
    if lhs.ndim < 2 or rhs.ndim < 2:
        raise Error("serializedMatMul: both operands need at least two dimensions, got shapes "
                    f"{tuple(lhs.shape)} and {tuple(rhs.shape)}")
    lhs_dim, rhs_dim = _SERIALIZED_DIMS[mode]
    length = lhs.shape[lhs_dim] if lhs_dim is not None else rhs.shape[rhs_dim]
    if factor < 1 or length % factor:
        raise Error(f"serializedMatMul: factor ({factor}) must be a factor of the dimension split by "
                    f"{mode.name} ({length})")
    lhs_parts = lhs.chunk(factor, lhs_dim) if lhs_dim is not None else [lhs] * factor
    rhs_parts = rhs.chunk(factor, rhs_dim) if rhs_dim is not None else [rhs] * factor
    products = [torch.matmul(a, b) for a, b in zip(lhs_parts, rhs_parts)]
    if mode is MatMulSerializationMode.ReducingDim:
        if keep_precision and products[0].dtype in (torch.float16, torch.bfloat16):
            out = torch.stack([p.float() for p in products]).sum(0).to(products[0].dtype)
        else:
            out = torch.stack(products).sum(0)
    else:
        out = torch.cat(products, dim=-2 if lhs_dim is not None else -1)
    return hints.hint(out, "matmul_serialization",
                      f"{mode.name} factor={factor} keep_precision={keep_precision}")


def _check_slicing(tensor, dim, start, size, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise Error(f"{name} must take a torch.tensor input. {type(tensor)} is not supported.")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise Error("Dimension must be an integer.")
    if not isinstance(start, torch.Tensor):
        raise Error(f"Slice start argument to {name} must be a torch.tensor. {type(start)} is not "
                    "supported.")
    if start.is_floating_point() or start.is_complex() or start.numel() != 1:
        raise Error(f"{name}: the start must be an integer tensor of one element, got dtype "
                    f"{start.dtype} and shape {tuple(start.shape)}")
    if isinstance(size, bool) or not isinstance(size, int):
        raise Error("Size must be an integer.")
    if size == 0:
        raise Error("The start and end of a slice must be different.")
    if size < 0:
        raise Error("Taking a slice of a tensor with the end less than the start is not supported.")
    if size > tensor.shape[dim]:
        raise Error(f"{name}: size {size} exceeds dimension {dim} of the tensor "
                    f"({tensor.shape[dim]})")


def dynamic_slice(tensor: torch.Tensor, dim: int, start: torch.Tensor, size: int, step: int) -> torch.Tensor:
    """``size`` elements of ``tensor`` along ``dim`` from ``start`` (a tensor read on the
    device), every ``step``-th kept. A start that would overrun is moved back into range."""
    _check_slicing(tensor, dim, start, size, "dynamic_slice")
    if isinstance(step, bool) or not isinstance(step, int):
        raise Error("Step must be an integer.")
    if step < 1:
        raise Error("Slicing step must be at least 1")
    return dynamic_slicing.dynamic_slice(tensor, dim, start, size, step)


def dynamic_update(input: torch.Tensor, src: torch.Tensor, dim: int, start: torch.Tensor,  # noqa: A002
                   size: int) -> torch.Tensor:
    """``input`` with ``src`` written over ``size`` elements along ``dim`` from ``start`` (a
    tensor read on the device); a new tensor, ``input`` is unchanged."""
    _check_slicing(input, dim, start, size, "dynamic_update")
    if not isinstance(src, torch.Tensor):
        raise Error(f"Src argument to dynamic_update must be a torch.tensor. {type(src)} is not "
                    "supported.")
    if input.dim() != src.dim():
        raise Error(f"input and src tensors must have same dimensionality. ({input.dim()}) vs "
                    f"({src.dim()})")
    if input.dtype != src.dtype:
        raise Error(f"input and src tensor must have same dtype. ({input.dtype} vs {src.dtype})")
    if src.shape[dim] != size:
        raise Error(f"dynamic_update: src has {src.shape[dim]} elements along dimension {dim}, "
                    f"size is {size}; they must be equal")
    return dynamic_slicing.dynamic_update(input, src, dim, start, size)


def _check_count(name: str, value, low: int, high: int | None = None) -> None:
    if (isinstance(value, bool) or not isinstance(value, int) or value < low
            or (high is not None and value > high)):
        bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise Error(f"ctc_beam_search_decoder: {name} must be an int {bounds}, got {value!r}")


def ctc_beam_search_decoder(probs: torch.Tensor, lengths: torch.Tensor, blank: int = 0, beam_width: int = 100,
                            top_paths: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``top_paths`` most probable label sequences of a CTC beam search (``beam_width``
    beams) over log probabilities ``probs`` ``[input_length, batch_size, num_classes]``, using
    the first ``lengths[b]`` (``[batch_size]``) time steps of each batch element.

    Returns the paths' log probabilities ``[batch_size, top_paths]`` (``probs``' dtype), their
    lengths ``[batch_size, top_paths]`` and the labels ``[batch_size, top_paths, input_length]``
    (int32, zero padded), best first. As Poplibs' decoder: a prefix beam search over the log
    probabilities as given; a path that does not exist has log probability ``-inf`` and length 0.
    No gradient, as in PopTorch."""
    if not isinstance(probs, torch.Tensor):
        raise Error("ctc_beam_search_decoder: probs must be a torch.tensor argument. "
                    f"{type(probs)} is not supported.")
    if not isinstance(lengths, torch.Tensor):
        raise Error("ctc_beam_search_decoder: lengths must be a torch.tensor argument. "
                    f"{type(lengths)} is not supported.")
    if probs.dim() != 3:
        raise Error("Incorrect shape for first input to CTC beam search decoder: probs must be "
                    f"[input_length, batch_size, num_classes], got shape {tuple(probs.shape)}")
    if not probs.is_floating_point():
        raise Error(f"ctc_beam_search_decoder: probs must hold floating point log probabilities, got "
                    f"dtype {probs.dtype}")
    if lengths.shape != probs.shape[1:2] or lengths.is_floating_point() or lengths.is_complex() \
            or lengths.dtype == torch.bool:
        raise Error("ctc_beam_search_decoder: lengths must be an integer tensor of shape [batch_size] "
                    f"({probs.shape[1]}), got dtype {lengths.dtype} and shape {tuple(lengths.shape)}")
    _check_count("blank", blank, 0, probs.shape[2] - 1)
    _check_count("beam_width", beam_width, 1)
    _check_count("top_paths", top_paths, 1, beam_width)
    return ctc_decoding.ctc_beam_search_decoder(probs, lengths, blank, beam_width, top_paths)


class NameScope:
    """Prefix the names of the operations recorded in this block (``with
    poptorch.NameScope("encoder"): ...``); scopes nest as ``outer/inner``. The compile report
    counts operations per scope and names the scope of each hint."""

    def __init__(self, name: str):
        if not isinstance(name, str):
            raise Error(f"Parameter to NameScope must be a string, got {name!r}")
        self.name = name
        self._outer = None

    def __enter__(self) -> "NameScope":
        self._outer = hints.current_name_scope()
        hints.set_name_scope(f"{self._outer}/{self.name}" if self._outer else self.name)
        return self

    def __exit__(self, *exc_info) -> None:
        hints.set_name_scope(self._outer)


class MultiConv:
    """Plan the convolutions recorded in this region together (``with poptorch.MultiConv():``),
    with PopTorch's per-convolution settings. Emulated IPUs compute each convolution as it is;
    the compile report lists each region, its settings and its convolutions."""

    _PARTIALS = {torch.float32: "float", torch.float16: "half"}

    def __init__(self):
        self._settings: dict = {}
        self._outer = None

    @staticmethod
    def _per_conv(name: str, value, kind: type):
        if value is None or isinstance(value, kind):
            return value if value is None else (value,)
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, kind) for v in value):
            return tuple(value)
        raise AssertionError(f"Invalid {name}!")

    def _set(self, name: str, value) -> "MultiConv":
        self._settings[name] = value
        return self

    def availableMemoryProportions(self, value) -> "MultiConv":  # noqa: N802
        """The proportion of memory each convolution may use for temporaries (one for all, or
        one per convolution)."""
        return self._set("available_memory_proportions",
                         self._per_conv("available memory proportion", value, float))

    def partialsTypes(self, value) -> "MultiConv":  # noqa: N802
        """The partials type of each convolution: ``torch.float`` or ``torch.half``."""
        values = value if isinstance(value, (list, tuple)) else [value]
        if not all(v in self._PARTIALS for v in values):
            raise ValueError("Invalid partials types. Expecting torch.float or torch.half")
        return self._set("partials_types", tuple(self._PARTIALS[v] for v in values))

    def enableConvDithering(self, value) -> "MultiConv":  # noqa: N802
        """Dithering for each convolution (one bool for all, or one per convolution)."""
        if value is not None and not isinstance(value, bool) and not (
                isinstance(value, (list, tuple)) and all(isinstance(v, bool) for v in value)):
            raise ValueError("value must be bool or list of bools")
        return self._set("conv_dithering", value if not isinstance(value, bool) else (value,))

    def planType(self, value: MultiConvPlanType) -> "MultiConv":  # noqa: N802
        """How the convolutions are planned together (``poptorch.MultiConvPlanType``)."""
        if value is not None and not isinstance(value, MultiConvPlanType):
            raise AssertionError("Invalid plan type!")
        return self._set("plan_type", None if value is None else value.name)

    def perConvReservedTiles(self, value: int) -> "MultiConv":  # noqa: N802
        if isinstance(value, bool) or not isinstance(value, int):
            raise AssertionError(f"perConvReservedTiles expects an int, got {value!r}")
        return self._set("per_conv_reserved_tiles", value)

    def cycleBackOff(self, value: float) -> "MultiConv":  # noqa: N802
        if not isinstance(value, float):
            raise AssertionError(f"cycleBackOff expects a float, got {value!r}")
        return self._set("cycle_back_off", value)

    def __enter__(self) -> "MultiConv":
        if hints.current_multi_conv() is not None:
            raise Error("Nested poptorch.MultiConv is not supported")
        hints.set_multi_conv((id(self), tuple(sorted(self._settings.items()))))
        return self

    def __exit__(self, *exc_info) -> None:
        hints.set_multi_conv(None)
