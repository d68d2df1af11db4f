"""Integer arithmetic that the device, carrying int64 as int32, would compute otherwise than
torch raises after the call, naming the operation and its line: an int64 result beyond int32
(it would wrap), a float converted to int64 beyond int32, an integer division by zero (torch
refuses it). The same program gives torch's numbers wherever the values fit, and only
operations whose values can leave int32 are checked."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ipu_backend as poptorch
from ipu_backend.compiler import integer_faults, integer_ranges, program

LOW, HIGH = -2**31, 2**31 - 1


class IntegerOps(nn.Module):
    def forward(self, x, y, f):
        added = x + y
        subtracted = x - y
        reversed_ = 5 - x
        multiplied = x * y
        negated = -x
        absolute = x.abs()
        total = x.sum()
        running = x.cumsum(0)
        product = x.prod()
        squared = x ** 2
        shifted = x << 20
        running_product = x.cumprod(0)
        quotient = x // y
        remainder = x % y
        truncated = torch.fmod(x, y)
        converted = f.long()
        return (added, subtracted, reversed_, multiplied, negated, absolute, total, running, product,
                squared, shifted, running_product, quotient, remainder, truncated, converted)


SAFE = dict(x=[3, -4, 5, 6], y=[2, 3, -7, 1], f=[1.5, -2.7, 3e3, 0.0])
FAULTS = [
    ("int64 overflow", "added = x + y", dict(x=[HIGH, 1, 1, 1], y=[1, 1, 1, 1])),
    ("int64 overflow", "subtracted = x - y", dict(x=[LOW, 1, 1, 1], y=[1, 1, 1, 1])),
    ("int64 overflow", "reversed_ = 5 - x", dict(x=[LOW + 2, 1, 1, 1])),
    ("int64 overflow", "multiplied = x * y", dict(x=[65536, 1, 1, 1], y=[65536, 1, 1, 1])),
    ("int64 overflow", "negated = -x", dict(x=[LOW, 1, 1, 1])),
    ("int64 overflow", "absolute = x.abs()", dict(x=[LOW, 1, 1, 1])),
    ("int64 overflow", "total = x.sum()", dict(x=[2**30, 2**30, 2**30, -7])),
    ("int64 overflow", "running = x.cumsum(0)", dict(x=[2**30, 2**30, -2**30, -7])),
    ("int64 overflow", "product = x.prod()", dict(x=[2**16, 2**15, 2, 1])),
    ("int64 overflow", "squared = x ** 2", dict(x=[46341, 1, 1, 1])),
    ("int64 overflow", "shifted = x << 20", dict(x=[2048, 1, 1, 1])),
    ("int64 overflow", "running_product = x.cumprod(0)", dict(x=[2**16, 2**15, 2, 1])),
    ("int64 overflow", "quotient = x // y", dict(x=[LOW, 1, 1, 1], y=[-1, 1, 1, 1])),
    ("integer division by zero", "quotient = x // y", dict(y=[2, 0, 1, 1])),
    ("integer division by zero", "remainder = x % y", dict(y=[2, 0, 1, 1])),
    ("integer division by zero", "truncated = torch.fmod(x, y)", dict(y=[2, 0, 1, 1])),
    ("int64 conversion", "converted = f.long()", dict(f=[3e9, 1.0, 1.0, 1.0])),
    ("int64 conversion", "converted = f.long()", dict(f=[float("nan"), 1.0, 1.0, 1.0])),
]


def _inputs(values):
    values = {**SAFE, **values}
    return torch.tensor(values["x"]), torch.tensor(values["y"]), torch.tensor(values["f"])


@pytest.fixture(scope="module")
def integer_ops():
    return poptorch.inferenceModel(IntegerOps())


def test_integer_results_within_int32_are_torchs(integer_ops):
    inputs = _inputs(SAFE)
    for ours, torchs in zip(integer_ops(*inputs), IntegerOps()(*inputs)):
        assert ours.dtype == torchs.dtype
        torch.testing.assert_close(ours, torchs, rtol=0, atol=0)


class EdgeOps(nn.Module):
    def forward(self, x, y, f):
        return x + y, x - y, x * y, x.sum(), f.long()


def test_results_at_the_ends_of_int32_are_torchs():
    x, y = torch.tensor([HIGH - 1, LOW + 1, 2**16, -2**30]), torch.tensor([1, -1, -2**15, 1])
    f = torch.tensor([2.0**31 - 128, -2.0**31, 0.5, -0.5])
    for ours, torchs in zip(poptorch.inferenceModel(EdgeOps())(x, y, f), EdgeOps()(x, y, f)):
        torch.testing.assert_close(ours, torchs, rtol=0, atol=0)


@pytest.mark.parametrize("what,line,values", FAULTS, ids=[f"{line} {what}" for what, line, _ in FAULTS])
def test_integer_results_torch_would_not_give_raise_naming_the_line(integer_ops, what, line, values):
    inputs = _inputs(values)
    with pytest.raises(poptorch.Error, match=f"{what}: [^\n]*test_integer_faults.py:[0-9]+: {re.escape(line)}"):
        integer_ops(*inputs)
    # the executor goes on: the next call of values that fit gives torch's numbers
    torch.testing.assert_close(integer_ops(*_inputs(SAFE))[0], IntegerOps()(*_inputs(SAFE))[0], rtol=0, atol=0)


class HashedEmbedding(nn.Module):
    """Feature hashing: ids spread over a small table by a multiplication."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(97, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, ids, target):
        hashed = (ids * 1000003) % 97
        return F.mse_loss(self.out(self.embedding(hashed)).squeeze(-1), target)


