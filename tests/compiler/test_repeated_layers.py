"""Repeated layers compiled as one loop over their stacked weights equal torch eager and the
unrolled program (``loop_repeated_layers=False``): outputs, gradients, weights and buffers after
optimizer steps, per-layer random keys, pipelines, and the structures that fall back to the
unrolled capture. fp32 tolerance: 1e-5 relative, 1e-6 absolute."""

import copy

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ipu_backend as poptorch
from ipu_backend.compiler import compile_module, to_jax
from ipu_backend.compiler.layer_calls import REPEATED_LAYER
from ipu_backend.compiler.layer_loops import layer_loop
from ipu_backend.runtime import executor
from ipu_backend.runtime.multi_ipu import multi_ipu_program
from ipu_backend.runtime.weights import weight_store

RTOL, ATOL = 1e-5, 1e-6


class GPTBlock(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, layers, vocab=11, width=16, context=6):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(GPTBlock(width) for _ in range(layers)))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens, targets):
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1]))
        logits = self.head(self.ln_f(self.blocks(x)))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_batch(batch=2, vocab=11, context=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, context), generator=generator)
    return tokens, torch.roll(tokens, -1, 1)


def count(program, target) -> int:
    return sum(node.target is target for node in program.graph_module.graph.nodes)


def jax_outputs_and_grads(program, module, args, loss_of=lambda outputs: outputs[1], key=0):
    """The program's outputs and the gradients of ``loss_of(outputs)`` w.r.t. the parameters."""
    params, buffers = program.state(module)
    inputs = tuple(to_jax(a) for a in args)

    def loss(p):
        outputs = program.fn(p, buffers, inputs, jax.random.key(key))[0]
        return loss_of(outputs), outputs

    (_, outputs), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return outputs, grads


def assert_close(actual, expected, what=""):
    np.testing.assert_allclose(np.asarray(actual), expected.detach().numpy(), rtol=RTOL, atol=ATOL, err_msg=what)


def assert_grads(grads, module, what=""):
    for name, param in module.named_parameters():
        assert_close(grads[name], param.grad, f"{what} gradient of {name}")


@pytest.mark.parametrize("layers", [4, 24])
def test_gpt_loop_equals_torch_and_the_unrolled_program(layers):
    """24 layers are compared with torch only: compiling them unrolled takes long."""
    torch.manual_seed(0)
    model = TinyGPT(layers)
    args = gpt_batch()
    logits, loss = model(*args)
    loss.backward()
    looped = compile_module(model, args)
    assert count(looped, layer_loop) == 1 and count(looped, REPEATED_LAYER) == 0
    looped_out, looped_grads = jax_outputs_and_grads(looped, model, args)
    programs = [(looped_out, looped_grads, "looped")]
    if layers == 4:
        unrolled = compile_module(model, args, loop_repeated_layers=False)
        assert count(unrolled, layer_loop) == 0
        assert len(looped.graph_module.graph.nodes) < len(unrolled.graph_module.graph.nodes) / 2
        unrolled_out, unrolled_grads = jax_outputs_and_grads(unrolled, model, args)
        programs.append((unrolled_out, unrolled_grads, "unrolled"))
        for name in looped_grads:
            np.testing.assert_allclose(looped_grads[name], unrolled_grads[name], rtol=RTOL, atol=ATOL, err_msg=name)
    for outputs, grads, what in programs:
        assert_close(outputs[0], logits, what)
        assert_close(outputs[1], loss, what)
        assert_grads(grads, model, what)


def torch_steps(model, optimizer, batches):
    losses = []
    for args in batches:
        optimizer.zero_grad()
        loss = model(*args)[1]
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def ipu_steps(model, optimizer, batches, **options):
    executor = poptorch.trainingModel(model, poptorch.Options(**options), optimizer)
    losses = torch.stack([executor(*args)[1] for args in batches])
    return losses, executor


