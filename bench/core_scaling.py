"""Device iterations on one CPU core and on all of them: how each path scales.

Runs the MLP and seed-CNN comparisons of ``device_iterations.py`` (executor, torch eager,
hand-written JAX; same data, rounds and ratios) twice, each time in a fresh process: once pinned
to one core, once allowed every core. XLA's and torch's thread pools size themselves from the
process's CPU affinity when they start, so each core count needs its own process. Reports, per
core count, each path's rate and the executor's ratios, and each path's speed-up from one core
to all: a ratio that holds on one core but not on all is a difference in how the two runtimes
spread a step over the cores, not in how much work the step does.
Writes bench/results/core_scaling.json. Run by hand: ``make bench``.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys

RESULTS = pathlib.Path(__file__).parent / "results" / "core_scaling.json"
WORKLOADS = {"mlp": "steps_per_s", "seed_cnn": "images_per_s"}


def measure(cores: int) -> dict:
    """Both workloads of ``device_iterations.py`` in this process, pinned to its first
    ``cores`` CPUs before JAX and torch start their thread pools."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])
    import torch
    torch.set_num_threads(cores)
    import device_iterations
    return {"mlp": device_iterations.mlp_benchmark(), "seed_cnn": device_iterations.cnn_benchmark()}


def _in_subprocess(cores: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--cores", str(cores)], check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _speedups(one: dict, every: dict, unit: str) -> dict:
    return {path: every[unit][path] / rate for path, rate in one[unit].items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", type=int, help="measure in this process, on this many cores")
    args = parser.parse_args()
    if args.cores:
        print(json.dumps(measure(args.cores)))
        return
    all_cores = len(os.sched_getaffinity(0))
    runs = {1: _in_subprocess(1), all_cores: _in_subprocess(all_cores)}
    results = {"cores": list(runs), "runs": {str(c): r for c, r in runs.items()}, "speedup_to_all_cores": {}}
    for workload, unit in WORKLOADS.items():
        speedups = _speedups(runs[1][workload], runs[all_cores][workload], unit)
        results["speedup_to_all_cores"][workload] = speedups
        for cores, run in runs.items():
            ratios = {k: round(v, 2) for k, v in run[workload].items() if k.startswith("executor_vs_")
                      and not k.endswith("_median_of_rounds")}
            print(f"{workload} on {cores} core(s): {unit} "
                  f"{ {k: round(v) for k, v in run[workload][unit].items()} } {ratios}")
        print(f"{workload} speed-up from 1 to {all_cores} cores: "
              f"{ {k: round(v, 2) for k, v in speedups.items()} }")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
