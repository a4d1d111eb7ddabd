"""Pipeline receive buffers held only while their micro-batch is in flight.

torch's ``PipelineStage`` allocates, when a schedule first runs, one receive buffer per
micro-batch for the stage's input activations and one for its output gradients, and
keeps all m of them for the life of the stage; a micro-batch needs its buffers only from
the moment its receive is posted until the stage has finished that micro-batch's
backward (or, forward only, its forward). :func:`hold_receive_buffers_in_flight` frees
each buffer's storage (``untyped_storage().resize_(0)``, as FSDP frees its unsharded
parameters) right after the stage allocates it and again once its micro-batch is done,
and gives it back its storage just before its receive is posted. The tensors themselves
(and so torch's bookkeeping) stay; a receive overwrites the whole buffer, so training is
bit for bit the same.

Legend: m micro-batches per step.

torch API this depends on (``torch.distributed.pipelining.stage``, checked by
:func:`hold_receive_buffers_in_flight`, which fails if any is missing):
``get_fwd_recv_ops`` / ``get_bwd_recv_ops`` (post a micro-batch's receives),
``set_local_fwd_input`` / ``set_local_bwd_input`` (a V schedule's pass between its two
stages on one rank), ``forward_one_chunk``, ``backward_one_chunk(mb, full_backward=...)`` and
``backward_weight_one_chunk`` (compute), and the private ``_prepare_forward_infra`` /
``_prepare_backward_infra`` (allocate the buffers), ``args_recv_info`` /
``grad_recv_info`` ({micro-batch: tuple of ``_RecvInfo``}) and ``_RecvInfo.buffer`` /
``_RecvInfo.is_root_arg``. Tensors a V schedule passes between its two stages on one rank
replace ``_RecvInfo.buffer`` without a receive; torch would keep them referenced there
until the next step: they are not freed (others share them) but their references are
dropped once the micro-batch is done, and a passed output gradient is counted as a
gradient buffer.
"""

from __future__ import annotations

import functools

import torch

