"""Compile time: how long a training model's first call compiles, by phase, cold and warm.

Models: the seed CNN (batch 40, AdamW) and a GPT-style decoder (token embedding 512×256,
positions T=128, blocks of LayerNorm → qkv Linear → ``scaled_dot_product_attention(is_causal=True)``
→ proj, LayerNorm → 4× MLP with GELU; AdamW; batch 2) with 4 and 24 blocks. Each is a
``trainingModel`` with deviceIterations=1, compiled by ``model.compile(x, y)``.

Every measurement runs in a fresh process: *cold* with an empty executable cache
(``Options.enableExecutableCaching(<temp dir>)``, the persistent executable cache), *warm* in a
second process on the same directory. The GPT's blocks compile as one loop by default
(``Options.loopRepeatedLayers``); ``unrolled`` runs turn that off. Phases come from
``jax.monitoring`` events: the compiler's capture (torch.export and decomposition), JAX's tracing
(which runs the lowerings), MLIR lowering and XLA compilation (time spans merged, so nested
events count once); ``other`` is the rest of the call (executor set-up). ``compilations`` counts
XLA compilations, the program's and the small ones around it. CPU seconds are the process's
user + system time over the call (``cpu s``), and of the whole process with its own child
processes, imports included (``proc cpu``).

torch.compile (inductor) is timed on the same models: its first training step (forward,
backward, optimizer step) less a steady step, cold (empty ``TORCHINDUCTOR_CACHE_DIR``) and warm.

Writes bench/results/compile_time.json and prints a table. Run by hand:
``python bench/compile_time.py [--only seed_cnn,gpt4,gpt24] [--no-torch-compile]``;
``--profile`` instead profiles the 4-block GPT's first call (cProfile, top functions printed,
the profile written next to the results); ``--profile --warm`` profiles it in a second process,
after a first one filled a fresh executable cache (the warm start), and ``--only`` picks the model.
"""

import argparse
import cProfile
import json
import os
import pathlib
import pstats
import resource
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from seed_cnn import SeedCNNWithLoss  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "compile_time.json"
PROFILE = RESULTS.with_name("compile_time_gpt4.prof")
VOCAB, WIDTH, CONTEXT, HEADS, BATCH = 512, 256, 128, 4, 2
MODELS = {"seed_cnn": None, "gpt4": 4, "gpt24": 24}


class GPTBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, blocks: int, vocab=VOCAB, width=WIDTH, context=CONTEXT, heads=HEADS):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[GPTBlock(width, heads) for _ in range(blocks)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens, targets):
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1]))
        logits = self.head(self.ln_f(self.blocks(x)))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def model_and_inputs(name: str):
    torch.manual_seed(0)
    if name == "seed_cnn":
        return SeedCNNWithLoss(), (torch.randn(40, 1, 28, 28), torch.randint(0, 10, (40,)))
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT))
    return GPT(MODELS[name]), (tokens, torch.roll(tokens, -1, 1))


# --- one measurement, in a process of its own -------------------------------------------------
class PhaseSpans:
    """Time spans of the compile phases, recorded through ``jax.monitoring``."""

    def __init__(self):
        import jax.monitoring

        from ipu_backend.compiler.program import CAPTURE_EVENT
        self.names = {CAPTURE_EVENT: "capture", "/jax/core/compile/jaxpr_trace_duration": "tracing",
                      "/jax/core/compile/jaxpr_to_mlir_module_duration": "mlir",
                      "/jax/core/compile/backend_compile_duration": "xla"}
        self.spans = {name: [] for name in self.names.values()}
        jax.monitoring.register_event_time_span_listener(self._record)

    def _record(self, event, start, end, **kwargs):
        if event in self.names:
            self.spans[self.names[event]].append((start, end))

    def seconds(self) -> dict:
        """Seconds per phase, overlapping spans (nested traces) counted once."""
        return {name: _union(spans) for name, spans in self.spans.items()}


def _union(spans) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_ipu(name: str, cache_dir: str, loop: bool) -> dict:
    import ipu_backend as poptorch
    spans = PhaseSpans()
    model, inputs = model_and_inputs(name)
    options = poptorch.Options().enableExecutableCaching(cache_dir).loopRepeatedLayers(loop)
    executor = poptorch.trainingModel(model, options, optimizer=poptorch.optim.AdamW(model.parameters(), lr=1e-3))
    start, cpu = time.perf_counter(), _cpu_seconds()
    executor.compile(*inputs)
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    start = time.perf_counter()
    executor(*inputs)
    first_run = time.perf_counter() - start
    phases = spans.seconds()
    phases["other"] = max(0.0, seconds - sum(phases.values()))
    return {"seconds": seconds, "cpu_seconds": cpu, "phases": phases,
            "compilations": len(spans.spans["xla"]), "first_run_seconds": first_run}


