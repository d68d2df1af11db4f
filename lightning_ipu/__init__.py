"""PyTorch Lightning on emulated Graphcore IPUs: ``pl.Trainer(accelerator="ipu", devices=8)``.

Importing this package registers accelerator ``"ipu"`` and strategy ``"ipu_strategy"`` with
``lightning.pytorch`` (and with ``pytorch_lightning`` when that package is installed, whose
classes are in :mod:`lightning_ipu.pytorch_lightning`), and makes ``accelerator="ipu"`` select
:class:`IPUStrategy` and :class:`IPUPrecision`.
"""

from lightning_ipu import _registration, _standalone
from lightning_ipu.accelerator import IPUAccelerator
from lightning_ipu.precision import IPUPrecision
from lightning_ipu.strategy import IPUStrategy

_registration.register()
_standalone.install()

__all__ = ["IPUAccelerator", "IPUPrecision", "IPUStrategy"]
