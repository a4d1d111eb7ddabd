"""Host synchronisations of the MoE layer, counted on CPU as CUDA would make them.

DESIGN.md: at most one host sync per MoE layer forward (the all-to-all split sizes), none
on the local dropless path, none added by backward or recomputation. A sync is any call
that makes the host wait for the device on CUDA. :class:`SyncCounter` sees them on CPU
tensors, at two levels:

* Tensor methods and factories, wrapped while counting (a torch-function mode would not
  see what backward and recomputation run): ``Tensor.tolist`` / ``item`` / ``cpu`` /
  ``numpy`` (one sync each, whatever ops they run inside), and host data turned into a
  device tensor (``torch.tensor`` / ``as_tensor`` with a device, ``Tensor.new_tensor``:
  a copy from pageable memory, which torch waits for);
* aten ops (``TorchDispatchMode``): ``_local_scalar_dense`` (``bool()``, ``int()`` of a
  tensor), ops whose CUDA kernels size their output on the host (``nonzero``, ``unique``,
  ``masked_select``, indexing with a bool mask, ``repeat_interleave`` without
  ``output_size``, ``bincount``, ``equal``), and copies between the host and a device
  (seen when the test runs on a real device).

The code must take the path CUDA takes: :func:`epscale.ops.device_code_path` turns off
the CPU-only shortcuts (the CPU kernel, bincount, host branches) and the experts run
torch's grouped GEMM with the accelerators' rules (bf16 here, widths multiples of 8).

Counted per MoE layer: the local backend in one process, every EP backend at ep=2 over
two gloo ranks (one spawn for all cases), each under no / full / selective recomputation
of a transformer block. Not seen on CPU: syncs inside a CUDA kernel's own implementation,
and a host tensor moved with ``.to(device)`` (on CPU that is no copy); the single-process
cases also run on a GPU (``EPSCALE_TEST_DEVICE=cuda``), where such copies are counted.
"""

from __future__ import annotations

import warnings

import pytest
import torch

# The counter lives in the package (benchmarks/gpu_check.py counts a training step's syncs
# with it on a GPU); these tests count on the code path CUDA takes, on CPU.
from epscale.metrics.host_syncs import HostSyncCounter as SyncCounter

from dist_utils import CaseRunner, assert_no_failures, run_distributed


def count_step(module: torch.nn.Module, x: torch.Tensor, steps: int = 1
               ) -> tuple[list, list]:
    """Syncs of ``steps`` forward+backward passes of ``module`` on ``x`` on the device
    code path: (forward events, backward events) of the last step (the first may set
    things up)."""
    from epscale.moe.layer import moe_layers
    from epscale.ops import device_code_path

    fwd = bwd = []
    with device_code_path():
        for _ in range(steps):
            xg = x.detach().clone().requires_grad_(x.is_floating_point())
            with SyncCounter() as c:
                y = module(xg)
                n = len(c.events)
                aux = sum((m.aux_loss for m in moe_layers(module)), torch.zeros(()))
                (y.float().square().mean() + aux).backward()
            fwd, bwd = c.events[:n], c.events[n:]
    return fwd, bwd


# --------------------------------------------------------------------------------------
# The counter itself
# --------------------------------------------------------------------------------------


def test_the_counter_sees_each_kind_of_sync():
    from epscale.dispatch.layout import segment_ids, select_true

    x = torch.arange(6)
    cases = [
        (lambda: x.tolist(), "tolist"), (lambda: x.sum().item(), "item"),
        (lambda: bool(x[0]), "_local_scalar_dense"), (lambda: int(x.sum()), "_local_scalar_dense"),
        (lambda: x.nonzero(), "nonzero"), (lambda: torch.unique(x), "_unique2"),
        (lambda: x[x > 2], "index with a bool mask"),
        (lambda: torch.masked_select(x, x > 2), "masked_select"),
        (lambda: torch.repeat_interleave(x, x), "repeat_interleave without output_size"),
        (lambda: torch.bincount(x), "bincount"),
        (lambda: torch.tensor([1, 2], device=x.device), "tensor(host data, device=...)"),
        (lambda: x.new_tensor([3]), "new_tensor(host data)"),
        (lambda: x.cpu(), "cpu"),
    ]
    for fn, what in cases:
        with SyncCounter() as c:
            fn()
        assert [e[0] for e in c.events] == [what], (what, c.events)
    # ... in backward and in recomputation too
    from torch.utils.checkpoint import checkpoint

    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            g.sum().tolist()
            return g * 2

    def reads(t):
        t.detach().sum().tolist()
        return ReadsInBackward.apply(t.sin())

    xf = torch.ones(3, requires_grad=True)
    with SyncCounter() as c:
        y = checkpoint(reads, xf, use_reentrant=False)
        assert len(c.events) == 1
        y.sum().backward()  # the recomputation's read, then the backward's
    assert [e[0] for e in c.events] == ["tolist"] * 3, c.events
    assert torch.Tensor.tolist is not None and "wrapper" not in repr(torch.Tensor.tolist)
    # ... and none where the sizes are known on the host or nothing leaves the device
    with SyncCounter() as c:
        segment_ids(x[:3], int(3))
        select_true(x > 2, 3)
        torch.repeat_interleave(x, x, output_size=15)
        torch.repeat_interleave(x, 2)
        x.index_select(0, x[:2])
        x.new_full((1,), 3)
        torch.zeros(3)
    assert c.events == [], c.events


