"""parallel.overlap and the communication clock: the same training with overlap 'auto' and
'none' (the plain blocking path) for every dispatcher at ep=2 and with FSDP, step records
that carry comm_s / comm_exposed_s by kind, and the clock itself on real gloo collectives.

One spawn of two processes runs every case."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import (CaseRunner, assert_no_failures, backward_on_its_own_thread,
                        run_distributed, run_trainer)
from epscale.config import ConfigError, load_config
from epscale.dispatch.comm import CommCounter, Exchange, GroupInfo, has_handoff, hand_off
from epscale.metrics.commclock import CommClock, _union
from epscale.parallel.overlap_pair import PairStats, finish_partner, run_pair
from epscale.plan.overlap import COMM_KINDS
from test_train import assert_losses_close, tiny_overrides

BASE = {"train.steps": 2, "train.eval_every": 0, "train.ckpt_every": 0,
        "train.micro_batch_size": 2, "train.collective_timeout_s": 0, "train.preflight": False,
        "model.dim": 32, "moe.hidden_dim": 32, "model.dense_hidden_dim": 64,
        "model.seq_len": 32, "model.num_heads": 2, "moe.aux_loss_scope": "global"}
# name -> overrides; each runs with parallel.overlap auto and none
CASES = {
    "alltoall": {"parallel.ep": 2, "parallel.dispatcher": "alltoall"},
    "dedup chunks2": {"parallel.ep": 2, "parallel.dispatcher": "dedup",
                      "parallel.overlap_chunks": 2, "moe.num_shared_experts": 1},
    "hierarchical chunks2": {"parallel.ep": 2, "parallel.dispatcher": "hierarchical",
                             "parallel.ranks_per_node": 1, "parallel.overlap_chunks": 2},
    "allgather": {"parallel.ep": 2, "parallel.dispatcher": "allgather"},
    "fsdp ep2 dedup": {"parallel.fsdp": True, "parallel.ep": 2, "parallel.overlap_chunks": 2},
}

# parallel.overlap_micro_batches: each runs with the pairs and without, 3 micro-batches a
# step (a middle pair, and a last forward paired while DDP's reduction waits for it)
PAIRS = {"train.grad_accum": 3, "train.micro_batch_size": 1, "parallel.ep": 2}
PAIR_CASES = {
    "pairs alltoall": {**PAIRS, "parallel.dispatcher": "alltoall"},
    "pairs dedup chunks2 shared, full recompute": {
        **PAIRS, "parallel.dispatcher": "dedup", "parallel.overlap_chunks": 2,
        "moe.num_shared_experts": 1, "train.activation_checkpointing": "full"},
    "pairs hierarchical, selective recompute, spill": {
        **PAIRS, "parallel.dispatcher": "hierarchical", "parallel.ranks_per_node": 1,
        "train.activation_checkpointing": "selective", "parallel.spill_threshold": 1.0,
        "parallel.spill_min_rows": 1},
    "pairs allgather, light recompute, mtp": {
        **PAIRS, "parallel.dispatcher": "allgather", "train.recompute_modules": "[norm,router]",
        "model.mtp_depth": 1},
}
# these also run paired with every backward on a thread of its own, as CUDA's autograd
# engine runs it on its device thread (the hand-offs must come from that thread)
ENGINE_THREAD_CASES = ("pairs alltoall", "pairs dedup chunks2 shared, full recompute")


def _records(corpus_dir: Path, run_dir: Path, over: dict, inspect=None) -> list[dict]:
    cfg = load_config(None, tiny_overrides(corpus_dir, **{**BASE, **over}))
    return run_trainer(cfg, run_dir, 2, inspect=inspect)


def _check_record(rec: dict, over: dict) -> None:
    """The communication fields of one step record, by what the layout sends."""
    kinds = rec["comm_by_kind"]
    assert set(kinds) == set(COMM_KINDS)
    for k in COMM_KINDS:
        assert 0.0 <= kinds[k]["exposed_s"] <= kinds[k]["s"] + 1e-12, (k, kinds[k])
    assert 0.0 <= rec["comm_exposed_s"] <= rec["comm_s"] + 1e-12
    assert 0.0 <= rec["comm_exposed_share"] <= 1.0
    assert kinds["dispatch"]["s"] > 0
    assert (kinds["fsdp"]["s"] > 0) == bool(over.get("parallel.fsdp"))
    assert (kinds["dp"]["s"] > 0) != bool(over.get("parallel.fsdp"))  # FSDP reduces itself
    assert kinds["pp"]["s"] == 0
    if over.get("parallel.overlap") == "none":  # every exchange blocking: all of it exposed
        assert kinds["dispatch"]["exposed_s"] == kinds["dispatch"]["s"]


def _clock_cases(runner: CaseRunner, corpus_dir: Path, tmp: Path) -> None:
    """The clock on real collectives: blocking calls are wholly exposed, a tracked work's
    wait is the exposed part of its flight, intercepted functions are restored."""
    with runner.case("clock"):
        clock = CommClock()
        x = torch.ones(64)
        with clock.blocking("dp"):
            dist.all_reduce(x)
        if dist.get_rank() == 1:
            time.sleep(0.05)  # rank 0's wait is exposed: its peer has not joined yet
        work = clock.track("dispatch", dist.all_reduce(x, async_op=True), (x,))
        assert isinstance(work, dist.Work)
        work.wait()
        original = dist.all_reduce
        with clock.intercept("fsdp", dist, ("all_reduce",)):
            assert dist.all_reduce is not original
            dist.all_reduce(x, async_op=True).wait()
            dist.all_reduce(x)
        assert dist.all_reduce is original
        assert x[0].item() == 2.0 ** 4  # every call reduced, once each
        t = clock.totals()
        assert t["dp"]["s"] > 0 and t["dp"]["exposed_s"] == t["dp"]["s"]
        assert 0 <= t["dispatch"]["exposed_s"] <= t["dispatch"]["s"]
        if dist.get_rank() == 0:
            assert t["dispatch"]["exposed_s"] >= 0.02
        assert 0 < t["fsdp"]["exposed_s"] <= t["fsdp"]["s"]
        assert t["pp"] == {"s": 0.0, "n": 0.0, "exposed_s": 0.0}
        assert [t[k]["n"] for k in ("dp", "dispatch", "fsdp")] == [1, 1, 2]
        assert t["exposed_s"] <= t["s"] <= sum(t[k]["s"] for k in COMM_KINDS) + 1e-12
        clock.reset()
        assert clock.totals()["s"] == 0.0
    with runner.case("pipeline p2p"):
        # two stages: the schedule's sends and receives are timed as 'pp', nothing else
        recs = _records(corpus_dir, tmp / "pp", {"parallel.pp": 2, "train.grad_accum": 2,
                                                 "model.tie_embeddings": False})
        for rec in recs:
            assert rec["comm_by_kind"]["pp"]["s"] > 0
            assert rec["comm_by_kind"]["pp"]["exposed_s"] <= rec["comm_by_kind"]["pp"]["s"]
            assert rec["comm_by_kind"]["dispatch"]["s"] == 0


class _LoggedClock(CommClock):
    """A CommClock that logs which thread read it (issue, wait start, wait end)."""

    def __init__(self, log: list):
        self.log = log
        super().__init__()

    def _now(self):
        self.log.append(threading.current_thread().name)
        return super()._now()


def _pair_case(runner: CaseRunner, rank: int) -> None:
    """Two micro-batches through run_pair on real gloo all-to-alls: the first's exchange
    is in flight while the second computes, and the clock's exposed wait of the first
    starts only after that compute (hidden, not exposed); both exchanges deliver."""
    with runner.case("overlapped pair: hand-offs and the clock"):
        log: list = []
        clock = _LoggedClock(log)
        info = GroupInfo.of(dist.group.WORLD, 2, CommCounter())
        info.counter.clock = clock
        x_N1 = (torch.arange(4.0) + 10 * rank).view(4, 1)
        log.clear()

        def forward():
            ex = Exchange(info, [2, 2], [2, 2], async_op=True)
            (y,) = ex(x_N1)
            return ex.done(y)[0]       # waits: hands off first

        def backward():
            log.append("compute")
            (z,) = Exchange(info, [2, 2], [2, 2])(x_N1 * 2)  # blocking: hands off too
            return z

        stats = PairStats()
        y, z = run_pair(forward, backward, stats)
        me, helper = threading.current_thread().name, "epscale-overlap-pair"
        # issue F | compute B, issue B | wait F (start, end) | wait B (start, end)
        assert log == [me, "compute", helper, me, me, helper, helper], log
        assert stats.pairs == 1 and stats.switches == 2
        want = torch.tensor([2 * rank, 2 * rank + 1, 10 + 2 * rank, 11 + 2 * rank]).view(4, 1)
        assert torch.equal(y, want) and torch.equal(z, 2 * want)
        t = clock.totals()
        assert t["dispatch"]["n"] == 2 and t["dispatch"]["exposed_s"] <= t["dispatch"]["s"]
        assert not has_handoff()


def _micro_batch_pair_cases(runner: CaseRunner, corpus_dir: Path, tmp: Path) -> dict:
    """Each of PAIR_CASES with parallel.overlap_micro_batches and without: the step
    records' losses and gradient norms, and the pairs the step ran (and their hand-offs)."""
    out = {}
    runs = [(name, paired) for name in PAIR_CASES for paired in (True, False)]
    for name, paired in runs + [(name, "engine thread") for name in ENGINE_THREAD_CASES]:
        with runner.case(f"{name} {paired}"):
            held = {}
            engine = paired == "engine thread"
            with backward_on_its_own_thread() if engine else contextlib.nullcontext():
                recs = _records(corpus_dir, tmp / f"{name}-{paired}".replace(" ", "_"),
                                {**PAIR_CASES[name], "parallel.overlap_micro_batches": bool(paired)},
                                inspect=lambda t: held.update(stepper=t.stepper))
            stats = held["stepper"].pair_stats
            out[(name, paired)] = (
                [(r["step"], r["loss"], r["grad_norm"], r.get("mtp_loss")) for r in recs],
                None if stats is None else (stats.pairs, stats.switches))
    return out


