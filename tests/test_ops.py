"""PopTorch's in-model ops against torch eager: ipu_print_tensor (value and gradient printed,
identity otherwise), planning hints and name scopes (recorded in the compile report, numbers
unchanged), serializedMatMul, dynamic_slice/dynamic_update, isRunningOnIpu.
fp32 tolerance: 1e-5 relative (1e-6 absolute)."""

import copy
import json
import os

import pytest
import torch

import ipu_backend as poptorch
from ipu_backend.compiler.tensor_print import PrintFormat, format_tensor

RTOL, ATOL = 1e-5, 1e-6
Mode = poptorch.MatMulSerializationMode


def train_once(model, *inputs):
    """One SGD step compiled and in torch eager: (compiled loss, eager loss), weights compared."""
    reference = copy.deepcopy(model)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    loss = training(*inputs)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = reference(*inputs)
    expected.backward()
    optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)
    training.destroy()
    return loss, expected.detach()


class Printed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))

    def forward(self, x):
        y = poptorch.ipu_print_tensor(x @ self.weight, "product", digits=3, separator=" ")
        return (y * y).sum()


def test_ipu_print_tensor_prints_value_and_gradient(capfd):
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    loss, expected = train_once(Printed(), x)
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    err = capfd.readouterr().err
    assert "product: (\n (1.00 2.00)\n (3.00 4.00)\n)" in err
    assert "product_gradient: (\n (2.00 4.00)\n (6.00 8.00)\n)" in err    # d(sum y²)/dy = 2y
    assert Printed()(x).item() == 30.0 and capfd.readouterr().err == ""      # eager: identity


def test_print_layout_summarises_and_wraps():
    fmt = PrintFormat(summarise_threshold=5, edge_items=1, max_line_width=12, digits=2, separator=",")
    assert format_tensor("t", torch.arange(8.0).numpy(), fmt) == "t: (0.0,...,\n  7.0)"
    assert format_tensor("", torch.tensor([3, -12]).numpy(), PrintFormat()) == "(  3, -12)"


class Hinted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        x = poptorch.set_overlap_for_input(x, poptorch.OverlapMode.OverlapAccumulationLoop)
        with poptorch.NameScope("encoder"):
            h = poptorch.set_available_memory(self.layer(x), 0.3)
            with poptorch.NameScope("inner"):
                h = poptorch.nop(torch.relu(h))
        h = poptorch.serializedMatMul(h, y, Mode.ReducingDim, 3)
        return poptorch.set_overlap_for_output(h, poptorch.OverlapMode.NoOverlap)


def test_hints_and_name_scopes_reach_the_compile_report_and_change_nothing(tmp_path):
    torch.manual_seed(0)
    model = Hinted()
    x, y = torch.randn(2, 4), torch.randn(3, 5)
    executor = poptorch.inferenceModel(model, poptorch.Options().enableProfiling(str(tmp_path)))
    torch.testing.assert_close(executor(x, y), torch.relu(model.layer(x)) @ y, rtol=RTOL, atol=ATOL)
    executor.destroy()
    with open(os.path.join(tmp_path, "inference", "compile_report.json"), encoding="utf-8") as file:
        stage = json.load(file)["programs"][0]["stages"][0]
    hints = {(h["kind"], h["value"], h["op"], h["name_scope"]) for h in stage["hints"]}
    assert hints == {
        ("overlap_for_input", "OverlapAccumulationLoop", "input", ""),
        ("available_memory_proportion", "0.3", "aten.addmm", "encoder"),
        ("nop", "", "aten.relu", "encoder/inner"),
        ("matmul_serialization", "ReducingDim factor=3 keep_precision=False", "aten.sum", ""),
        ("overlap_for_output", "NoOverlap", "aten.sum", ""),
    }
    assert set(stage["name_scopes"]) == {"encoder", "encoder/inner"}
    with open(os.path.join(tmp_path, "inference", "compile_report.html"), encoding="utf-8") as file:
        assert "available_memory_proportion" in file.read()


