"""Replicas grouped as PopTorch's CommGroupType says: groups sharing input data
(Options.inputReplicaGrouping) and weights holding one value per group (replicaGrouping)."""

import numpy as np
import pytest
import torch

import ipu_backend as poptorch
from ipu_backend import CommGroupType, Error, VariableRetrievalMode

ONE_PER_GROUP = VariableRetrievalMode.OnePerGroup


class Project(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.W = torch.nn.Parameter(weight)

    def forward(self, x):
        z = x @ self.W
        return z, poptorch.identity_loss(z ** 2, reduction="mean")


def _problem(rows=8, features=6, outputs=8):
    rng = np.random.RandomState(3)
    return (torch.tensor(rng.normal(size=(rows, features)).astype(np.float32)),
            torch.tensor(rng.normal(size=(features, outputs)).astype(np.float32) * 0.3))


def _torch_steps(x, w, steps):
    """torch eager on the whole problem: the losses and the final weight."""
    w = torch.nn.Parameter(w.clone())
    optimizer = torch.optim.SGD([w], lr=0.05, momentum=0.9)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.mean((x @ w) ** 2)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return np.array(losses), w.detach()


@pytest.mark.parametrize("input_type,weight_type", [(CommGroupType.Consecutive, CommGroupType.Orthogonal),
                                                    (CommGroupType.Orthogonal, CommGroupType.Consecutive)])
def test_grouped_weight_and_input_train_as_torch_on_the_whole_problem(input_type, weight_type):
    # 8 replicas = 2 shares of the rows x 4 column blocks of W: replica r reads one share and one
    # block, so together the replicas compute x @ W whole, as torch does.
    x, w = _problem()
    expected_losses, expected_w = _torch_steps(x, w, steps=3)
    blocks = w.reshape(6, 4, 2).permute(1, 0, 2).contiguous()          # [block, features, 2]
    model = Project(blocks)
    options = poptorch.Options().replicationFactor(8).inputReplicaGrouping(4, input_type)
    options.outputMode(poptorch.OutputMode.All)
    training = poptorch.trainingModel(model, options, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    training.W.replicaGrouping(weight_type, 2, ONE_PER_GROUP)
    losses = [float(training(x.reshape(2, 4, 6))[1].sum()) / 8 for _ in range(3)]
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    trained = model.W.detach().permute(1, 0, 2).reshape(6, 8)
    torch.testing.assert_close(trained, expected_w, rtol=1e-5, atol=1e-6)


def test_each_replica_reads_its_groups_row_in_inference():
    x, w = _problem()
    blocks = w.reshape(6, 4, 2).permute(1, 0, 2).contiguous()
    inference = poptorch.inferenceModel(Project(blocks), poptorch.Options().replicationFactor(4))
    inference.W.replicaGrouping(CommGroupType.NoGrouping, 0, ONE_PER_GROUP)
    outputs, _ = inference(x[:4])                                     # replica r: row r, block r
    expected = torch.stack([x[r] @ blocks[r] for r in range(4)])
    torch.testing.assert_close(outputs, expected, rtol=1e-5, atol=1e-6)


def test_groups_of_replicas_sharing_input_average_as_torch():
    # 4 replicas in 2 groups: each share of the batch is seen by 2 replicas; the mean over the
    # replicas is torch's mean over the shares.
    x, w = _problem(rows=4)
    expected_losses, expected_w = _torch_steps(x, w, steps=2)
    model = Project(w.clone())
    options = poptorch.Options().replicationFactor(4).inputReplicaGrouping(2, "orthogonal")
    training = poptorch.trainingModel(model, options, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for _ in range(2):
        training(x)
    torch.testing.assert_close(model.W.detach(), expected_w, rtol=1e-5, atol=1e-6)
    assert options.input_group_size == 2 and options.input_group_type is CommGroupType.Orthogonal


def test_replicas_of_one_group_return_the_same_outputs():
    x, w = _problem(rows=4)
    options = poptorch.Options().replicationFactor(4).inputReplicaGrouping(2, CommGroupType.Consecutive)
    outputs, _ = poptorch.inferenceModel(Project(w), options)(x[:2])
    expected = x[:2] @ w
    torch.testing.assert_close(outputs, expected[[0, 0, 1, 1]], rtol=1e-5, atol=1e-6)


def test_dataloader_combines_one_batch_per_input_group():
    options = poptorch.Options().deviceIterations(2).replicationFactor(4).inputReplicaGrouping(2, "consecutive")
    loader = poptorch.DataLoader(options, torch.utils.data.TensorDataset(torch.arange(24.0)), batch_size=3)
    assert [tuple(batch[0].shape) for batch in loader] == [(12,), (12,)]


def test_options_keep_the_input_groups():
    options = poptorch.Options().replicationFactor(4).inputReplicaGrouping(2, CommGroupType.Orthogonal)
    again = poptorch.Options.from_dict(options.toDict())
    assert (again.input_group_size, again.input_group_type) == (2, CommGroupType.Orthogonal)
    assert options.runtime_settings().key != poptorch.Options().replicationFactor(4).runtime_settings().key
    ungrouped = poptorch.Options().replicationFactor(4).inputReplicaGrouping(4, CommGroupType.NoGrouping)
    assert ungrouped.input_group_size == 1


def test_a_weight_without_one_value_per_group_is_refused():
    x, w = _problem(rows=4)
    training = poptorch.trainingModel(Project(w), poptorch.Options().replicationFactor(4))
    training.W.replicaGrouping(CommGroupType.Consecutive, 2, ONE_PER_GROUP)
    with pytest.raises(Error, match=r"W is grouped over replicas in 2 groups.*its shape is \(6, 8\)"):
        training(x)


def test_reading_every_replicas_value_is_refused():
    x, w = _problem(rows=4)
    training = poptorch.trainingModel(Project(w.expand(4, 6, 8).clone()), poptorch.Options().replicationFactor(4))
    training.W.replicaGrouping(CommGroupType.NoGrouping, 0, VariableRetrievalMode.AllReplicas)
    with pytest.raises(Error, match="AllReplicas.*not emulated"):
        training(x)


def test_a_replication_factor_the_input_groups_do_not_divide_is_refused():
    options = poptorch.Options().replicationFactor(4).inputReplicaGrouping(4, "consecutive").replicationFactor(2)
    x, w = _problem(rows=4)
    with pytest.raises(Error, match=r"input_group_size \(4\) must be a factor of replication_factor \(2\)"):
        poptorch.inferenceModel(Project(w), options)(x)


def test_a_parameter_read_through_the_wrapper_is_the_parameter():
    x, w = _problem(rows=4)
    model = Project(w)
    training = poptorch.trainingModel(model)
    assert training.W.shape == (6, 8) and torch.equal(torch.mul(training.W, 1), w)
    assert torch.equal(training.W * 2, w * 2) and torch.equal(training.W[0], w[0]) and len(training.W) == 6


def test_a_model_split_over_ipus_cannot_group_weights():
    class Split(Project):
        def forward(self, x):
            with poptorch.Block(ipu_id=0):
                z = x @ self.W
            with poptorch.Block(ipu_id=1):
                return z, poptorch.identity_loss(z ** 2, reduction="mean")

    x, w = _problem(rows=4)
    options = poptorch.Options().replicationFactor(2).deviceIterations(2)
    inference = poptorch.inferenceModel(Split(w.expand(2, 6, 8).clone()), options)
    inference.W.replicaGrouping(CommGroupType.NoGrouping, 0, ONE_PER_GROUP)
    with pytest.raises(Error, match="split over IPUs .* cannot group weights over replicas"):
        inference(x)