def test_a_training_step_with_replicas_and_device_iterations_is_checked_in_every_micro_batch():
    torch.manual_seed(0)
    model, reference = HashedEmbedding(), HashedEmbedding()
    reference.load_state_dict(model.state_dict())
    options = poptorch.Options().deviceIterations(2).replicationFactor(2)
    training = poptorch.trainingModel(model, options, torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    ids, target = torch.randint(0, 2000, (8, 3)), torch.randn(8, 3)
    training(ids, target)
    for step in range(2):       # each device iteration: one step over both replicas' micro-batches
        optimizer.zero_grad()
        reference(ids[4 * step:4 * step + 4], target[4 * step:4 * step + 4]).backward()
        optimizer.step()
    training.copyWeightsToHost()
    for ours, torchs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, torchs, rtol=1e-5, atol=1e-6)
    ids[7, 1] = 10**6          # one id of the last micro-batch of the second replica
    with pytest.raises(poptorch.Error, match=r"int64 overflow: aten.mul.Tensor at .*hashed = \(ids \* 1000003\)"):
        training(ids, target)


class Classifier(nn.Module):
    def forward(self, x, labels, mask):
        positions = torch.arange(x.shape[1]) * 4 + 1
        counts = mask.sum(-1) * 1000 + positions[:1]
        halves = labels // 2 + x.argmax(-1) % 3
        return F.cross_entropy(x, labels) + counts.sum() + halves.sum()


def test_operations_whose_values_stay_within_int32_are_not_checked():
    x, labels, mask = torch.randn(8, 5), torch.randint(0, 5, (8,)), torch.rand(8, 6) > 0.5
    captured = program.compile_module(Classifier(), (x, labels, mask))
    found = integer_ranges.checks(captured.graph_module)
    assert [node.target for node in found] == [torch.ops.aten.sum.dim_IntList]     # halves.sum()
    torch.testing.assert_close(poptorch.inferenceModel(Classifier())(x, labels, mask),
                               Classifier()(x, labels, mask), rtol=1e-6, atol=1e-6)


def test_every_operation_checked_for_overflow_has_a_float_check():
    assert integer_ranges.ARITHMETIC == set(integer_faults._IN_FLOAT32)
    assert integer_ranges.SUMS == set(integer_faults._SUMS_IN_FLOAT32)


