"""Cluster descriptions for the simulator: YAML files and named presets.

A cluster is ``nodes x gpus_per_node`` devices. Each device has its own share of the
intra-node fabric (NVLink; ``intra_bw_GBps`` per direction) and its own NIC to the other
nodes (InfiniBand; ``inter_bw_GBps`` per direction), both with a per-transfer latency.
Compute: ``gemm_tflops`` is the dense peak in the training dtype, ``gemm_efficiency`` the
fraction large GEMMs reach, and ``gemm_half_rows`` the rows per expert at which a grouped
GEMM reaches half of that (small expert batches are slower per row: each expert GEMM
costs as if it had ``gemm_half_rows`` extra rows). ``layer_overhead_us`` is fixed time per
MoE layer and pass (kernel launches, router, permutation bookkeeping).

The step model by shape (:mod:`epscale.plan.shapes`) needs four more: ``sm_count`` (the
GPU's SMs: GEMM tiles of ``gemm_tile_m x gemm_tile_n`` run in waves of them; 0 keeps the
calibrated ``gemm_half_rows`` model), ``mem_bw_GBps`` (HBM bandwidth: memory-bound work is
charged by the bytes it moves; 0 keeps ``layer_overhead_us`` instead), ``fp8_tflops``
(the dense fp8 peak, for runs whose linear layers compute in fp8; 0: none). The GPU
presets set them from the data sheets (H100 SXM: 132 SMs, 3.35 TB/s HBM3, 1,979 dense fp8
TFLOP/s; H800: the same chip with NVLink cut) and charge no flat overhead.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from ..config import ConfigError, apply_overrides, from_dict, load_yaml


@dataclass(frozen=True)
class ClusterSpec:
    """One homogeneous cluster (see the module docstring for the meaning of each field)."""

    name: str = "cluster"
    nodes: int = 1
    gpus_per_node: int = 8
    intra_bw_GBps: float = 450.0
    intra_latency_us: float = 3.0
    inter_bw_GBps: float = 50.0
    inter_latency_us: float = 10.0
    gemm_tflops: float = 989.0
    gemm_efficiency: float = 0.6
    gemm_half_rows: float = 128.0
    layer_overhead_us: float = 50.0
    sm_count: int = 0
    gemm_tile_m: int = 128
    gemm_tile_n: int = 128
    mem_bw_GBps: float = 0.0
    fp8_tflops: float = 0.0
    description: str = ""

    def __post_init__(self) -> None:
        for key in ("nodes", "gpus_per_node"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"cluster key '{key}' = {v!r} is invalid: must be a positive integer")
        for key in ("intra_bw_GBps", "inter_bw_GBps", "gemm_tflops"):
            v = getattr(self, key)
            if not v > 0:
                raise ConfigError(f"cluster key '{key}' = {v!r} is invalid: must be > 0")
        if not 0 < self.gemm_efficiency <= 1:
            raise ConfigError(f"cluster key 'gemm_efficiency' = {self.gemm_efficiency!r} is "
                              "invalid: must be in (0, 1]")
        for key in ("sm_count", "gemm_tile_m", "gemm_tile_n"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if key == "sm_count" else 1):
                raise ConfigError(f"cluster key '{key}' = {v!r} is invalid: must be an integer "
                                  f"{'>= 0' if key == 'sm_count' else '>= 1'}")
        for key in ("intra_latency_us", "inter_latency_us", "gemm_half_rows", "layer_overhead_us",
                    "mem_bw_GBps", "fp8_tflops"):
            if getattr(self, key) < 0:
                raise ConfigError(f"cluster key '{key}' = {getattr(self, key)!r} is invalid: "
                                  "must be >= 0")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def flops_per_s(self) -> float:
        """Sustained GEMM rate of one device on large problems (FLOP/s)."""
        return self.gemm_tflops * 1e12 * self.gemm_efficiency

    def as_dict(self) -> dict:
        return asdict(self)


# H100 SXM: 989 dense bf16 TFLOP/s, NVLink 4 at 900 GB/s bidirectional (450 per
# direction), one 400 Gb/s NDR InfiniBand NIC per GPU (50 GB/s). H800: NVLink cut to
# 400 GB/s bidirectional; DeepSeek-V3's report quotes ~160 GB/s achieved NVLink and 50 GB/s
# IB per GPU, which is what the dispatch kernels see.
H100 = dict(sm_count=132, mem_bw_GBps=3350.0, fp8_tflops=1979.0, layer_overhead_us=0.0)
# B200 (Blackwell): dense tensor-core peaks of NVIDIA's Blackwell data sheets, HGX B200 at
# 1,000 W 2,250 bf16 / 4,500 fp8 (MXFP8 runs at the fp8 rate) TFLOP/s, GB200's B200 at
# 1,200 W 2,500 / 5,000; 8 TB/s HBM3e; NVLink 5 at 1.8 TB/s bidirectional (900 per
# direction); 148 SMs; one 400 Gb/s ConnectX-7 NIC per GPU between NVLink domains.
BLACKWELL = dict(sm_count=148, mem_bw_GBps=8000.0, intra_bw_GBps=900.0, layer_overhead_us=0.0)
PRESETS: dict[str, ClusterSpec] = {
    "h100-node": ClusterSpec(name="h100-node", nodes=1, gpus_per_node=8, **H100,
                             description="one 8x H100 SXM node, NVLink 4"),
    "h100-64": ClusterSpec(name="h100-64", nodes=8, gpus_per_node=8, **H100,
                           description="8 nodes of 8x H100 SXM, NDR InfiniBand per GPU"),
    "field-report": ClusterSpec(
        name="field-report", nodes=128, gpus_per_node=8, **H100,
        description="1,024 H100 SXM (128 nodes x 8): NVLink 4 inside nodes, one 400 Gb/s "
                    "InfiniBand NIC per GPU between them; the field-report scenario "
                    "(64 experts, recipe ref-1t-64e)"),
    "h800-2048": ClusterSpec(
        name="h800-2048", nodes=256, gpus_per_node=8, intra_bw_GBps=160.0, **H100,
        description="DeepSeek-V3's cluster: 2,048 H800, NVLink ~160 GB/s, IB 50 GB/s per GPU"),
    "b200-node": ClusterSpec(name="b200-node", nodes=1, gpus_per_node=8,
                             gemm_tflops=2250.0, fp8_tflops=4500.0, **BLACKWELL,
                             description="one DGX/HGX B200 node: 8x B200 at 1,000 W, NVLink 5, "
                                         "one 400 Gb/s NIC per GPU"),
    "gb200-nvl72": ClusterSpec(name="gb200-nvl72", nodes=1, gpus_per_node=72,
                               gemm_tflops=2500.0, fp8_tflops=5000.0, **BLACKWELL,
                               description="one GB200 NVL72 rack: 72 B200 at 1,200 W in one "
                                           "NVLink 5 domain, one 400 Gb/s NIC per GPU"),
}


def load_cluster(spec: str | Path, overrides: list[str] | None = None) -> ClusterSpec:
    """A preset name or a cluster YAML file (the ClusterSpec fields at top level), with
    optional ``key=value`` overrides (e.g. ``nodes=16``)."""
    if str(spec) in PRESETS:
        data = asdict(PRESETS[str(spec)])
    elif Path(spec).is_file():
        data = load_yaml(spec, empty_hint="name a preset or fill in the cluster keys")
        data.setdefault("name", Path(spec).stem)
    else:
        raise ConfigError(f"cluster '{spec}' is neither a preset nor a file; presets: "
                          f"{', '.join(PRESETS)}")
    data = apply_overrides(data, overrides or [])
    try:
        return from_dict(ClusterSpec, data, prefix="cluster")
    except ConfigError as e:
        raise ConfigError(f"{e} (cluster {spec})") from None


def dump_cluster(cluster: ClusterSpec, path: str | Path, comment: str = "") -> None:
    text = "".join(f"# {line}\n" for line in comment.splitlines()) if comment else ""
    Path(path).write_text(text + yaml.safe_dump(cluster.as_dict(), sort_keys=False))