def _worker(rank, world, corpus_dir, tmp, cases):
    corpus_dir, tmp = Path(corpus_dir), Path(tmp)
    runner = CaseRunner(rank)
    _clock_cases(runner, corpus_dir, tmp)
    _pair_case(runner, rank)
    out = {"micro-batch pairs": _micro_batch_pair_cases(runner, corpus_dir, tmp)}
    for name, over in cases.items():
        for mode in ("auto", "none"):
            with runner.case(f"{name} {mode}"):
                o = {**over, "parallel.overlap": mode}
                recs = _records(corpus_dir, tmp / f"{name}-{mode}".replace(" ", "_"), o)
                for rec in recs:
                    _check_record(rec, o)
                out[(name, mode)] = {r["step"]: (r["loss"], r["grad_norm"]) for r in recs}
    return runner.failures, out


@pytest.fixture(scope="module")
def overlap_runs(tmp_path_factory):
    """One spawn of two processes: every case of this file that trains."""
    from test_train import corpus

    tmp = tmp_path_factory.mktemp("overlap")
    corpus(tmp)
    results = run_distributed(_worker, 2, args=(str(tmp), str(tmp / "runs"), CASES))
    assert_no_failures([failures for failures, _out in results])
    return results


def test_overlap_auto_and_none_train_the_same(overlap_runs):
    got = overlap_runs[0][1]
    for name in CASES:
        auto, none = got[(name, "auto")], got[(name, "none")]
        assert sorted(auto) == [1, 2], name
        # step 1 starts from the same weights: summation order only
        for i in (0, 1):
            assert_losses_close({s: v[i] for s, v in none.items()},
                                {s: v[i] for s, v in auto.items()}, same_weights=(1,))