class TwoStageHashing(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.second = nn.Linear(3, 1)

    def forward(self, ids, target):
        with poptorch.Block("first", ipu_id=0):
            hidden = self.first(((ids * 65537) % 13).float())
        with poptorch.Block("second", ipu_id=1):
            return F.mse_loss(self.second(hidden + (ids * 2**20).float()).squeeze(-1), target)


def test_a_pipelined_model_checks_each_stage():
    torch.manual_seed(0)
    model, reference = TwoStageHashing(), TwoStageHashing()
    reference.load_state_dict(model.state_dict())
    options = poptorch.Options()
    options.Training.gradientAccumulation(3)
    options.setExecutionStrategy(poptorch.PipelinedExecution("first", "second"))
    training = poptorch.trainingModel(model, options, torch.optim.SGD(model.parameters(), lr=0.01))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    ids, target = torch.randint(0, 2000, (6, 3)), torch.randn(6)
    training(ids, target)
    optimizer.zero_grad()
    reference(ids, target).backward()          # three accumulated micro-batches: one step
    optimizer.step()
    training.copyWeightsToHost()
    for ours, torchs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, torchs, rtol=1e-5, atol=1e-6)
    ids[5, 0] = 4096                       # fits the first stage's product, not the second's
    with pytest.raises(poptorch.Error, match=r"int64 overflow: aten.mul.Tensor at .*ids \* 2\*\*20") as raised:
        training(ids, target)
    assert "65537" not in str(raised.value)


