"""``lightning-ipu``: Lightning's CLI with the IPU accelerator and strategy registered.

A YAML config with ``trainer.accelerator: ipu`` (and, optionally, ``trainer.strategy`` as
``class_path: lightning_ipu.IPUStrategy`` with ``init_args``, nested ``ipu_backend.Options``
included) runs with no user script::

    lightning-ipu fit --config examples/lightning_digits.yaml

The model (and data module) are given by ``class_path`` in the config, as with ``LightningCLI``'s
subclass mode, and may live in the current directory (which is put on ``sys.path``, as
``python -m`` does); every subcommand and flag of ``LightningCLI`` is available.
"""

import os
import sys

from lightning.pytorch.cli import LightningCLI

import lightning_ipu  # noqa: F401  (registers accelerator "ipu" and strategy "ipu_strategy")


def main(args: list[str] | None = None) -> None:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    LightningCLI(subclass_mode_model=True, subclass_mode_data=True, args=args,
                 save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
