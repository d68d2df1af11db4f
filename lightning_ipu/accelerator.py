"""``IPUAccelerator``: emulated Graphcore IPUs as a Lightning accelerator (``accelerator="ipu"``).

``devices`` is the number of replicas (one IPU each, more with a pipelined model):

* a positive int, or a string of one (``devices="4"``);
* a power of two, unless the options ask for ``autoRoundNumIPUs`` (then the IPUs reserved are
  rounded up to one and the rest idle), checked by :class:`~lightning_ipu.IPUStrategy`;
* at most :data:`MAX_IPUS_PER_HOST`;
* ``"auto"`` gives **1** replica: the numbers then equal a CPU run with the same batch size.
"""

from typing import Any

import torch
from typing_extensions import override

from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ipu_backend.lightning_seam import MK2, memory_in_use

MAX_IPUS_PER_HOST = 64
"""An IPU-POD64's IPUs: the most one host process drives."""


class IPUAccelerator(Accelerator):
    """Emulated IPUs: replicas of the model run as JAX programs, one JAX device per IPU."""

    def __init__(self) -> None:
        super().__init__()
        self._ipus = 1

    @override
    def setup(self, trainer) -> None:
        self._ipus = trainer.num_devices

    @override
    def setup_device(self, device: torch.device) -> None:
        """Batches stay on the host until the compiled step takes them: nothing to set up."""

    @override
    def teardown(self) -> None:
        """Programs and weights are released by the strategy."""

    @override
    def get_device_stats(self, device: Any) -> dict[str, Any]:
        """Memory in use on each emulated IPU (weights, optimizer state and the arrays of the
        last call that are still alive), against an IPU's In-Processor-Memory."""
        used = memory_in_use()
        stats = {}
        for ipu in range(self._ipus):
            in_use = used[ipu % len(used)]
            stats[f"ipu{ipu}/memory_used_bytes"] = in_use
            stats[f"ipu{ipu}/memory_percent"] = 100.0 * in_use / MK2.memory_bytes
        return stats

    @staticmethod
    @override
    def parse_devices(devices: int | str) -> int:
        """The number of IPUs asked for, validated (see the module docstring)."""
        if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
            devices = int(devices)
        if isinstance(devices, bool) or not isinstance(devices, int):
            raise MisconfigurationException(
                f"`Trainer(accelerator='ipu', devices={devices!r})`: devices is the number of IPU "
                "replicas, a positive int such as 1, 2, 4 or 8 (or 'auto' for 1)")
        if devices < 1:
            raise MisconfigurationException(
                f"`Trainer(accelerator='ipu', devices={devices})`: the number of IPUs must be positive")
        if devices > MAX_IPUS_PER_HOST:
            raise MisconfigurationException(
                f"`Trainer(accelerator='ipu', devices={devices})`: one host drives at most "
                f"{MAX_IPUS_PER_HOST} IPUs")
        return devices

    @staticmethod
    @override
    def get_parallel_devices(devices: int | str) -> list[torch.device]:
        """The host device once per IPU: batches are prepared on the host for every replica."""
        return [torch.device("cpu")] * IPUAccelerator.parse_devices(devices)

    @staticmethod
    @override
    def auto_device_count() -> int:
        return 1

    @staticmethod
    @override
    def is_available() -> bool:
        """Emulated IPUs are always available."""
        return True

    @staticmethod
    def name() -> str:
        return "ipu"

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry) -> None:
        accelerator_registry.register(cls.name(), cls, description=cls.__name__, override=True)
