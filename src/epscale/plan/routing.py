"""Routing distributions for the simulator: which experts a token picks.

Legend: L distinct layer distributions, E experts, K top-k, M sampled tokens, S step samples.

A distribution is a per-layer vector of router *weights* ``w_LE``; a token picks K distinct
experts by Gumbel-top-k on ``log w`` (the law of sampling without replacement in
proportion to w), inside the ``topk_groups`` best groups when group-limited routing is on
(the group score is the sum of its two best perturbed scores, as ``select_experts`` does).
Sampling M tokens gives both the expected share of assignments of every expert and the
probabilities that a token touches a given rank or node, which the deduplicated and
hierarchical dispatchers' traffic depends on.

Kinds: ``uniform``; ``zipf:s`` (the expert of popularity rank i has weight (i+1)^-s, ranks
shuffled per layer so hot experts land on different ranks); ``trace:PATH`` (a run's
metrics.jsonl: per step and MoE layer ``tokens_per_expert``; weights are fitted so the
sampled shares reproduce the measured ones).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import ConfigError


@dataclass(frozen=True)
class RoutingSpec:
    kind: str = "uniform"          # 'uniform' | 'zipf' | 'trace'
    skew: float = 1.0              # zipf exponent s
    trace: str | None = None       # metrics.jsonl path
    trace_steps: int = 8           # the last N logged steps are used

    @staticmethod
    def parse(text: str, trace_steps: int = 8) -> "RoutingSpec":
        """'uniform', 'zipf', 'zipf:1.2' or 'trace:RUN_DIR/metrics.jsonl' (or a run dir)."""
        kind, _, arg = text.partition(":")
        if kind == "uniform" and not arg:
            return RoutingSpec("uniform")
        if kind == "zipf":
            try:
                s = float(arg) if arg else 1.0
            except ValueError:
                s = -1.0
            if not s >= 0:
                raise ConfigError(f"routing 'zipf:{arg}' is invalid: the skew s must be a number >= 0")
            return RoutingSpec("zipf", skew=s)
        if kind == "trace" and arg:
            p = Path(arg)
            if p.is_dir():
                p = p / "metrics.jsonl"
            if not p.is_file():
                raise ConfigError(f"routing trace '{arg}' is invalid: no file {p}")
            return RoutingSpec("trace", trace=str(p), trace_steps=trace_steps)
        raise ConfigError(f"routing '{text}' is invalid: must be 'uniform', 'zipf[:s]' or "
                          "'trace:PATH' (a metrics.jsonl or a run directory)")

    def label(self) -> str:
        return {"uniform": "uniform", "zipf": f"zipf(s={self.skew:g})",
                "trace": f"trace({Path(self.trace or '').parent.name or self.trace})"}[self.kind]


def zipf_weights(num_layers: int, num_experts: int, s: float, rng: np.random.Generator) -> np.ndarray:
    """[L, E] router weights, popularity rank i -> (i+1)^-s, a fresh shuffle per layer."""
    base = (np.arange(1, num_experts + 1, dtype=np.float64)) ** (-s)
    perms = np.argsort(rng.random((num_layers, num_experts)), axis=1)
    return base[perms]


def sample_topk(weights_LE: np.ndarray, top_k: int, num_tokens: int, rng: np.random.Generator,
                num_groups: int = 0, topk_groups: int = 0) -> np.ndarray:
    """[L, M, K] expert ids chosen by M tokens per layer (Gumbel-top-k, group-limited)."""
    L, E = weights_LE.shape
    logw = np.log(np.maximum(weights_LE, 1e-300))[:, None, :]
    scores = (logw + rng.gumbel(size=(L, num_tokens, E))).astype(np.float32)
    if num_groups > 0 and topk_groups < num_groups:
        per = E // num_groups
        g = scores.reshape(L, num_tokens, num_groups, per)
        top2 = np.sort(g, axis=-1)[..., -min(2, per):].sum(axis=-1)          # [L, M, G]
        keep = np.argsort(-top2, axis=-1)[..., :topk_groups]
        mask = np.ones((L, num_tokens, num_groups), dtype=bool)
        np.put_along_axis(mask, keep, False, axis=-1)
        scores = np.where(np.repeat(mask, per, axis=-1), -np.inf, scores)
    part = np.argpartition(-scores, top_k - 1, axis=-1)[..., :top_k]
    return part


def shares_of(chosen_LMK: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, E] share of all assignments that went to each expert (rows sum to 1)."""
    L, M, K = chosen_LMK.shape
    flat = chosen_LMK.reshape(L, -1) + (np.arange(L) * num_experts)[:, None]
    counts = np.bincount(flat.ravel(), minlength=L * num_experts).reshape(L, num_experts)
    return counts / (M * K)


