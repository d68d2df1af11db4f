"""The options the runtime compiles with: on XLA:CPU the device-iterations loop of the MLP bench
(bench/device_iterations.py) updates its weights in place, with no copy of a weight in the loop's
body (XLA's default copy insertion copied the output layer's weight at the start of every
iteration)."""

import re

import torch
import torch.nn.functional as F

import ipu_backend as poptorch


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(64, 128)
        self.out = torch.nn.Linear(128, 10)

    def forward(self, x, y):
        logits = self.out(torch.relu(self.hidden(x)))
        return logits, F.cross_entropy(logits, y)


def computation(hlo: str, name: str) -> str:
    """The text of the computation ``name`` in an HLO module's text."""
    start = re.search(rf"^%?{re.escape(name)} .*\{{$", hlo, re.MULTILINE).end()
    return hlo[start:hlo.index("\n}", start)]


def test_device_iterations_loop_updates_weights_without_copying_them():
    torch.manual_seed(0)
    model = Classifier()
    training = poptorch.trainingModel(model, poptorch.Options().deviceIterations(4),
                                      torch.optim.SGD(model.parameters(), lr=0.1))
    training(torch.randn(4 * 32, 64), torch.randint(0, 10, (4 * 32,)))
    hlo = next(iter(training._compiled.values())).executable.as_text()
    bodies = re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo)
    assert bodies
    weight_shapes = {f"f32[{','.join(map(str, p.shape))}]" for p in model.parameters()}
    for body in bodies:
        copied = re.findall(r"= (f32\[[\d,]*\])\{[\d,]*\} copy\(", computation(hlo, body))
        assert not weight_shapes & set(copied), f"loop {body} copies weights shaped {copied}"
