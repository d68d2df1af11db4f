"""Tied weights (Hugging Face's ``head.weight = emb.weight``, either direction): one parameter,
its gradients from both uses summed, one optimizer state, still one tensor after the weights come
back to the host; on one IPU and with the two uses on different pipeline stages. Against torch
eager, fp32 within 1e-5 relative."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch

RTOL, ATOL = 1e-5, 1e-6


class TiedLM(torch.nn.Module):
    def __init__(self, tie_to_embedding: bool, split: bool = False):
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 4)
        self.hidden = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        if tie_to_embedding:
            self.head.weight = self.embedding.weight
        else:
            self.embedding.weight = self.head.weight
        if split:
            self.hidden = poptorch.BeginBlock(self.hidden, "hidden", ipu_id=1)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.hidden(self.embedding(ids))))
        return logits, F.cross_entropy(logits, labels)


def torch_steps(model, optimizer, ids, labels, steps):
    for step in range(steps):
        optimizer.zero_grad()
        _, loss = model(ids[step], labels[step])
        loss.backward()
        optimizer.step()


def batches(steps, micro):
    generator = torch.Generator().manual_seed(1)
    return (torch.randint(0, 10, (steps, micro), generator=generator),
            torch.randint(0, 10, (steps, micro), generator=generator))


@pytest.mark.parametrize("tie_to_embedding", [True, False], ids=["head-to-embedding", "embedding-to-head"])
def test_tied_weight_is_one_parameter_trained_as_in_torch(tie_to_embedding):
    torch.manual_seed(0)
    model = TiedLM(tie_to_embedding)
    reference = copy.deepcopy(model)
    ids, labels = batches(3, 4)
    torch_optimizer = torch.optim.Adam(reference.parameters(), lr=0.05)
    torch_steps(reference, torch_optimizer, ids, labels, 3)

    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    ipu = poptorch.trainingModel(model, poptorch.Options().deviceIterations(3), optimizer)
    ipu(ids.reshape(-1), labels.reshape(-1))
    ipu.copyWeightsToHost()

    assert model.head.weight is model.embedding.weight
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=name)
    state, expected = optimizer.state_dict()["state"], torch_optimizer.state_dict()["state"]
    assert sorted(state) == sorted(expected)          # one entry for the tied weight
    for index in expected:
        torch.testing.assert_close(state[index]["exp_avg"], expected[index]["exp_avg"], rtol=RTOL, atol=ATOL)
    assert set(model.state_dict()) == set(reference.state_dict())


@pytest.mark.parametrize("tie_to_embedding", [True, False], ids=["head-to-embedding", "embedding-to-head"])
def test_tied_weight_used_on_two_pipeline_stages_trains_as_in_torch(tie_to_embedding):
    """The embedding runs on IPU 0, the head on IPU 1: the stage that reads the weight first
    updates it with the gradients of both uses."""
    torch.manual_seed(0)
    model = TiedLM(tie_to_embedding, split=True)
    reference = copy.deepcopy(model)
    ids, labels = batches(2, 6)
    torch_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), ids, labels, 2)

    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(3)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    ipu = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ipu(ids.reshape(-1), labels.reshape(-1))
    ipu.copyWeightsToHost()

    assert model.head.weight is model.embedding.weight
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=name)
