"""ipu-run: what each instance is told, and a run that ends with its first failure or a signal.

The launcher runs in the test process (``launcher.main``), starting small Python programs as
instances; one test goes through ``python -m ipu_backend.run`` itself.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest

from ipu_backend.distributed import environment, launcher

ROOT = Path(__file__).resolve().parents[2]
DUMP_ENVIRONMENT = ("import json, os, sys; json.dump({k: v for k, v in os.environ.items() "
                    "if k.startswith(('POPDIST_', 'IPU_BACKEND_'))}, "
                    "open(os.path.join(sys.argv[1], os.environ['POPDIST_REPLICA_INDEX_OFFSET']), 'w'))")


def plan(*arguments: str) -> tuple[launcher.Plan, list[str]]:
    return launcher.make_plan(launcher._parser().parse_args([*arguments, "python", "train.py"]))


def test_each_instance_is_told_its_replicas_and_the_coordinator():
    this, others = plan("--num-instances", "2", "--num-replicas", "8", "--ipus-per-replica", "2")
    assert this.instances == (0, 1) and others == []
    host, port = this.coordinator.split(":")
    assert host == "localhost" and int(port) > 0
    second = this.environment(1, 1)
    assert second == {
        environment.TOTAL_REPLICAS: "8", environment.LOCAL_REPLICAS: "4", environment.REPLICA_OFFSET: "4",
        environment.IPUS_PER_REPLICA: "2", environment.UNIFORM_REPLICAS: "1", environment.LOCAL_INSTANCE: "1",
        environment.COORDINATOR: this.coordinator,
        environment.HEARTBEAT_TIMEOUT: str(environment.DEFAULT_HEARTBEAT_TIMEOUT),
        environment.INIT_TIMEOUT: str(environment.DEFAULT_INIT_TIMEOUT)}


def test_environment_gives_the_instance_as_popdist_reads_it(monkeypatch):
    this, _ = plan("--num-instances", "4", "--num-replicas", "8")
    for name, value in this.environment(3, 3).items():
        monkeypatch.setenv(name, value)
    instance = environment.from_environment()
    assert (instance.index, instance.count, instance.local_replicas, instance.replica_offset,
            instance.total_replicas, instance.launched) == (3, 4, 2, 6, 8, True)


def test_several_hosts_get_their_share_and_the_others_command_lines():
    this, others = plan("--num-instances", "4", "--num-replicas", "4", "--host", "a,b")
    assert this.instances == (0, 1) and this.coordinator.startswith("a:")
    assert len(others) == 1 and others[0].startswith("ipu-run ")
    other, _ = launcher.make_plan(launcher._parser().parse_args(others[0].split()[1:]))
    assert other.instances == (2, 3) and other.coordinator == this.coordinator
    assert others[0].endswith("-- python train.py")


def test_srun_tasks_each_start_their_share(monkeypatch):
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[07-08]")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    this, others = plan("--num-instances", "4", "--num-replicas", "8")
    assert this.instances == (2, 3) and others == []
    assert this.coordinator == f"node07:{launcher.SLURM_PORT_BASE + 123456 % 10000}"


@pytest.mark.parametrize("nodes, first", [("node07", "node07"), ("node[03-05,9],gpu1", "node03"),
                                          ("a1,b[2-3]", "a1"), ("rack[1-2]-ib", "rack1-ib")])
def test_first_host_of_a_slurm_node_list(nodes, first):
    assert launcher.first_slurm_host(nodes) == first


@pytest.mark.parametrize("arguments, message", [
    (["--num-instances", "2", "--num-replicas", "3"], "multiple of --num-instances"),
    (["--num-instances", "3", "--host", "a,b"], "multiple of the 2 hosts"),
    (["--num-instances", "2", "--host", "a,b", "--host-index", "1"], "needs --coordinator"),
    (["--num-instances", "0"], "must be positive"),
])
def test_bad_command_lines_say_what_is_wrong(arguments, message):
    with pytest.raises(launcher.UsageError, match=message):
        plan(*arguments)


def test_instances_run_with_their_environment(tmp_path):
    status = launcher.main(["--num-instances", "2", "--num-replicas", "4", "--",
                            sys.executable, "-c", DUMP_ENVIRONMENT, str(tmp_path)])
    assert status == 0
    told = [json.loads((tmp_path / offset).read_text()) for offset in ("0", "2")]
    assert [t[environment.LOCAL_INSTANCE] for t in told] == ["0", "1"]
    assert told[0][environment.COORDINATOR] == told[1][environment.COORDINATOR]


def test_a_failed_instance_stops_the_others(capfd):
    """Instance 1 fails at once; instance 0 would run for a minute and is stopped."""
    program = ("import os, sys, time; "
               "time.sleep(60) if os.environ['POPDIST_REPLICA_INDEX_OFFSET'] == '0' else sys.exit(3)")
    started = time.monotonic()
    status = launcher.main(["--num-instances", "2", "--", sys.executable, "-c", program])
    assert status == 3 and time.monotonic() - started < 30
    assert "instance 1 exited with status 3; stopping the other instances" in capfd.readouterr().err


def test_an_instance_ignoring_sigterm_is_killed():
    program = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               "time.sleep(60) if os.environ['POPDIST_REPLICA_INDEX_OFFSET'] == '0' else sys.exit(1)")
    started = time.monotonic()
    assert launcher.main(["--num-instances", "2", "--kill-timeout", "1", "--",
                          sys.executable, "-c", program]) == 1
    assert time.monotonic() - started < 30


def test_sigint_reaches_every_instance(tmp_path):
    """Each instance records the SIGINT the launcher forwards, then exits; so does the launcher."""
    program = ("import os, signal, sys, time; out = sys.argv[1] + '/' + os.environ['POPDIST_REPLICA_INDEX_OFFSET']\n"
               "signal.signal(signal.SIGINT, lambda *a: (open(out, 'w').write('interrupted'), sys.exit(0)))\n"
               "open(out + '.ready', 'w').close(); time.sleep(60)")

    def interrupt_when_ready():
        while not all((tmp_path / f"{i}.ready").exists() for i in range(2)):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_ready, daemon=True).start()
    status = launcher.main(["--num-instances", "2", "--", sys.executable, "-c", program, str(tmp_path)])
    assert status == 128 + signal.SIGINT
    assert [(tmp_path / str(i)).read_text() for i in range(2)] == ["interrupted", "interrupted"]


def test_tagged_output_names_the_instance(capfd):
    assert launcher.main(["--num-instances", "2", "--tag-output", "--", sys.executable, "-c",
                          "import os; print('hello', os.environ['POPDIST_REPLICA_INDEX_OFFSET'])"]) == 0
    lines = sorted(capfd.readouterr().out.splitlines())
    assert lines == ["[0] hello 0", "[1] hello 1"]


def test_module_and_console_script_run_the_launcher(tmp_path):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["ipu-run"] == "ipu_backend.distributed.launcher:main"
    result = subprocess.run([sys.executable, "-m", "ipu_backend.run", "--num-instances", "2", "--",
                             sys.executable, "-c", DUMP_ENVIRONMENT, str(tmp_path)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["0", "1"]


def test_a_missing_program_is_named(capfd):
    assert launcher.main(["--num-instances", "2", "--", "no-such-program-here"]) == 127
    assert "cannot start 'no-such-program-here': no such program" in capfd.readouterr().err


def test_instances_die_with_the_launcher(tmp_path):
    """The launcher killed outright (no chance to stop anyone): its instances get SIGTERM."""
    program = ("import os, sys, time; open(sys.argv[1] + '/' + os.environ['POPDIST_REPLICA_INDEX_OFFSET'], 'w')"
               ".write(str(os.getpid())); time.sleep(60)")
    run = subprocess.Popen([sys.executable, "-c", "import sys; from ipu_backend.distributed import launcher; "
                            "sys.exit(launcher.main(sys.argv[1:]))", "--num-instances", "2", "--",
                            sys.executable, "-c", program, str(tmp_path)],
                           cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int((tmp_path / name).read_text()) for name in ("0", "1")]
    run.kill()
    run.wait()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