def assert_same_state(model, reference):
    for (name, value), (_, expected) in zip(model.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(value, expected, rtol=RTOL, atol=ATOL, msg=name)


def adamw(params):
    """AdamW with an eps above the noise of gradients that are zero in exact arithmetic (the
    attention's key bias: softmax ignores a constant added to every score), which Adam would
    otherwise scale up to whole learning-rate steps of arbitrary sign, in torch as here."""
    return torch.optim.AdamW(params, lr=0.01, eps=1e-4)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.mark.parametrize("layers,optimizer", [(4, adamw), (24, sgd)])
def test_gpt_training_steps_equal_torch_and_the_unrolled_program(layers, optimizer):
    """24 layers train with SGD: over that depth, float32 rounding differences of gradients near
    zero grow past 1e-6 once Adam divides them by their own root mean square."""
    torch.manual_seed(1)
    model = TinyGPT(layers)
    reference, unrolled = copy.deepcopy(model), copy.deepcopy(model)
    batches = [gpt_batch(seed=s) for s in range(3)]
    expected = torch_steps(reference, optimizer(reference.parameters()), batches)
    losses, executor = ipu_steps(model, optimizer(model.parameters()), batches)
    assert count(executor.last_program, layer_loop) == 1
    assert len(weight_store(model).packing.stacks) == 12        # every block weight travels stacked
    torch.testing.assert_close(losses, expected, rtol=RTOL, atol=ATOL)
    assert_same_state(model, reference)
    if layers == 4:
        unrolled_losses, unrolled_executor = ipu_steps(
            unrolled, optimizer(unrolled.parameters()), batches, loop_repeated_layers=False)
        assert count(unrolled_executor.last_program, layer_loop) == 0
        torch.testing.assert_close(losses, unrolled_losses, rtol=RTOL, atol=ATOL)
        assert_same_state(model, unrolled)
        executor.copyWeightsToHost()
        torch.testing.assert_close(executor._optimizer.state_dict()["state"][3]["exp_avg"],
                                   unrolled_executor._optimizer.state_dict()["state"][3]["exp_avg"],
                                   rtol=RTOL, atol=ATOL)


def test_stacked_optimizer_state_round_trips_through_torch():
    """Two steps, the weights and the optimizer state read back into torch's objects, a new
    executor from them, a third step: as three steps of torch."""
    torch.manual_seed(8)
    model = TinyGPT(3)
    reference = copy.deepcopy(model)
    batches = [gpt_batch(seed=s) for s in range(3)]
    expected = torch_steps(reference, adamw(reference.parameters()), batches)
    optimizer = adamw(model.parameters())
    first = poptorch.trainingModel(model, poptorch.Options(), optimizer)
    for args in batches[:2]:
        first(*args)
    first.copyWeightsToHost()
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    assert state["state"][2]["exp_avg"].shape == model.blocks[0].ln1.weight.shape
    fresh = TinyGPT(3)
    fresh.load_state_dict(weights)
    fresh_optimizer = adamw(fresh.parameters())
    fresh_optimizer.load_state_dict(state)
    loss = poptorch.trainingModel(fresh, poptorch.Options(), fresh_optimizer)(*batches[2])[1]
    torch.testing.assert_close(loss, expected[2], rtol=RTOL, atol=ATOL)
    assert_same_state(fresh, reference)


def test_frozen_layers_and_an_inference_model_of_another_layout_share_the_weights():
    """The blocks' first LayerNorm frozen (outside the optimizer, still stacked), then an
    unrolled inference model of the same module reads the weights the looped one trained."""
    torch.manual_seed(9)
    model = TinyGPT(4)
    for block in model.blocks:
        block.ln1.requires_grad_(False)
    reference = copy.deepcopy(model)
    batches = [gpt_batch(seed=s) for s in range(2)]
    trained = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    expected = torch_steps(reference, sgd(trained(reference)), batches)
    losses, _ = ipu_steps(model, sgd(trained(model)), batches)
    assert {stack.key for stack in weight_store(model).packing.stacks} >= {"blocks.0:4.ln1.weight"}
    torch.testing.assert_close(losses, expected, rtol=RTOL, atol=ATOL)
    inference = poptorch.inferenceModel(model, poptorch.Options().loopRepeatedLayers(False))
    logits = inference(*batches[0])[0]
    assert weight_store(model).packing.stacks == ()
    reference.eval()
    torch.testing.assert_close(logits, reference(*batches[0])[0], rtol=RTOL, atol=ATOL)
    assert_same_state(model, reference)


class Encoder(nn.Module):
    def __init__(self, layers=3, width=16):
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 3)

    def forward(self, x, y):
        out = self.head(self.encoder(x).mean(1))
        return out, F.cross_entropy(out, y)


class ListLoop(nn.Module):
    """An ``nn.ModuleList`` iterated in forward, each layer updating batch-norm statistics."""

    def __init__(self, layers=4, width=6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Tanh())
                                    for _ in range(layers))
        self.head = nn.Linear(width, 3)

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        out = self.head(x)
        return out, F.mse_loss(out, y)


@pytest.mark.parametrize("make", [Encoder, ListLoop], ids=["transformer_encoder", "module_list_batch_norm"])
def test_encoder_and_module_list_loops_train_as_torch(make):
    torch.manual_seed(2)
    model = make()
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(3)
    if make is Encoder:
        batches = [(torch.randn(4, 5, 16, generator=generator), torch.randint(0, 3, (4,), generator=generator))
                   for _ in range(3)]
    else:
        batches = [(torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator))
                   for _ in range(3)]
    expected = torch_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), batches)
    losses, executor = ipu_steps(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), batches)
    assert count(executor.last_program, layer_loop) == 1
    torch.testing.assert_close(losses, expected, rtol=RTOL, atol=ATOL)
    assert_same_state(model, reference)


