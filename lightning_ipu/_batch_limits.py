"""Warnings for fractional batch limits that land on other samples than on the CPU.

Lightning applies ``limit_*_batches``, ``overfit_batches`` and ``val_check_interval`` given as
fractions to the length of the loader it iterates, which on IPUs counts host calls of several
batches each (``_data.py``). Where the fraction of the calls is not the fraction of the batches
(half of 5 calls is 2 calls, 4 batches; half of 10 batches is 5), the run would see other
samples than the same Trainer on the CPU: this says so, and which fractions agree.
"""

import warnings
from collections.abc import Callable

from lightning.fabric.utilities.data import sized_len


def warn_if_fraction_splits_calls(trainer, stage: str, dataloader: object, calls: int,
                                  factor: int) -> None:
    """Warn where a fractional limit of ``stage`` runs other batches than on the CPU.

    ``dataloader`` is the user's loader, ``calls`` the length of the IPU loader made from it,
    each of whose items combines ``factor`` of its batches (the last one fewer where it is short).
    """
    batches = sized_len(dataloader)
    if factor == 1 or batches is None or not calls:
        return
    name = _name(trainer, stage)
    limit = getattr(trainer, f"limit_{stage}_batches")

    def limited(fraction: float) -> tuple[int, int]:
        """Calls run and batches the CPU runs for ``fraction``, as Lightning rounds them."""
        return int(calls * fraction), int(batches * fraction)

    def agrees(fraction: float) -> bool:
        ran, cpu = limited(fraction)
        return ran > 0 and min(ran * factor, batches) == cpu

    if isinstance(limit, float) and limit != 1.0 and not agrees(limit):   # 1.0: a dropped short batch, warned of
        ran, cpu = limited(limit)
        warnings.warn(f"{name}={limit} counts host calls on IPUs: it runs {ran} of the {calls} calls "
                      f"({min(ran * factor, batches)} of the loader's {batches} batches), where the "
                      f"CPU runs {cpu}; each call combines {factor} batches. "
                      f"{_advice(name, agrees)}", stacklevel=3)
    interval = trainer.val_check_interval
    if stage != "train" or not isinstance(interval, float) or interval == 1.0 or not trainer.limit_val_batches:
        return
    epoch_calls, epoch = _limit(calls, limit), _limit(batches, limit)

    def every(fraction: float) -> tuple[int, int]:
        """Calls and CPU batches between validations for ``fraction``, as Lightning rounds them."""
        return max(1, int(epoch_calls * fraction)), max(1, int(epoch * fraction))

    def validates_alike(fraction: float) -> bool:
        calls_between, cpu = every(fraction)
        return calls_between * factor == cpu

    if not validates_alike(interval):
        calls_between, cpu = every(interval)
        warnings.warn(f"val_check_interval={interval} counts host calls on IPUs: validation runs "
                      f"every {_calls(calls_between)} ({calls_between * factor} batches), where the "
                      f"CPU validates every {cpu} batches; each call combines {factor} batches. "
                      f"{_advice('val_check_interval', validates_alike)}", stacklevel=3)


def _calls(count: int) -> str:
    return f"{count} call{'s' * (count != 1)}"


def _limit(length: int, limit: int | float) -> int:
    return min(length, limit) if isinstance(limit, int) else int(length * limit)


def _name(trainer, stage: str) -> str:
    if stage in ("train", "val") and trainer.overfit_batches:
        return "overfit_batches"
    return f"limit_{stage}_batches"


def _advice(name: str, agrees: Callable[[float], bool]) -> str:
    """Up to three fractions of two decimals that agree with the CPU, or an int."""
    fractions = [f"{i / 100:g}" for i in range(5, 100, 5) if agrees(i / 100)][:3]
    alike = f"a fraction the CPU rounds alike ({', '.join(fractions)}) or " if fractions else ""
    return f"Give {name} {alike}an int number of calls."
