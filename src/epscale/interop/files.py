"""Hugging Face model directories on disk: ``config.json`` and safetensors weights, one
file or sharded with ``model.safetensors.index.json``; read lazily (one tensor at a time)
and written in shards of bounded size.

Every problem is an :class:`HFError` naming the file (and the tensor) it is about.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .errors import HFError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
__all__ = ["DTYPES", "HFError", "HFWeights", "plan_shards", "read_json", "write_shards"]


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise HFError(f"'{path}' does not exist")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HFError(f"'{path}' is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise HFError(f"'{path}' must hold a JSON object, not a {type(data).__name__}")
    return data


class HFWeights:
    """The safetensors weights of a Hugging Face directory, by tensor name.

    ``shape(name)`` and ``dtype(name)`` read only headers; ``get(name)`` reads one tensor.
    A shard that the index names but that is missing, truncated or not safetensors, or an
    index entry that its shard does not hold, is an HFError naming the file and tensor.
    """

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self._handles: dict[str, object] = {}
        self._checked: set[str] = set()
        if not self.dir.is_dir():
            raise HFError(f"'{self.dir}' is not a directory (expected a Hugging Face model "
                          "directory with config.json and *.safetensors)")
        index = self.dir / INDEX
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise HFError(f"'{index}' has no 'weight_map' of tensor name -> shard file")
            self.file_of = {str(k): str(v) for k, v in weight_map.items()}
        else:
            files = [self.dir / SINGLE] if (self.dir / SINGLE).is_file() else \
                sorted(self.dir.glob("*.safetensors"))
            if not files:
                other = sorted(p.name for p in self.dir.glob("*.bin")) or sorted(
                    p.name for p in self.dir.glob("*.pt"))
                hint = (f" (found {', '.join(other[:3])}: only safetensors is read; convert "
                        "with transformers' save_pretrained(safe_serialization=True))"
                        if other else "")
                raise HFError(f"'{self.dir}' holds no {INDEX} and no *.safetensors file{hint}")
            self.file_of = {}
            for f in files:
                for name in self._open(f.name).keys():
                    self.file_of[name] = f.name

    def _open(self, file: str, for_tensor: str | None = None):
        handle = self._handles.get(file)
        if handle is not None:
            return handle
        path = self.dir / file
        what = f" (it holds '{for_tensor}', listed in {INDEX})" if for_tensor else ""
        if not path.is_file():
            raise HFError(f"shard '{path}' is missing{what}")
        try:
            handle = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError, ValueError) as e:
            raise HFError(f"shard '{path}' is truncated or not a safetensors file{what}: {e}"
                          ) from None
        self._handles[file] = handle
        return handle

    def _handle(self, name: str):
        if name not in self.file_of:
            raise HFError(f"tensor '{name}' is in no safetensors file of '{self.dir}'")
        file = self.file_of[name]
        handle = self._open(file, name)
        if file not in self._checked:
            listed = {n for n, f in self.file_of.items() if f == file}
            missing = sorted(listed - set(handle.keys()))
            if missing:
                raise HFError(f"shard '{self.dir / file}' lacks tensor '{missing[0]}' that "
                              f"{INDEX} places there ({len(missing)} missing)")
            self._checked.add(file)
        return handle

    def names(self) -> list[str]:
        return sorted(self.file_of)

    def where(self, name: str) -> Path:
        return self.dir / self.file_of[name]

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Tensor ``name`` as fp32 (``shape``: what config.json implies it must be)."""
        handle = self._handle(name)
        if shape is not None and self.shape(name) != tuple(shape):
            raise HFError(f"tensor '{name}' in '{self.where(name)}' has shape "
                          f"{self.shape(name)}, but config.json implies {tuple(shape)}")
        try:
            t = handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise HFError(f"tensor '{name}' in '{self.where(name)}' could not be read: {e}"
                          ) from None
        if not t.is_floating_point():
            raise HFError(f"tensor '{name}' in '{self.where(name)}' has dtype {t.dtype}; "
                          "quantized checkpoints are not read (dequantize to bf16 first)")
        return t.float()


def plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Group units (name, bytes), in order, into shards of at most ``max_bytes`` (a unit
    larger than that gets a shard of its own)."""
    shards: list[list[str]] = []
    current, used = [], 0
    for name, nbytes in sizes:
        if current and used + nbytes > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current:
        shards.append(current)
    return shards


def shard_name(i: int, n: int) -> str:
    return SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_shards(out_dir: Path, shards: Iterator[dict[str, torch.Tensor]], num_shards: int) -> int:
    """Write each dict of tensors as the hub's shard files (and the index when there is
    more than one); returns the total bytes."""
    weight_map: dict[str, str] = {}
    total = 0
    for i, tensors in enumerate(shards):
        name = shard_name(i, num_shards)
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    if num_shards > 1:
        (out_dir / INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
            indent=2))
    return total
