"""One full state dict to and from a sharded checkpoint (``epscale checkpoint export`` /
``import``): plain tensors that ``Transformer.load_state_dict`` takes, and back into a
checkpoint that ``epscale train`` resumes from at any dp x ep.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from .paths import (FORMAT_VERSION, CheckpointError, checkpoints_root, latest_valid, sha256,
                    step_dir, validate)
from .store import quiet


def resolve(path: str | Path) -> Path:
    """A checkpoint directory itself, or the newest valid checkpoint of a run directory."""
    p = Path(path)
    if (p / "meta.json").is_file() or (p / ".metadata").is_file():
        return p
    if not p.exists():
        raise CheckpointError(f"'{p}' does not exist")
    found = latest_valid(p)
    if found is None:
        raise CheckpointError(f"'{p}' holds no complete checkpoint (looked in {checkpoints_root(p)})")
    return found[0]


def export_full(path: str | Path, out: str | Path) -> dict:
    """Write ``{"model": full state dict, "optim": {...}, "meta": {...}}`` (plain tensors)
    from a sharded checkpoint or run directory to ``out`` with ``torch.save``."""
    ckpt = resolve(path)
    meta = validate(ckpt)
    with quiet():
        full = _load_state_dict_from_keys(checkpoint_id=str(ckpt))
    full["meta"] = {k: v for k, v in meta.items() if k != "files"}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(full, out)
    return full["meta"]


def import_full(src: str | Path, run_dir: str | Path, step: int | None = None) -> Path:
    """Turn a full state dict (an export, or a bare model ``state_dict``) into a checkpoint
    of ``run_dir`` that ``epscale train`` resumes from (at any dp x ep)."""
    src = Path(src)
    if not src.is_file():
        raise CheckpointError(f"'{src}' does not exist")
    try:
        blob = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"'{src}' is not a torch.save file of tensors: {e}") from e
    if not isinstance(blob, dict):
        raise CheckpointError(f"'{src}' holds a {type(blob).__name__}, not a state dict")
    if "model" in blob and isinstance(blob["model"], dict):
        state = {"model": blob["model"]}
        if isinstance(blob.get("optim"), dict) and blob["optim"]:
            state["optim"] = blob["optim"]
        meta = dict(blob.get("meta") or {})
    elif all(isinstance(v, torch.Tensor) for v in blob.values()):
        state, meta = {"model": blob}, {}
    else:
        raise CheckpointError(f"'{src}' is neither an 'epscale checkpoint export' file nor a "
                              "model state dict (name -> tensor)")
    step = int(meta.get("step", 0) if step is None else step)
    final = step_dir(run_dir, step)
    tmp = final.parent / f".tmp_{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with quiet():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    files = {f.name: {"size": f.stat().st_size, "sha256": sha256(f)}
             for f in sorted(tmp.iterdir()) if f.is_file()}
    meta.update({"format": FORMAT_VERSION, "step": step, "time": time.time(),
                 "world_size": 1, "imported_from": str(src), "files": files})
    meta.setdefault("dp", 1)
    meta.setdefault("ep", 1)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    cfg_path = Path(run_dir) / "config.yaml"
    if isinstance(meta.get("config"), dict) and not cfg_path.exists():
        # so that `epscale train --run-dir RUN_DIR` rebuilds the same model
        cfg_path.write_text(yaml.safe_dump(meta["config"], sort_keys=False))
    return final