class Serialized(torch.nn.Module):
    def __init__(self, mode, rhs):
        super().__init__()
        self.mode, self.rhs = mode, torch.nn.Parameter(rhs)

    def forward(self, x):
        return poptorch.serializedMatMul(x, self.rhs, self.mode, 3).pow(2).sum()


@pytest.mark.parametrize("mode,shapes", [
    (Mode.InputChannels, ((2, 6, 4), (4, 5))),
    (Mode.ReducingDim, ((6, 9), (9, 4))),
    (Mode.OutputChannels, ((6, 4), (4, 9))),
    (Mode.Disabled, ((6, 4), (4, 5))),
])
def test_serialized_matmul_equals_matmul_with_gradients(mode, shapes):
    torch.manual_seed(0)
    lhs, rhs = torch.randn(shapes[0]), torch.randn(shapes[1])
    eager = (lhs @ rhs).pow(2).sum()
    loss, expected = train_once(Serialized(mode, rhs), lhs)
    torch.testing.assert_close(expected, eager, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)


def test_serialized_matmul_keeps_half_partials_in_float():
    lhs, rhs = torch.rand(2, 64, dtype=torch.half), torch.rand(64, 2, dtype=torch.half)
    out = poptorch.serializedMatMul(lhs, rhs, Mode.ReducingDim, 8, keep_precision=True)
    torch.testing.assert_close(out, (lhs.float() @ rhs.float()).half(), rtol=1e-3, atol=1e-3)
    with pytest.raises(poptorch.Error, match=r"factor \(5\) must be a factor of the dimension split "
                                             r"by InputChannels \(2\)"):
        poptorch.serializedMatMul(lhs, rhs, Mode.InputChannels, 5)


class Slicer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(6, 3))

    def forward(self, start, patch):
        window = poptorch.dynamic_slice(self.table, 0, start, 4, 2)
        updated = poptorch.dynamic_update(self.table, patch, 0, start, 2)
        return (window * window).sum() + (updated * updated).sum() * 0.5


@pytest.mark.parametrize("start", [1, 5])       # 5 overruns: moved back into range
def test_dynamic_slice_and_update_equal_torch_with_gradients(start):
    torch.manual_seed(0)
    model = Slicer()
    start_tensor, patch = torch.tensor([start]), torch.randn(2, 3)
    begin = min(start, 2)
    table = model.table.detach()
    updated = table.clone()
    updated[min(start, 4):min(start, 4) + 2] = patch
    manual = table[begin:begin + 4:2].pow(2).sum() + updated.pow(2).sum() * 0.5
    torch.testing.assert_close(model(start_tensor, patch), manual)
    loss, expected = train_once(model, start_tensor, patch)
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)


def test_dynamic_slice_errors_are_poptorch_s():
    with pytest.raises(poptorch.Error, match="Slicing step must be at least 1"):
        poptorch.dynamic_slice(torch.ones(4), 0, torch.tensor([0]), 2, 0)
    with pytest.raises(poptorch.Error, match="The start and end of a slice must be different."):
        poptorch.dynamic_slice(torch.ones(4), 0, torch.tensor([0]), 0, 1)
    with pytest.raises(poptorch.Error, match=r"input and src tensor must have same dtype"):
        poptorch.dynamic_update(torch.ones(4), torch.ones(2, dtype=torch.int32), 0, torch.tensor(0), 2)


class Branchy(torch.nn.Module):
    def forward(self, x):
        return x + 1 if poptorch.isRunningOnIpu() else x - 1


def test_is_running_on_ipu_only_while_compiled():
    x = torch.zeros(2)
    assert not poptorch.isRunningOnIpu()
    torch.testing.assert_close(Branchy()(x), x - 1)
    torch.testing.assert_close(poptorch.inferenceModel(Branchy())(x), x + 1)


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    @poptorch.autocast()
    def forward(self, x):
        h = self.layer(x)
        with poptorch.autocast(enabled=False):
            kept = torch.mm(x, x.t())
        return h, kept


