"""Lowerings: ``poptorch.ipu_print_tensor`` prints through a host callback, in the forward pass
and (when asked) the gradient in the backward pass; the value passes through unchanged."""

import jax

from ipu_backend.compiler.registry import lowering
from ipu_backend.compiler.tensor_print import PRINT_TENSOR, PrintFormat, printer


@lowering(PRINT_TENSOR)
def print_tensor(ctx, x, title, print_gradient, summarise_threshold, edge_items, max_line_width,
                 digits, float_format, separator, open_bracket, close_bracket):
    fmt = PrintFormat(summarise_threshold, edge_items, max_line_width, digits, float_format,
                      separator, open_bracket, close_bracket)
    show_value, show_gradient = printer(title, fmt), printer(f"{title}_gradient", fmt)

    @jax.custom_vjp
    def shown(value):
        jax.debug.callback(show_value, value)
        return value

    def forward(value):
        jax.debug.callback(show_value, value)
        return value, None

    def backward(_, gradient):
        if print_gradient:
            jax.debug.callback(show_gradient, gradient)
        return (gradient,)

    shown.defvjp(forward, backward)
    return shown(x)
