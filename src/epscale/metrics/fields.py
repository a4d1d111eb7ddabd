"""Named parts of one flat float64 vector: what a step packs for its ONE all-reduce, by name.

A :class:`Fields` table is built once from (name, part) pairs in packing order; a part is a
shape (``()`` a number, ``(n,)`` a list, ``(r, c)`` a matrix) or another table (nested).
``pack`` concatenates values given by name (device tensors as they are, host numbers
gathered into one host tensor per run), ``unpack`` reads the reduced values back by name,
so no code does position arithmetic::

    fields = Fields([("loss", ()), ("counts", (8,)), ("ranks", (world, 3))])
    flat = fields.pack({"loss": loss_t, "counts": counts_t, "ranks": slots}, device)
    dist.all_reduce(flat)
    out = fields.unpack(flat.tolist())   # {"loss": float, "counts": [...], "ranks": array}
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence, Union

import numpy as np
import torch

Part = Union[tuple[int, ...], "Fields"]


class Fields:
    """The layout of a flat vector: each name's slice, in order; ``size`` in all."""

    def __init__(self, parts: Sequence[tuple[str, Part]]):
        self.parts = list(parts)
        self.slices: dict[str, slice] = {}
        pos = 0
        for name, part in self.parts:
            if name in self.slices:
                raise ValueError(f"Fields: the name {name!r} appears twice")
            n = part.size if isinstance(part, Fields) else math.prod(part)
            self.slices[name] = slice(pos, pos + n)
            pos += n
        self.size = pos

    def _host(self, values: Mapping[str, Any], out: list[float]) -> None:
        """Append the host values of this whole table to ``out``, in order."""
        for name, part in self.parts:
            v = values[name]
            if isinstance(part, Fields):
                part._host(v, out)
            else:
                flat = np.asarray(v, dtype=np.float64).reshape(-1).tolist()
                if len(flat) != self.slices[name].stop - self.slices[name].start:
                    raise ValueError(f"Fields: {name!r} has {len(flat)} values, its part "
                                     f"{part} holds {math.prod(part)}")
                out.extend(flat)

    def pack(self, values: Mapping[str, Any], device: torch.device) -> torch.Tensor:
        """One float64 vector on ``device`` of ``values`` (name -> a tensor covering the
        whole part, or host numbers: a number, a sequence, an array, or a mapping for a
        nested table)."""
        chunks: list[torch.Tensor] = []
        host: list[float] = []
        for name, part in self.parts:
            v = values[name]
            if isinstance(v, torch.Tensor):
                n = self.slices[name].stop - self.slices[name].start
                if v.numel() != n:
                    raise ValueError(f"Fields: {name!r} is a tensor of {v.numel()} values, "
                                     f"its part holds {n}")
                if host:
                    chunks.append(torch.tensor(host, dtype=torch.float64).to(device))
                    host = []
                chunks.append(v.reshape(-1).to(device, torch.float64))
            elif isinstance(part, Fields):
                part._host(v, host)
            else:
                Fields([(name, part)])._host({name: v}, host)
        if host:
            chunks.append(torch.tensor(host, dtype=torch.float64).to(device))
        return torch.cat(chunks)

    def unpack(self, vals: Sequence[float]) -> dict[str, Any]:
        """name -> a float (shape ()), a list (n,), a float64 array (r, c) or a dict (a
        nested table), from the flat values ``vals``."""
        out: dict[str, Any] = {}
        for name, part in self.parts:
            v = vals[self.slices[name]]
            if isinstance(part, Fields):
                out[name] = part.unpack(v)
            elif part == ():
                out[name] = v[0]
            elif len(part) == 1:
                out[name] = list(v)
            else:
                out[name] = np.asarray(v).reshape(part)
        return out
