"""A real one-node Slurm cluster on localhost for the tests (session-scoped pytest fixture).

``slurm_cluster`` installs Debian's ``slurm-wlm`` and ``munge`` when they are missing
(``apt-get``, as root), then starts its *own* daemons from a temporary directory:

* ``munged`` with a fresh key and a private socket (so it never clashes with a system munged),
* ``slurmctld`` and ``slurmd`` in the foreground (``-D -f slurm.conf``), on free ports, with
  state, spool, pid and log files in the same temporary directory,

waits for the node to turn idle and yields a :class:`SlurmCluster` whose ``env`` carries
``SLURM_CONF`` for ``sbatch``/``squeue``/``scontrol``. Teardown cancels what is still queued
and stops every daemon it started, by process id. Where Slurm cannot be installed or started
the tests that use the fixture are skipped with the exact reason; they never pass silently.

Use it with ``from slurm_cluster import slurm_cluster  # noqa: F401`` in a test module.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "srun")
_FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
             "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def _which(name: str) -> str | None:
    for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return shutil.which(name)


def _missing_binaries() -> list[str]:
    return [b for b in _BINARIES if _which(b) is None]


def ensure_slurm_installed() -> str | None:
    """Install slurm-wlm and munge with apt-get where needed. Returns None when everything is
    there, else the reason it cannot be (used as the skip message)."""
    missing = _missing_binaries()
    if not missing:
        return None
    if os.geteuid() != 0:
        return (f"Slurm binaries {missing} are missing and this user (uid {os.geteuid()}) is not "
                "root, so apt-get cannot install slurm-wlm and munge")
    if shutil.which("apt-get") is None:
        return f"Slurm binaries {missing} are missing and this machine has no apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends",
                 "slurm-wlm", "munge"]):
        r = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=900)
        if r.returncode != 0:
            tail = (r.stdout + r.stderr).strip().splitlines()[-5:]
            return f"'{' '.join(cmd)}' failed with exit code {r.returncode}: " + " | ".join(tail)
    missing = _missing_binaries()
    if missing:
        return f"apt-get installed slurm-wlm and munge but {missing} are still missing"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_line(hostname: str) -> str:
    """The NodeName line for this machine, from ``slurmd -C`` (CPUs, sockets, memory)."""
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True,
                         timeout=60).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("NodeName=")), None)
    if line is None:
        cpus = os.cpu_count() or 1
        mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        line = f"NodeName={hostname} CPUs={cpus} RealMemory={mem_mb}"
    line = re.sub(r"^NodeName=\S+", f"NodeName={hostname}", line)
    # Leave a little memory slack: slurmd drains a node that reports less than configured.
    m = re.search(r"RealMemory=(\d+)", line)
    if m:
        line = line.replace(m.group(0), f"RealMemory={max(1, int(m.group(1)) - 256)}")
    return line + " State=UNKNOWN"


@dataclass
class SlurmCluster:
    """A running one-node cluster. ``env`` is the environment for Slurm client commands."""

    root: Path
    conf: Path
    hostname: str
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        r = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}"
                               f"\n{self.logs()}")
        return r

    def job_info(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def job_state(self, job_id: str) -> str:
        return self.job_info(job_id).get("JobState", "UNKNOWN")

    def wait(self, job_id: str, timeout: float, states: set[str] | None = None,
             poll: float = 0.5) -> str:
        """Wait until the job is in one of ``states`` (default: any finished state)."""
        states = states or _FINISHED
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f}s, wanted {states}"
                           f"\n{self.logs()}")

    def logs(self, lines: int = 15) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            p = self.root / name
            if p.exists():
                tail = p.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {name} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(parts)

    def cancel_all(self, timeout: float = 60) -> None:
        r = self.run("squeue", "-h", "-o", "%i", check=False)
        ids = r.stdout.split()
        if ids:
            self.run("scancel", *ids, check=False)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not self.run("squeue", "-h", "-o", "%i", check=False).stdout.split():
                    break
                time.sleep(0.5)


def _write_config(root: Path, hostname: str) -> Path:
    for d in ("state", "spool", "log"):
        (root / d).mkdir(mode=0o755)
    conf = root / "slurm.conf"
    conf.write_text(f"""\