def inclusion_probs(weights_LE: np.ndarray, top_k: int) -> np.ndarray:
    """[L, E] probability that a token picks each expert under Gumbel-top-k sampling from
    ``weights_LE``, by Rosen's approximation ``pi_e = 1 - exp(-t w_e)`` with t solving
    ``sum_e pi_e = K`` (deterministic, so no sampling noise enters the simulated loads)."""
    w = weights_LE / weights_LE.sum(axis=1, keepdims=True)
    L, E = w.shape
    if top_k >= E:
        return np.ones_like(w)
    lo, hi = np.zeros(L), np.full(L, 1.0)
    while True:
        short = (1 - np.exp(-hi[:, None] * w)).sum(axis=1) < top_k
        if not short.any():
            break
        hi = np.where(short, hi * 2, hi)
    for _ in range(80):
        mid = (lo + hi) / 2
        under = (1 - np.exp(-mid[:, None] * w)).sum(axis=1) < top_k
        lo, hi = np.where(under, mid, lo), np.where(under, hi, mid)
    return 1 - np.exp(-hi[:, None] * w)


def fit_weights(target_LE: np.ndarray, top_k: int, num_tokens: int, rng: np.random.Generator,
                num_groups: int = 0, topk_groups: int = 0, iters: int = 6) -> np.ndarray:
    """Router weights whose sampled shares approach ``target_LE`` (multiplicative updates).
    A share above 1/K cannot be realised (a token picks an expert at most once); such
    targets end up at the largest share that can."""
    target = target_LE / target_LE.sum(axis=1, keepdims=True)
    w = np.maximum(target, 1e-12)
    if top_k == 1 and num_groups == 0:
        return w          # top-1 sampling realises the weights exactly
    for _ in range(iters):
        got = shares_of(sample_topk(w, top_k, num_tokens, rng, num_groups, topk_groups),
                        target.shape[1])
        w = w * np.clip((target + 1e-9) / (got + 1e-9), 0.25, 4.0)
        w = w / w.sum(axis=1, keepdims=True)
    return np.maximum(w, 1e-12)


def read_trace(path: str | Path, num_experts: int, last_steps: int = 8) -> np.ndarray:
    """[S, L, E] tokens per expert from a run's metrics.jsonl (the last ``last_steps``
    records that carry ``layers[*].tokens_per_expert``)."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines()):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"trace {path}: line {n + 1} is not JSON ({e})") from None
        layers = rec.get("layers") if isinstance(rec, dict) else None
        if not layers:
            continue
        counts = [lay.get("tokens_per_expert") for lay in layers]
        if any(c is None for c in counts):
            continue
        rows.append(counts)
    if not rows:
        raise ConfigError(f"trace {path} has no records with layers[*].tokens_per_expert")
    arr = np.asarray(rows[-last_steps:], dtype=np.float64)
    if arr.ndim != 3 or arr.shape[2] != num_experts:
        raise ConfigError(f"trace {path} has {arr.shape[-1]} experts per layer but the recipe has "
                          f"moe.num_experts={num_experts}; simulate the recipe the trace came from")
    return arr


def layer_shares(spec: RoutingSpec, num_layers: int, num_experts: int, top_k: int,
                 rng: np.random.Generator, num_tokens: int = 2048, num_groups: int = 0,
                 topk_groups: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
    """Base routing: ([L, E] router weights, [S, L, E] measured step shares or None).

    For synthetic kinds the weights define everything (step-to-step noise is added by the
    step model from the batch size); for a trace the weights are fitted to its mean shares
    and the per-step shares are returned as well.
    """
    if spec.kind == "uniform":
        return np.full((num_layers, num_experts), 1.0 / num_experts), None
    if spec.kind == "zipf":
        return zipf_weights(num_layers, num_experts, spec.skew, rng), None
    counts = read_trace(spec.trace, num_experts, spec.trace_steps)
    steps = counts / np.maximum(counts.sum(axis=2, keepdims=True), 1)
    mean = steps.mean(axis=0)
    w = fit_weights(mean, top_k, num_tokens, rng, num_groups, topk_groups)
    return w, steps
