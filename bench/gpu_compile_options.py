"""GPU compile options: what XLA's GPU autotuning costs at a first call, and what it buys.

On an NVIDIA GPU most of a transformer's first call is XLA choosing kernels: it compiles and
times Triton candidates for every matrix product. This benchmark trains ``bench/gpu.py``'s
workloads with ``trainingModel`` at deviceIterations 10 under XLA's default GPU options and
with each alternative (``XLA_FLAGS``, one process each): the first call, the rate after it and
the weights after 20 steps against torch CUDA's (as ``bench/gpu.py`` measures them).

    PYTHONPATH=. python3 bench/gpu_compile_options.py --out options.json   # on the GPU machine
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

VARIANTS = {
    "default": "",
    "triton_gemm_off": "--xla_gpu_enable_triton_gemm=false",
    "autotune_0": "--xla_gpu_autotune_level=0",
}
PLAN = [("gpt_small", "fp32"), ("cnn", "fp32"), ("gpt_mid", "fp32"), ("gpt_small", "tf32")]


def child(work_name: str, setting: str) -> dict:
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import gpu
    import torch

    gpu.apply_setting(setting)
    work = gpu.workloads(smoke=not torch.cuda.is_available())[work_name]
    return gpu.training_model(work, setting, 10, "single", "cuda" if torch.cuda.is_available() else "cpu", 3.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="gpu_compile_options.json")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds; no process starts after")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    began, rows = time.perf_counter(), []
    for work_name, setting in PLAN:
        for variant, flags in VARIANTS.items():
            if time.perf_counter() - began > args.budget:
                break
            env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()}
            done = subprocess.run([sys.executable, __file__, "--child", work_name, setting], env=env,
                                  capture_output=True, text=True, check=False)
            lines = done.stdout.strip().splitlines()
            row = {"work": work_name, "setting": setting, "variant": variant}
            row.update(json.loads(lines[-1]) if done.returncode == 0 and lines
                       else {"error": done.stderr.strip()[-600:]})
            rows.append(row)
            pathlib.Path(args.out).write_text(json.dumps(rows, indent=2))
            print(f"{work_name:10s} {setting:5s} {variant:16s} first call {row.get('first_call_s', float('nan')):6.1f} s"
                  f"  rate {row.get('rate', float('nan')):10.1f}  fidelity {row.get('fidelity_rel', float('nan')):.1e}"
                  + (f"  {row['error']}" if "error" in row else ""), flush=True)


if __name__ == "__main__":
    main()