# --------------------------------------------------------------------------------------
# The local backend, one process
# --------------------------------------------------------------------------------------

DIM, HIDDEN = 32, 16


def _moe(**over):
    import epscale

    torch.manual_seed(0)
    cfg = dict(dim=DIM, hidden_dim=HIDDEN, num_experts=8, top_k=2, num_shared_experts=1,
               aux_loss_coeff=0.01, seq_aux_loss_coeff=0.01, z_loss_coeff=0.001)
    cfg.update(over)
    return epscale.MoE(epscale.MoEConfig(**cfg)).to(torch.bfloat16)


def _x(T=24):
    return torch.randn(2, T // 2, DIM).to(torch.bfloat16)


def _names(events):
    return [f"{w} at {where}" for w, where in events]


@pytest.mark.parametrize("fuse", [True, False])
def test_local_dropless_makes_no_sync(fuse):
    from epscale.dispatch.local import LocalDispatcher

    moe = _moe()
    if not fuse:  # the generic dispatch -> experts -> combine path
        moe.dispatcher = LocalDispatcher(8, fuse=False, dropless=True)
    fwd, bwd = count_step(moe, _x())
    assert fwd == [] and bwd == [], (_names(fwd), _names(bwd))


def test_local_with_capacity_reads_the_kept_rows_once():
    moe = _moe(capacity_factor=1.0)
    fwd, bwd = count_step(moe, _x())
    assert len(fwd) == 1 and fwd[0][1].startswith("dispatch/host.py"), _names(fwd)
    assert bwd == [], _names(bwd)


def test_slow_grouped_gemm_fallback_warns_once_and_syncs_once(monkeypatch):
    """fp32 rows on the device path: torch's fast grouped GEMM takes bf16, so the experts
    loop over groups with host sizes (one sync, honestly counted) and warn, once."""
    from epscale.moe import experts

    monkeypatch.setattr(experts, "_WARNED_SLOW", set())
    moe = _moe().float()
    x = _x().float()
    with pytest.warns(UserWarning, match="loop over groups with host offsets.*float32") as rec:
        fwd, bwd = count_step(moe, x)
    assert len(rec) == 1
    assert len(fwd) == 1 and bwd == [], (_names(fwd), _names(bwd))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call says nothing
        count_step(moe, x)
    # bf16 with widths not multiples of 8 falls back too; use_grouped_mm: never asks for
    # the loop and is not warned about
    from epscale.ops import device_code_path

    with device_code_path():
        reason = experts.slow_grouped_mm_reason(torch.zeros(2, 12, dtype=torch.bfloat16), 16)
    assert "multiples of 8" in reason
    never = _moe(use_grouped_mm="never")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fwd, _ = count_step(never, _x())
    assert len(fwd) == 1, _names(fwd)


def _model(mode: str, parallel=None, **over):
    """Two MoE blocks in bf16, parallelized by ``parallel(model)`` when given, then set to
    recompute ``mode`` (after parallelizing, as the trainer does)."""
    import epscale
    from epscale.config import ModelConfig
    from epscale.model import Transformer
    from epscale.parallel.activation import apply_activation_checkpointing

    torch.manual_seed(0)
    moe_cfg = epscale.MoEConfig(dim=DIM, hidden_dim=HIDDEN, num_experts=8, top_k=2,
                                num_shared_experts=1, aux_loss_coeff=0.01, **over)
    model = Transformer(ModelConfig(vocab_size=64, dim=DIM, num_layers=2, num_heads=4,
                                    seq_len=16, dense_hidden_dim=32), moe_cfg)
    model = model.to(torch.bfloat16)
    if parallel is not None:
        parallel(model)
    apply_activation_checkpointing(model, mode)
    return model


class _LossOf(torch.nn.Module):
    """tokens -> logits, for count_step (which backprops a function of the output)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(tokens)


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
@pytest.mark.parametrize("capacity", [None, 1.0])
def test_recomputation_adds_no_sync(mode, capacity):
    """Two MoE blocks: forward syncs = per layer x layers (0 dropless, 1 with capacity),
    backward none, whatever is recomputed."""
    tokens = torch.randint(0, 64, (2, 12))
    model = _LossOf(_model(mode, capacity_factor=capacity))
    fwd, bwd = count_step(model, tokens, steps=2)
    per_layer = 0 if capacity is None else 1
    assert len(fwd) == 2 * per_layer, _names(fwd)
    assert bwd == [], _names(bwd)
    plain = _LossOf(_model("none", capacity_factor=capacity))
    count_step(plain, tokens, steps=2)
    _assert_same_grads(model, plain)


@pytest.mark.parametrize("impl", ["auto", "grouped_mm"])
def test_light_recomputation_adds_no_sync(impl):
    """train.recompute_modules (every part at once; moe_act acts on the grouped-GEMM
    path): the forward's syncs are the plain run's, backward has none, and the gradients
    are the plain run's (without moe_act, which moves the gate weights before the down
    projection: another order of roundings, tests/test_saved_fp8.py)."""
    from epscale.parallel.activation import RECOMPUTE_MODULES, apply_activation_checkpointing

    tokens = torch.randint(0, 64, (2, 12))
    plain = _LossOf(_model("none", experts_impl=impl))
    want_fwd, _ = count_step(plain, tokens, steps=2)
    for exact in (False, True):
        model = _model("none", experts_impl=impl)
        apply_activation_checkpointing(model, "none", [
            m for m in RECOMPUTE_MODULES if m != "mla_up_proj" and not (exact and m == "moe_act")])
        fwd, bwd = count_step(_LossOf(model), tokens, steps=2)
        assert len(fwd) == len(want_fwd), (_names(fwd), _names(want_fwd))
        assert bwd == [], _names(bwd)
    _assert_same_grads(_LossOf(model), plain)


def test_fp8_storage_adds_no_sync():
    """train.activation_storage: fp8 (with moe_act): quantizing the saved rows and restoring
    them reads nothing on the host, forward or backward."""
    from epscale.parallel.activation import apply_activation_checkpointing, apply_activation_storage

    tokens = torch.randint(0, 64, (2, 12))
    plain = _LossOf(_model("none", experts_impl="grouped_mm"))
    want_fwd, _ = count_step(plain, tokens, steps=2)
    model = _model("none", experts_impl="grouped_mm")
    apply_activation_checkpointing(model, "none", ["moe_act"])
    apply_activation_storage(model, "fp8")
    fwd, bwd = count_step(_LossOf(model), tokens, steps=2)
    assert len(fwd) == len(want_fwd), (_names(fwd), _names(want_fwd))
    assert bwd == [], _names(bwd)


def _assert_same_grads(model, plain):
    """Recomputed with the first forward's host values, the gradients are those of the
    plain run: bit for bit on CPU (the same ops on the same values), within bf16 rounding
    on a GPU (atomic adds sum in any order there)."""
    want = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        tol = 0.0 if p.device.type == "cpu" else 2e-2
        torch.testing.assert_close(p.grad, want[name].grad, rtol=tol, atol=tol * 1e-2,
                                   msg=lambda m: f"grad of {name}: {m}")


def test_recomputation_reuses_the_forwards_host_values():
    """A recomputed forward gets the values its first forward read, not fresh ones, and
    a recomputation that reads something else fails loudly."""
    from torch.utils.checkpoint import checkpoint

    from epscale.dispatch.host import host_ints, recompute_contexts

    calls, seen = [], []

    def fn(x):  # reads a different value each time it runs
        calls.append(1)
        seen.append(host_ints(torch.tensor([len(calls)])))
        return x.sin()

    x = torch.ones(3, requires_grad=True)
    y = checkpoint(fn, x, use_reentrant=False, context_fn=recompute_contexts)
    y.sum().backward()
    assert len(calls) == 2 and seen == [[1], [1]], seen  # recomputed, and replayed
    torch.testing.assert_close(x.grad, torch.ones(3).cos())

    def changing(t):  # reads a list of another length when recomputed
        calls.append(1)
        host_ints(torch.zeros(len(calls), dtype=torch.long))
        return t.sin()

    y = checkpoint(changing, torch.ones(2, requires_grad=True), use_reentrant=False,
                   context_fn=recompute_contexts)
    with pytest.raises(RuntimeError, match="recomputed forward must run the same code"):
        y.sum().backward()


# --------------------------------------------------------------------------------------
# The EP backends at ep=2, two gloo ranks
# --------------------------------------------------------------------------------------

EP_BACKENDS = [("alltoall", {}), ("allgather", {}), ("dedup", {}),
               ("dedup", {"overlap_chunks": 2}), ("hierarchical", {})]


def _ep_worker(rank, world):
    import epscale

    runner = CaseRunner(rank)
    torch.manual_seed(0)
    flat = epscale.ParallelDims(dp=1, ep=world)
    nodes = epscale.ParallelDims(dp=1, ep=world, ranks_per_node=1)  # 2 nodes: both stages
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(rank))
    for name, opts in EP_BACKENDS:
        dims = nodes if name == "hierarchical" else flat
        plain = None
        for mode in ("none", "full", "selective"):
            with runner.case(f"{name}{opts} {mode}"):
                model = _LossOf(_model(mode, lambda m: epscale.parallelize(
                    m, dims, dispatcher=name, **opts)))
                fwd, bwd = count_step(model, tokens)
                # one sync per MoE layer forward (the split sizes), from the dispatcher
                assert len(fwd) == 2, _names(fwd)
                assert all(w.startswith("dispatch/host.py") for _, w in fwd), _names(fwd)
                assert bwd == [], _names(bwd)
                if mode == "none":
                    plain = model
                else:  # recomputed with the split sizes of the first forward
                    _assert_same_grads(model, plain)
    return runner.failures, runner.num_cases


@pytest.mark.cpu_only  # gloo ranks
def test_ep_backends_sync_once_per_layer_forward():
    results = run_distributed(_ep_worker, 2)
    assert_no_failures(results, min_cases=len(EP_BACKENDS) * 3)


class _TrainingLossOf(torch.nn.Module):
    """tokens -> the training loss (the fused chunked head; with multi-token-prediction
    modules their losses too), for count_step."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        loss = self.model.loss(tokens[:, :-1], tokens[:, 1:])
        return loss + self.model.mtp_loss()


