"""The Lightning face for the standalone ``pytorch_lightning`` package.

``lightning.pytorch`` and ``pytorch_lightning`` are two copies of Lightning with separate classes: a
``pytorch_lightning.Trainer`` only takes ``pytorch_lightning`` strategies and accelerators. As
Lightning builds ``pytorch_lightning`` from ``lightning.pytorch``'s sources, this module serves
``lightning_ipu.pytorch_lightning.<module>`` from the source of ``lightning_ipu/<module>.py`` with
``lightning.pytorch`` read as ``pytorch_lightning`` and ``lightning.fabric`` as
``lightning_fabric`` (the modules share everything else: ``ipu_backend``, ``lightning_ipu._data``,
``lightning_ipu._outputs``). Importing ``lightning_ipu.pytorch_lightning`` registers its
accelerator and strategy with ``pytorch_lightning``; :func:`install` makes that happen as soon as
``pytorch_lightning`` is imported.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

PACKAGE = "lightning_ipu.pytorch_lightning"
MODULES = ("accelerator", "precision", "strategy", "_lightning_hooks", "_registration")
"""The modules that import Lightning, and so exist once per Lightning package."""
_HERE = Path(__file__).parent
_PACKAGE_SOURCE = '''"""lightning_ipu for pytorch_lightning: IPUAccelerator, IPUPrecision and IPUStrategy."""
from . import _registration
from .accelerator import IPUAccelerator
from .precision import IPUPrecision
from .strategy import IPUStrategy

_registration.register()
'''


def for_pytorch_lightning(source: str) -> str:
    return source.replace("lightning.pytorch", "pytorch_lightning").replace("lightning.fabric", "lightning_fabric")


class _StandaloneModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads ``lightning_ipu.pytorch_lightning`` and its modules."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == PACKAGE:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        package, _, name = fullname.rpartition(".")
        if package == PACKAGE and name in MODULES:
            spec = importlib.machinery.ModuleSpec(fullname, self, origin=str(_HERE / f"{name}.py"))
            spec.has_location = True
            return spec
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        if module.__name__ == PACKAGE:
            source, filename = _PACKAGE_SOURCE, f"<{PACKAGE}>"
        else:
            filename = module.__spec__.origin
            source = for_pytorch_lightning(Path(filename).read_text())
        exec(compile(source, filename, "exec"), module.__dict__)


class _RegisterAfterExec(importlib.abc.Loader):
    """``pytorch_lightning``'s own loader, then the registration of the IPU classes."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        importlib.import_module(PACKAGE)


class _WhenPytorchLightningIsImported(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "pytorch_lightning":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfterExec(spec.loader)
        return spec


def install() -> None:
    """Serve the standalone modules, and register them once ``pytorch_lightning`` is imported
    (now, if it is already)."""
    if not any(isinstance(finder, _StandaloneModules) for finder in sys.meta_path):
        sys.meta_path.append(_StandaloneModules())
    if "pytorch_lightning" in sys.modules:
        importlib.import_module(PACKAGE)
    elif importlib.util.find_spec("pytorch_lightning") is not None and not any(
            isinstance(finder, _WhenPytorchLightningIsImported) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WhenPytorchLightningIsImported())