def test_micro_batch_pairs_train_bit_for_bit_as_one_after_the_other(overlap_runs):
    """parallel.overlap_micro_batches: each forward but the first runs with the previous
    micro-batch's backward, interleaved at their exchanges (every dispatcher; chunked,
    with shared experts; full, selective and light recomputation; spill-over; MTP; DDP's
    reduction in the last backward). The same operations on the same tensors, the
    backwards in micro-batch order: the same losses and gradient norms, bit for bit."""
    got = overlap_runs[0][1]["micro-batch pairs"]
    for name in PAIR_CASES:
        (paired, stats), (plain, none) = got[(name, True)], got[(name, False)]
        assert none is None and [r[0] for r in plain] == [1, 2], name
        assert paired == plain, name
        pairs, switches = stats
        assert pairs == 2 * (PAIRS["train.grad_accum"] - 1), (name, stats)  # 2 a step
        # at least: the forward hands over at its first exchange, the backward at its
        # first, and the forward's end waits for the backward's end
        assert switches >= 2 * pairs, (name, stats)


def test_micro_batch_pairs_hand_off_where_the_engine_runs_the_backward(overlap_runs):
    """With every backward on a thread of its own (CUDA's autograd engine runs it on its
    device thread while the caller waits), the pairs hand over at the same exchanges as
    when the helper runs it, and train bit for bit as one after the other. Without the
    engine's hand-off the backward ran whole at the forward's first hand-off (fewer
    switches)."""
    got = overlap_runs[0][1]["micro-batch pairs"]
    for name in ENGINE_THREAD_CASES:
        (engine, engine_stats), (paired, stats) = got[(name, "engine thread")], got[(name, True)]
        assert engine == paired == got[(name, False)][0], name
        assert engine_stats == stats, name


