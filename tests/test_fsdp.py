"""FSDP2 with expert parallelism, in the real trainer on real gloo process groups: layouts
(FSDP dp_shard=4 x ep=2 and 4, HSDP 2 x 2 x 2, expert hidden-dim sharding; the two-rank
layouts are cells of tests/test_layout_matrix.py) train the tiny model with the losses of one process at the same global batch,
with every dispatcher; activation checkpointing full and selective change nothing; the
meta-device build holds a one-process build's values; no rank holds the whole model, and
the largest share is the memory estimate's parameters per rank; a
checkpoint (blocking or written in the background) resumes bit for bit under FSDP and
loads at other layouts (FSDP <-> replicated
<-> one process) with the same loss.

One spawn of 4 ranks runs every case inside it, one of 2 loads its checkpoint (the trainer leaves the
process group it did not create); the one-process references run here."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from dist_utils import CaseRunner, assert_no_failures, copy_checkpoint, run_distributed, run_trainer
from epscale.model import build_model
from epscale.parallel.materialize import full_view
from epscale.plan.memory import memory_per_rank
from epscale.training import checkpoint as ckpt
from epscale.training.loop import train
from test_train import assert_losses_close, tiny_cfg

STEPS = 3
# The balance loss over the global batch (aux_loss_scope=global): a per-micro-batch one
# averaged over ranks is not the loss of one process's batch, and its gradient shows.
BASE = {"train.steps": STEPS, "train.eval_every": 0, "train.ckpt_every": 0,
        "train.micro_batch_size": 2, "train.collective_timeout_s": 0, "train.preflight": False,
        "moe.aux_loss_scope": "global"}
FSDP = {"parallel.fsdp": True}

# name -> (world, overrides on BASE). Every dispatcher appears; AC modes on FSDP layouts.
CASES4 = {
    "fsdp4 ep2 dedup": {**FSDP, "parallel.ep": 2},
    "fsdp4 ep2 alltoall ac-full": {**FSDP, "parallel.ep": 2, "parallel.dispatcher": "alltoall",
                                   "train.activation_checkpointing": "full"},
    "fsdp4 ep2 allgather ac-selective": {**FSDP, "parallel.ep": 2,
                                         "parallel.dispatcher": "allgather",
                                         "train.activation_checkpointing": "selective"},
    "hsdp 2x2 ep2 dedup-overlap": {**FSDP, "parallel.ep": 2, "parallel.dp_replicate": 2,
                                   "parallel.overlap_chunks": 2},
    # efsdp = 1 under selective recomputation (the experts' weights need no gather)
    "fsdp4 ep4 hierarchical ac-selective": {**FSDP, "parallel.ep": 4,
                                            "parallel.dispatcher": "hierarchical",
                                            "parallel.ranks_per_node": 2,
                                            "train.activation_checkpointing": "selective"},
    "fsdp4 ep2 hidden-dim shards": {**FSDP, "parallel.ep": 2, "moe.num_experts": 6},
}
# The two-rank FSDP layouts (dp_shard=2 x ep=1, and ep=2 under each recomputation mode,
# the common single-node layout) are cells of tests/test_layout_matrix.py.


def losses_by_step(records) -> dict[int, tuple[float, float]]:
    """{step: (loss, grad norm)}: the norm checks the gradients themselves (AdamW would
    hide a gradient scaled by a constant from the losses)."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records}


def assert_same_training(got, ref, same_weights=()) -> None:
    assert_losses_close({s: v[0] for s, v in got.items()}, {s: v[0] for s, v in ref.items()},
                        same_weights)
    assert_losses_close({s: v[1] for s, v in got.items()}, {s: v[1] for s, v in ref.items()},
                        same_weights)


