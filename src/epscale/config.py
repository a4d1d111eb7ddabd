"""Typed configs: one dataclass per component, YAML recipes, dotted ``key=value`` overrides.

Every user-facing value is validated when the dataclass is built; a bad value raises
:class:`ConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration value, key or file that cannot work. The message says which and why."""


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"config key '{key}' = {value!r} is invalid: {allowed}")


# --------------------------------------------------------------------------------------
# Component configs
# --------------------------------------------------------------------------------------


@dataclass
class MoEConfig:
    """One Mixture-of-Experts feed-forward layer.

    dim: model width D. hidden_dim: hidden width F of each routed expert.
    num_experts: routed experts E. top_k: experts chosen per token K.
    score_func: 'softmax' or 'sigmoid' router scores. route_norm: renormalise the chosen K
    weights to sum to one. route_scale: factor applied to the gate weights after that.
    num_shared_experts: dense experts every token passes through (their combined hidden
    width is ``num_shared_experts * (shared_hidden_dim or hidden_dim)``).
    num_groups / topk_groups: group-limited routing (DeepSeek-V3 node-limited routing);
    0 disables. capacity_factor: None is dropless, else capacity = ceil(T*K*cf/E) per
    expert. drop_policy: 'probs' drops the lowest-weight assignments first, 'position'
    the latest tokens. activation: 'swiglu' or 'gelu'.
    aux_loss_coeff: Switch/GShard balance loss, with expert fractions over this rank's
    micro-batch (aux_loss_scope 'micro_batch') or over every rank's batch ('global');
    seq_aux_loss_coeff: DeepSeek sequence-wise
    balance loss; z_loss_coeff: ST-MoE router z-loss.
    bias_update_speed: loss-free balancing step ``u`` (0 disables the update).
    use_grouped_mm: 'auto' uses torch's grouped GEMM where it exists, 'never' a loop.
    debug: raise on non-finite inputs instead of counting them.
    """

    dim: int = 256
    hidden_dim: int = 512
    num_experts: int = 8
    top_k: int = 2
    score_func: str = "softmax"
    route_norm: bool = True
    route_scale: float = 1.0
    num_shared_experts: int = 0
    shared_hidden_dim: int | None = None
    num_groups: int = 0
    topk_groups: int = 0
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    activation: str = "swiglu"
    aux_loss_coeff: float = 0.0
    aux_loss_scope: str = "micro_batch"
    seq_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    bias_update_speed: float = 0.0
    use_grouped_mm: str = "auto"
    debug: bool = False

    def __post_init__(self) -> None:
        p = "moe"
        _check_types(self, p)
        for name in ("dim", "hidden_dim", "num_experts", "top_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(f"{p}.{name}", v, "must be a positive integer")
        if self.top_k > self.num_experts:
            _fail(f"{p}.top_k", self.top_k,
                  f"must be <= moe.num_experts ({self.num_experts}); a token cannot choose "
                  "more experts than exist")
        _choice(f"{p}.score_func", self.score_func, ("softmax", "sigmoid"))
        _choice(f"{p}.drop_policy", self.drop_policy, ("probs", "position"))
        _choice(f"{p}.aux_loss_scope", self.aux_loss_scope, ("micro_batch", "global"))
        _choice(f"{p}.activation", self.activation, ("swiglu", "gelu"))
        _choice(f"{p}.use_grouped_mm", self.use_grouped_mm, ("auto", "never"))
        if self.num_shared_experts < 0:
            _fail(f"{p}.num_shared_experts", self.num_shared_experts, "must be >= 0")
        if self.shared_hidden_dim is not None and self.shared_hidden_dim < 1:
            _fail(f"{p}.shared_hidden_dim", self.shared_hidden_dim, "must be >= 1 or null")
        if self.route_scale <= 0:
            _fail(f"{p}.route_scale", self.route_scale, "must be > 0")
        if self.num_groups < 0 or self.topk_groups < 0:
            _fail(f"{p}.num_groups/topk_groups", (self.num_groups, self.topk_groups),
                  "must be >= 0")
        if self.num_groups > 0:
            if self.num_experts % self.num_groups:
                _fail(f"{p}.num_groups", self.num_groups,
                      f"must divide moe.num_experts ({self.num_experts})")
            if not 1 <= self.topk_groups <= self.num_groups:
                _fail(f"{p}.topk_groups", self.topk_groups,
                      f"must be in [1, moe.num_groups={self.num_groups}]")
            if self.topk_groups * (self.num_experts // self.num_groups) < self.top_k:
                _fail(f"{p}.topk_groups", self.topk_groups,
                      f"the {self.topk_groups} kept groups hold "
                      f"{self.topk_groups * (self.num_experts // self.num_groups)} experts, "
                      f"fewer than moe.top_k={self.top_k}")
        elif self.topk_groups > 0:
            _fail(f"{p}.topk_groups", self.topk_groups,
                  "needs moe.num_groups > 0 (group-limited routing is off)")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            _fail(f"{p}.capacity_factor", self.capacity_factor, "must be > 0 or null (dropless)")
        for name in ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "bias_update_speed"):
            if getattr(self, name) < 0:
                _fail(f"{p}.{name}", getattr(self, name), "must be >= 0")

    @property
    def shared_width(self) -> int:
        """Hidden width of the merged shared-expert FFN (0 when there is none)."""
        return self.num_shared_experts * (self.shared_hidden_dim or self.hidden_dim)


@dataclass
class ModelConfig:
    """Decoder-only MoE transformer. Layers < num_dense_layers are dense; after that every
    ``moe_every``-th layer is MoE (GLaM style), the rest dense with ``dense_hidden_dim``."""

    vocab_size: int = 256
    dim: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    seq_len: int = 256
    dense_hidden_dim: int = 1024
    num_dense_layers: int = 0
    moe_every: int = 1
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # attention: 'mha' (multi-head, grouped-query when num_kv_heads < num_heads) or 'mla'
    # (DeepSeek multi-head latent attention; the *_rank and *_head_dim keys below).
    attention: str = "mha"
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    def __post_init__(self) -> None:
        p = "model"
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "seq_len",
                     "dense_hidden_dim", "moe_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(f"{p}.{name}", v, "must be a positive integer")
        if self.num_dense_layers < 0 or self.num_dense_layers > self.num_layers:
            _fail(f"{p}.num_dense_layers", self.num_dense_layers,
                  f"must be in [0, model.num_layers={self.num_layers}]")
        _choice(f"{p}.attention", self.attention, ("mha", "mla"))
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            _fail(f"{p}.num_kv_heads", self.num_kv_heads,
                  f"must divide model.num_heads ({self.num_heads})")
        if self.head_dim is None and self.dim % self.num_heads:
            _fail(f"{p}.num_heads", self.num_heads,
                  f"must divide model.dim ({self.dim}) unless model.head_dim is set")

    def is_moe_layer(self, layer_id: int) -> bool:
        if layer_id < self.num_dense_layers:
            return False
        return (layer_id - self.num_dense_layers) % self.moe_every == 0


@dataclass
class ParallelConfig:
    """Process layout: world = dp * ep. ranks_per_node None means LOCAL_WORLD_SIZE."""

    dp: int = 1
    ep: int = 1
    dispatcher: str = "dedup"
    ranks_per_node: int | None = None
    overlap_chunks: int = 1
    # dispatch payload: 'auto' (the activations' dtype), 'bf16', or 'fp8' (e4m3 with
    # per-128-channel scales; dedup and hierarchical only).
    payload: str = "auto"
    # Least-loaded spill-over (LLEP): when max/mean EP-rank load of a step exceeds this,
    # hot experts' overflow rows run on the least-loaded ranks (null: off; needs ep >= 2).
    spill_threshold: float | None = None
    spill_min_rows: int = 32
    # Redundant experts (EPLB-style): extra physical expert slots per MoE layer over the EP
    # group (num_experts + redundant_experts must divide by ep); the hottest experts get
    # copies, re-planned every rebalance_every steps (0: keep the first plan) from the loads
    # of the last rebalance_window steps (null: rebalance_every).
    redundant_experts: int = 0
    rebalance_every: int = 100
    rebalance_window: int | None = None

    def __post_init__(self) -> None:
        _choice("parallel.payload", self.payload, ("auto", "bf16", "fp8"))
        for name in ("redundant_experts", "rebalance_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                _fail(f"parallel.{name}", v, "must be an integer >= 0")
        if self.rebalance_window is not None and (
                not isinstance(self.rebalance_window, int) or self.rebalance_window < 1):
            _fail("parallel.rebalance_window", self.rebalance_window,
                  "must be a positive integer (steps) or null (= rebalance_every)")
        if self.redundant_experts and self.spill_threshold is not None:
            _fail("parallel.redundant_experts", self.redundant_experts,
                  "cannot be combined with parallel.spill_threshold (spill-over plans for the "
                  "plain one-copy layout); use one of the two, or set redundant_experts: 0")
        if self.spill_threshold is not None and self.spill_threshold < 1.0:
            _fail("parallel.spill_threshold", self.spill_threshold,
                  "must be >= 1.0 (a max/mean rank-load ratio) or null (off)")
        if self.spill_min_rows < 1:
            _fail("parallel.spill_min_rows", self.spill_min_rows, "must be >= 1")
        for name in ("dp", "ep", "overlap_chunks"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(f"parallel.{name}", v, "must be a positive integer")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            _fail("parallel.ranks_per_node", self.ranks_per_node, "must be >= 1 or null")


@dataclass
class DataConfig:
    """Training text. source: 'stdlib' (the Python standard library's source files),
    a path to a text file or folder, or a ``.bin`` token memmap (``dtype`` uint16/uint32)."""

    source: str = "stdlib"
    dtype: str = "uint16"
    val_fraction: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        _choice("data.dtype", self.dtype, ("uint16", "uint32"))
        if not 0.0 < self.val_fraction < 1.0:
            _fail("data.val_fraction", self.val_fraction, "must be in (0, 1)")


@dataclass
class TrainConfig:
    """Optimisation and the loop."""

    steps: int = 300
    micro_batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 1234
    dtype: str = "auto"
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 1
    ckpt_every: int = 100
    ckpt_keep: int = 2
    spike_factor: float = 0.0
    spike_window: int = 50
    spike_patience: int = 3
    # A collective blocked longer than this ends the job with a report naming the rank,
    # the operation and the step (epscale.launch.watchdog); 0 disables the watchdog.
    collective_timeout_s: float = 600.0
    # Before training, every rank joins a short timed all-reduce/all-to-all; a slow or
    # missing rank is reported by host and rank (multi-process runs only).
    preflight: bool = True

    def __post_init__(self) -> None:
        if not self.collective_timeout_s >= 0:
            _fail("train.collective_timeout_s", self.collective_timeout_s,
                  "must be >= 0 seconds (0 disables the watchdog)")
        for name in ("steps", "micro_batch_size", "grad_accum", "eval_batches", "log_every",
                     "ckpt_keep", "spike_window", "spike_patience"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(f"train.{name}", v, "must be a positive integer")
        for name in ("warmup_steps", "eval_every", "ckpt_every"):
            if getattr(self, name) < 0:
                _fail(f"train.{name}", getattr(self, name), "must be >= 0 (0 disables)")
        if not self.lr > 0:
            _fail("train.lr", self.lr, "must be > 0")
        if self.min_lr < 0 or self.min_lr > self.lr:
            _fail("train.min_lr", self.min_lr, f"must be in [0, train.lr={self.lr}]")
        _choice("train.dtype", self.dtype, ("auto", "float32", "bfloat16"))


@dataclass
class MetricsConfig:
    """Where step metrics go besides RUN_DIR/metrics.jsonl (always written).

    tensorboard: also write TensorBoard events to RUN_DIR/tensorboard (the 'monitor'
    extra). prometheus_port: rank 0 serves /metrics there for a cluster's Prometheus
    (null: off; 0: any free port). dead_after_steps: an expert with no tokens for this many
    steps counts as dead in the metrics and alerts.
    """

    tensorboard: bool = False
    prometheus_port: int | None = None
    dead_after_steps: int = 50

    def __post_init__(self) -> None:
        if self.prometheus_port is not None and not 0 <= self.prometheus_port <= 65535:
            _fail("metrics.prometheus_port", self.prometheus_port, "must be a port in [0, 65535] or null")
        if self.dead_after_steps < 1:
            _fail("metrics.dead_after_steps", self.dead_after_steps, "must be >= 1")


@dataclass
class RunConfig:
    """A whole recipe: the YAML file's top-level sections."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    name: str = "run"
    # 'tiny' asks load_config to shrink a published recipe to CPU size keeping its family's
    # structure (epscale.recipes.apply_scale; the other overrides then apply on top). The
    # shrunk config says 'full' again, so re-loading it (a run's config.yaml) is stable.
    scale: str = "full"

    def __post_init__(self) -> None:
        if self.moe.dim != self.model.dim:
            _fail("moe.dim", self.moe.dim, f"must equal model.dim ({self.model.dim})")
        _choice("scale", self.scale, ("full", "tiny"))


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        hint = difflib.get_close_matches(str(value), allowed, n=1)
        extra = f"; did you mean '{hint[0]}'?" if hint else ""
        _fail(key, value, f"must be one of {', '.join(repr(a) for a in allowed)}{extra}")


# --------------------------------------------------------------------------------------
# Building dataclasses from dicts, YAML and overrides
# --------------------------------------------------------------------------------------


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a (resolved) type annotation, converting harmless cases."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None:
            if type(None) in args:
                return None
            _fail(key, value, f"must not be null (expected {_type_name(annotation)})")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        _fail(key, value, "must be true or false")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        _fail(key, value, "must be an integer")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        _fail(key, value, "must be a number")
    if annotation is str:
        if isinstance(value, str):
            return value
        _fail(key, value, "must be a string")
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, dict):
            _fail(key, value, f"must be a mapping of {annotation.__name__} fields")
        return from_dict(annotation, value, prefix=key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            _fail(key, value, "must be a list")
        return origin(value)
    if origin is dict:
        if not isinstance(value, dict):
            _fail(key, value, "must be a mapping")
        return value
    return value


def _check_types(cfg: Any, prefix: str) -> None:
    """Type-check (and harmlessly coerce) every field of a dataclass built directly in
    Python, so a wrong type gets the same ConfigError as one read from YAML."""
    hints = typing.get_type_hints(type(cfg))
    for f in fields(cfg):
        if f.init:
            setattr(cfg, f.name, _coerce(f"{prefix}.{f.name}", getattr(cfg, f.name), hints[f.name]))


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", str(annotation))


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a (nested) dict. Unknown keys and wrong types raise
    ConfigError with the dotted key and, for typos, a did-you-mean suggestion."""
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{prefix or cls.__name__}' must be a mapping, "
                          f"got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{dotted}'.{hint} "
                              f"Known keys here: {', '.join(names)}")
        kwargs[key] = _coerce(dotted, value, hints[key])
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as e:  # pragma: no cover - defensive: missing required field
        raise ConfigError(f"config section '{prefix or cls.__name__}': {e}") from e


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config dataclass (for YAML dumps and checkpoints)."""
    return dataclasses.asdict(cfg)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'moe.top_k=2'`` -> (['moe', 'top_k'], 2). The value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key=value (e.g. train.steps=50)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted ``key=value`` overrides to a nested dict (a copy is returned)."""
    import copy

    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{text}': '{part}' is not a section")
        node[path[-1]] = value
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, with errors that name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{p}' is not valid YAML: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping at top level")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                cls: type = RunConfig) -> Any:
    """Load a recipe (``RunConfig`` by default) from YAML with dotted overrides.

    The ``moe.dim`` key follows ``model.dim`` unless set explicitly.
    """
    data = load_yaml(path) if path is not None else {}
    data = apply_overrides(data, overrides or [])
    if cls is RunConfig:
        model_dim = (data.get("model") or {}).get("dim", ModelConfig.dim)
        if isinstance(data.get("moe", {}), dict):
            data.setdefault("moe", {}).setdefault("dim", model_dim)
    try:
        cfg = from_dict(cls, data)
    except ConfigError as e:
        where = f" (in {path})" if path is not None else ""
        raise ConfigError(f"{e}{where}") from None
    if cls is RunConfig and cfg.scale == "tiny":
        from .recipes import apply_scale

        cfg = apply_scale(cfg, overrides or [])
    return cfg


def dump_yaml(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