@pytest.mark.parametrize("over, says", [
    ({"parallel.overlap": "none"}, "parallel.overlap is 'none'"),
    ({"parallel.pp": 2, "model.tie_embeddings": False}, "without a pipeline"),
    ({"parallel.fsdp": True}, "replicated layout"),
    ({"parallel.ep": 1}, "parallel.ep = 1"),
    ({"train.compile": True}, "train.compile"),
    ({"train.activation_storage": "fp8", "moe.experts_impl": "grouped_mm"},
     "activation_storage"),
    ({"train.grad_accum": 1}, "train.grad_accum is 1"),
])
def test_micro_batch_pairs_refuse_what_they_cannot_run(tmp_path, over, says):
    base = {"parallel.overlap_micro_batches": True, "parallel.ep": 2, "train.grad_accum": 2}
    with pytest.raises(ConfigError, match="parallel.overlap_micro_batches") as err:
        load_config(None, tiny_overrides(tmp_path, **{**base, **over}))
    assert says in str(err.value)
    load_config(None, tiny_overrides(tmp_path, **base))  # the base alone is fine


def test_finish_partner_runs_the_other_side_to_its_end_first():
    log = []

    def first():
        log.append("a1")
        hand_off()
        log.append("a2")
        finish_partner()  # b hands off twice more before it ends: a waits through both
        log.append("a3")

    def second():
        for step in ("b1", "b2", "b3"):
            log.append(step)
            hand_off()

    run_pair(first, second)
    assert log == ["a1", "b1", "a2", "b2", "b3", "a3"]
    finish_partner()  # outside a pair: nothing


def test_overlap_key_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="parallel.overlap"):
        load_config(None, tiny_overrides(tmp_path, **{"parallel.overlap": "always"}))


def test_pair_runs_one_thread_at_a_time_switching_at_hand_offs():
    log = []

    def first():
        for step in ("a1", "a2", "a3"):
            log.append(step)
            hand_off()
        return "a"

    def second():
        log.append("b1")
        hand_off()
        log.append("b2")
        return "b"

    stats = PairStats()
    assert run_pair(first, second, stats) == ("a", "b")
    assert log == ["a1", "b1", "a2", "b2", "a3"]  # after b ends, a runs on alone
    assert (stats.pairs, stats.switches) == (1, 3)
    assert not has_handoff()
    hand_off()  # outside a pair: nothing to hand to


