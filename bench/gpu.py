"""GPU benchmark: trainingModel against torch eager and torch.compile on one NVIDIA GPU, with the
same float32 precision settings, and the weights each reaches checked against torch CUDA's.

Workloads (AdamW, lr 1e-3, random data):
- ``cnn``: the seed CNN (examples/seed_cnn.py), batch 40; images/s.
- ``gpt_small``: a 4-block GPT, d=256, 4 heads, T=128, vocabulary 8192, batch 16; sequences/s.
- ``gpt_mid``: a 6-block GPT, d=768, 12 heads, T=256, vocabulary 8192, batch 8; sequences/s.
The GPTs run with the emulated IPU's memory check off (they outgrow a Mk2 IPU).
Each GPT block is pre-LayerNorm causal self-attention (``F.scaled_dot_product_attention``) and a
4x GELU MLP; the loss is the cross-entropy over the vocabulary.

Settings: ``fp32`` (``torch.backends.cuda.matmul.allow_tf32`` and
``torch.backends.cudnn.allow_tf32`` False), ``tf32`` (both True), ``bf16`` (the model's weights
and activations in bfloat16). trainingModel reads the settings when it captures
the model, so both libraries run with the same ones.

Paths: torch eager (data already on the GPU); torch.compile of the model (in a child process
with its own time limit: recorded as skipped when it runs past it); trainingModel at
deviceIterations 10 and 100 (data fed from host tensors, as a DataLoader would); 4 replicas
folded on the GPU and a 2-stage BeginBlock pipeline (gradientAccumulation 4) on it; for
bfloat16, also with attention decomposed rather than cuDNN's flash attention; for the seed CNN,
also with its convolutions' algorithms timed by XLA (``torch.backends.cudnn.benchmark`` set for
that model alone; torch eager and the reference keep cuDNN's heuristic choice). The first
trainingModel call (capture and compilation) is timed apart. Fidelity: from the same initial
weights and batches, the weights after 20 steps (2 calls of deviceIterations 10) against torch
eager's with the same setting, as the relative error ``|w - w_torch| / |w_torch|`` over all the
weights (and, in the JSON, the tensor where it is largest).

Every measurement has a place in a plan run in order of importance; one starts only while the
time budget (``--budget``) leaves its reserve, else it is recorded as skipped. Results are
written to ``--out`` (JSON) after each measurement, so a run cut short keeps what it measured,
and printed as a table at the end.

    PYTHONPATH=. python3 bench/gpu.py --out gpu.json            # on the GPU machine
    PYTHONPATH=. python3 bench/gpu.py --smoke --out /tmp/g.json  # tiny, on the CPU: checks it runs
"""

import os

# Set before JAX starts: torch and JAX share the GPU, so JAX allocates as it goes.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from seed_cnn import SeedCNNWithLoss  # noqa: E402

LEARNING_RATE = 1e-3
FIDELITY_CALLS = 2            # calls of deviceIterations 10: 20 steps
TIMED_SECONDS = 1.5           # how long each rate is measured for (--smoke: a tenth)
SMOKE_RESERVE_SCALE = 0.1     # --smoke: tiny models need a tenth of each task's reserve


# ---------------------------------------------------------------------------------------------
# Workloads


class CausalBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        batch, length, dim = x.shape
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(dim, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, length, dim))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Returns the mean cross-entropy of the next-token logits against ``targets``."""

    def __init__(self, vocabulary: int, length: int, dim: int, heads: int, layers: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocabulary, dim), nn.Embedding(length, dim)
        self.blocks = nn.Sequential(*(CausalBlock(dim, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocabulary, bias=False)

    def forward(self, tokens, targets):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        logits = self.head(self.ln(self.blocks(self.tokens(tokens) + self.positions(positions))))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    unit: str
    config: dict = field(default_factory=dict)
    memory_check: str = "error"

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return SeedCNNWithLoss() if self.name == "cnn" else GPT(**self.config)

    def batches(self, count: int, seed: int) -> list[tuple]:
        generator = torch.Generator().manual_seed(seed)
        if self.name == "cnn":
            return [(torch.randn(self.batch, 1, 28, 28, generator=generator),
                     torch.randint(0, 10, (self.batch,), generator=generator)) for _ in range(count)]
        vocabulary, length = self.config["vocabulary"], self.config["length"]
        return [tuple(torch.randint(0, vocabulary, (self.batch, length), generator=generator)
                      for _ in range(2)) for _ in range(count)]


def workloads(smoke: bool) -> dict[str, Workload]:
    if smoke:
        tiny = dict(vocabulary=64, length=16, dim=32, heads=2, layers=1)
        return {"cnn": Workload("cnn", 8, "img/s"),
                "gpt_small": Workload("gpt_small", 4, "seq/s", tiny),
                "gpt_mid": Workload("gpt_mid", 4, "seq/s", tiny, memory_check="off")}
    return {"cnn": Workload("cnn", 40, "img/s"),
            "gpt_small": Workload("gpt_small", 16, "seq/s",
                                  dict(vocabulary=8192, length=128, dim=256, heads=4, layers=4),
                                  memory_check="off"),
            "gpt_mid": Workload("gpt_mid", 8, "seq/s",
                                dict(vocabulary=8192, length=256, dim=768, heads=12, layers=6),
                                memory_check="off")}


def apply_setting(setting: str) -> None:
    """torch's float32 precision switches for ``setting`` (bf16 computes in float32 nowhere).
    The legacy switches: torch.export reads cuDNN's legacy flag, which torch refuses to answer
    once the new switches set its convolutions apart from its RNNs."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = setting == "tf32"