class DividesInOneBranch(nn.Module):
    def forward(self, x, d):
        return torch.cond(x.sum() > 0, lambda x, d: x // d, lambda x, d: x * 2, (x, d))


def test_a_check_in_a_branch_counts_only_where_the_branch_is_taken():
    """A call's replicas are vmapped, where a conditional computes both branches."""
    executor = poptorch.inferenceModel(DividesInOneBranch())
    for x, d in (([4, 6], [2, 3]), ([-4, -6], [0, 3])):        # the second divides by 0 in the branch not taken
        inputs = torch.tensor(x), torch.tensor(d)
        torch.testing.assert_close(executor(*inputs), DividesInOneBranch()(*inputs), rtol=0, atol=0)
    with pytest.raises(poptorch.Error, match="integer division by zero"):
        executor(torch.tensor([4, 6]), torch.tensor([0, 3]))


class IntegerSums(nn.Module):
    """Int64 matrix products and scatters: each adds many terms into one element."""

    def forward(self, a, b, index, mask):
        matrix = a @ b
        batched = a.unsqueeze(0) @ b.unsqueeze(0)
        added = torch.addmm(b[:1, :1], a, b, beta=-1, alpha=-1)
        vector = torch.addmv(b[0, :3], a, b[:, 0])
        batch_sum = torch.addbmm(b[:3, :3], a.unsqueeze(0), b.unsqueeze(0))
        scattered = torch.zeros(3, dtype=torch.long).scatter_add(0, index, a[0])
        indexed = torch.ones(3, dtype=torch.long).index_add(0, index, a[1])
        masked = a[2].clone()
        masked.index_put_((mask,), b[0, :1], accumulate=True)
        means = torch.zeros(3, dtype=torch.long).scatter_reduce(0, index, a[0], "mean", include_self=False)
        products = torch.ones(3, dtype=torch.long).scatter_reduce(0, index, a[1], "prod")
        shifted = torch.bitwise_left_shift(a[0], index)
        return matrix, batched, added, vector, batch_sum, scattered, indexed, masked, means, products, shifted


SUMS_SAFE = dict(a=[[3, -4, 5], [6, 2, -1], [7, 8, -9]], b=[[1, 2, -3], [4, -5, 6], [-7, 8, 9]],
                 index=[0, 2, 2], mask=[True, False, True])
BIG = 2**30 + 2**29
SUMS_FAULTS = [
    ("matrix = a @ b", dict(a=[[BIG, BIG, 0], [1, 1, 1], [1, 1, 1]], b=[[1, 1, 1], [1, 1, 1], [1, 1, 1]])),
    ("batched = a.unsqueeze(0) @ b.unsqueeze(0)", dict(a=[[1, 1, 1], [1, 1, 1], [1, 1, 1]],
                                                      b=[[1, 1, 1], [1, 1, 1], [1, 1, 2**31 - 1]])),
    ("added = torch.addmm(", dict(b=[[-BIG, 1, 1], [1, 1, 1], [1, 1, 1]])),
    ("scattered = torch.zeros(3, dtype=torch.long).scatter_add(0, index, a[0])",
     dict(a=[[1, BIG, BIG], [1, 1, 1], [1, 1, 1]])),
    ("indexed = torch.ones(3, dtype=torch.long).index_add(0, index, a[1])",
     dict(a=[[1, 1, 1], [1, 2**30, 2**30 - 1], [1, 1, 1]])),
    ("masked.index_put_((mask,), b[0, :1], accumulate=True)", dict(a=[[1, 1, 1], [1, 1, 1], [2**31 - 1, 1, 1]])),
    # torch's mean fits; the sum it divides does not
    ("means = torch.zeros(3, dtype=torch.long).scatter_reduce(", dict(a=[[1, BIG, BIG], [1, 1, 1], [1, 1, 1]])),
    ("products = torch.ones(3, dtype=torch.long).scatter_reduce(", dict(a=[[1, 1, 1], [1, 2**16, 2**15], [1, 1, 1]])),
    ("shifted = torch.bitwise_left_shift(a[0], index)", dict(a=[[1, 2**29, 1], [1, 1, 1], [1, 1, 1]])),
]


def _sums_inputs(values):
    values = {**SUMS_SAFE, **values}
    return (torch.tensor(values["a"]), torch.tensor(values["b"]), torch.tensor(values["index"]),
            torch.tensor(values["mask"]))


@pytest.fixture(scope="module")
def integer_sums():
    return poptorch.inferenceModel(IntegerSums())


@pytest.mark.parametrize("values", [SUMS_SAFE, dict(
    a=[[2**30, 2**30 - 1, 1], [-2**30, 2**30 - 1, 1], [2**31 - 2, 0, 0]],
    b=[[1, 0, 0], [-1, 0, 0], [0, 0, 0]], index=[0, 1, 1])], ids=["small", "large terms, sums at the ends"])
def test_integer_sums_within_int32_are_torchs(integer_sums, values):
    """Every result that fits is torch's, also where terms near 2**30 cancel and where sums
    reach the ends of int32."""
    inputs = _sums_inputs(values)
    for ours, torchs in zip(integer_sums(*inputs), IntegerSums()(*inputs)):
        assert ours.dtype == torchs.dtype
        torch.testing.assert_close(ours, torchs, rtol=0, atol=0)


@pytest.mark.parametrize("line,values", SUMS_FAULTS, ids=[line for line, _ in SUMS_FAULTS])
def test_integer_sums_torch_would_not_give_raise_naming_the_line(integer_sums, line, values):
    inputs = _sums_inputs(values)
    torchs = IntegerSums()(*inputs)
    assert any(((t > HIGH) | (t < LOW)).any() for t in torchs)      # torch's result leaves int32
    with pytest.raises(poptorch.Error, match=f"int64 overflow: [^\n]*test_integer_faults.py:[0-9]+: +{re.escape(line)}"):
        integer_sums(*inputs)


def test_scatters_of_counts_are_not_checked():
    """A count by scatter_add of ones into zeros stays within its number of terms."""
    class Counts(nn.Module):
        def forward(self, labels):
            return torch.zeros(5, dtype=torch.long).scatter_add(0, labels, torch.ones_like(labels))

    labels = torch.tensor([0, 3, 3, 4])
    captured = program.compile_module(Counts(), (labels,))
    assert integer_ranges.checks(captured.graph_module) == {}
    torch.testing.assert_close(poptorch.inferenceModel(Counts())(labels), Counts()(labels), rtol=0, atol=0)