# One-node test cluster written by tests/slurm_cluster.py
ClusterName=epscale-test
SlurmctldHost={hostname}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
MinJobAge=3600
KillWait=20
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
{_node_line(hostname)}
PartitionName=debug Nodes={hostname} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    # No cgroup plugin is configured above; this file only keeps slurmd from looking for one.
    (root / "cgroup.conf").write_text("CgroupAutomount=no\nConstrainCores=no\n"
                                      "ConstrainRAMSpace=no\nConstrainDevices=no\n")
    return conf


def _start_munged(root: Path) -> subprocess.Popen:
    mdir = root / "munge"
    mdir.mkdir(mode=0o700)
    key = mdir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    cmd = [_which("munged"), "--foreground", "--force", f"--key-file={key}",
           f"--socket={mdir}/munge.socket", f"--pid-file={mdir}/munged.pid",
           f"--log-file={root}/munged.log", f"--seed-file={mdir}/munged.seed"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open(root / "munged.stderr", "w"))
    deadline = time.monotonic() + 20
    while not (mdir / "munge.socket").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("munged did not start: "
                               + (root / "munged.stderr").read_text(errors="replace"))
        time.sleep(0.1)
    return proc


def _stop(proc: subprocess.Popen, timeout: float = 15) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def start_cluster(root: Path) -> SlurmCluster:
    hostname = socket.gethostname().split(".")[0]
    conf = _write_config(root, hostname)
    env = dict(os.environ, SLURM_CONF=str(conf))
    cluster = SlurmCluster(root=root, conf=conf, hostname=hostname, env=env)
    try:
        cluster.procs["munged"] = _start_munged(root)
        for name in ("slurmctld", "slurmd"):
            extra = ["-i"] if name == "slurmctld" else []  # -i: ignore stale saved state
            cluster.procs[name] = subprocess.Popen(
                [_which(name), "-D", "-f", str(conf), *extra], env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=open(root / f"{name}.stderr", "w"))
            time.sleep(0.5)
        deadline = time.monotonic() + 60
        state = ""
        while time.monotonic() < deadline:
            for name, p in cluster.procs.items():
                if p.poll() is not None:
                    err = (root / f"{name}.stderr").read_text(errors="replace")
                    raise RuntimeError(f"{name} exited with {p.returncode}: {err}\n"
                                       f"{cluster.logs()}")
            r = cluster.run("sinfo", "-h", "-N", "-o", "%T", "-n", hostname, check=False)
            state = r.stdout.strip().lower()
            if state == "idle":
                return cluster
            time.sleep(0.5)
        raise RuntimeError(f"node {hostname} is '{state}', not idle, 60 s after start\n"
                           f"{cluster.logs()}")
    except BaseException:
        stop_cluster(cluster)
        raise


def stop_cluster(cluster: SlurmCluster) -> None:
    if cluster.procs.get("slurmctld") and cluster.procs["slurmctld"].poll() is None:
        try:
            cluster.cancel_all()
        except Exception:  # teardown must go on and stop the daemons
            pass
    for name in ("slurmd", "slurmctld", "munged"):
        if name in cluster.procs:
            _stop(cluster.procs[name])


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running one-node Slurm cluster (see the module docstring); skipped with the exact
    reason where Slurm cannot be installed."""
    reason = ensure_slurm_installed()
    if reason:
        pytest.skip(f"real Slurm unavailable: {reason}")
    root = Path(tempfile.mkdtemp(prefix="epscale-slurm-"))
    root.chmod(0o755)  # slurmd and jobs (root) read it; munged wants no group/other write
    cluster = start_cluster(root)
    try:
        yield cluster
    finally:
        stop_cluster(cluster)
        shutil.rmtree(root, ignore_errors=True)
