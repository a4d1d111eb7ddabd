"""ZeRO-1/2 (``parallel.zero``) in the real trainer on real gloo process groups: ZeRO-1
under a pipeline (pp=2 x FSDP dp_shard=2 under 1F1B, and DeepSeek-V3's shape: DualPipeV
with ep=2 inside each stage) and ZeRO-1 and ZeRO-2 without one (FSDP dp_shard=4 x ep=2,
two micro-batches per step) train the tiny model with the losses and gradient norms of
one process at the same global batch; a ZeRO-1 pp=2 checkpoint resumes bit for bit and
continues at pp=1 (ZeRO-3, dp_shard=4 x ep=2); the memory model's weight, gradient,
AdamW and gathered-weight bytes are what FSDP holds on every rank, exactly (at the step's
last forward, after earlier micro-batches' backwards), under ZeRO-1/2 and under ZeRO-3
in a pipeline (bf16 compute there: gathered bf16, fp32 gradients), and with the last
stage's embedding copy and an MTP module under 1F1B and DualPipeV.

One spawn of 4 ranks runs every case; the one-process references run here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dist_utils import CaseRunner, assert_no_failures, copy_checkpoint, run_distributed, run_trainer
from epscale.config import ConfigError, load_config
from epscale.plan.layout import Layout
from epscale.plan.memory import Activations, estimate, pipeline_memory
from test_pipeline import BASE, REFERENCES, _summary
from test_train import assert_losses_close, tiny_cfg

STEPS = 4
PP_ZERO1 = {"parallel.pp": 2, "parallel.fsdp": True, "parallel.zero": 1,
            "train.micro_batch_size": 1, "train.grad_accum": 4}
NO_PP = {"parallel.fsdp": True, "parallel.ep": 2, "train.micro_batch_size": 1,
         "train.grad_accum": 2, "train.steps": STEPS}
# name -> overrides on BASE; every micro-batch holds one sequence (REFERENCES[1])
CASES = {
    "zero1 pp2 fsdp2 1f1b": {**PP_ZERO1, "train.steps": STEPS, "train.ckpt_every": 2},
    # DeepSeek-V3's shape: DualPipeV, experts over ep inside each stage (efsdp = 1)
    "zero1 pp2 fsdp2 ep2 dualpipev": {**PP_ZERO1, "parallel.ep": 2,
                                      "parallel.pp_schedule": "dualpipev", "train.steps": STEPS},
    "zero1 fsdp4 ep2": {**NO_PP, "parallel.zero": 1},
    "zero2 fsdp4 ep2": {**NO_PP, "parallel.zero": 2},
}
MEMORY_ONLY = {"zero3 pp2 fsdp2 bf16": {**PP_ZERO1, "parallel.zero": 3, "train.steps": 1,
                                        "train.dtype": "bfloat16"},
               # the last stage's embedding copy (a tied head) and an MTP module, on the
               # rank of both ends (DualPipeV's rank 0) and of the last alone (1F1B's rank 1)
               "zero1 pp2 fsdp2 ep2 dualpipev tied mtp": {
                   **PP_ZERO1, "parallel.ep": 2, "parallel.pp_schedule": "dualpipev",
                   "train.steps": 1, "model.tie_embeddings": True, "model.mtp_depth": 1},
               "zero1 pp2 fsdp2 1f1b tied mtp": {**PP_ZERO1, "train.steps": 1,
                                                 "model.tie_embeddings": True,
                                                 "model.mtp_depth": 1}}


def _fsdp_params(modules) -> list:
    """Every FSDPParam under ``modules`` (FSDP2's own record of a parameter's shard, its
    gathered copy and its gradients), once."""
    seen = {}
    for root in modules:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    for fp in group.fsdp_params:
                        seen[id(fp)] = fp
    return list(seen.values())


def _nbytes(t) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def held_bytes(modules, opt) -> dict[str, int]:
    """What this rank holds now: fp32 weight shards, gathered weights (FSDP's all-gather
    outputs while allocated), gradients (unsharded, being accumulated, and sharded) and
    AdamW's moments."""
    out = {"params": 0, "unsharded": 0, "grads": 0}
    for fp in _fsdp_params(modules):
        out["params"] += _nbytes(fp.sharded_param)
        out["unsharded"] += sum(o.untyped_storage().nbytes() for o in fp.all_gather_outputs)
        unsharded = getattr(fp, "_unsharded_param", None)
        for g in (fp.unsharded_accumulated_grad, None if unsharded is None else unsharded.grad,
                  fp.sharded_param.grad):
            out["grads"] += _nbytes(g) if g is not None else 0
    out["optimizer"] = sum(_nbytes(v) for s in opt.state.values() for k, v in s.items()
                           if k in ("exp_avg", "exp_avg_sq"))
    return out