def prepared(model: nn.Module, setting: str) -> nn.Module:
    return model.to(torch.bfloat16) if setting == "bf16" else model


def loss_of(result):
    return result[1] if isinstance(result, tuple) else result


# ---------------------------------------------------------------------------------------------
# Measurements


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def torch_steps(model, optimizer, batches) -> None:
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss_of(model(*batch)).backward()
        optimizer.step()


def timed_rate(run, per_run: int, device: str, seconds: float) -> float:
    """Samples per second of ``run()`` (``per_run`` samples each), after one untimed run,
    repeated for about ``seconds``."""
    run()
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    once = time.perf_counter() - start
    repeats = max(2, min(200, int(seconds / max(once, 1e-6))))
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    synchronize(device)
    return repeats * per_run / (time.perf_counter() - start)


def relative_errors(weights: dict, reference: dict) -> dict:
    """``|w - w_ref| / |w_ref|`` over all the weights together (float64 norms), and the tensor
    where it is largest. A weight whose gradient is zero but for rounding (the key projection's
    bias: softmax ignores a shift of the scores) moves by AdamW's full step either way, so the
    largest is no measure of the arithmetic; the overall one is."""
    squares, total, worst = 0.0, 0.0, (0.0, "")
    for name, ref in reference.items():
        ref = ref.detach().double().cpu()
        diff = float((weights[name].detach().double().cpu() - ref).norm())
        norm = float(ref.norm())
        squares, total = squares + diff ** 2, total + norm ** 2
        worst = max(worst, (diff / max(norm, 1e-30), name))
    return {"fidelity_rel": (squares / max(total, 1e-60)) ** 0.5,
            "fidelity_worst_tensor": {"name": worst[1], "rel": worst[0]}}


def torch_reference(work: Workload, setting: str, device: str, batches) -> dict:
    """torch eager's weights after ``batches`` from the initial weights."""
    model = prepared(work.model(), setting).to(device)
    torch_steps(model, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE),
                [tuple(t.to(device) for t in b) for b in batches])
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


def torch_eager(work: Workload, setting: str, device: str, seconds: float) -> dict:
    model = prepared(work.model(), setting).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    batches = [tuple(t.to(device) for t in b) for b in work.batches(4, seed=1)]
    rate = timed_rate(lambda: torch_steps(model, optimizer, batches), len(batches) * work.batch,
                      device, seconds)
    return {"rate": rate}


def combined(batches) -> tuple:
    """PopTorch's combined batch: the steps' batches one after another along dim 0."""
    return tuple(torch.cat(parts) for parts in zip(*batches))


def training_model(work: Workload, setting: str, iterations: int, variant: str, device: str,
                   seconds: float) -> dict:
    """trainingModel at ``iterations`` device iterations (``variant``: "single", "replicas4",
    "pipeline2", "decomposed", attention decomposed rather than kept whole, or "tuned", its
    convolutions compiled under ``torch.backends.cudnn.benchmark``): the first call, the rate
    and, at 10 iterations, the weights after 20 steps against torch eager's."""
    import ipu_backend as poptorch
    from ipu_backend.compiler.lowering_options import lowering_options

    model = prepared(work.model(), setting)
    opts = poptorch.Options().deviceIterations(iterations).setMemoryCheck(work.memory_check)
    if variant == "replicas4":
        opts.replicationFactor(4)
    if variant == "pipeline2":
        opts.Training.gradientAccumulation(4)
        # The second half of the model, its loss included, on the second IPU.
        second = model.fc1 if work.name == "cnn" else model.blocks[len(model.blocks) // 2]
        poptorch.BeginBlock(second, ipu_id=1)
    result = {}
    fidelity = iterations == 10
    steps = iterations * (FIDELITY_CALLS if fidelity else 1)
    batches = work.batches(steps, seed=2)
    reference = torch_reference(work, setting, device, batches) if fidelity else None
    trained = poptorch.trainingModel(model, opts, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))
    # the capture, at the first call, reads the attention choice
    benchmark = torch.backends.cudnn.benchmark
    with lowering_options(attention="decomposed" if variant == "decomposed" else "auto"):
        try:
            torch.backends.cudnn.benchmark = variant == "tuned"
            calls = [combined(batches[i:i + iterations]) for i in range(0, steps, iterations)]
            start = time.perf_counter()
            trained(*calls[0])
            result["first_call_s"] = time.perf_counter() - start
            for call in calls[1:]:
                trained(*call)
            if fidelity:
                trained.copyWeightsToHost()
                result.update(relative_errors(dict(model.named_parameters()), reference))
            timing = [combined(work.batches(iterations, seed=3 + i)) for i in range(2)]
            index = iter(range(10**9))
            result["rate"] = timed_rate(lambda: trained(*timing[next(index) % 2]),
                                        iterations * work.batch, "cpu", seconds)
        finally:
            torch.backends.cudnn.benchmark = benchmark
            trained.destroy()
    return result


