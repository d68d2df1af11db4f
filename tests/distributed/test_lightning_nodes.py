"""``Trainer(accelerator="ipu", devices=2, num_nodes=2)``: two processes (started by ipu-run or torchrun,
gloo between this host's CPU devices) train as one process with 4 replicas does on the same global
batches, and as Lightning on the CPU; they log the single process's values, rank 0 alone writes the
checkpoint, and one process resumes from it. Which process is which comes from ipu-run's or from
Lightning's own cluster environments (torchrun's and SLURM's variables)."""

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ipu_backend.distributed import environment, launcher
from tests.distributed import nodes
from tests.lightning.helpers import assert_same_weights

ROOT = Path(__file__).resolve().parents[2]
NODE = str(ROOT / "tests" / "distributed" / "lightning_node.py")
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture
def nodes_environment(monkeypatch):
    """What the nodes inherit: this tree on the path, two CPU devices each, Lightning's default seed."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("IPU_BACKEND_CPU_DEVICES", "2")
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> tuple[dict, list, dict, dict]:
    """One process with 4 replicas, and Lightning on the CPU, reading the nodes' global batches for
    two epochs: the IPU run's weights after the first epoch (from its checkpoint), its logged values
    after each epoch and its final weights, and the CPU run's final weights."""
    directory = tmp_path_factory.mktemp("single")
    ipu, metrics = nodes.module(), nodes.MetricsAfterValidation()
    trainer = pl.Trainer(accelerator="ipu", devices=4, max_epochs=2, callbacks=[nodes.checkpoints(directory), metrics],
                         **nodes.FLAGS)
    nodes.fit(trainer, ipu, order=nodes.DISTRIBUTED_ORDER)
    cpu = nodes.module()
    nodes.fit(pl.Trainer(accelerator="cpu", max_epochs=2, **{**nodes.FLAGS, "enable_checkpointing": False}), cpu,
              batch_size=4 * nodes.BATCH_SIZE, order=nodes.DISTRIBUTED_ORDER)
    first_epoch = torch.load(directory / "epoch=0.ckpt", weights_only=False)["state_dict"]
    return first_epoch, metrics.epochs, ipu.state_dict(), cpu.state_dict()


def assert_nodes_trained_as_one_process(out: Path, single_process) -> None:
    first_epoch, metrics, _, _ = single_process
    results = [np.load(out / f"node{rank}.npz") for rank in range(2)]
    for result in results:
        assert int(result["world_size"]) == 2 and int(result["global_step"]) == 4
        for name, weight in first_epoch.items():
            torch.testing.assert_close(torch.from_numpy(result[f"weight/{name}"]), weight, rtol=RTOL, atol=ATOL,
                                       msg=name)
        for name, value in metrics[0].items():      # every value logged is the single process's
            torch.testing.assert_close(torch.from_numpy(result[f"metric/{name}"]), value, rtol=RTOL, atol=ATOL,
                                       msg=name)
    assert [int(result["saves"]) for result in results] == [1, 0]      # rank 0 alone writes
    saved = torch.load(out / "epoch=0.ckpt", weights_only=False)
    assert saved["global_step"] == 4
    torch.testing.assert_close(saved["state_dict"], first_epoch, rtol=RTOL, atol=ATOL)


def test_two_nodes_under_ipu_run_train_as_one_process_and_resume_in_one(tmp_path, nodes_environment,
                                                                          single_process):
    assert launcher.main(["--num-instances", "2", "--num-replicas", "4", "--", sys.executable, NODE,
                          str(tmp_path)]) == 0
    assert_nodes_trained_as_one_process(tmp_path, single_process)

    _, _, final, cpu = single_process
    resumed = nodes.module()
    trainer = pl.Trainer(accelerator="ipu", devices=4, max_epochs=2, callbacks=[nodes.checkpoints(tmp_path / "resumed")],
                         **nodes.FLAGS)
    nodes.fit(trainer, resumed, order=nodes.DISTRIBUTED_ORDER, ckpt_path=tmp_path / "epoch=0.ckpt")
    assert trainer.global_step == 8
    torch.testing.assert_close(resumed.state_dict(), final, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(resumed.state_dict(), cpu, rtol=RTOL, atol=ATOL)


def test_two_nodes_under_torchrun_train_as_one_process(tmp_path, nodes_environment, single_process):
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
                          "--master-port", str(launcher._free_port()), NODE, str(tmp_path)],
                         env=os.environ, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_nodes_trained_as_one_process(tmp_path, single_process)


def strategy_under(monkeypatch, variables: dict[str, str], num_nodes: int = 2):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return pl.Trainer(accelerator="ipu", devices=2, num_nodes=num_nodes, logger=False).strategy


def test_torchrun_variables_give_the_rank(monkeypatch):
    strategy = strategy_under(monkeypatch, {"TORCHELASTIC_RUN_ID": "run", "RANK": "1", "WORLD_SIZE": "2",
                                            "LOCAL_RANK": "0", "GROUP_RANK": "1", "MASTER_ADDR": "node0",
                                            "MASTER_PORT": "29500"})
    assert type(strategy.cluster_environment).__name__ == "TorchElasticEnvironment"
    assert (strategy.global_rank, strategy.world_size, strategy.is_distributed) == (1, 2, True)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


def test_slurm_variables_give_the_rank(monkeypatch):
    strategy = strategy_under(monkeypatch, {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
                                            "SLURM_NODEID": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "42",
                                            "SLURM_NODELIST": "node[0-1]", "SLURM_NNODES": "2",
                                            "SLURM_NTASKS_PER_NODE": "1"})
    assert type(strategy.cluster_environment).__name__ == "SLURMEnvironment"
    assert (strategy.global_rank, strategy.world_size) == (1, 2)


def ipu_run_environment(replicas: int) -> dict[str, str]:
    """What ipu-run tells instance 1 of 2."""
    this, _ = launcher.make_plan(launcher._parser().parse_args(["--num-instances", "2", "--num-replicas",
                                                                str(replicas), "python"]))
    return this.environment(1, 1)


def test_ipu_run_variables_give_the_rank(monkeypatch):
    strategy = strategy_under(monkeypatch, ipu_run_environment(4))
    assert (strategy.global_rank, strategy.world_size, strategy.local_rank) == (1, 2, 1)
    assert environment.from_environment().index == 1


def test_devices_must_agree_with_ipu_run_replicas(monkeypatch):
    with pytest.raises(MisconfigurationException, match=r"devices=2\)` but ipu-run gives each instance 4 "):
        strategy_under(monkeypatch, ipu_run_environment(8))


def test_num_nodes_must_match_the_processes_started(monkeypatch):
    with pytest.raises(MisconfigurationException, match=r"num_nodes=2\)` runs one process per node.*1 process"):
        strategy_under(monkeypatch, {}, num_nodes=2)
