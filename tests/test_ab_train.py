"""benchmarks/ab_train.py's comparison (the trainer runs themselves are the benchmark's):
two run directories are the same only when every deterministic number of metrics.jsonl
and every tensor of the final checkpoint is the same bit for bit."""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parent.parent


def _load_script():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("ab_train", ROOT / "benchmarks" / "ab_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_dir(path: Path, loss: float, weight: torch.Tensor, step_time: float) -> Path:
    (path / "checkpoints").mkdir(parents=True)
    (path / "config.yaml").write_text("train:\n  seed: 1234\n")
    records = [{"event": "start", "step": 0, "time": step_time},
               {"step": 1, "loss": loss, "grad_norm": 0.5, "time": step_time,
                "step_time_s": step_time, "time_breakdown": {"forward": step_time},
                "layers": [{"layer": 0, "tokens_per_expert": [3, 5]}]}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with warnings.catch_warnings():  # one process, no process group
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": weight}},
                 checkpoint_id=str(path / "checkpoints" / "step_00000001"))
    return path


def test_bit_for_bit_comparison(tmp_path):
    ab = _load_script()
    w = torch.tensor([1.0, 2.0, 3.0])
    base = _run_dir(tmp_path / "base", 2.5, w, step_time=1.0)
    same = _run_dir(tmp_path / "same", 2.5, w.clone(), step_time=7.0)  # only the clock differs
    assert ab.compare_metrics(base, same) == []
    assert ab.compare_checkpoints(base, same) == ([], 1)

    one_ulp = torch.nextafter(torch.tensor(2.5, dtype=torch.float64), torch.tensor(3.0,
                                                                              dtype=torch.float64))
    w2 = w.clone()
    w2[1] = torch.nextafter(w2[1], torch.tensor(3.0))
    other = _run_dir(tmp_path / "other", float(one_ulp), w2, step_time=1.0)
    diffs = ab.compare_metrics(base, other)
    assert len(diffs) == 1 and diffs[0].startswith("step 1: loss:")
    assert ab.compare_checkpoints(base, other) == (["checkpoint tensor model.w differs"], 1)
    assert ab.same(float("nan"), float("nan")) and not ab.same(1, 1.0)