class Hidden(nn.Module):
    """Returns every layer's output: the loop's intermediate values are read outside it."""

    def __init__(self, layers=5):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(layers))

    def forward(self, x):
        states = []
        for layer in self.layers:
            x = torch.tanh(layer(x))
            states.append(x)
        return torch.stack(states), x.square().sum()


def test_intermediate_outputs_of_a_loop():
    torch.manual_seed(4)
    model = Hidden()
    x = torch.randn(3, 4)
    states, loss = model(x)
    loss.backward()
    program = compile_module(model, (x,))
    outputs, grads = jax_outputs_and_grads(program, model, (x,))
    assert_close(outputs[0], states)
    assert_grads(grads, model)


class Projection(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)


class DropBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return x + self.scale * self.drop(torch.ones_like(x))


def test_each_layer_of_a_loop_draws_its_own_random_numbers():
    model = nn.Sequential(*(DropBlock() for _ in range(6)))
    x = torch.zeros(8, 16)
    program = compile_module(model, (x,))
    assert count(program, layer_loop) == 1
    kept = []
    for key in (0, 0, 1):
        _, grads = jax_outputs_and_grads(program, model, (x,), loss_of=lambda out: out.sum(), key=key)
        # d(sum)/d(scale_k) = 2 × (elements layer k keeps): one dropout mask per layer
        kept.append(np.array([float(grads[f"{k}.scale"]) / 2 for k in range(6)]))
    np.testing.assert_array_equal(kept[0], kept[1])
    assert len(set(kept[0].tolist())) > 1 and not np.array_equal(kept[0], kept[2])
    assert all(0.2 * 128 < n < 0.8 * 128 for n in kept[0])
    model.eval()
    program = compile_module(model, (x,))
    assert_close(program.fn(*program.state(model), (to_jax(x),), jax.random.key(0))[0], model(x))


class Mutating(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2.0)                                 # updates its input in place
        return self.linear(x)


class BlockInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        with poptorch.Block("inner"):
            return self.linear(x)


class Scaled(nn.Module):
    def __init__(self, alpha):
        super().__init__()
        self.alpha = alpha
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.alpha * self.linear(x)


def hooked():
    layers = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4)) for _ in range(3)))
    for layer in layers:
        layer[0].register_forward_hook(lambda module, args, output: output * 2)
    return layers


@pytest.mark.parametrize("make", [
    lambda: nn.Sequential(nn.Linear(4, 4), *(Mutating() for _ in range(3))),
    lambda: nn.Sequential(*(Scaled(alpha) for alpha in (1.0, 2.0, 3.0))),
    hooked,
], ids=["input_updated_in_place", "attributes_differ", "hook_inside"])
def test_structures_that_cannot_loop_are_captured_inline(make):
    torch.manual_seed(5)
    model = make()
    x = torch.randn(3, 4)
    expected = model(x.clone())
    expected.sum().backward()
    program = compile_module(model, (x,))
    assert count(program, layer_loop) == 0 and count(program, REPEATED_LAYER) == 0
    outputs, grads = jax_outputs_and_grads(program, model, (x,), loss_of=lambda out: out.sum())
    assert_close(outputs, expected)
    assert_grads(grads, model)


def test_a_layer_opening_a_block_is_captured_inline():
    model = nn.Sequential(*(BlockInside() for _ in range(3)))
    program = compile_module(model, (torch.randn(3, 4),))
    assert count(program, REPEATED_LAYER) == 0
    assert sum(node.meta.get("custom", {}).get("ipu_block") == ("inner", None)
               for node in program.graph_module.graph.nodes) >= 3


