"""The weights of repeated layers held out of the model's export (``layer_weights``): the program
is the one an export of the whole tree gives, and a model whose code reads those weights (a
penalty over ``self.parameters()``, a weight read by name, a refusal it catches, a layer called
under ``torch.no_grad()``) is exported with them, its loss and gradients equal to torch eager.
fp32 tolerance: 1e-5 relative, 1e-6 absolute."""

import os
import sysconfig

import pytest
import torch
import torch.nn.functional as F

from ipu_backend.compiler import compile_module, layer_weights
from tests.compiler.test_repeated_layers import (
    Encoder, TinyGPT, assert_close, gpt_batch, jax_outputs_and_grads,
)


@pytest.fixture
def held(monkeypatch):
    """The number of layers whose weights each capture put back, capture by capture."""
    counts = []
    put_back = layer_weights.Held.put_back

    def counted(self, exported, calls, state_names):
        counts.append(len(self.layers))
        return put_back(self, exported, calls, state_names)

    monkeypatch.setattr(layer_weights.Held, "put_back", counted)
    return counts


def compiled_as_torch(model, args):
    """``model``'s program, its outputs and gradients checked against torch eager's (a parameter
    no gradient reaches, None in torch, zero in the program)."""
    logits, loss = model(*args)
    loss.backward()
    program = compile_module(model, args)
    outputs, grads = jax_outputs_and_grads(program, model, args)
    assert_close(outputs[0], logits)
    assert_close(outputs[1], loss)
    for name, param in model.named_parameters():
        assert_close(grads[name], torch.zeros_like(param) if param.grad is None else param.grad, name)
    return program


def encoder_batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(4, 5, 16, generator=generator), torch.randint(0, 3, (4,), generator=generator)


@pytest.mark.parametrize("make, batch, layers", [(lambda: TinyGPT(4), gpt_batch, 4), (Encoder, encoder_batch, 3)],
                         ids=["gpt", "transformer_encoder"])
def test_held_weights_give_the_program_of_the_whole_tree(make, batch, layers, held, monkeypatch):
    torch.manual_seed(0)
    model, args = make(), batch()
    program = compile_module(model, args)
    assert held == [layers - 1]
    monkeypatch.setattr(layer_weights, "holdable", lambda root, run: False)
    whole = compile_module(model, args)
    assert held == [layers - 1]
    assert program.identity is not None and program.identity == whole.identity
    assert [s.name for s in program.params] == [name for name, _ in model.named_parameters()]


class Penalized(TinyGPT):
    """A loss with an L2 penalty over every parameter, walked in forward."""

    def forward(self, tokens, targets):
        logits, loss = super().forward(tokens, targets)
        return logits, loss + 1e-2 * sum(p.pow(2).sum() for p in self.parameters())


class ReadByName(TinyGPT):
    """A later block's weight read by name outside the block."""

    def forward(self, tokens, targets):
        logits, loss = super().forward(tokens, targets)
        return logits, loss + self.blocks[2].fc.weight.abs().mean()


class Counted(TinyGPT):
    """A refusal the model's code catches (and would answer otherwise)."""

    def forward(self, tokens, targets):
        logits, loss = super().forward(tokens, targets)
        try:
            size = sum(p.numel() for p in self.blocks.parameters())
        except Exception:  # noqa: BLE001 - the user's own catch-all is the case tested
            size = 1
        return logits, loss * size / 1000


class FrozenMiddle(TinyGPT):
    """A block called under ``torch.no_grad()``: no gradient reaches it or through it."""

    def forward(self, tokens, targets):
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1]))
        x = self.blocks[0](x)
        with torch.no_grad():
            x = self.blocks[1](x)
        for block in self.blocks[2:]:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("make", [Penalized, ReadByName, Counted, FrozenMiddle])
def test_code_reading_held_weights_is_exported_with_them(make, held):
    torch.manual_seed(3)
    compiled_as_torch(make(4), gpt_batch())
    assert held == [], "exported with the weights in place"


class TiedToALayer(TinyGPT):
    """The final LayerNorm's weight is a later block's: exported outside the block, held inside."""

    def __init__(self, layers):
        super().__init__(layers)
        self.ln_f.weight = self.blocks[2].ln1.weight


def test_a_weight_tied_to_a_held_layer_is_one_parameter(held):
    torch.manual_seed(5)
    model = TiedToALayer(4)
    program = compiled_as_torch(model, gpt_batch())
    assert held == [3]
    assert [s.name for s in program.params] == [name for name, _ in model.named_parameters()]


class InABranch(TinyGPT):
    """The blocks called in ``torch.cond``'s branches, which torch's compiler traces: inline."""

    def forward(self, tokens, targets):
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1]))
        x = torch.cond(x.sum() > 0, lambda v: self.blocks(v), lambda v: self.blocks(v * 2), (x,))
        logits = self.head(self.ln_f(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_layers_called_in_a_cond_branch_equal_torch():
    torch.manual_seed(7)
    compiled_as_torch(InABranch(4), gpt_batch())


def test_only_torch_and_the_standard_library_walk_on_behalf_of_the_capture(monkeypatch):
    """Outside a virtual environment, installed packages (a model from a library) live inside
    the standard library's directory: their code is the model's, not the standard library's."""
    stdlib = sysconfig.get_paths()["stdlib"]
    monkeypatch.setattr(layer_weights, "_INSTALLED", (os.path.join(stdlib, "site-packages") + os.sep,))
    assert layer_weights.library_code(os.path.join(stdlib, "copy.py"))
    assert layer_weights.library_code(torch.nn.Module.named_parameters.__code__.co_filename)
    assert not layer_weights.library_code(os.path.join(stdlib, "site-packages", "litgpt", "model.py"))
    assert not layer_weights.library_code(__file__)
