"""Lowerings grouped by op family; importing this package registers them all."""

from ipu_backend.compiler.lowerings import (  # noqa: F401
    attention,
    comparison,
    control_flow,
    convolution,
    counting,
    creation,
    ctc_decoding,
    dynamic_slicing,
    elementwise,
    host_calls,
    layers,
    linalg,
    losses,
    markers,
    normalization,
    point_clouds,
    printing,
    random,
    reductions,
    views,
)