def test_layers_with_operations_between_them_are_called_one_by_one():
    torch.manual_seed(6)
    model = nn.ModuleList(Projection() for _ in range(3))

    class Between(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = model

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    outer = Between()
    x = torch.randn(3, 4)
    expected = outer(x)
    expected.sum().backward()
    program = compile_module(outer, (x,))
    assert count(program, REPEATED_LAYER) == 3 and count(program, layer_loop) == 0
    outputs, grads = jax_outputs_and_grads(program, outer, (x,), loss_of=lambda out: out.sum())
    assert_close(outputs, expected)
    assert_grads(grads, outer)


class Checkpointed(GPTBlock):
    def forward(self, x):
        return poptorch.recomputationCheckpoint(super().forward(x))


class PipelinedGPT(TinyGPT):
    """Blocks 0-1 on IPU 0 and 2-3 on IPU 1: the run of blocks crosses the stage boundary."""

    def __init__(self, checkpoint=False):
        super().__init__(4)
        if checkpoint:
            self.blocks = nn.Sequential(*(Checkpointed() for _ in range(4)))
        poptorch.BeginBlock(self.blocks[0], "B0", ipu_id=0)
        poptorch.BeginBlock(self.blocks[2], "B1", ipu_id=1)


@pytest.mark.parametrize("recompute", [0, 3], ids=["stashed", "recomputed"])
def test_a_run_split_over_pipeline_stages_loops_within_each(recompute):
    torch.manual_seed(7)
    model = PipelinedGPT(checkpoint=bool(recompute))
    reference = copy.deepcopy(model)
    batches = [gpt_batch(batch=6, seed=s) for s in range(2)]
    expected = []
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for tokens, targets in batches:
        optimizer.zero_grad()
        for micro in range(3):
            loss = reference(tokens[2 * micro:2 * micro + 2], targets[2 * micro:2 * micro + 2])[1]
            (loss / 3).backward()
            expected.append(loss.detach())
        optimizer.step()
    opts = poptorch.Options().outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(3)
    if recompute:
        opts._Popart.set("autoRecomputation", recompute)
    executor = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    losses = torch.cat([executor(*batch)[1].flatten() for batch in batches])
    program = multi_ipu_program(executor)
    assert [sum(node.target is layer_loop for node in stage.nodes) for stage in program.part.stages] == [1, 1]
    torch.testing.assert_close(losses, torch.stack(expected), rtol=RTOL, atol=ATOL)
    assert_same_state(model, reference)


def test_a_first_call_takes_the_weights_stacked_from_the_host(monkeypatch):
    """A new executor stacks a loop's weights on the host as its program takes them: no device
    conversion (a small compiled program of its own) before the first call."""
    from ipu_backend.runtime import packing
    conversions = []
    convert = packing._convert
    monkeypatch.setattr(packing, "_convert", lambda *args: conversions.append(args) or convert(*args))
    torch.manual_seed(0)
    net = TinyGPT(3)
    reference = copy.deepcopy(net)
    model = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    tokens, targets = gpt_batch()
    model(tokens, targets)
    assert conversions == []
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(tokens, targets)[1].backward()
    optimizer.step()
    model.copyWeightsToHost()
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=name)


class ScaledBlock(GPTBlock):
    """A block whose output is scaled by a plain attribute its forward reads."""

    def __init__(self):
        super().__init__()
        self.scale = 1.0

    def forward(self, x):
        return super().forward(x) * self.scale


def test_a_later_layers_attribute_changed_after_compiling_is_computed_with():
    """The loop is captured from the first block: a later block's attribute is a guard too."""
    torch.manual_seed(4)
    net = TinyGPT(4)
    net.blocks = nn.Sequential(*(ScaledBlock() for _ in range(4)))
    reference = copy.deepcopy(net)
    model = poptorch.inferenceModel(net)
    args = gpt_batch()
    torch.testing.assert_close(model(*args)[1], reference(*args)[1], rtol=RTOL, atol=ATOL)
    for layer in (2, 0):
        net.blocks[layer].scale = reference.blocks[layer].scale = 0.5 + layer
        torch.testing.assert_close(model(*args)[1], reference(*args)[1], rtol=RTOL, atol=ATOL)


class IndexedBlock(GPTBlock):
    """A block that keeps its index, as Hugging Face's and litgpt's blocks do; its forward reads
    it when ``reads``."""

    def __init__(self, index, reads):
        super().__init__()
        self.index, self.reads = index, reads

    def forward(self, x):
        y = super().forward(x)
        return y * (1 + self.index / 10) if self.reads else y


@pytest.mark.parametrize("reads", [False, True], ids=["unread", "read"])
def test_layers_differing_in_an_index_loop_unless_their_forward_reads_it(reads, monkeypatch):
    torch.manual_seed(6)
    net = TinyGPT(4)
    net.blocks = nn.Sequential(*(IndexedBlock(index, reads) for index in range(4)))
    args = gpt_batch()
    logits, loss = net(*args)
    loss.backward()
    program = compile_module(net, args)
    assert count(program, layer_loop) == (0 if reads else 1)
    outputs, grads = jax_outputs_and_grads(program, net, args)
    assert_close(outputs[0], logits)
    assert_close(outputs[1], loss)
    assert_grads(grads, net)
    captures = []
    monkeypatch.setattr(executor, "compile_module", lambda *a, **k: captures.append(a) or compile_module(*a, **k))
    inference = poptorch.inferenceModel(net)
    for _ in range(3):
        torch.testing.assert_close(inference(*args)[1], net(*args)[1], rtol=RTOL, atol=ATOL)
    assert len(captures) == 1, "the guards hold"