def _estimated(cfg, world: int, pp_rank: int) -> dict[str, float]:
    acts = Activations.of(cfg, compute_dtype="bfloat16" if cfg.train.dtype == "bfloat16"
                          else "float32")
    lay = Layout.from_config(cfg, world)
    mem = (pipeline_memory(cfg, lay, acts)[pp_rank].memory if lay.pp > 1
           else estimate(cfg, lay, acts))
    return {k: getattr(mem, k) for k in ("params", "unsharded", "grads", "optimizer")}


def _measure(t, cfg, world, seen: dict) -> None:
    """After set-up: record what the rank holds at every training forward (the last one
    is the step's last micro-batch: earlier backwards have run), and the estimate."""
    modules = [t.model, *t.chunks]
    seen["estimate"] = _estimated(cfg, world, t.dims.pp_rank)

    def hook(module, args):
        if module.training and torch.is_grad_enabled():
            seen["held"] = held_bytes(modules, t.opt)

    for m in t.chunks or [t.model]:
        m.register_forward_pre_hook(hook)


def _run(corpus_dir: Path, run_dir: Path, world: int, over: dict, seen=None) -> list[dict]:
    cfg = tiny_cfg(corpus_dir, **{**BASE, **over})
    inspect = (lambda t: _measure(t, cfg, world, seen)) if seen is not None else None
    return _summary(run_trainer(cfg, run_dir, world, inspect=inspect))


def _worker(rank, world, corpus_dir, tmp):
    corpus_dir, tmp = Path(corpus_dir), Path(tmp)
    runner, out = CaseRunner(rank), {"memory": {}}
    for name, over in {**CASES, **MEMORY_ONLY}.items():
        with runner.case(name):
            seen = out["memory"][name] = {}
            out[name] = _run(corpus_dir, tmp / name.replace(" ", "_"), world, over, seen)
    full = tmp / "zero1_pp2_fsdp2_1f1b"
    for name, over in (("resumed zero1 pp2", {**PP_ZERO1, "train.steps": STEPS}),
                       ("continued at zero3 fsdp4 ep2", NO_PP)):
        with runner.case(name):
            run_dir = tmp / name.replace(" ", "_")
            copy_checkpoint(full, 2, run_dir, rank)
            out[name] = _run(corpus_dir, run_dir, world, over)
    return runner.failures, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    corpus_dir = tmp_path_factory.mktemp("corpus")
    tmp, tmp1 = tmp_path_factory.mktemp("w4"), tmp_path_factory.mktemp("w1")
    ref = _run(corpus_dir, tmp1 / "ref", 1, {**REFERENCES[1], "train.steps": STEPS})
    results = run_distributed(_worker, 4, args=(str(corpus_dir), str(tmp)), timeout_s=600)
    assert_no_failures([f for f, _ in results])
    return ref, [out for _, out in results]


def _by_step(records, key):
    return {r["step"]: r[key] for r in records}


@pytest.mark.parametrize("name", list(CASES))
def test_zero_trains_like_one_process(runs, name):
    """Losses and gradient norms of one process at the same global batch (step 1 from
    the same weights)."""
    ref, got = runs
    records = got[0][name]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        assert_losses_close(_by_step(records, key), _by_step(ref, key), same_weights=(1,))
    # validation after the last step (its forwards keep the weights gathered; then freed)
    assert records[-1]["val_loss"] == pytest.approx(ref[-1]["val_loss"], rel=5e-4)


def test_zero1_pipeline_checkpoint_resumes_exactly_and_reshards(runs):
    _, got = runs
    full = {r["step"]: (r["loss"], r["grad_norm"]) for r in got[0]["zero1 pp2 fsdp2 1f1b"]}
    resumed = got[0]["resumed zero1 pp2"]
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:    # bit for bit: the same layout continues from its own checkpoint
        assert (r["loss"], r["grad_norm"]) == full[r["step"]]
    other = got[0]["continued at zero3 fsdp4 ep2"]
    assert [r["step"] for r in other] == [3, 4]
    assert_losses_close(_by_step(other, "loss"), {s: v[0] for s, v in full.items()},
                        same_weights=(3,))


