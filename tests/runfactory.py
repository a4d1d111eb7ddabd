"""Synthetic run directories following the metrics.jsonl contract, healthy or broken on
purpose, for the monitor's tests (and the README screenshot).

``make_run(path, **scenario)`` writes RUN_DIR/{config.yaml, metrics.jsonl, heartbeats/}
and returns the path. Scenario switches (all off by default = a healthy, finished run):

collapse_layer / collapse_from: that layer routes every token to expert 0 from that step.
dead: {layer: [experts]} that receive no tokens from ``dead_from``.
straggler_rank / straggler_from / straggler_factor: that rank's busy time grows.
nan_at: [steps] with a non-finite loss/grad norm, skipped, plus a skip_nonfinite event.
spike_at: [steps] where the loss jumps x3.
slow_from: throughput falls to 40% from that step.
comm_share: the communication share of every step (default 0.2).
bias_growth: per-step growth of layer 0's expert-bias range (saturates when large).
drop_frac: dropped share of assignments in every layer.
silent_rank: that rank's heartbeat stops ``silent_for_s`` seconds before ``now``; the
    run is left running (no end event).
ended: write the end event (default True unless silent_rank / truncate is set).
truncate_last: cut the last line in the middle (a crash mid-write).
minimal: write only step, time, loss, lr, tokens_per_s and per-layer tokens_per_expert.
layout_change_at: [steps] where an elastic restart changed the layout (a layout_change
    event: half the ranks lost, then back).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import yaml

SECTIONS = ("data", "forward", "attention", "router", "dispatch", "experts", "combine",
            "backward", "optimizer", "sync")


def make_run(path: str | Path, *, steps: int = 60, layers: int = 2, experts: int = 8,
             top_k: int = 2, dp: int = 1, ep: int = 2, tokens: int = 2048, seed: int = 0,
             now: float = 1_700_000_000.0, collapse_layer: int | None = None,
             collapse_from: int = 1, dead: dict[int, list[int]] | None = None,
             dead_from: int = 1, straggler_rank: int | None = None, straggler_from: int = 1,
             straggler_factor: float = 1.8, nan_at: tuple[int, ...] = (),
             spike_at: tuple[int, ...] = (), slow_from: int | None = None,
             comm_share: float = 0.2, bias_growth: float = 0.0, drop_frac: float = 0.0,
             silent_rank: int | None = None, silent_for_s: float = 3600.0,
             ended: bool | None = None, truncate_last: bool = False,
             minimal: bool = False, layout_change_at: tuple[int, ...] = (),
             name: str = "synthetic") -> Path:
    run = Path(path)
    (run / "heartbeats").mkdir(parents=True, exist_ok=True)
    (run / "checkpoints").mkdir(exist_ok=True)
    (run / "logs").mkdir(exist_ok=True)
    world = dp * ep
    cfg = {"name": name,
           "model": {"dim": 64, "num_layers": layers, "num_heads": 4, "seq_len": 128,
                     "vocab_size": 256},
           "moe": {"dim": 64, "hidden_dim": 128, "num_experts": experts, "top_k": top_k},
           "parallel": {"dp": dp, "ep": ep, "dispatcher": "dedup"},
           "data": {"source": "stdlib"}, "train": {"steps": steps, "lr": 3e-3}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    if ended is None:
        ended = silent_rank is None and not truncate_last
    rng = np.random.default_rng(seed)
    dead = dead or {}
    t0 = now - steps * 0.5 - (silent_for_s if silent_rank is not None else 60.0)
    lines: list[str] = [json.dumps({"event": "start", "step": 0, "time": t0, "world_size": world})]
    prefs = [rng.dirichlet(np.full(experts, 30.0)) for _ in range(layers)]
    bias_range = 0.0
    t = t0
    for step in range(1, steps + 1):
        busy = np.full(world, 0.4) * rng.uniform(0.97, 1.03, size=world)
        if straggler_rank is not None and step >= straggler_from:
            busy[straggler_rank] *= straggler_factor
        if slow_from is not None and step >= slow_from:
            busy *= 2.5
        step_time = float(busy.max() / (1 - comm_share))
        t += step_time
        lay_out = []
        bias_range += bias_growth
        for lay in range(layers):
            p = prefs[lay].copy()
            if collapse_layer == lay and step >= collapse_from:
                p = np.zeros(experts)
                p[0] = 1.0
            for e in dead.get(lay, []):
                if step >= dead_from:
                    p[e] = 0.0
            p = p / p.sum()
            counts = rng.multinomial(tokens * top_k, p)
            per_rank = counts.reshape(ep, experts // ep).sum(1)
            mean = counts.mean()
            entry: dict[str, Any] = {
                "layer": lay, "tokens_per_expert": counts.tolist(),
                "rank_load": per_rank.tolist(),
                "max_vio": float(counts.max() / mean - 1),
                "dropped_frac": float(drop_frac),
                "router_entropy": float(-(p[p > 0] * np.log(p[p > 0])).sum()),
                "bias_min": -bias_range / 2 if lay == 0 else -0.01,
                "bias_max": bias_range / 2 if lay == 0 else 0.01}
            lay_out.append(entry)
        loss = 5.5 * math.exp(-step / 40) + 2.2 + float(rng.normal(0, 0.02))
        if step in spike_at:
            loss *= 3
        gnorm = 1.0 + float(rng.normal(0, 0.05))
        skipped = False
        if step in nan_at:
            loss, gnorm, skipped = float("nan"), float("inf"), True
        tps = world * tokens / step_time
        bd = {s: 0.0 for s in SECTIONS}
        bd.update(data=0.01 * step_time, forward=0.15 * step_time, attention=0.1 * step_time,
                  router=0.02 * step_time, experts=0.2 * step_time,
                  backward=(0.45 - comm_share / 2) * step_time, optimizer=0.07 * step_time,
                  dispatch=comm_share * 0.35 * step_time, combine=comm_share * 0.35 * step_time,
                  sync=comm_share * 0.3 * step_time)
        rec: dict[str, Any] = {
            "step": step, "time": t, "loss": loss, "lr": 3e-3 * min(1.0, step / 10),
            "grad_norm": gnorm, "tokens_per_s": tps, "tokens_per_s_per_proc": tps / world,
            "step_time_s": step_time, "time_breakdown": bd, "comm_share": comm_share,
            "mfu": 0.01 * tps / (world * tokens / 0.5 * (1 - comm_share)) * 40,
            "max_vio": max(x["max_vio"] for x in lay_out),
            "worst_rank_idle": float(max(1 - min(x["rank_load"]) / max(x["rank_load"])
                                         for x in lay_out)),
            "dropped_frac": float(drop_frac), "skipped": skipped, "layers": lay_out,
            "rank_step_time_s": [step_time] * world,
            "mem_mb": 1500.0 + 2 * step}
        rec["rank_wait_frac"] = [float(1 - b / step_time) for b in busy]
        if minimal:  # a bare-bones writer: a few scalars and the routing counts only
            rec = {k: rec[k] for k in ("step", "time", "loss", "lr", "tokens_per_s")}
            rec["layers"] = [{"layer": x["layer"], "tokens_per_expert": x["tokens_per_expert"]}
                             for x in lay_out]
        if step % 20 == 0:
            rec["val_loss"] = loss + 0.05
        lines.append(json.dumps(rec))
        if step in nan_at:
            lines.append(json.dumps({"event": "skip_nonfinite", "step": step, "time": t}))
        if step in layout_change_at:
            k = layout_change_at.index(step)
            old, new = (world, world // 2) if k % 2 == 0 else (world // 2, world)
            lines.append(json.dumps({
                "event": "layout_change", "step": step, "time": t,
                "old": {"world_size": old, "dp": max(1, old // ep), "ep": ep,
                        "grad_accum": world // old, "global_batch": 8 * world},
                "new": {"world_size": new, "dp": max(1, new // ep), "ep": ep,
                        "grad_accum": world // new, "global_batch": 8 * world},
                "ranks_lost": old - new, "hosts_lost": {"node2": old - new} if old > new else {},
                "hosts_gained": {"node2": new - old} if new > old else {}, "steps_lost": 2,
                "outage_s": 9.0, "setup_s": 4.0, "load_s": 0.3, "first_step_s": 0.6,
                "resume_s": 13.9}))
        if step % 25 == 0:
            lines.append(json.dumps({"event": "checkpoint", "step": step, "time": t,
                                     "path": f"checkpoints/step{step:06d}"}))
    if ended:
        lines.append(json.dumps({"event": "end", "step": steps, "time": t}))
    text = "\n".join(lines) + "\n"
    if truncate_last:
        last = lines[-1]
        text = "\n".join(lines[:-1]) + "\n" + last[: len(last) // 2]
    (run / "metrics.jsonl").write_text(text)
    hb_time = t if ended else now - 5.0
    for r in range(world):
        stamp = (now - silent_for_s) if r == silent_rank else hb_time
        hb_step = steps if r != silent_rank else max(1, steps // 2)
        (run / "heartbeats" / f"rank{r}.json").write_text(json.dumps(
            {"rank": r, "host": f"node{r // 4:02d}", "step": hb_step, "time": stamp}))
    return run
