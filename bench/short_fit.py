"""A short ``Trainer.fit`` against a hand-written JAX scan loop, each from a fresh process.

The host-bound MLP of ``lightning_trainer.py`` (64→128→10, batch 32, SGD lr 0.01, ``self.log`` of
the loss each step): one epoch of 64,000 samples (2,000 optimizer steps) trained by a new
LightningModule with ``pl.Trainer(accelerator="ipu", strategy=IPUStrategy(device_iterations=100))``,
compilation included, against the same MLP hand-written in JAX as one jitted ``lax.scan`` of 100
SGD steps per call (``device_iterations.py``), its compilation included. Each runs in a process of
its own, *cold* (an empty executable cache: ``IPU_BACKEND_CACHE_DIR`` for the Trainer,
JAX's persistent compilation cache for the hand-written loop) and then *warm* (a second process on
the same cache directory), so that nothing compiled in one run helps the next but the cache.
Timed from the Trainer's (or the loop's) construction to its trained weights, imports excluded
(``process s`` adds the process's start and imports).
Target (issue 18): the Trainer ≥ 0.5× the hand-written loop's speed, warm.
Writes bench/results/short_fit.json. Run by hand on an idle machine:
``python bench/short_fit.py``.
"""

import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

RESULTS = pathlib.Path(__file__).parent / "results" / "short_fit.json"
CACHE_VARIABLE = "IPU_BACKEND_CACHE_DIR"
"""Where the Trainer's executors cache their programs (``ipu_backend.runtime.executable_cache``)."""


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _data():
    import torch
    from lightning_trainer import SAMPLES
    torch.manual_seed(0)
    return torch.randn(SAMPLES, 64), torch.randint(0, 10, (SAMPLES,))


def trainer_fit() -> dict:
    import lightning.pytorch as pl
    import torch
    from lightning_trainer import BATCH, FLAGS, ITERATIONS, MLP
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ipu import IPUStrategy
    torch.set_num_threads(1)
    x, y = _data()
    start, cpu = time.perf_counter(), _cpu_seconds()
    trainer = pl.Trainer(accelerator="ipu", strategy=IPUStrategy(device_iterations=ITERATIONS), max_epochs=1,
                         **FLAGS)
    trainer.fit(MLP(), DataLoader(TensorDataset(x, y), batch_size=BATCH))
    return {"seconds": time.perf_counter() - start, "cpu_seconds": _cpu_seconds() - cpu,
            "steps": trainer.global_step}


def handwritten_jax(cache_dir: str) -> dict:
    import jax
    from device_iterations import mlp_handwritten
    from lightning_trainer import BATCH, ITERATIONS, SAMPLES
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    x, y = _data()
    start, cpu = time.perf_counter(), _cpu_seconds()
    mlp_handwritten(x, y, BATCH, ITERATIONS)()
    return {"seconds": time.perf_counter() - start, "cpu_seconds": _cpu_seconds() - cpu,
            "steps": SAMPLES // BATCH}


def run_child(kind: str, cache_dir: str) -> dict:
    """One run in a new process; ``process_seconds`` is the whole process, start and imports
    included."""
    command = [sys.executable, __file__, "--child", kind, cache_dir]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False,
                            env={**os.environ, CACHE_VARIABLE: cache_dir})
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"}
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    measured["process_seconds"] = time.perf_counter() - start
    return measured


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        kind, cache_dir = sys.argv[2], sys.argv[3]
        print(json.dumps(trainer_fit() if kind == "trainer_fit" else handwritten_jax(cache_dir)))
        return
    results = {}
    for kind in ("trainer_fit", "handwritten_jax"):
        with tempfile.TemporaryDirectory(prefix="short_fit_") as cache_dir:
            results[kind] = {"cold": run_child(kind, cache_dir), "warm": run_child(kind, cache_dir)}
    for cache in ("cold", "warm"):
        fit, jax_loop = results["trainer_fit"][cache], results["handwritten_jax"][cache]
        if "error" not in fit and "error" not in jax_loop:
            results[f"trainer_vs_handwritten_{cache}"] = jax_loop["seconds"] / fit["seconds"]
    results["load_average_1_5_15_min"] = os.getloadavg()
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"{'run':16s} {'cache':5s} {'wall s':>7s} {'cpu s':>7s} {'process s':>9s}")
    for kind in ("trainer_fit", "handwritten_jax"):
        for cache, run in results[kind].items():
            if "error" in run:
                print(f"{kind:16s} {cache:5s} error: {run['error']}")
                continue
            print(f"{kind:16s} {cache:5s} {run['seconds']:7.2f} {run['cpu_seconds']:7.2f} "
                  f"{run['process_seconds']:9.2f}")
    for cache in ("cold", "warm"):
        ratio = results.get(f"trainer_vs_handwritten_{cache}")
        if ratio is not None:
            print(f"Trainer.fit / hand-written JAX speed, {cache} cache: {ratio:.2f}x (target, warm: >= 0.5x)")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
