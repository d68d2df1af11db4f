"""Every use of Lightning internals, checked against the Lightning version.

Lightning has no public hook for two things this plugin needs:

1. **Choosing the strategy and precision plugin from ``accelerator="ipu"``.** Left alone,
   ``Trainer(accelerator="ipu", devices=8)`` picks ``DDPStrategy`` (more than one device) and
   ``precision="16-mixed"`` a CUDA ``MixedPrecision``. The accelerator connector's flag check is
   wrapped so that, right after it, an IPU accelerator gets :class:`IPUStrategy` and
   :class:`IPUPrecision` (and an ``IPUStrategy`` with ``accelerator="auto"`` the IPU accelerator).
2. **Counting optimizer steps.** One host call runs ``device_iterations`` optimizer steps, but the
   loop counts one per batch; the extra steps are added to the loop's optimizer-step progress
   (``trainer.global_step``) and to the step loggers use (``_loop_progress.py``, which the
   strategy calls; it imports nothing of Lightning).
"""

import functools
import warnings

from lightning.pytorch import __version__ as lightning_version
from lightning.pytorch.trainer.connectors import accelerator_connector
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from .accelerator import IPUAccelerator
from .precision import SUPPORTED_PRECISIONS, IPUPrecision
from .strategy import IPUStrategy

TESTED_VERSIONS = ("2.5", "2.6")
"""Lightning ``major.minor`` versions whose internals these hooks were written and tested for."""

_WRAPPED_FLAG = "_lightning_ipu_routing"


def check_version(version: str = lightning_version) -> bool:
    """Whether ``version`` is one the hooks were tested with; warns when it is not."""
    tested = ".".join(version.split(".")[:2]) in TESTED_VERSIONS
    if not tested:
        warnings.warn(f"lightning_ipu was tested with Lightning {', '.join(TESTED_VERSIONS)}; with "
                      f"{version} the selection of the IPU strategy from accelerator='ipu' and the "
                      "optimizer-step counting may not work", stacklevel=2)
    return tested


def route_ipu_flags() -> None:
    """Wrap the accelerator connector's flag check (idempotent)."""
    connector = accelerator_connector._AcceleratorConnector
    original = getattr(connector, "_check_config_and_set_final_flags", None)
    if original is None:
        raise ImportError("lightning_ipu cannot select the IPU strategy with this Lightning version "
                          f"({lightning_version}): _AcceleratorConnector._check_config_and_set_final_flags "
                          "is gone. Pass strategy=lightning_ipu.IPUStrategy() explicitly.")
    if getattr(original, _WRAPPED_FLAG, False):
        return

    @functools.wraps(original)
    def check_flags_then_route_to_ipu(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _route_to_ipu(self)

    setattr(check_flags_then_route_to_ipu, _WRAPPED_FLAG, True)
    connector._check_config_and_set_final_flags = check_flags_then_route_to_ipu


def _route_to_ipu(connector) -> None:
    strategy, accelerator = connector._strategy_flag, connector._accelerator_flag
    ipu_strategy = isinstance(strategy, IPUStrategy) or strategy == IPUStrategy.strategy_name
    ipu_accelerator = isinstance(accelerator, IPUAccelerator) or accelerator == IPUAccelerator.name()
    if not (ipu_strategy or ipu_accelerator):
        return
    if not ipu_accelerator:
        if accelerator != "auto":
            raise MisconfigurationException(
                f"IPUStrategy runs on the IPU accelerator; got accelerator={accelerator!r}. Use "
                "accelerator='ipu' (or leave it out)")
        connector._accelerator_flag = IPUAccelerator.name()
    if not ipu_strategy:
        if strategy != "auto":
            raise MisconfigurationException(
                f"accelerator='ipu' runs with lightning_ipu.IPUStrategy; got strategy={strategy!r}. "
                "Leave strategy out (or 'auto'), or pass strategy='ipu_strategy' or IPUStrategy(...)")
        connector._strategy_flag = IPUStrategy.strategy_name
    plugin = connector._precision_plugin_flag
    if plugin is None:
        connector._precision_plugin_flag = IPUPrecision(connector._precision_flag)
    elif not isinstance(plugin, IPUPrecision):
        raise MisconfigurationException(
            f"the precision plugin {type(plugin).__name__} does not run on IPUs; pass "
            f"precision=... (one of {', '.join(SUPPORTED_PRECISIONS)}) or an IPUPrecision")