COMPILE_CHILD = "--compile-child"


def torch_compile(work_name: str, setting: str, smoke: bool, limit: float) -> dict:
    """torch.compile's rate, measured in a child process killed after ``limit`` seconds (its
    compilation included)."""
    command = [sys.executable, __file__, COMPILE_CHILD, work_name, setting] + (["--smoke"] if smoke else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"status": "skipped", "note": f"torch.compile ran past its {limit:.0f} s budget"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"torch.compile child failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1])


def compile_child(work_name: str, setting: str, smoke: bool) -> None:
    work = workloads(smoke)[work_name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    apply_setting(setting)
    model = prepared(work.model(), setting).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    compiled = torch.compile(model)
    batches = [tuple(t.to(device) for t in b) for b in work.batches(4, seed=1)]
    start = time.perf_counter()
    torch_steps(compiled, optimizer, batches[:1])
    synchronize(device)
    first = time.perf_counter() - start
    rate = timed_rate(lambda: torch_steps(compiled, optimizer, batches), len(batches) * work.batch,
                      device, timed_seconds(smoke))
    print(json.dumps({"rate": rate, "first_call_s": first}))


# ---------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class Task:
    work: str
    setting: str
    path: str                 # "torch eager" | "torch.compile" | "trainingModel D=10" | ...
    reserve: float            # seconds it is expected to need at most (compilation included)


def plan() -> list[Task]:
    """The measurements in order of importance."""
    tasks = []

    def add(work, setting, path, reserve):
        tasks.append(Task(work, setting, path, reserve))

    add("gpt_mid", "tf32", "torch eager", 10)
    add("gpt_mid", "tf32", "trainingModel D=10", 60)
    add("gpt_mid", "bf16", "torch eager", 10)
    add("gpt_mid", "bf16", "trainingModel D=10", 60)
    add("gpt_mid", "bf16", "trainingModel D=10 attention decomposed", 60)
    add("cnn", "fp32", "torch eager", 5)
    add("cnn", "fp32", "trainingModel D=10", 25)
    add("cnn", "fp32", "trainingModel D=100", 25)
    add("cnn", "fp32", "trainingModel D=10 2-stage pipeline", 40)
    add("cnn", "fp32", "trainingModel D=10 4 replicas", 25)
    add("cnn", "fp32", "trainingModel D=10 convolutions tuned", 25)
    add("gpt_mid", "fp32", "torch eager", 10)
    add("gpt_mid", "fp32", "trainingModel D=10", 60)
    add("gpt_mid", "tf32", "torch.compile", 90)
    add("gpt_mid", "tf32", "trainingModel D=100", 60)
    add("cnn", "tf32", "torch eager", 5)
    add("cnn", "tf32", "trainingModel D=100", 25)
    for setting in ("tf32", "fp32"):
        add("gpt_small", setting, "torch eager", 5)
        add("gpt_small", setting, "trainingModel D=10", 40)
    add("cnn", "fp32", "torch.compile", 60)
    add("gpt_small", "tf32", "torch.compile", 60)
    add("gpt_small", "tf32", "trainingModel D=100", 40)
    add("gpt_small", "tf32", "trainingModel D=10 2-stage pipeline", 60)
    return tasks


VARIANTS = {"": "single", "4 replicas": "replicas4", "2-stage pipeline": "pipeline2",
            "attention decomposed": "decomposed", "convolutions tuned": "tuned"}


def timed_seconds(smoke: bool) -> float:
    return TIMED_SECONDS * (SMOKE_RESERVE_SCALE if smoke else 1)


def run_task(task: Task, work: Workload, device: str, smoke: bool, limit: float) -> dict:
    """``task``'s measurement; ``limit``: the seconds torch.compile's child process may take."""
    apply_setting(task.setting)
    if task.path == "torch eager":
        return torch_eager(work, task.setting, device, timed_seconds(smoke))
    if task.path == "torch.compile":
        return torch_compile(task.work, task.setting, smoke, limit)
    _, iterations, *rest = task.path.split(" ", 2)
    return training_model(work, task.setting, int(iterations[2:]), VARIANTS[rest[0] if rest else ""],
                          device, timed_seconds(smoke))


def environment(device: str) -> dict:
    import jax

    return {"python": platform.python_version(), "torch": torch.__version__, "jax": jax.__version__,
            "jax_backend": jax.default_backend(),
            "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "jax_devices": [str(d) for d in jax.devices()],
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")}


def table(rows: list[dict]) -> str:
    eager = {(r["work"], r["setting"]): r.get("rate") for r in rows if r["path"] == "torch eager"}
    lines = [f"{'workload':10} {'setting':7} {'path':38} {'rate':>11} {'unit':6} {'vs eager':>8} "
             f"{'1st call':>8} {'fidelity':>9}  status"]
    for r in rows:
        rate, base = r.get("rate"), eager.get((r["work"], r["setting"]))
        ratio = f"{rate / base:8.2f}" if rate and base else f"{'':8}"
        first = f"{r['first_call_s']:7.1f}s" if "first_call_s" in r else f"{'':8}"
        fidelity = f"{r['fidelity_rel']:9.1e}" if "fidelity_rel" in r else f"{'':9}"
        status = r["status"] + (f": {r['note']}" if r.get("note") else "")
        shown = f"{rate:11.1f}" if rate else " " * 11
        lines.append(f"{r['work']:10} {r['setting']:7} {r['path']:38} {shown} {r['unit']:6} {ratio} "
                     f"{first} {fidelity}  {status[:150]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the results (JSON)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole plan (default 400; 300 with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU: check it runs")
    parser.add_argument("--only", default="", help="run the tasks whose 'workload setting path' "
                        "contains this text")
    args = parser.parse_args()
    started = time.perf_counter()
    budget = args.budget or (300.0 if args.smoke else 400.0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        sys.exit("no CUDA device: run with --smoke to check the benchmark on the CPU")
    if args.smoke:
        # one JAX device, as on one GPU: replicas fold and pipeline stages share it
        os.environ.setdefault("IPU_BACKEND_CPU_DEVICES", "1")
        torch.set_num_threads(1)    # torch's spinning workers would take the cores JAX needs
    works = workloads(args.smoke)
    results = {"smoke": args.smoke, "budget_s": budget, "environment": environment(device),
               "workloads": {k: {"batch": w.batch, "unit": w.unit, **w.config} for k, w in works.items()},
               "rows": []}
    out = pathlib.Path(args.out)
    print(json.dumps(results["environment"]), flush=True)
    if device == "cuda" and results["environment"]["jax_backend"] != "gpu":
        print("WARNING: torch sees a GPU but JAX runs on its CPU: trainingModel's figures are CPU "
              "figures", flush=True)
    for task in plan():
        key = f"{task.work} {task.setting} {task.path}"
        if args.only not in key:
            continue
        work = works[task.work]
        row = {"work": task.work, "setting": task.setting, "path": task.path, "unit": work.unit}
        left = budget - (time.perf_counter() - started)
        reserve = task.reserve * (SMOKE_RESERVE_SCALE if args.smoke else 1)
        if left < reserve:
            row.update(status="skipped", note=f"{left:.0f} s of the budget left, {reserve:.0f} s reserved")
        else:
            print(f"[{time.perf_counter() - started:6.1f}s] {key}", flush=True)
            begun = time.perf_counter()
            try:
                row.update(status="ok")
                row.update(run_task(task, work, device, args.smoke, min(left, reserve)))
            # A benchmark reports every failure and goes on with the rest of its plan.
            except Exception as error:  # noqa: BLE001
                row.update(status="error", note=f"{type(error).__name__}: {error}"[:600],
                           traceback=traceback.format_exc()[-4000:])
            row["wall_s"] = time.perf_counter() - begun
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        results["rows"].append(row)
        results["elapsed_s"] = time.perf_counter() - started
        out.write_text(json.dumps(results, indent=1))
    print(table(results["rows"]))
    print(f"wrote {out} ({results.get('elapsed_s', 0):.0f} s)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == COMPILE_CHILD:
        compile_child(sys.argv[2], sys.argv[3], "--smoke" in sys.argv)
    else:
        main()