@pytest.mark.parametrize("name", [*CASES, *MEMORY_ONLY])
def test_memory_model_counts_what_fsdp_holds(runs, name):
    """Every rank: the estimate's fp32 weight shards, gradients, AdamW moments and
    gathered weights are the bytes FSDP holds at the last micro-batch's forward."""
    _, got = runs
    for rank, out in enumerate(got):
        seen = out["memory"][name]
        assert seen["held"] == seen["estimate"], (rank, seen)
        assert seen["held"]["unsharded"] > 0 and seen["held"]["grads"] > 0


def test_zero_config_rules_name_the_key(tmp_path):
    for over, words in ((["parallel.zero=1"], "set parallel.fsdp: true"),
                        (["parallel.fsdp=true", "parallel.zero=4"], "must be 1"),
                        (["parallel.fsdp=true", "parallel.zero=true"], "must be an integer"),
                        (["parallel.fsdp=true", "parallel.zero=2", "parallel.pp=2"],
                         "use parallel.zero: 1")):
        with pytest.raises(ConfigError, match=rf"'parallel.zero' = .* is invalid: .*{words}"):
            load_config(None, over)
    with pytest.raises(ConfigError, match="'parallel.zero' = 2 is invalid"):
        Layout(world=4, pp=2, fsdp=True, micro_batches=2, zero=2)
    lay = Layout.from_config(load_config(None, ["parallel.fsdp=true", "parallel.zero=1"]), 4)
    assert lay.zero == 1 and "ZeRO-1" in lay.label()
    # a replicated layout of a ZeRO-1 recipe (describe --no-fsdp, --fit) is plain
    assert Layout.from_config(load_config(None, ["parallel.fsdp=true", "parallel.zero=1"]), 4,
                              fsdp=False).zero == 3


def test_memory_model_orders_the_levels_and_fit_keeps_the_level():
    """Without a pipeline ZeRO-2 adds the gathered weights to ZeRO-3, ZeRO-1 the unsharded
    gradients to that; under one every level holds the stage's gathered weights and
    unsharded gradients. --fit's FSDP layouts keep the recipe's level (1 for 2 under a
    pipeline, which refuses it) and reproduce it by their overrides."""
    from epscale.plan.cluster import ClusterSpec
    from epscale.plan.fit import FitResult, candidates
    from epscale.plan.memory import memory_per_rank

    base = ["model.num_layers=4", "model.tie_embeddings=false", "parallel.fsdp=true",
            "parallel.dp=1", "parallel.ep=2"]
    mem = {z: memory_per_rank(load_config(None, base + [f"parallel.zero={z}"]), world=4)
           for z in (1, 2, 3)}
    assert mem[3].unsharded == 0 < mem[2].unsharded == mem[1].unsharded
    assert mem[3].grads == mem[2].grads == mem[3].params < mem[1].grads
    assert mem[1].params == mem[3].params and mem[1].optimizer == mem[3].optimizer
    piped = {z: memory_per_rank(load_config(None, base + ["parallel.pp=2", "train.grad_accum=2",
                                                          f"parallel.zero={z}"]), world=8)
             for z in (1, 3)}
    assert piped[1] == piped[3] and piped[1].unsharded > 0
    cfg = load_config(None, base + ["parallel.zero=2", "train.grad_accum=4"])
    tried = candidates(cfg, ClusterSpec(nodes=1, gpus_per_node=4))
    assert {(c.parallel.fsdp, c.parallel.pp > 1, c.parallel.zero) for c in tried} == {
        (False, False, 3), (False, True, 3), (True, False, 2), (True, True, 1)}
    firsts = {(c.parallel.fsdp, c.parallel.pp): c for c in reversed(tried)}
    for c in firsts.values():
        over = FitResult(c, mem[1], 1.0, 1.0, recipe_pp=1).overrides()
        again = load_config(None, base + ["parallel.zero=2", "train.grad_accum=4", *over])
        assert (again.parallel.zero, again.parallel.fsdp) == (c.parallel.zero, c.parallel.fsdp)