def measure_torch_compile(name: str) -> dict:
    """On the GPU where torch has one, as the executor's program runs on JAX's default backend."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, inputs = model_and_inputs(name)
    model, inputs = model.to(device), tuple(tensor.to(device) for tensor in inputs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model)

    def step():
        optimizer.zero_grad()
        compiled(*inputs)[1].backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()

    start, cpu = time.perf_counter(), _cpu_seconds()
    step()
    first, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    steady = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        steady.append(time.perf_counter() - start)
    return {"seconds": first - min(steady), "cpu_seconds": cpu, "first_step_seconds": first,
            "steady_step_seconds": min(steady)}


def child(spec: dict) -> dict:
    if spec["kind"] == "torch_compile":
        return measure_torch_compile(spec["model"])
    return measure_ipu(spec["model"], spec["cache_dir"], spec["loop"])


# --- the parent: processes in turn, a table ---------------------------------------------------
def run_child(spec: dict, env: dict | None = None) -> dict:
    """One measurement in a new process, with the CPU seconds of the whole process and of the
    processes it started (inductor compiles in worker processes), imports included."""
    command = [sys.executable, __file__, "--child", json.dumps(spec)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})},
                            check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    measured["process_cpu_seconds"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return measured


def cold_and_warm(spec: dict, env_of_dir=None) -> dict:
    """The same measurement in two processes sharing a fresh cache directory."""
    with tempfile.TemporaryDirectory(prefix="compile_time_") as cache_dir:
        spec = {**spec, "cache_dir": cache_dir}
        env = env_of_dir(cache_dir) if env_of_dir else None
        return {"cold": run_child(spec, env), "warm": run_child(spec, env)}


def table(results: dict) -> str:
    head = (f"{'model':9s} {'variant':14s} {'cache':5s} {'wall s':>7s} {'cpu s':>7s} {'proc cpu':>8s} "
            f"{'capture':>8s} "
            f"{'tracing':>8s} {'mlir':>6s} {'xla':>7s} {'other':>6s} {'#xla':>5s}")
    lines = [head, "-" * len(head)]
    for model, variants in results["models"].items():
        for variant, runs in variants.items():
            for cache, run in runs.items():
                if "error" in run:
                    lines.append(f"{model:9s} {variant:14s} {cache:5s} error: {run['error']}")
                    continue
                phases = run.get("phases", {})
                cells = " ".join(f"{phases[p]:{w}.2f}" if p in phases else " " * w
                                 for p, w in (("capture", 8), ("tracing", 8), ("mlir", 6), ("xla", 7),
                                              ("other", 6)))
                count = f"{run['compilations']:5d}" if "compilations" in run else ""
                lines.append(f"{model:9s} {variant:14s} {cache:5s} {run['seconds']:7.2f} "
                             f"{run['cpu_seconds']:7.2f} {run['process_cpu_seconds']:8.2f} {cells} {count}")
    return "\n".join(lines)


def profile(name: str, warm: bool) -> None:
    """cProfile of ``name``'s first call in this process, on a fresh executable cache or, ``warm``,
    on one a first process filled."""
    with tempfile.TemporaryDirectory(prefix="compile_time_") as cache_dir:
        if warm:
            cold = run_child({"kind": "ipu", "model": name, "loop": True, "cache_dir": cache_dir})
            if "error" in cold:
                raise SystemExit(f"the cold run failed: {cold['error']}")
        import ipu_backend as poptorch
        model, inputs = model_and_inputs(name)
        options = poptorch.Options().enableExecutableCaching(cache_dir)
        executor = poptorch.trainingModel(model, options, optimizer=poptorch.optim.AdamW(model.parameters(), lr=1e-3))
        profiler = cProfile.Profile()
        profiler.runcall(executor.compile, *inputs)
    path = PROFILE.with_name(f"compile_time_{name}{'_warm' if warm else ''}.prof")
    RESULTS.parent.mkdir(exist_ok=True)
    profiler.dump_stats(path)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--only", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--no-torch-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--no-unrolled", action="store_true", help="skip the GPTs with their blocks unrolled")
    parser.add_argument("--profile", action="store_true", help="cProfile one model's first call (--only, gpt4 if "
                        "not given)")
    parser.add_argument("--warm", action="store_true", help="with --profile: in a second process, on a warm cache")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.profile:
        profile("gpt4" if args.only == ",".join(MODELS) else args.only, args.warm)
        return
    results = {"models": {}}
    for name in args.only.split(","):
        variants = {"default": cold_and_warm({"kind": "ipu", "model": name, "loop": True})}
        if name != "seed_cnn" and not args.no_unrolled:
            variants["unrolled"] = cold_and_warm({"kind": "ipu", "model": name, "loop": False})
        if not args.no_torch_compile:
            variants["torch.compile"] = cold_and_warm(
                {"kind": "torch_compile", "model": name},
                lambda cache_dir: {"TORCHINDUCTOR_CACHE_DIR": cache_dir})
        results["models"][name] = variants
        print(table({"models": {name: variants}}).split("\n", 2)[-1], flush=True)
    gpt = results["models"]
    if "gpt4" in gpt and "gpt24" in gpt:
        results["gpt24_over_gpt4"] = gpt["gpt24"]["default"]["cold"].get("seconds", 0) / max(
            1e-9, gpt["gpt4"]["default"]["cold"].get("seconds", 0))
    import jax
    results["environment"] = {"jax": jax.__version__, "torch": torch.__version__, "cpus": os.cpu_count(),
                              "jax_device": jax.devices()[0].device_kind,
                              "load_average_1_5_15_min": os.getloadavg()}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(table(results))
    if "gpt24_over_gpt4" in results:
        print(f"24 blocks / 4 blocks (cold, default): {results['gpt24_over_gpt4']:.2f}x")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
