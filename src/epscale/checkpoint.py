"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP) that reshard on load.

Layout of one checkpoint, ``RUN_DIR/checkpoints/step_00000100/``:

* DCP files (``.metadata``, ``__{rank}_0.distcp``) holding ``{"model": ..., "optim": ...}``.
  Routed-expert weights and their AdamW moments are DTensors on the (dp, ep) mesh
  (Replicate over dp, Shard(0) over ep), every other tensor is a plain replicated tensor,
  so a checkpoint written at one (dp, ep) loads at any other: DCP reads the overlapping
  slices of the saved shards.
* ``rank_{r}.pt``: that rank's RNG states.
* ``meta.json``, written last by rank 0: step, layout, data position, loop counters, the
  config, and the size and SHA-256 of every file (a corrupt file is detected on load).

A save goes to ``checkpoints/.tmp_step_.../`` and is renamed when complete, so a crash
mid-save never touches the latest good checkpoint; only the newest ``keep`` are kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from .config import ConfigError

FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message names its path."""


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_root(run_dir) / f"step_{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step_*`` directory, oldest first (complete or not)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def read_meta(path: Path) -> dict:
    try:
        return json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint '{path}' is incomplete: no meta.json") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint '{path}' has an unreadable meta.json: {e}") from None


def validate(path: Path, verify_hashes: bool = True) -> dict:
    """The checkpoint's meta if every listed file is present with the recorded size (and
    hash); raises CheckpointError naming the path and the first problem otherwise."""
    meta = read_meta(path)
    files = meta.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise CheckpointError(f"checkpoint '{path}' is incomplete: meta.json lists no DCP files")
    for name, info in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint '{path}' is incomplete: '{name}' is missing")
        if f.stat().st_size != info["size"]:
            raise CheckpointError(f"checkpoint '{path}' is corrupt: '{name}' has "
                                  f"{f.stat().st_size} bytes, expected {info['size']}")
        if verify_hashes and _sha256(f) != info["sha256"]:
            raise CheckpointError(f"checkpoint '{path}' is corrupt: '{name}' fails its SHA-256 check")
    return meta


def latest_valid(run_dir: str | Path, report: Callable[[str], None] = print
                 ) -> tuple[Path, dict] | None:
    """The newest checkpoint that validates, reporting (with its path) every newer one
    that does not; None when there is none."""
    for _step, path in reversed(list_checkpoints(run_dir)):
        try:
            return path, validate(path)
        except CheckpointError as e:
            report(f"{e}; trying the previous checkpoint")
    return None


# --------------------------------------------------------------------------------------
# State dicts: expert tensors as DTensors on the (dp, ep) mesh
# --------------------------------------------------------------------------------------


def _is_expert(param: torch.Tensor) -> bool:
    from .training.optim import is_expert_param

    return is_expert_param(param)


def _wrap(t: torch.Tensor, expert: bool, dims) -> torch.Tensor:
    if not expert or getattr(dims, "mesh", None) is None or dims.ep == 1:
        return t
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(t, dims.mesh, [Replicate(), Shard(0)], run_check=False)


class _PlacedExperts:
    """Expert tensors of a model placed with redundant experts (``parallel.redundant_experts``),
    seen in the logical layout: this rank's E/ep logical experts, contiguous, exactly as
    an unplaced model holds them. Checkpoints therefore never depend on the placement (a
    checkpoint written with one placement, or none, loads into any other, at any ep).

    ``for_save`` gathers the logical rows from the slots (one exchange per layer);
    ``for_load`` hands out empty logical buffers and ``scatter`` copies what DCP loaded
    into them back to every slot that holds the expert (one exchange per layer).
    """

    def __init__(self, model: nn.Module, opt, dims):
        from .moe.layer import MoE
        from .placement.runtime import get_placement

        self.placement = get_placement(model)
        self.dims, self.opt = dims, opt
        if opt is not None and self.placement is not None:
            from .training.optim import ensure_optimizer_state

            ensure_optimizer_state(opt)
        self.layers = []  # (layer index, module name prefix, moe)
        if self.placement is not None:
            moes = [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
            self.layers = [(i, n, m) for i, (n, m) in enumerate(moes)]
        self.views: dict[str, dict[str, torch.Tensor]] = {}  # param name -> logical views
        self._live: list[tuple[int, list[torch.Tensor], list[torch.Tensor]]] = []

    def _collect(self, load: bool) -> None:
        from .placement.runtime import expert_state, logical_layout, relayout_rows

        for i, prefix, moe in self.layers:
            fields = expert_state(moe, self.opt, keys=("exp_avg", "exp_avg_sq"))
            live = [t for _, _, t in fields]
            E, ep = moe.cfg.num_experts, self.dims.ep
            if load:
                logical = [t.new_zeros((E // ep, *t.shape[1:])) for t in live]
                self._live.append((i, live, logical))
            else:
                logical, _, _ = relayout_rows(live, self.placement.phy2log[i].numpy(),
                                              logical_layout(E), self.dims)
            for (pname, key, _), t in zip(fields, logical):
                name = f"{prefix}.experts.{pname}" if prefix else f"experts.{pname}"
                self.views.setdefault(name, {})[key] = t

    def for_save(self) -> "_PlacedExperts":
        self._collect(load=False)
        return self

    def for_load(self) -> "_PlacedExperts":
        self._collect(load=True)
        return self

    @torch.no_grad()
    def scatter(self) -> None:
        """After a load into the logical buffers: copy them into every slot."""
        from .placement.runtime import logical_layout, relayout_rows

        for i, live, logical in self._live:
            E = self.placement.replica_count.shape[1]
            placed, _, _ = relayout_rows(logical, logical_layout(E),
                                         self.placement.phy2log[i].numpy(), self.dims)
            for t, v in zip(live, placed):
                t.copy_(v)


def build_state(model: nn.Module, opt: torch.optim.Optimizer | None, dims,
                placed: "_PlacedExperts | None" = None) -> dict[str, Any]:
    """``{"model": {name: tensor}, "optim": {name: {"step", "exp_avg", "exp_avg_sq"}}}``
    whose tensors share storage with the live parameters and optimizer state (a DCP load
    writes straight into them). Experts under a redundant-expert placement appear in their
    logical layout instead (``placed``: a :class:`_PlacedExperts` prepared for save or
    load)."""
    if opt is not None:
        from .training.optim import ensure_optimizer_state

        ensure_optimizer_state(opt)
    views = placed.views if placed is not None else {}
    params = dict(model.named_parameters())
    model_sd = {}
    for name, t in model.state_dict().items():
        p = params.get(name)
        if name in views:
            t = views[name]["param"]
        model_sd[name] = _wrap(t, p is not None and _is_expert(p), dims)
    state: dict[str, Any] = {"model": model_sd}
    if opt is not None:
        optim_sd = {}
        for name, p in params.items():
            st = opt.state.get(p)
            if not st:
                continue
            expert = _is_expert(p)
            src = views.get(name, st)
            optim_sd[name] = {"step": st["step"], "exp_avg": _wrap(src["exp_avg"], expert, dims),
                              "exp_avg_sq": _wrap(src["exp_avg_sq"], expert, dims)}
        state["optim"] = optim_sd
    return state


def _copy_back(model: nn.Module, opt, state: dict, skip: set[str] = frozenset()) -> None:
    """Copy DTensor local shards into the live tensors when DCP did not load in place
    (``skip``: names whose tensors are not the live ones, the placed experts)."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    live = model.state_dict()
    for name, t in state["model"].items():
        if name not in skip and live[name].data_ptr() != local(t).data_ptr():
            live[name].copy_(local(t))
    if opt is not None and "optim" in state:
        params = dict(model.named_parameters())
        for name, entry in state["optim"].items():
            if name in skip:
                continue
            st = opt.state[params[name]]
            for k, t in entry.items():
                if st[k].data_ptr() != local(t).data_ptr():
                    st[k].copy_(local(t))


