"""PopDist's API and options configured from the launcher's environment (one process: the
environment variables are set by the test)."""

import pytest
import torch

import ipu_backend as poptorch
import ipu_backend.distributed as popdist
from ipu_backend.distributed import environment
from ipu_backend.runtime.executor import PoplarExecutor


@pytest.fixture
def third_of_four(monkeypatch):
    """The environment ipu-run gives instance 2 of 4 instances of 2 replicas each."""
    for name, value in {environment.TOTAL_REPLICAS: "8", environment.LOCAL_REPLICAS: "2",
                        environment.REPLICA_OFFSET: "4", environment.IPUS_PER_REPLICA: "1",
                        environment.LOCAL_INSTANCE: "0"}.items():
        monkeypatch.setenv(name, value)


def test_without_a_launcher_there_is_one_instance_of_one_replica():
    assert not popdist.isPopdistEnvSet()
    assert (popdist.getInstanceIndex(), popdist.getNumInstances(), popdist.getNumLocalReplicas(),
            popdist.getNumTotalReplicas(), popdist.getReplicaIndexOffset()) == (0, 1, 1, 1, 0)
    opts = poptorch.Options()
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (0, 1)


def test_the_launcher_environment_places_the_instance(third_of_four):
    assert popdist.isPopdistEnvSet()
    assert (popdist.getInstanceIndex(), popdist.getNumInstances(), popdist.getNumLocalReplicas(),
            popdist.getNumTotalReplicas(), popdist.getReplicaIndexOffset(), popdist.getNumIpusPerReplica(),
            popdist.getLocalInstanceIndex()) == (2, 4, 2, 8, 4, 1, 0)


def test_popdist_options_set_local_replicas_and_instance(third_of_four):
    opts = popdist.poptorch.Options().deviceIterations(3)
    assert opts.replication_factor == 2 and opts.device_iterations == 3
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (2, 4)
    assert popdist.Options is popdist.poptorch.Options
    clone = opts.clone()
    assert (clone.replication_factor, clone.Distributed.processId) == (2, 2)


@pytest.mark.parametrize("call", [
    lambda o: o.replicationFactor(2), lambda o: o.useIpuId(1), lambda o: o.Distributed.disable(),
    lambda o: o.Distributed.setEnvVarNames("A", "B"), lambda o: o.Distributed.configureProcessId(0, 2),
])
def test_popdist_options_refuse_what_the_launcher_sets(third_of_four, call):
    with pytest.raises(poptorch.Error, match="with popdist.poptorch.Options"):
        call(popdist.poptorch.Options())


def test_popdist_options_check_ipus_per_replica(third_of_four):
    assert popdist.poptorch.Options(ipus_per_replica=1).replication_factor == 2
    with pytest.raises(poptorch.Error, match="--ipus-per-replica"):
        popdist.poptorch.Options(ipus_per_replica=2)
    with pytest.raises(poptorch.Error, match="Cannot call `replicationFactor`"):
        popdist.poptorch.Options(replication_factor=4)


def test_plain_options_take_the_instance_from_the_environment(third_of_four):
    opts = poptorch.Options().replicationFactor(2)
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (2, 4)
    assert opts.Distributed.disable().numProcesses == 1


def test_options_read_open_mpi_ranks_as_poptorch(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    opts = poptorch.Options()
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (1, 3)


def test_configure_process_id_takes_several_processes():
    opts = poptorch.Options().replicationFactor(2)
    opts.Distributed.configureProcessId(1, 2)
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (1, 2)
    with pytest.raises(poptorch.Error, match="below num_processes"):
        opts.Distributed.configureProcessId(2, 2)


def test_inconsistent_launcher_environment_is_refused(monkeypatch):
    monkeypatch.setenv(environment.TOTAL_REPLICAS, "4")
    monkeypatch.setenv(environment.LOCAL_REPLICAS, "3")
    with pytest.raises(poptorch.Error, match="spread uniformly"):
        popdist.getInstanceIndex()


def test_several_processes_without_a_coordinator_say_how_to_launch():
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(0, 2)
    with pytest.raises(poptorch.Error, match="launch the instances with ipu-run"):
        poptorch.trainingModel(torch.nn.Linear(2, 1), opts)


def test_an_executor_over_processes_jax_does_not_connect_is_refused():
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(0, 2)
    with pytest.raises(poptorch.Error, match=r"process 0 of 2, but JAX connects 1 process\(es\): start the "
                                             "processes with ipu-run"):
        PoplarExecutor(torch.nn.Linear(2, 1), opts, training=False)


def spanning_two_processes() -> poptorch.Options:
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(0, 2)
    return opts


def test_manual_optimization_over_several_processes_is_refused():
    from ipu_backend import lightning_seam

    model = torch.nn.Linear(2, 1)
    with pytest.raises(poptorch.Error, match="manual optimization runs in one process"):
        lightning_seam.manual_step_executor(model, spanning_two_processes(), [torch.optim.SGD(model.parameters())],
                                            "training_step", None, None)


def test_a_model_split_over_ipus_over_several_processes_is_refused(monkeypatch):
    """As if JAX connected two processes (this is process 0): the split model is refused when built."""
    from ipu_backend.runtime import processes

    monkeypatch.setattr(processes, "process_count", lambda: 2)
    monkeypatch.setattr(processes, "from_first_process", lambda value: value)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    poptorch.BeginBlock(model[1], ipu_id=1)
    with pytest.raises(poptorch.Error, match=r"split over IPUs \(BeginBlock, Block, Stage\) runs in one process"):
        PoplarExecutor(model, spanning_two_processes(), training=False)(torch.ones(2, 2))
