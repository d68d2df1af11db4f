"""PopTorch's ``module_repr``: a module's ``repr`` that also shows its forward pre-hooks, where
``BeginBlock`` annotations live (torch's own ``repr`` hides them). An executor's ``repr`` is its
model's, shown this way."""

import torch


def _indented(text: str) -> str:
    return "\n  ".join(text.split("\n"))


def module_repr(module: torch.nn.Module) -> str:
    """``repr(module)`` with each module's forward pre-hooks (``BeginBlock(user_id=..., ipu_id=...)``)
    written before its name."""
    extra = module.extra_repr()
    extra_lines = extra.split("\n") if extra else []
    child_lines = [f"({name}): {_indented(module_repr(child))}" for name, child in module._modules.items()
                   if child is not None]
    hooks = "".join(f"{hook!r} " for hook in module._forward_pre_hooks.values())
    text = f"{hooks}{module._get_name()}("
    lines = extra_lines + child_lines
    if len(extra_lines) == 1 and not child_lines:
        text += extra_lines[0]
    elif lines:
        text += "\n  " + "\n  ".join(lines) + "\n"
    return text + ")"
