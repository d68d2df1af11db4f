"""Processes joined by jax.distributed (gloo between this host's CPU devices), started by ipu-run:
a program over the global mesh of 2 instances x 2 replicas reduces over all of them, each
instance feeds and reads back its own replicas' rows, replicated values are process 0's; an
instance killed mid-run ends the run at once with a clear error."""

import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ipu_backend.distributed import launcher

ROOT = Path(__file__).resolve().parents[2]
INSTANCE = str(ROOT / "tests" / "distributed" / "collective_instance.py")


@pytest.fixture
def instances_environment(monkeypatch):
    """What the instances inherit: this tree on the path, two CPU devices each (one per replica)."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("IPU_BACKEND_CPU_DEVICES", "2")
    return monkeypatch


def run_two_instances(out: Path) -> int:
    return launcher.main(["--num-instances", "2", "--num-replicas", "4", "--", sys.executable, INSTANCE, str(out)])


def test_a_global_mesh_reduces_over_every_instance(tmp_path, instances_environment):
    assert run_two_instances(tmp_path) == 0
    everything = np.arange(12, dtype=np.float32).reshape(4, 3)
    for index in range(2):
        result = np.load(tmp_path / f"instance{index}.npz")
        assert result["devices"] == 2                              # one device per replica
        np.testing.assert_array_equal(result["total"], 1 + everything.sum(0))   # process 0's weight, 1
        np.testing.assert_array_equal(result["scaled"], everything[2 * index:2 * index + 2])


def test_a_killed_instance_ends_the_run_with_a_clear_error(tmp_path, instances_environment, capfd):
    """Instance 1 dies after its first step, while instance 0 waits for it in its second."""
    instances_environment.setenv("KILL_INSTANCE", "1")
    status = run_two_instances(tmp_path)
    ended = time.time()
    err = capfd.readouterr().err
    assert status == 128 + 9
    assert "instance 1 was killed by SIGKILL; stopping the other instances" in err
    assert "ipu-run: the run failed: instance 1 was killed by SIGKILL" in err
    assert [p.name for p in tmp_path.iterdir()] == ["killed"]       # instance 0 never finished
    assert ended - float((tmp_path / "killed").read_text()) < 15