@pytest.mark.parametrize("doc_masking", [False, True])
@pytest.mark.parametrize("mtp_depth", [0, 1])
def test_the_training_loss_adds_no_sync(mtp_depth, doc_masking):
    """What the trainer runs (``Transformer.loss``: the head and the cross-entropy over
    chunks of rows, and the multi-token-prediction modules' shifted targets and losses),
    with and without document masking (the dense mask, as on CPU; the targets skipped
    after each EOS): forward syncs are the MoE layers' (none dropless), backward none."""
    import epscale
    from epscale.config import ModelConfig
    from epscale.model import Transformer

    torch.manual_seed(0)
    moe_cfg = epscale.MoEConfig(dim=DIM, hidden_dim=HIDDEN, num_experts=8, top_k=2,
                                num_shared_experts=1, aux_loss_coeff=0.01)
    model = Transformer(ModelConfig(vocab_size=64, dim=DIM, num_layers=2, num_heads=4,
                                    seq_len=16, dense_hidden_dim=32, mtp_depth=mtp_depth),
                        moe_cfg).to(torch.bfloat16)
    model.train()
    if doc_masking:
        model.set_document_masking(0, "dense")
    tokens = torch.randint(0, 64, (2, 13))
    tokens[:, 5] = 0                                    # an EOS in each sequence
    fwd, bwd = count_step(_TrainingLossOf(model), tokens, steps=2)
    assert fwd == [], _names(fwd)
    assert bwd == [], _names(bwd)
    assert len(model.last_mtp_losses) == mtp_depth
