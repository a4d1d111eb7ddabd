"""``epscale slurm render|submit CONFIG --nodes N --gpus-per-node G ...``: sbatch scripts.

The rendered script runs one torchrun agent per node under ``srun`` (``--kill-on-bad-exit``),
with a c10d rendezvous on the first node of the allocation (``scontrol show hostnames``) and a
port derived from the job id; it keeps a log directory per job, asks Slurm to requeue it after
a node failure, and turns the SIGUSR1 that Slurm sends before the time limit into "checkpoint
at the end of this step, exit, requeue". NCCL/InfiniBand presets are written out with a comment
each. ``--gpus-per-node 0`` is the CPU mode (no GPU request, gloo, ``--procs-per-node`` worker
processes per node), which is how the test-suite runs it on a one-node local cluster.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError, RunConfig, load_config, recipe_path
from .local import ELASTIC_ENV, pin_global_batch, train_args
from .watchdog import NCCL_FLIGHT_RECORDER_ENV

TEMPLATE = Path(__file__).parent / "templates" / "sbatch.sh.in"

# (name, value, why) — written as `export NAME=${NAME:-value}` so a user's setting wins.
NCCL_PRESETS: list[tuple[str, str, str]] = [
    ("NCCL_IB_HCA", "mlx5",
     "InfiniBand adapters NCCL may use ('mlx5' = every ConnectX port). List the GPU-fabric "
     "ports (mlx5_0,mlx5_1,...) to keep traffic off the storage/management NIC."),
    ("NCCL_SOCKET_IFNAME", "^lo,docker",
     "TCP interface for NCCL's bootstrap (and its fallback transport): anything but loopback "
     "and docker bridges."),
    ("NCCL_IB_TIMEOUT", "22",
     "InfiniBand retransmission timeout exponent (4.096 us * 2^22 ~ 17 s): survives short "
     "fabric hiccups on large clusters instead of failing the collective."),
    ("NCCL_IB_RETRY_CNT", "10", "InfiniBand retries before NCCL reports a network error."),
    ("NCCL_DEBUG", "WARN",
     "WARN prints errors only; run once with INFO to check that NCCL picked IB (NET/IB), "
     "not sockets (NET/Socket)."),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1",
     "a failed or timed-out collective tears the process down instead of hanging; torchrun "
     "then restarts the group from the last checkpoint."),
    ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True",
     "fewer out-of-memory errors from fragmentation: MoE token counts change every step."),
]
GLOO_PRESETS: list[tuple[str, str, str]] = [
    ("GLOO_SOCKET_IFNAME", "",
     "CPU mode (gloo): the interface gloo uses between nodes; empty = the one the hostname "
     "resolves to. Set it (e.g. eth0) on machines with several networks."),
]
_TIME_RE = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}"
                      r"|\d+-\d+:\d{1,2}:\d{1,2})$")


def bad_option(option: str, value, allowed: str) -> ConfigError:
    return ConfigError(f"{option} = {value!r} is invalid: {allowed}")


def time_limit_seconds(text: str) -> int:
    """Seconds in a Slurm time limit ('90', 'MM:SS', 'HH:MM:SS', 'D-HH', 'D-HH:MM[:SS]')."""
    if not _TIME_RE.match(text):
        raise bad_option("--time", text, "use a Slurm time limit: minutes, MM:SS, HH:MM:SS, D-HH, "
                                   "D-HH:MM or D-HH:MM:SS")
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
        parts = [int(x) for x in text.split(":")]
        parts += [0] * (3 - len(parts))  # D-HH[:MM[:SS]]
        h, m, s = parts
    else:
        parts = [int(x) for x in text.split(":")]
        if len(parts) == 1:
            h, m, s = 0, parts[0], 0
        elif len(parts) == 2:
            h, m, s = 0, parts[0], parts[1]
        else:
            h, m, s = parts
    return ((days * 24 + h) * 60 + m) * 60 + s


@dataclass
class SlurmJob:
    """Everything the sbatch script needs. Paths are made absolute by :meth:`resolved`.

    nodes: nodes in the allocation. gpus_per_node: GPUs requested per node; 0 is CPU mode.
    procs_per_node: training processes per node (default: gpus_per_node, or 1 in CPU mode).
    cpus_per_node: CPUs for the node's torchrun task (``--cpus-per-task``), None = Slurm's default.
    exclusive: whole nodes; None means yes with GPUs (training owns the node), no on CPU.
    signal_before: seconds before the time limit at which training is told to checkpoint.
    max_restarts: torchrun group restarts after a rank fails, within one job attempt.
    preflight: before training, run ``epscale preflight`` on every rank of the allocation
    (timed all-reduce/all-to-all); a missing or failing rank ends the job with its host named.
    min_nodes: elastic (``min_nodes < nodes``): a node that fails leaves the others to
    restart at the smaller layout, down to this many (torchrun ``--nnodes=MIN:MAX``; the
    job and its step survive the node, ``--no-kill``); the global batch is kept
    (``train.global_batch_size``, pinned at the full allocation's). A lost node does not
    return within the job: the requeued job starts on a full allocation again.
    rejoin_timeout: elastic: how long the survivors wait for a lost node before going on.
    """

    config: str
    nodes: int = 1
    gpus_per_node: int = 0
    procs_per_node: int | None = None
    cpus_per_node: int | None = None
    mem: str | None = None
    partition: str | None = None
    time: str | None = None
    exclude: str | None = None
    account: str | None = None
    qos: str | None = None
    exclusive: bool | None = None
    job_name: str | None = None
    run_dir: str | None = None
    log_root: str | None = None
    chdir: str | None = None
    python: str = field(default_factory=lambda: sys.executable)
    max_restarts: int = 3
    min_nodes: int | None = None
    rejoin_timeout: int = 30
    signal_before: int = 300
    preflight: bool = True
    env: list[str] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)
    # The loaded recipe (with the overrides), for the checks that need the model and layout
    # (``epscale slurm`` checks the node count against them before anything is queued).
    run_config: RunConfig | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.config = str(recipe_path(self.config))
        cfg = load_config(self.config, self.overrides)  # fail at render time, not in the queue
        self.run_config = cfg
        for opt, v, low in (("--nodes", self.nodes, 1), ("--gpus-per-node", self.gpus_per_node, 0),
                            ("--max-restarts", self.max_restarts, 0),
                            ("--signal-before", self.signal_before, 1)):
            if not isinstance(v, int) or v < low:
                raise bad_option(opt, v, f"must be an integer >= {low}")
        if self.min_nodes is not None and not (isinstance(self.min_nodes, int)
                                               and 1 <= self.min_nodes <= self.nodes):
            raise bad_option("--min-nodes", self.min_nodes,
                             f"must be an integer in [1, --nodes = {self.nodes}]")
        if self.rejoin_timeout < 0:
            raise bad_option("--rejoin-timeout", self.rejoin_timeout, "must be >= 0 seconds")
        if self.signal_before > 65535:
            raise bad_option("--signal-before", self.signal_before, "Slurm allows at most 65535 s")
        if self.procs_per_node is None:
            self.procs_per_node = self.gpus_per_node or 1
        if self.procs_per_node < 1:
            raise bad_option("--procs-per-node", self.procs_per_node, "must be an integer >= 1")
        if self.gpus_per_node and self.procs_per_node > self.gpus_per_node:
            raise bad_option("--procs-per-node", self.procs_per_node,
                       f"at most --gpus-per-node ({self.gpus_per_node}): one process per GPU")
        if self.cpus_per_node is not None and self.cpus_per_node < 1:
            raise bad_option("--cpus-per-node", self.cpus_per_node, "must be an integer >= 1")
        if self.time is not None:
            limit = time_limit_seconds(self.time)
            if self.signal_before >= limit:
                raise bad_option("--signal-before", self.signal_before,
                           f"must be shorter than the time limit --time={self.time} ({limit} s)")
        for opt, v in (("--partition", self.partition), ("--exclude", self.exclude),
                       ("--account", self.account), ("--qos", self.qos), ("--mem", self.mem),
                       ("--job-name", self.job_name)):
            if v is not None and (not v or re.search(r"\s", v)):
                raise bad_option(opt, v, "must be a non-empty value without spaces")
        for item in self.env:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", item):
                raise bad_option("--env", item, "use NAME=VALUE")
        if self.exclusive is None:
            self.exclusive = self.gpus_per_node > 0
        self.job_name = self.job_name or f"epscale-{cfg.name}"
        base = Path(self.chdir or Path.cwd()).resolve()
        self.chdir = str(base)
        self.run_dir = str((base / (self.run_dir or f"runs/{self.job_name}")).resolve())
        self.log_root = str((base / (self.log_root or f"{self.run_dir}/slurm")).resolve())
        self.config = str(Path(self.config).resolve())

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < self.nodes


ELASTIC_SBATCH = """\
# Elastic: a node that fails does not end the job (--no-kill); the other nodes' torchrun
# agents restart their workers at the smaller layout, which resume the newest checkpoint.
#SBATCH --no-kill"""
ELASTIC_EXPORT = f"""\
# Elastic: ranks past the largest world the config can train at stand by (whole nodes).
export {ELASTIC_ENV}=1"""


def _export_block(presets: list[tuple[str, str, str]]) -> list[str]:
    lines = []
    for name, value, why in presets:
        lines.append(f"# {name}: {why}")
        if value:
            lines.append(f'export {name}="${{{name}:-{value}}}"')
        else:
            lines.append(f"# export {name}=eth0")
    return lines


def _preflight_block(job: SlurmJob) -> str:
    if not job.preflight:
        return ""
    return f"""\
# Preflight: every rank joins a short timed all-reduce/all-to-all before training; the report
# (slow ranks by host and rank) goes to this job's output. A rank that does not join or fails
# the check ends the job here, before hours are spent waiting on it (exclude its node).
srun --kill-on-bad-exit=1 --ntasks-per-node=1 --nodes={job.nodes} \\
    --cpus-per-task="{job.cpus_per_node or '$SLURM_CPUS_ON_NODE'}" \\
    {shlex.quote(job.python)} -m torch.distributed.run \\
    --nnodes={job.nodes} --nproc-per-node={job.procs_per_node} \\
    --rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:$((RDZV_PORT + 20000))" \\
    --rdzv-id="preflight-$SLURM_JOB_ID-$ATTEMPT" --max-restarts=0 \\
    -m epscale preflight --timeout 120
PREFLIGHT_RC=$?
if [ "$PREFLIGHT_RC" != 0 ]; then
    echo "[epscale] preflight failed (exit code $PREFLIGHT_RC): see the ranks and hosts named above"
    exit "$PREFLIGHT_RC"
fi
"""


def render(job: SlurmJob, script_name: str = "job.sbatch") -> str:
    """The sbatch script for ``job`` (text)."""
    res = []
    if job.gpus_per_node:
        res.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_node:
        res.append(f"#SBATCH --cpus-per-task={job.cpus_per_node}")
    for opt in ("mem", "partition", "time", "exclude", "account", "qos"):
        value = getattr(job, opt)
        if value:
            res.append(f"#SBATCH --{opt}={value}")
    if job.exclusive:
        res.append("#SBATCH --exclusive")

    env = ["# --- environment ---------------------------------------------------------------",
           "# One math thread pool per process, sized so the node's CPUs are not oversubscribed.",
           f"THREADS=$(( ${{SLURM_CPUS_ON_NODE:-{job.procs_per_node}}} / {job.procs_per_node} ))",
           '[ "$THREADS" -ge 1 ] || THREADS=1',
           'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$THREADS}"']
    if job.gpus_per_node:
        env.append("# NCCL / InfiniBand presets (GPU mode)")
        env += _export_block(NCCL_PRESETS)
        env.append("# NCCL flight recorder: every rank keeps its last collectives and dumps them "
                   "when one times out")
        env += _export_block([(n, v.replace("{dump_dir}", "$LOG_DIR"), w)
                              for n, v, w in NCCL_FLIGHT_RECORDER_ENV])
    else:
        env.append("# CPU mode: gloo between processes, no GPUs requested")
        env += _export_block(GLOO_PRESETS)
    extra = [f"export {shlex.quote(e.split('=', 1)[0])}={shlex.quote(e.split('=', 1)[1])}"
             for e in job.env]
    if job.elastic:
        extra.append(ELASTIC_EXPORT)

    # The script's own preflight step already checked every rank: the trainer skips its own.
    overrides = job.overrides + (["train.preflight=false"] if job.preflight else [])
    if job.elastic:  # the full allocation's global batch, kept at every node count
        overrides += pin_global_batch(job.run_config, job.world_size)[1]
    tr = train_args(job.config, job.run_dir, overrides)
    values = {
        "script_name": script_name, "job_name": job.job_name, "nodes": str(job.nodes),
        "procs_per_node": str(job.procs_per_node), "sbatch_resources": "\n".join(res),
        "chdir": job.chdir, "log_root": shlex.quote(job.log_root),
        "signal_before": str(job.signal_before), "run_dir": shlex.quote(job.run_dir),
        "env_presets": "\n".join(env), "extra_env": "\n".join(extra),
        "python": shlex.quote(job.python), "max_restarts": str(job.max_restarts),
        "train_args": shlex.join(tr),
        # Since Slurm 22.05 srun does not inherit sbatch's --cpus-per-task: give the node's
        # one torchrun task every CPU the job holds there, else its workers share one core.
        "preflight_block": _preflight_block(job),
        "srun_cpus": str(job.cpus_per_node) if job.cpus_per_node else "$SLURM_CPUS_ON_NODE",
        "nnodes": f"{job.min_nodes}:{job.nodes}" if job.elastic else str(job.nodes),
        "elastic_sbatch": ELASTIC_SBATCH if job.elastic else "",
        "srun_kill": ("--no-kill --kill-on-bad-exit=0" if job.elastic else "--kill-on-bad-exit=1"),
        "rdzv_conf": (f" --rdzv-conf=last_call_timeout={job.rejoin_timeout}"
                      if job.elastic else ""),
    }
    text = TEMPLATE.read_text()
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    assert "{{" not in text, f"unfilled placeholder in {TEMPLATE}"
    return re.sub(r"\n{3,}", "\n\n", text)


def write_script(job: SlurmJob, path: str | Path) -> Path:
    """Write the script (executable) and create the log root Slurm writes its output to."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(render(job, p.name))
    p.chmod(0o755)
    Path(job.log_root).mkdir(parents=True, exist_ok=True)  # sbatch --output needs it to exist
    return p


def submit(script: str | Path, sbatch: str = "sbatch", env: dict | None = None) -> str:
    """Run ``sbatch --parsable SCRIPT`` and return the job id."""
    r = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True,
                       env=env, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RuntimeError(f"sbatch failed with exit code {r.returncode}: {r.stderr.strip()}")
    return r.stdout.strip().split(";")[0]  # "<id>;<cluster>" on multi-cluster setups


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------
