"""Every registered lowering is exercised by an op parity case (each case checks its claim)."""

import importlib
import pathlib

from ipu_backend.compiler import registered_ops


def _claimed_ops() -> set:
    claimed = set()
    for path in sorted(pathlib.Path(__file__).parent.glob("test_ops_*.py")):
        module = importlib.import_module(f"tests.compiler.{path.stem}")
        for case in module.CASES:
            claimed.update(case.ops)
    return claimed


def test_every_lowering_has_a_parity_case():
    untested = {str(op) for op in registered_ops() - _claimed_ops()}
    assert not untested, f"lowerings with no op parity case: {sorted(untested)}"