def _cfg(corpus_dir: Path, world: int, over: dict):
    """The same global batch at every world size: 8 sequences per step."""
    return tiny_cfg(corpus_dir, **{**BASE, **over, "train.micro_batch_size": 8 // world})


def _local_bytes(model) -> tuple[int, int]:
    """(dense, expert) bytes this rank's parameter storages hold."""
    dense = expert = 0
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        n = local.numel() * local.element_size()
        if ".experts." in name:
            expert += n
        else:
            dense += n
    return dense, expert


def _check_meta_init(model, cfg, dims) -> None:
    """Each rank's shards hold what a one-process build of the seed holds there."""
    ref = dict(build_model(cfg).named_parameters())
    for name, p in model.named_parameters():
        local, shape, offset = full_view(p, dims)
        assert tuple(ref[name].shape) == shape, (name, shape)
        want = ref[name][tuple(slice(o, o + n) for o, n in zip(offset, local.shape))]
        assert torch.equal(local, want), name


def _trainer_case(corpus_dir, run_dir, world, over, inspect=None, stop_at=None) -> dict:
    cfg = _cfg(corpus_dir, world, over)
    check = (lambda t: inspect(t, cfg)) if inspect is not None else None
    return losses_by_step(run_trainer(cfg, run_dir, world, stop_at=stop_at, inspect=check))


def _worker(rank, world, corpus_dir, tmp, cases, resume):
    import torch.distributed as dist

    corpus_dir, tmp = Path(corpus_dir), Path(tmp)
    runner = CaseRunner(rank)
    out = {}
    for name, over in cases.items():
        with runner.case(name):
            def inspect(t, cfg):
                if not t.fsdp:
                    return
                _check_meta_init(t.model, cfg, t.dims)
                dense, expert = _local_bytes(t.model)
                sums = torch.tensor([dense, expert], dtype=torch.float64)
                dist.all_reduce(sums)
                ref = build_model(cfg)
                full_dense, full_expert = _local_bytes(ref)
                rep, shard = t.dims.dp_replicate, t.dims.dp_shard
                # every replica holds one copy in all, split over its dp_shard ranks
                assert sums.tolist() == [rep * full_dense, rep * full_expert]
                # each rank its 1/dp_shard share (uneven splits: at most a row more each)
                rows = sum(p[0].numel() * p.element_size() for p in ref.parameters() if p.dim())
                assert dense + expert <= (full_dense + full_expert) / shard + rows
                # the memory estimate's parameters per rank: the largest share, exactly
                held = torch.tensor([float(dense + expert) / 4])
                dist.all_reduce(held, op=dist.ReduceOp.MAX)
                assert held.item() == memory_per_rank(cfg, world=world).params_per_rank
            out[name] = _trainer_case(corpus_dir, tmp / name.replace(" ", "_"), world, over, inspect)
    if resume:
        with runner.case("fsdp exact resume and reshard"):
            over = {**FSDP, "parallel.ep": 2}
            full_run = tmp / "uninterrupted"
            out["uninterrupted"] = _trainer_case(corpus_dir, full_run, world,
                                                 {**over, "train.steps": 4, "train.ckpt_every": 2})
            resumed = tmp / "resumed"
            copy_checkpoint(full_run, 2, resumed, rank)
            out["resumed"] = _trainer_case(corpus_dir, resumed, world, {**over, "train.steps": 4})
            # written in the background (DCP async_save over its own gloo group), then
            # resumed from: the same as the blocking saves
            async_run = tmp / "async"
            out["async"] = _trainer_case(corpus_dir, async_run, world,
                                         {**over, "train.steps": 4, "train.ckpt_every": 2,
                                          "train.async_checkpoint": True})
            from_async = tmp / "from_async"
            copy_checkpoint(async_run, 2, from_async, rank)
            out["resumed from async"] = _trainer_case(corpus_dir, from_async, world,
                                                      {**over, "train.steps": 4})
            replicated = tmp / "replicated"
            copy_checkpoint(full_run, 2, replicated, rank)
            out["replicated dp2 x ep2 from fsdp"] = _trainer_case(
                corpus_dir, replicated, world, {"parallel.ep": 2, "train.steps": 4}, stop_at=3)
            back = tmp / "fsdp_from_replicated"
            copy_checkpoint(replicated, 3, back, rank)
            out["fsdp from replicated"] = _trainer_case(corpus_dir, back, world,
                                                        {**over, "train.steps": 4})
    return runner.failures, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run every case once: the 4- and 2-rank spawns and the one-process references."""
    corpus_dir = tmp_path_factory.mktemp("corpus")
    tmp4, tmp2, tmp1 = (tmp_path_factory.mktemp(n) for n in ("w4", "w2", "w1"))
    r4 = run_distributed(_worker, 4, args=(str(corpus_dir), str(tmp4), CASES4, True),
                         timeout_s=600)
    assert_no_failures([f for f, _ in r4])
    # a fresh FSDP dp_shard=2 run, and the 4-rank FSDP checkpoint loaded at dp_shard=2 x ep=1
    fsdp_ckpt = ckpt.step_dir(tmp4 / "uninterrupted", 2)
    target = tmp2 / "from_fsdp4"
    (target / "checkpoints").mkdir(parents=True)
    shutil.copytree(fsdp_ckpt, ckpt.step_dir(target, 2))
    r2b = run_distributed(_load_worker, 2, args=(str(corpus_dir), str(target)), timeout_s=300)
    # one process: the references, and the FSDP checkpoint loaded there
    refs = {}
    for E in (8, 6):
        cfg = tiny_cfg(corpus_dir, **{**BASE, "train.micro_batch_size": 8, "moe.num_experts": E,
                                      "train.steps": 4})
        refs[E] = losses_by_step(train(cfg, tmp1 / f"ref{E}").records)
    one = tmp1 / "one_from_fsdp"
    (one / "checkpoints").mkdir(parents=True)
    shutil.copytree(fsdp_ckpt, ckpt.step_dir(one, 2))
    cfg1 = tiny_cfg(corpus_dir, **{**BASE, "train.micro_batch_size": 8, "train.steps": 3})
    one_loss = losses_by_step(train(cfg1, one).records)
    return {"w4": r4[0][1], "w2_load": r2b[0], "refs": refs, "one": one_loss}


def _load_worker(rank, world, corpus_dir, run_dir):
    return _trainer_case(Path(corpus_dir), Path(run_dir), world,
                         {**FSDP, "train.steps": 3})


@pytest.mark.parametrize("name", list(CASES4))
def test_four_rank_layouts_train_like_one_process(runs, name):
    E = CASES4[name].get("moe.num_experts", 8)
    assert_same_training(runs["w4"][name], runs["refs"][E], same_weights={1})


def test_activation_checkpointing_changes_nothing(runs):
    plain = runs["w4"]["fsdp4 ep2 dedup"]
    for name in ("fsdp4 ep2 alltoall ac-full", "fsdp4 ep2 allgather ac-selective"):
        assert_same_training(runs["w4"][name], plain, same_weights={1, 2, 3})


def test_fsdp_resume_is_bitwise(runs):
    full, resumed = runs["w4"]["uninterrupted"], runs["w4"]["resumed"]
    assert sorted(resumed) == [3, 4]
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)
    # background saves: the run and a resume from its checkpoint, bit for bit
    assert runs["w4"]["async"] == full
    assert runs["w4"]["resumed from async"] == {s: full[s] for s in (3, 4)}


def test_fsdp_checkpoint_loads_at_other_layouts(runs):
    """Saved at FSDP dp_shard=4 x ep=2, step 2; step 3 from the same weights everywhere."""
    want = runs["w4"]["uninterrupted"][3]
    got = {"replicated dp=2 x ep=2": runs["w4"]["replicated dp2 x ep2 from fsdp"][3],
           "fsdp dp_shard=2 x ep=1": runs["w2_load"][3], "one process": runs["one"][3]}
    for layout, loss_norm in got.items():
        assert loss_norm == pytest.approx(want, rel=1e-5), (layout, loss_norm, want)
    # and back: the replicated run's step-3 checkpoint continues under FSDP
    assert_same_training(runs["w4"]["fsdp from replicated"], runs["w4"]["uninterrupted"])
