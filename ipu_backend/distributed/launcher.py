"""``ipu-run`` (also ``python -m ipu_backend.run``): start a run's instances, as PopRun does.

    ipu-run --num-instances 2 --num-replicas 4 python train.py --epochs 3

starts two instances of ``python train.py --epochs 3`` on this host, each driving two of the four
replicas. Each instance learns its place from PopRun's environment variables (``POPDIST_*``, read
by :mod:`ipu_backend.distributed`) and where JAX's coordination service is (instance 0 serves it
on a free port); ``import ipu_backend`` then connects it to the others.

With ``--host a,b`` the instances are spread evenly over the hosts: ``ipu-run`` starts those of
this host (the first, or ``--host-index``) and prints the command that starts the others on each
other host. Run by ``srun`` (one task per host), each task starts its own share and instance 0's
host serves the coordinator.

The launcher forwards SIGINT and SIGTERM to every instance; when an instance fails, it stops the
others (SIGTERM, then SIGKILL after ``--kill-timeout`` seconds) and exits with the failed
instance's status, so a run never outlives its first failure; should the launcher itself die, its
instances get SIGTERM. An instance on another host that
dies is noticed by the survivors' collectives at once, or by JAX's coordination service after
``--heartbeat-timeout`` seconds.
"""

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from ipu_backend.distributed import environment

POLL_SECONDS = 0.05
SLURM_PORT_BASE = 20000
"""Under ``srun`` the coordinator listens on this port plus the job id modulo 10000."""
_EXEC_WITH_DEATH_SIGNAL = """import ctypes, os, signal, sys
try:
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG (Linux)
except (OSError, AttributeError):
    pass
os.execvp(sys.argv[1], sys.argv[1:])
"""
"""What an instance starts as: it asks to get SIGTERM when the launcher dies, then becomes the
program. (Done in the child's own interpreter: the launcher may hold JAX's threads, so it forks
nothing that runs Python.)"""


@dataclass(frozen=True)
class Plan:
    """What this launcher starts: ``instances`` (global indices) of ``num_instances``."""

    num_instances: int
    num_replicas: int
    ipus_per_replica: int
    instances: tuple[int, ...]
    coordinator: str
    heartbeat_timeout: int
    init_timeout: int

    def environment(self, index: int, local_index: int) -> dict[str, str]:
        """The variables instance ``index`` (the ``local_index``-th of its host) is started with."""
        local = self.num_replicas // self.num_instances
        return {
            environment.TOTAL_REPLICAS: str(self.num_replicas),
            environment.LOCAL_REPLICAS: str(local),
            environment.REPLICA_OFFSET: str(index * local),
            environment.IPUS_PER_REPLICA: str(self.ipus_per_replica),
            environment.UNIFORM_REPLICAS: "1",
            environment.LOCAL_INSTANCE: str(local_index),
            environment.COORDINATOR: self.coordinator,
            environment.HEARTBEAT_TIMEOUT: str(self.heartbeat_timeout),
            environment.INIT_TIMEOUT: str(self.init_timeout),
        }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ipu-run", description="Start the instances of a multi-process IPU run (PopRun's role).",
        usage="ipu-run --num-instances N --num-replicas R [options] [--] program [args ...]")
    parser.add_argument("--num-instances", type=int, default=1, help="host processes in the run (default 1)")
    parser.add_argument("--num-replicas", type=int, default=None,
                        help="replicas in the whole run, spread evenly over the instances (default: one per "
                             "instance)")
    parser.add_argument("--ipus-per-replica", type=int, default=1, help="IPUs of each replica (default 1)")
    parser.add_argument("--host", "--hosts", dest="hosts", default=None,
                        help="comma-separated hosts over which the instances are spread evenly")
    parser.add_argument("--host-index", type=int, default=None,
                        help="which of --host this is (default 0; under srun, the task's index)")
    parser.add_argument("--coordinator", default=None,
                        help="host:port of JAX's coordination service (default: a free port on the first host)")
    parser.add_argument("--heartbeat-timeout", type=int, default=environment.DEFAULT_HEARTBEAT_TIMEOUT,
                        help="seconds after which a silent instance counts as dead (default %(default)s)")
    parser.add_argument("--init-timeout", type=int, default=environment.DEFAULT_INIT_TIMEOUT,
                        help="seconds the instances wait for each other to start (default %(default)s)")
    parser.add_argument("--kill-timeout", type=float, default=10.0,
                        help="seconds between SIGTERM and SIGKILL when stopping instances (default %(default)s)")
    parser.add_argument("--tag-output", action="store_true", help="prefix each output line with [instance]")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program each instance runs")
    return parser


class UsageError(Exception):
    """A command line that cannot start a run; the message says why."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list (``node[03-05,9],gpu1`` -> ``node03``)."""
    depth = 0
    for position, character in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(character, 0)
        if character == "," and depth == 0:
            nodelist = nodelist[:position]
            break
    if "[" not in nodelist:
        return nodelist
    prefix, rest = nodelist.split("[", 1)
    ranges, suffix = rest.split("]", 1)
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def _slurm_step() -> tuple[int, int, str, str] | None:
    """(tasks, this task, first host, job id) when ``srun`` started this launcher as one of
    several tasks, else None."""
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))
    if tasks < 2:
        return None
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "localhost")
    return tasks, int(os.environ.get("SLURM_PROCID", "0")), first_slurm_host(nodelist), \
        os.environ.get("SLURM_JOB_ID", "0")