def test_autocast_computes_in_half_when_compiled_as_torch_autocast():
    torch.manual_seed(0)
    model, x = Mixed(), torch.randn(2, 4)
    h, kept = poptorch.inferenceModel(model)(x)
    with torch.autocast("cpu", dtype=torch.float16):
        expected = model.layer(x)
    assert h.dtype == torch.float16 and kept.dtype == torch.float32
    torch.testing.assert_close(h, expected, rtol=0, atol=0)
    assert model(x)[0].dtype == torch.float32          # a plain torch call: unchanged, as PopTorch


class TwoConvs(torch.nn.Module):
    def __init__(self, multi_conv):
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(1, 2, 3), torch.nn.Conv2d(1, 2, 3)
        self.multi_conv = multi_conv

    def forward(self, x):
        with self.multi_conv:
            u, v = self.a(x), self.b(x.abs())
        return u - v


def test_multi_conv_computes_as_torch_and_is_reported(tmp_path):
    torch.manual_seed(0)
    region = (poptorch.MultiConv().availableMemoryProportions((0.8, 0.7)).partialsTypes(torch.float)
              .planType(poptorch.MultiConvPlanType.Parallel))
    model, x = TwoConvs(region), torch.randn(1, 1, 6, 6)
    executor = poptorch.inferenceModel(model, poptorch.Options().enableProfiling(str(tmp_path)))
    torch.testing.assert_close(executor(x), model(x).detach(), rtol=RTOL, atol=ATOL)
    executor.destroy()
    with open(os.path.join(tmp_path, "inference", "compile_report.json"), encoding="utf-8") as file:
        [group] = json.load(file)["programs"][0]["stages"][0]["multi_convs"]
    assert group == {"convolutions": 2, "settings": {"available_memory_proportions": [0.8, 0.7],
                                                     "partials_types": ["float"], "plan_type": "Parallel"}}


class Nested(torch.nn.Module):
    def forward(self, x):
        with poptorch.MultiConv():
            with poptorch.MultiConv():
                return x * 2


class Empty(torch.nn.Module):
    def forward(self, x):
        with poptorch.MultiConv():
            return x * 2


def test_multi_conv_errors_are_poptorch_s():
    with pytest.raises(poptorch.Error, match="Nested poptorch.MultiConv is not supported"):
        poptorch.inferenceModel(Nested())(torch.ones(2))
    with pytest.raises(poptorch.Error, match="Unexpected end_multi_conv"):
        poptorch.inferenceModel(Empty())(torch.ones(2))
    with pytest.raises(ValueError, match="Invalid partials types"):
        poptorch.MultiConv().partialsTypes("half")
    with pytest.raises(AssertionError, match="Invalid plan type"):
        poptorch.MultiConv().planType("parallel")


class _OverlapMisused(torch.nn.Module):
    def __init__(self, case: str):
        super().__init__()
        self.case = case

    def forward(self, x):
        mode = poptorch.OverlapMode.OverlapAccumulationLoop
        if self.case == "input read twice":
            return x + 1, poptorch.set_overlap_for_input(x, mode)
        if self.case == "not an input":
            return poptorch.set_overlap_for_input(x + 1, mode)
        if self.case == "returned twice":
            y = x + 1
            return y, poptorch.set_overlap_for_output(y, mode)
        return poptorch.set_overlap_for_output(x + 1, mode) * 2       # not an output


@pytest.mark.parametrize("case, message", [
    ("input read twice", r"set_overlap_for_input must be the only op applied to an input\. This is not the "
                         r"case for input 0 to the model\."),
    ("not an input", r"set_overlap_for_input applied on a node which is not a tensor input to the model\."),
    ("returned twice", r"set_overlap_for_output cannot be used with a tensor that is returned twice\."),
    ("not an output", r"set_overlap_for_output applied on a node which is not a tensor output to the model\."),
])
def test_overlap_hints_on_what_is_not_a_model_input_or_output_raise_poptorchs_errors(case, message):
    with pytest.raises(poptorch.Error, match=message):
        poptorch.inferenceModel(_OverlapMisused(case))(torch.ones(2))