def _copy_local(dst: torch.Tensor, loaded: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    src = loaded.to_local() if isinstance(loaded, DTensor) else loaded
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src)


def _saved_keys(path: Path) -> dict[str, Any]:
    reader = dcp.FileSystemReader(str(path))
    return reader.read_metadata().state_dict_metadata


def check_compatible(path: Path, state: dict) -> None:
    """Raise CheckpointError when the saved tensors do not match the model's names/shapes."""
    saved = _saved_keys(path)
    from torch.distributed.tensor import DTensor

    problems = []
    for name, t in state["model"].items():
        key = f"model.{name}"
        if key not in saved:
            problems.append(f"'{name}' is not in the checkpoint")
            continue
        shape = tuple(t.shape) if not isinstance(t, DTensor) else tuple(t.size())
        saved_shape = tuple(getattr(saved[key], "size", ()))
        if saved_shape != shape:
            problems.append(f"'{name}' has shape {saved_shape} there, {shape} in the model")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"checkpoint '{path}' does not fit this model: "
                              f"{'; '.join(problems[:3])}{more}. Was it written with another "
                              "model config?")


# --------------------------------------------------------------------------------------
# Save / load
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet():
    """DCP warns that it 'assumes a single process' whenever no process group exists;
    for a single-process run that is exactly the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*single process.*")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: str | Path, step: int, model: nn.Module, opt, dims, meta: dict,
         keep: int = 2, extra_files: dict[str, Any] | None = None) -> Path:
    """Collective: every rank calls it. Writes ``step_{step:08d}`` atomically (temporary
    directory, then rename) and deletes all but the newest ``keep`` checkpoints.
    ``extra_files``: {file name: object} that rank 0 writes with ``torch.save`` beside the
    shards (listed and hashed in meta.json like them; read back with :func:`load_extra`)."""
    root = checkpoints_root(run_dir)
    final = step_dir(run_dir, step)
    tmp = root / f".tmp_{final.name}"
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    state = build_state(model, opt, dims, _PlacedExperts(model, opt, dims).for_save())
    with _quiet():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
    torch.save(rng_state(), tmp / f"rank_{rank}.pt")
    if rank == 0:
        for name, obj in (extra_files or {}).items():
            torch.save(obj, tmp / name)
    _barrier()
    if rank == 0:
        files = {}
        for f in sorted(tmp.iterdir()):
            if f.is_file():
                files[f.name] = {"size": f.stat().st_size, "sha256": _sha256(f)}
        full_meta = {"format": FORMAT_VERSION, "step": step, "time": time.time(),
                     "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                     "dp": dims.dp, "ep": dims.ep, **meta, "files": files}
        with open(tmp / "meta.json", "w") as f:
            json.dump(full_meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # re-saving a step (after a rollback): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        for _s, old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load(path: Path, model: nn.Module, opt, dims, restore_rng: bool = True) -> dict:
    """Collective. Loads model (and optimizer state when ``opt`` is given and the
    checkpoint has it) into the live tensors, resharding as needed; returns meta.json."""
    meta = read_meta(path)
    placed = _PlacedExperts(model, opt, dims).for_load()
    state = build_state(model, opt, dims, placed)
    check_compatible(path, state)
    if opt is not None and not any(k.startswith("optim.") for k in _saved_keys(path)):
        del state["optim"]  # model-only checkpoint (epscale checkpoint import): fresh AdamW
    try:
        with _quiet():
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except Exception as e:  # DCP wraps per-rank failures; name the checkpoint
        raise CheckpointError(f"checkpoint '{path}' could not be loaded: {e}") from e
    for name, entry in placed.views.items():  # the logical buffers DCP filled (or not)
        _copy_local(entry["param"], state["model"][name])
        if "optim" in state and name in state["optim"]:
            for k in ("exp_avg", "exp_avg_sq"):
                _copy_local(entry[k], state["optim"][name][k])
    placed.scatter()
    _copy_back(model, opt, state, skip=set(placed.views))
    if restore_rng:
        saved_world = int(meta.get("world_size", 1))
        f = path / f"rank_{_rank() % max(1, saved_world)}.pt"
        if f.is_file():
            set_rng_state(torch.load(f, weights_only=True))
    return meta


def load_extra(path: Path, name: str) -> Any:
    """An ``extra_files`` entry of a checkpoint (None when it was not written)."""
    f = Path(path) / name
    if not f.is_file():
        return None
    try:
        return torch.load(f, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint '{path}': '{name}' could not be read: {e}") from e


# --------------------------------------------------------------------------------------
# One full state dict: export / import
# --------------------------------------------------------------------------------------


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
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    ckpt = resolve(path)
    meta = validate(ckpt)
    with _quiet():
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
    with _quiet():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    files = {f.name: {"size": f.stat().st_size, "sha256": _sha256(f)}
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
        import yaml  # so `epscale train --run-dir RUN_DIR` rebuilds the same model

        cfg_path.write_text(yaml.safe_dump(meta["config"], sort_keys=False))
    return final
