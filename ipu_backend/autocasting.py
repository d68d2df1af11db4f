"""``poptorch.autocast``: PopTorch 3.0's automatic mixed precision, a region (or decorated
function) whose operations compute in float16 while the model runs on the IPUs.

PopTorch 3.1 removed it in favour of PyTorch's own ``torch.autocast``, which works inside
compiled models here too. This keeps 3.0 scripts running: while a model is compiled the region
is ``torch.autocast("cpu", dtype=torch.float16, enabled=enabled)`` (torch's lists of which
operations run in float16); run as a plain torch module it changes nothing, as PopTorch on the CPU.
"""

import functools

import torch

from ipu_backend.compiler.capture import capturing


class autocast:  # noqa: N801  (PopTorch's name)
    """``with poptorch.autocast(): ...`` or ``@poptorch.autocast()``; ``enabled=False`` turns
    automatic casting off inside an enclosing region."""

    def __init__(self, enabled: bool = True):
        if not isinstance(enabled, bool):
            raise TypeError(f"autocast(enabled=...) expects a bool, got {enabled!r}")
        self.enabled = enabled
        self._regions: list = []

    def __enter__(self) -> "autocast":
        region = torch.autocast("cpu", dtype=torch.float16, enabled=self.enabled) if capturing() else None
        if region is not None:
            region.__enter__()
        self._regions.append(region)
        return self

    def __exit__(self, *exc_info) -> None:
        region = self._regions.pop()
        if region is not None:
            region.__exit__(*exc_info)

    def __call__(self, function):
        @functools.wraps(function)
        def in_region(*args, **kwargs):
            with self:
                return function(*args, **kwargs)

        return in_region
