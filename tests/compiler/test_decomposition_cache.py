"""Decompositions kept between captures (``compiler/decomposition_cache.py``): a capture of an
equal graph takes the kept decomposition, which lowers to the same program (same identity, source
lines) and computes torch eager's outputs, gradients and buffers; what the decomposition reads
changes the key; an entry that does not come back equal, or cannot be read, is not used; graphs
it cannot write are decomposed every time. fp32 tolerance: 1e-5 relative, 1e-6 absolute."""

import pickle

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ipu_backend.compiler import capture, compile_module, decomposition_cache, to_jax
from ipu_backend.compiler.lowering_options import lowering_options
from tests.compiler.model_harness import check_model
from tests.compiler.test_repeated_layers import TinyGPT, gpt_batch


class DictStore(dict):
    """A store in memory, counting its hits."""

    hits = 0

    def get(self, key):
        value = dict.get(self, key)
        self.hits += value is not None
        return value

    def put(self, key, data):
        self[key] = data


@pytest.fixture
def decompositions(monkeypatch):
    """How many times a capture decomposed a graph (a list, one entry a decomposition)."""
    runs = []
    decompose = capture.decompose_to_core_aten

    def counted(exported):
        runs.append(exported)
        return decompose(exported)

    monkeypatch.setattr(capture, "decompose_to_core_aten", counted)
    return runs


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 3 * 3, 5)

    def forward(self, input):               # a name fx gives nodes only suffixed: a builtin's
        x = F.max_pool2d(F.relu(self.norm(self.conv(input))), 2)
        return self.fc(x.flatten(1))


def conv_case():
    torch.manual_seed(0)
    return ConvNet(), (torch.randn(3, 1, 8, 8),), dict(loss_fn=F.cross_entropy, targets=(torch.tensor([0, 3, 4]),))


def gpt_case():
    torch.manual_seed(0)
    return TinyGPT(2), gpt_batch(), {}


@pytest.mark.parametrize("case", [conv_case, gpt_case], ids=["conv_batchnorm_pool", "gpt_repeated_blocks"])
def test_an_equal_capture_takes_the_kept_decomposition_with_torchs_numbers(case, decompositions):
    store = DictStore()
    with decomposition_cache.kept_in(store):
        model, inputs, loss = case()
        first = check_model(model, inputs, **loss)
        decomposed = len(decompositions)
        assert decomposed >= 1 and len(store) == decomposed
        model, inputs, loss = case()
        second = check_model(model, inputs, **loss)      # outputs, gradients and buffers against torch eager
    assert len(decompositions) == decomposed, "the second capture decomposed again"
    assert store.hits == decomposed
    assert second.program.identity == first.program.identity is not None
    assert second.program.source_locations == first.program.source_locations
    assert any(second.program.source_locations.values())


def keys_of(module, inputs) -> list[str]:
    """The keys under which capturing ``module(*inputs)`` looks its decompositions up."""
    store = DictStore()
    with decomposition_cache.kept_in(store):
        compile_module(module, inputs)
    return sorted(store)


class Scaled(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return self.linear(x).clone(memory_format=torch.preserve_format) * 2


class ScaledElsewhere(Scaled):
    """The same computation written on other source lines."""

    def forward(self, x):
        return self.linear(x).clone(memory_format=torch.preserve_format) * 2


class Attention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_the_key_covers_what_the_decomposition_reads():
    torch.manual_seed(0)
    x = torch.randn(4, 4)
    key = keys_of(Scaled(), (x,))
    assert keys_of(Scaled(), (torch.randn(4, 4),)) == key, "equal graphs, other weights and inputs: one key"
    assert keys_of(Scaled(), (x.t().contiguous().t(),)) != key, "other strides"
    assert keys_of(Scaled(width=4).requires_grad_(False), (x,)) != key, "frozen weights"
    assert keys_of(ScaledElsewhere(), (x,)) != key, "other source lines"
    assert keys_of(Scaled().double(), (x.double(),)) != key, "other dtypes"
    q = torch.randn(1, 2, 4, 8)
    attention = keys_of(Attention(), (q, q, q))
    with lowering_options(attention="decomposed"):
        assert keys_of(Attention(), (q, q, q)) != attention, "the lowering options"


def test_an_entry_that_does_not_come_back_equal_is_not_used(decompositions):
    store = DictStore()
    with decomposition_cache.kept_in(store):
        model, inputs, _ = conv_case()
        check_model(model, inputs)
        (key, data), = store.items()
        entry = pickle.loads(data)
        index = next(i for i, node in enumerate(entry["nodes"]) if node[2] == ("op", "aten::relu", "default"))
        op, name, _, args, meta = entry["nodes"][index]
        entry["nodes"][index] = (op, name, ("op", "aten::sigmoid", "default"), args, meta)  # the digest says relu
        tampered = pickle.dumps(entry)
        exported = torch.export.export(model, inputs)
        assert decomposition_cache.read(data, exported) is not None
        assert decomposition_cache.read(tampered, exported) is None
        for stored in (tampered, b"not a pickle"):
            store[key] = stored
            before = len(decompositions)
            model, inputs, _ = conv_case()
            check_model(model, inputs)          # torch eager's numbers
            assert len(decompositions) == before + 1, f"the entry {stored[:12]!r}... was used"


class Gated(nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda a: a.sin(), lambda a: a.cos(), (x,))


def test_graphs_with_nested_graphs_are_decomposed_every_time(decompositions):
    store = DictStore()
    x = torch.rand(3, 4)
    with decomposition_cache.kept_in(store):
        for sign in (1, -1):
            program = compile_module(Gated(), (x * sign,))
            outputs, _ = program.fn({}, {}, (to_jax(x * sign),), jax.random.key(0))
            expected = (x * sign).sin() if sign > 0 else (x * sign).cos()
            torch.testing.assert_close(torch.from_numpy(np.array(outputs)), expected,
                                       rtol=1e-5, atol=1e-6)
    assert not store and len(decompositions) == 2