def make_plan(args: argparse.Namespace) -> tuple[Plan, list[str]]:
    """This launcher's :class:`Plan`, and the command lines that start the other hosts' share."""
    count = args.num_instances
    replicas = count if args.num_replicas is None else args.num_replicas
    if count < 1 or replicas < 1 or args.ipus_per_replica < 1:
        raise UsageError("--num-instances, --num-replicas and --ipus-per-replica must be positive")
    if replicas % count:
        raise UsageError(f"--num-replicas {replicas} must be a multiple of --num-instances {count}: each instance "
                         "drives the same number of replicas")
    hosts = args.hosts.split(",") if args.hosts else ["localhost"]
    slurm = None if args.hosts else _slurm_step()
    if slurm is not None:
        host_count, host_index, first_host, job = slurm
        default_coordinator = f"{first_host}:{SLURM_PORT_BASE + int(job) % 10000}"
    else:
        host_count, host_index = len(hosts), args.host_index or 0
        default_coordinator = f"{hosts[0]}:{_free_port()}" if host_index == 0 else None
    if count % host_count:
        raise UsageError(f"--num-instances {count} must be a multiple of the {host_count} hosts: each host runs "
                         "the same number of instances")
    if not 0 <= host_index < host_count:
        raise UsageError(f"--host-index {host_index} is not one of the {host_count} hosts")
    coordinator = args.coordinator or default_coordinator
    if coordinator is None:
        raise UsageError("--host-index other than 0 needs --coordinator HOST:PORT, as the first host's ipu-run "
                         "printed it")
    per_host = count // host_count
    this = Plan(count, replicas, args.ipus_per_replica,
                tuple(range(host_index * per_host, (host_index + 1) * per_host)), coordinator,
                args.heartbeat_timeout, args.init_timeout)
    others = [] if slurm is not None or host_index != 0 else [
        shlex.join(["ipu-run", "--num-instances", str(count), "--num-replicas", str(replicas),
                    "--ipus-per-replica", str(args.ipus_per_replica), "--host", ",".join(hosts),
                    "--host-index", str(h), "--coordinator", coordinator,
                    "--heartbeat-timeout", str(args.heartbeat_timeout), "--init-timeout", str(args.init_timeout),
                    "--", *args.command])
        for h in range(1, host_count)]
    return this, others


def _copy_tagged(stream, tag: bytes, out) -> None:
    for line in iter(stream.readline, b""):
        out.buffer.write(tag + line)
        out.flush()


def _describe(status: int) -> str:
    if status < 0:
        return f"was killed by {signal.Signals(-status).name}"
    return f"exited with status {status}"


def _exit_status(status: int) -> int:
    return 128 - status if status < 0 else status


class _Run:
    """The instances of this host, started, watched and stopped together."""

    def __init__(self, command: list[str], plan: Plan, tag_output: bool, kill_timeout: float):
        self.kill_timeout = kill_timeout
        self.stop_signal: int | None = None
        self.processes: dict[int, subprocess.Popen] = {}
        pipe = subprocess.PIPE if tag_output else None
        for local_index, index in enumerate(plan.instances):
            env = {**os.environ, **plan.environment(index, local_index)}
            self.processes[index] = subprocess.Popen([sys.executable, "-c", _EXEC_WITH_DEATH_SIGNAL, *command],
                                                     env=env, stdout=pipe, stderr=pipe, process_group=0)
        if tag_output:
            for index, process in self.processes.items():
                for stream, out in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
                    threading.Thread(target=_copy_tagged, args=(stream, f"[{index}] ".encode(), out),
                                     daemon=True).start()

    def forward(self, signum, frame) -> None:
        """Pass SIGINT/SIGTERM on to every instance (they run in their own process groups)."""
        self.stop_signal = signum
        self._signal_all(signum)

    def _signal_all(self, signum: int) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signum)

    def wait(self) -> int:
        """Wait for every instance; the first failure stops the others. The launcher's status."""
        failure: tuple[int, int] | None = None
        deadline = None
        while True:
            running = [p for p in self.processes.values() if p.poll() is None]
            if failure is None and self.stop_signal is None:
                failed = [(i, p.returncode) for i, p in self.processes.items() if p.returncode not in (None, 0)]
                if failed:
                    failure = failed[0]
                    if running:
                        print(f"ipu-run: instance {failure[0]} {_describe(failure[1])}; stopping the other "
                              "instances", file=sys.stderr, flush=True)
                        self._signal_all(signal.SIGTERM)
            if not running:
                break
            if (failure is not None or self.stop_signal is not None) and deadline is None:
                deadline = time.monotonic() + self.kill_timeout
            if deadline is not None and time.monotonic() > deadline:
                self._signal_all(signal.SIGKILL)
                deadline = float("inf")
            time.sleep(POLL_SECONDS)
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        if failure is not None:
            print(f"ipu-run: the run failed: instance {failure[0]} {_describe(failure[1])}", file=sys.stderr,
                  flush=True)
            return _exit_status(failure[1])
        return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``ipu-run`` with ``argv`` (default: the command line); returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no program to run: ipu-run [options] [--] program [args ...]")
    args.command = command
    try:
        this, others = make_plan(args)
    except UsageError as error:
        parser.error(str(error))
    for host_command in others:
        print(f"ipu-run: start the other hosts' instances with: {host_command}", file=sys.stderr, flush=True)
    if shutil.which(command[0]) is None:
        print(f"ipu-run: cannot start {command[0]!r}: no such program", file=sys.stderr, flush=True)
        return 127
    run = _Run(command, this, args.tag_output, args.kill_timeout)
    previous = {s: signal.signal(s, run.forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return run.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
