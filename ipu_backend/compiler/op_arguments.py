"""The arguments of an ATen op call as a graph node or a lowering sees them: by position where
the call gave them so, else by keyword."""


def argument(args, kwargs, index: int, name: str, default):
    """``args[index]`` where given by position, else ``kwargs[name]``, else ``default``."""
    return args[index] if len(args) > index else kwargs.get(name, default)
