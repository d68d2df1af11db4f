"""Facts about the emulated hardware, shared by the API and the runtime: an IPU's memory and
tiles (:class:`IpuSpec`, the Mk2 GC200 by default) and the memory check's settings."""

from dataclasses import dataclass

from ipu_backend.errors import Error

MB = 1_000_000


@dataclass(frozen=True)
class IpuSpec:
    """One IPU: its In-Processor-Memory in bytes and its tile count (Mk2 GC200 by default)."""

    memory_bytes: int = 900 * MB
    tiles: int = 1472
    name: str = "Mk2"

    def __post_init__(self):
        for field_name in ("memory_bytes", "tiles"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise Error(f"IpuSpec.{field_name} must be a positive int, got {value!r}")
        if not isinstance(self.name, str):
            raise Error(f"IpuSpec.name must be a str, got {self.name!r}")


MK2 = IpuSpec()
MK2_CLOCK_HZ = 1.33e9
"""The clock of a Mk2 (GC200) IPU: ``cycleCount`` converts measured compute time with it."""
MEMORY_CHECKS = ("error", "warn", "off")
"""What compiling a model too large for its IPUs does: raise, warn, or nothing."""
DEFAULT_CHECK = "error"
