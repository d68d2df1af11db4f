"""Pipeline overhead: a pipelined (and a sharded) training step against the fused single-IPU step
of the same model, in one run.

Model: two blocks of 4 × (Linear(1024, 1024) + tanh), MSE loss, SGD; 8 micro-batches of 16 per
step (gradientAccumulation 8). The fused step puts both blocks on IPU 0 (one stage: the
single-IPU step program, a ``lax.scan`` over micro-batches); the pipelined step runs each block on
its own emulated IPU with Graphcore's schedule.

On CPU the emulated devices share one XLA thread pool, so two IPUs cannot beat one: the target
is overhead — a pipelined step costs ≤ 15 % more than the fused step. Steps alternate between
the variants and the median of each is kept, so machine load affects them alike. Also reported:
the stash per micro-batch of stage 0 (activations only: the weights and their transposes are
recomputed, not stashed). Writes bench/results/pipeline_overhead.json. Run by hand:
`make bench`.
"""

import json
import pathlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import ipu_backend as poptorch
from ipu_backend.runtime.multi_ipu import multi_ipu_program

RESULTS = pathlib.Path(__file__).parent / "results" / "pipeline_overhead.json"
WIDTH, LAYERS, MICRO, ACCUMULATION, STEPS = 1024, 4, 16, 8, 12
TARGET = 1.15


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.second = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x, y):
        with poptorch.Block("B1", ipu_id=0):
            for layer in self.first:
                x = torch.tanh(layer(x))
        with poptorch.Block("B2", ipu_id=1):
            for layer in self.second:
                x = torch.tanh(layer(x))
            loss = F.mse_loss(x, y)
        return x, loss


def training_model(strategy):
    torch.manual_seed(0)
    model = TwoBlocks()
    opts = poptorch.Options().setExecutionStrategy(strategy)
    opts.Training.gradientAccumulation(ACCUMULATION)
    return poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=1e-3))


def main():
    x = torch.randn(ACCUMULATION * MICRO, WIDTH)
    y = torch.randn(ACCUMULATION * MICRO, WIDTH)
    variants = {
        "fused": training_model(poptorch.PipelinedExecution(poptorch.Stage("B1", "B2").ipu(0))),
        "pipelined": training_model(poptorch.PipelinedExecution("B1", "B2")),
        "sharded": training_model(poptorch.ShardedExecution("B1", "B2")),
    }
    times = {name: [] for name in variants}
    for model in variants.values():
        model(x, y)                                 # compile and warm up
    for _ in range(STEPS):
        for name, model in variants.items():
            start = time.perf_counter()
            model(x, y)                             # returns host tensors: the step has finished
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    stash = multi_ipu_program(variants["pipelined"]).memory[0].stash
    results = {
        "model": f"2 blocks × {LAYERS} × Linear({WIDTH}) + tanh, SGD",
        "micro_batch": MICRO, "micro_batches_per_step": ACCUMULATION, "steps_timed": STEPS,
        "median_step_ms": {name: round(1e3 * t, 2) for name, t in median.items()},
        "pipelined_over_fused": round(median["pipelined"] / median["fused"], 3),
        "sharded_over_fused": round(median["sharded"] / median["fused"], 3),
        "target_pipelined_over_fused": TARGET,
        "stage0_stash_bytes_per_micro_batch": stash // (2 * 2 - 1),
        "stage0_weight_bytes": LAYERS * (WIDTH * WIDTH + WIDTH) * 4,
    }
    print(json.dumps(results, indent=2))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
