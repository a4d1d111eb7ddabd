"""Shared base of the expert-parallel backends: the EP group, byte counting, the one count
exchange per layer, and combine with the shared experts running while it is in flight.

Legend: T tokens, D model dim, K top-k, E global experts, e local experts, P EP ranks.
"""

from __future__ import annotations

from abc import abstractmethod

from typing import Any, Callable

import torch

from .base import Dispatcher
from .comm import CommCounter, GroupInfo

PAYLOADS = ("auto", "bf16", "fp8")


class EPDispatcher(Dispatcher):
    """An EP backend over ``info`` (the EP group). Expert ``i`` lives on group rank
    ``i // e``; this rank holds ``[offset, offset + e)``.

    Subclasses implement ``dispatch`` and ``_combine_start(y_RD, handle) -> finish`` where
    ``finish()`` returns y_TD; the transfer may still be in flight between the two, which is
    what ``combine_overlapped`` uses to run the shared experts meanwhile.
    """

    def __init__(self, num_experts: int, info: GroupInfo, payload: str = "auto"):
        P = info.size
        if num_experts % P:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP size {P}")
        if payload not in PAYLOADS:
            raise ValueError(f"payload={payload!r} is not one of {', '.join(map(repr, PAYLOADS))}")
        e = num_experts // P
        super().__init__(num_experts, e, info.index * e)
        self.info = info
        self.payload = payload

    @property
    def counter(self) -> CommCounter:
        return self.info.counter

    def bytes_sent(self) -> int:
        return self.info.counter.total

    def inter_node_bytes_sent(self) -> int:
        return self.info.counter.inter_node

    # ----------------------------------------------------------------- combine
    @abstractmethod
    def _combine_start(self, y_RD: torch.Tensor, handle: Any, async_op: bool
                       ) -> Callable[[], torch.Tensor]:
        """Start the combine exchange (async when ``async_op``); the returned callable
        waits for it and returns y_TD."""

    def combine(self, y_RD: torch.Tensor, handle: Any) -> torch.Tensor:
        return self._combine_start(y_RD, handle, False)()

    def combine_overlapped(self, y_RD, handle, side_work):
        finish = self._combine_start(y_RD, handle, side_work is not None)
        side = side_work() if side_work is not None else None
        return finish(), side

    # ----------------------------------------------------------------- helpers
    def _payload_cast(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The tensor to send and whether its first field travels as fp8."""
        if self.payload == "bf16" and x_ND.dtype != torch.bfloat16:
            return x_ND.to(torch.bfloat16), False
        return x_ND, self.payload == "fp8"

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(experts={self.num_experts}, local={self.num_local_experts}, "
                f"offset={self.expert_offset}, ep={self.info.size}, payload={self.payload})")


def small_int_dtype(max_value: int) -> torch.dtype:
    """Narrowest signed int dtype holding -1..max_value (expert ids travel in it)."""
    if max_value < 127:
        return torch.int8
    if max_value < 32767:
        return torch.int16
    return torch.int32