def test_pair_backward_hands_off_from_the_engine_s_own_thread():
    """On CUDA the autograd engine runs a backward's nodes on its device thread while the
    thread that called backward() waits: that thread must hand over at the backward's
    exchanges as the pair's helper would. Emulated with the backward on a thread of its
    own (what CUDA's engine does); without the engine hand-off the backward ran whole at
    the forward's first hand-off: a1, b-grad, b-after, a2, a3."""
    log = []

    class HandsOff(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            log.append("b-grad")
            hand_off()
            log.append("b-after")
            return g

    x = torch.ones(2, requires_grad=True)
    loss = HandsOff.apply(x).sum()

    def first():
        for step in ("a1", "a2", "a3"):
            log.append(step)
            hand_off()

    def second():
        engine = threading.Thread(target=loss.backward, name="device-thread")
        engine.start()
        engine.join()

    stats = PairStats()
    run_pair(first, second, stats)
    assert log == ["a1", "b-grad", "a2", "b-after", "a3"], log
    assert stats.switches == 3 and torch.equal(x.grad, torch.ones(2))
    assert not has_handoff()
    # outside a pair a backward node on another thread has no hand-off: it runs through
    y = HandsOff.apply(torch.ones(1, requires_grad=True)).sum()
    engine = threading.Thread(target=y.backward)
    engine.start()
    engine.join()
    assert log[-2:] == ["b-grad", "b-after"]


def test_pair_sections_time_their_own_thread_only():
    """A section opened inside a pair closes while the other thread runs and reopens after
    (two intervals); the other's sections nest in the caller's, not in it."""
    from epscale.metrics import StepTimers

    timers = StepTimers()

    def first():
        with timers.section("forward"):
            hand_off()

    def second():
        with timers.section("experts"):
            pass

    with timers.section("backward"):
        run_pair(first, second, timers=timers)
    assert [(n, p) for n, p, _d in timers._durations()] == [
        ("forward", "backward"), ("experts", "backward"), ("forward", "backward"),
        ("backward", None)]
    assert timers.num_open() == 0


def test_pair_raises_what_either_side_raised():
    done = []

    def fails():
        hand_off()
        raise ValueError("backward broke")

    with pytest.raises(ValueError, match="backward broke"):
        run_pair(lambda: done.append(hand_off()) or "ok", fails)
    assert done == [None] and not has_handoff()


def test_union_of_intervals():
    assert _union([]) == 0.0
    assert _union([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.5, 3.6), (5.0, 5.0)]) == 3.0


def _synthetic(step: int, exposed: float, dispatch_s: float) -> dict:
    kinds = {k: {"s": 0.0, "exposed_s": 0.0, "exposed_share": 0.0, "collectives": 0.0}
             for k in COMM_KINDS}
    kinds["dispatch"] = {"s": dispatch_s, "exposed_s": exposed, "exposed_share": exposed,
                         "collectives": 8.0}
    return {"step": step, "step_time_s": 1.0, "comm_s": dispatch_s, "comm_exposed_s": exposed,
            "comm_exposed_share": exposed, "comm_by_kind": kinds}


def test_exposed_share_in_summary_report_and_check():
    from epscale.commands.monitor import exposed_line
    from epscale.monitor.report import exposed_columns
    from epscale.plan.overlap import exposed_summary

    recs = [_synthetic(s, e, 0.5) for s, e in ((1, 0.4), (2, 0.1), (3, 0.2), (4, 0.3))]
    ex = exposed_summary(recs)
    assert ex["exposed_share"] == pytest.approx(0.25)
    assert ex["by_kind"] == {"dispatch": pytest.approx(0.25)}  # only kinds that sent
    assert ex["hidden_frac"] == pytest.approx(0.5)             # 1 - exposed / in flight
    # monitor --check: the steps after the first fifth (a warm-up step 0 left out)
    warm = [_synthetic(0, 0.9, 1.0)] + recs
    assert exposed_line(warm) == ("communication: exposed 25.0% of the step (dispatch "
                                  "25.0%); 50.0% of its time in flight hidden behind compute")
    cols = exposed_columns(recs)
    assert cols["comm_exposed_share"] == [0.4, 0.1, 0.2, 0.3]
    assert cols["comm_exposed_share.dispatch"] == [0.4, 0.1, 0.2, 0.3]
    assert set(cols) == {"comm_exposed_share", "comm_exposed_share.dispatch"}
    # runs from before these fields, and runs without communication, show nothing
    assert exposed_summary([{"step": 1}]) is None and exposed_line([{"step": 1}]) is None
    assert exposed_line([_synthetic(1, 0.0, 0.0)]) is None
    assert exposed_columns([_synthetic(1, 0.0, 0.0)]) == {}
