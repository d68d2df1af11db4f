"""What a compiled program costs: XLA's FLOP and byte estimates, and its operations counted.

XLA's cost analysis counts the body of a loop once, not once per trip: for a step whose device
iterations or micro-batches are a loop, the FLOPs are those of one trip (reports say so).
"""

import re
from collections import Counter

import torch

from ipu_backend.compiler.layer_loops import unrolled

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s+=\s+(.*)$")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_BOOKKEEPING = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "copy"}


def xla_costs(executable) -> dict:
    """``{"flops", "bytes_accessed"}`` from XLA's cost analysis of a compiled program."""
    analysis = executable.cost_analysis()
    if isinstance(analysis, list):           # older JAX: one dict per device program
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    return {"flops": float(analysis.get("flops", 0.0)),
            "bytes_accessed": float(analysis.get("bytes accessed", 0.0))}


def _opcode(definition: str) -> str | None:
    """The opcode of an HLO instruction's right-hand side (after its shape, maybe a tuple)."""
    depth, index = 0, 0
    if definition.startswith("("):
        for index, char in enumerate(definition):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
        index += 1
    else:
        index = definition.find(" ")
    match = _OPCODE.match(definition, index)
    return match.group(1) if match else None


def hlo_op_counts(executable) -> dict[str, int]:
    """Instructions of the optimised HLO program by opcode (fusion bodies included), without
    parameters, constants and tuple bookkeeping."""
    counts = Counter()
    for line in executable.as_text().splitlines():
        match = _INSTRUCTION.match(line)
        opcode = match and _opcode(match.group(1))
        if opcode and opcode not in _BOOKKEEPING:
            counts[opcode] += 1
    return dict(counts.most_common())


def aten_op_counts(nodes) -> dict[str, int]:
    """Core-ATen operations among graph ``nodes``, by name (``aten.addmm``); repeated layers
    count once per layer, as they run."""
    counts = Counter()
    for node in unrolled(nodes):
        target = node.target
        is_aten = isinstance(target, torch._ops.OpOverload)
        counts[str(target.overloadpacket) if is_aten else getattr(target, "__name__", str(target))] += 1
    return dict(counts.most_common())
