"""``accelerator="ipu"`` and ``strategy="ipu_strategy"`` in Lightning's registries."""

from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import StrategyRegistry

from . import _lightning_hooks
from .accelerator import IPUAccelerator
from .strategy import IPUStrategy


def register() -> None:
    """Register the accelerator and the strategy, and route ``accelerator="ipu"`` to them."""
    _lightning_hooks.check_version()
    IPUAccelerator.register_accelerators(AcceleratorRegistry)
    StrategyRegistry.register(IPUStrategy.strategy_name, IPUStrategy,
                              description="Emulated IPUs (lightning_ipu)", override=True)
    _lightning_hooks.route_ipu_flags()