WRAPPED = ("_prepare_forward_infra", "_prepare_backward_infra", "get_fwd_recv_ops",
           "get_bwd_recv_ops", "set_local_fwd_input", "set_local_bwd_input",
           "forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
KINDS = ("act", "grad")  # input activations (args_recv_info), output gradients (grad_recv_info)


def _buffers(infos) -> list[torch.Tensor]:
    return [i.buffer for i in infos
            if not i.is_root_arg and isinstance(i.buffer, torch.Tensor)]


def _free(buf: torch.Tensor) -> None:
    buf.untyped_storage().resize_(0)


class ReceiveBuffers:
    """The receive buffers of one rank's stages that hold storage now, and the most that
    ever did at once: ``peak[kind]`` buffers (kind ``act`` or ``grad``), ``peak_bytes``."""

    def __init__(self) -> None:
        self.live: dict[tuple[int, str, int], list[tuple[torch.Tensor, object]]] = {}
        self.passed: dict[tuple[int, int], list] = {}   # inputs passed on the rank
        self.count = dict.fromkeys(KINDS, 0)
        self.peak = dict.fromkeys(KINDS, 0)
        self.bytes = self.peak_bytes = 0

    def take(self, stage: int, kind: str, mb: int, infos) -> None:
        """Give micro-batch ``mb``'s buffers of ``kind`` on ``stage`` their storage back."""
        bufs = _buffers(infos)
        for buf in bufs:
            assert buf.is_contiguous() and buf.storage_offset() == 0
            buf.untyped_storage().resize_(buf.numel() * buf.element_size())
        self._hold(stage, kind, mb, [(buf, None) for buf in bufs])

    def keep(self, stage: int, kind: str, mb: int, infos) -> None:
        """Count the tensors a V schedule passed to ``stage`` on this rank as micro-batch
        ``mb``'s ``kind`` (an output gradient is held here, like a received one; an input
        is the previous stage's output, already counted there: ``kind`` None), and drop
        the stage's references to them when the micro-batch is done."""
        infos = [i for i in infos if not i.is_root_arg and isinstance(i.buffer, torch.Tensor)]
        if kind is None:
            self.passed[(stage, mb)] = self.passed.get((stage, mb), []) + infos
        else:
            self._hold(stage, kind, mb, [(i.buffer, i) for i in infos])

    def _hold(self, stage: int, kind: str, mb: int, held: list) -> None:
        self.release(stage, kind, mb)
        self.live[(stage, kind, mb)] = held
        self.count[kind] += len(held)
        self.bytes += sum(b.untyped_storage().nbytes() for b, _ in held)
        self.peak[kind] = max(self.peak[kind], self.count[kind])
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def release(self, stage: int, kind: str, mb: int) -> None:
        """Free micro-batch ``mb``'s buffers of ``kind`` on ``stage`` (and drop the input
        gradient torch leaves on an activation buffer: the send holds its own
        reference); for tensors passed on the rank, drop the stage's reference."""
        for buf, info in self.live.pop((stage, kind, mb), []):
            self.count[kind] -= 1
            self.bytes -= buf.untyped_storage().nbytes()
            buf.grad = None
            if info is None:
                _free(buf)
            else:
                info.buffer = buf.new_empty(0)
        for info in self.passed.pop((stage, mb), []) if kind == "act" else []:
            info.buffer.grad = None
            info.buffer = info.buffer.new_empty(0)

    def release_all(self, stage: int, recv_info: dict) -> None:
        """Free every buffer of ``stage`` in ``recv_info`` (as just allocated by torch)."""
        for key in [k for k in self.live if k[0] == stage]:
            self.release(*key)
        for infos in recv_info.values():
            for buf in _buffers(infos):
                _free(buf)


def hold_receive_buffers_in_flight(stages: list) -> ReceiveBuffers:
    """Make ``stages`` (this rank's ``PipelineStage``s) hold each receive buffer's storage
    only while its micro-batch is in flight; returns the rank's :class:`ReceiveBuffers`."""
    pool = ReceiveBuffers()
    for stage in stages:
        missing = [n for n in WRAPPED if not callable(getattr(stage, n, None))]
        if missing:
            raise RuntimeError(f"torch {torch.__version__}'s PipelineStage lacks {missing}: "
                               "epscale.parallel.pipeline_buffers must follow its API")
        _wrap(stage, pool)
    return pool


def _wrap(stage, pool: ReceiveBuffers) -> None:
    s = stage.stage_index
    orig = {n: getattr(stage, n) for n in WRAPPED}

    def after(name, then):
        @functools.wraps(orig[name])
        def run(*args, **kwargs):
            out = orig[name](*args, **kwargs)
            then(*args, **kwargs)
            return out
        setattr(stage, name, run)

    def before(name, first):
        @functools.wraps(orig[name])
        def run(*args, **kwargs):
            first(*args, **kwargs)
            return orig[name](*args, **kwargs)
        setattr(stage, name, run)

    def done(mb):
        pool.release(s, "act", mb)
        pool.release(s, "grad", mb)

    def forward_done(mb, *args, **kwargs):
        if not (stage.has_backward and torch.is_grad_enabled()):
            done(mb)  # forward only: nothing comes back for this micro-batch

    def backward_done(mb, loss=None, full_backward=True, last_backward=False):
        if full_backward:
            done(mb)

    after("_prepare_forward_infra", lambda *a, **k: pool.release_all(s, stage.args_recv_info))
    after("_prepare_backward_infra", lambda *a, **k: pool.release_all(s, stage.grad_recv_info))
    before("get_fwd_recv_ops", lambda mb: pool.take(s, "act", mb, stage.args_recv_info[mb]))
    before("get_bwd_recv_ops", lambda mb: pool.take(s, "grad", mb, stage.grad_recv_info[mb])
           if stage.has_backward and not stage.is_last else None)
    after("set_local_fwd_input", lambda out, mb: pool.keep(s, None, mb, stage.args_recv_info[mb]))
    after("set_local_bwd_input", lambda out, mb: pool.keep(s, "grad", mb, stage.grad_recv_info[mb]))
    after("forward_one_chunk", forward_done)
    after("backward_one_chunk", backward_done)
    after("backward_weight_one_chunk", lambda mb, last_backward=False: done(mb))
