"""The embedding on the last pipeline stage (issue #33: the layouts that trained DeepSeek-V3):
a tied head, multi-token prediction (MTP) and document masking at parallel.pp > 1.

Every micro-batch's token ids reach every stage (the document mask is made on each, the
last stage masks its targets and runs the MTP modules); the last stage holds a copy of the
embedding (``stage_embedding``) whose gradient is summed with the first stage's after the
reductions, so the two stay equal bit for bit and train as the one-process model's single
embedding; checkpoints never hold the copy.

In process (float64): two stage chunks on one process give the whole model's losses and,
once the copy's gradient is added to the embedding's, its gradients (the dense and the
FlexAttention document masks). On 4 real gloo ranks, one spawn: pp=2 under 1F1B, GPipe,
interleaved 1F1B, zero-bubble, ZB-V and DualPipeV (its overlapped pairs and one after the
other), replicated (dp 2), with EP 2, with FSDP (ZeRO-3 and ZeRO-1, EP 2 inside), train as
one process at the same global batch (loss, MTP loss, grad norm, validation loss, and the
weights after the steps), the embedding and its copy equal bit for bit; checkpoints written
at pp=2 (1F1B: the copy on another rank; DualPipeV: on the same rank) resume bit for bit
and continue at pp=1, and a pp=1 checkpoint continues at pp=2."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import CaseRunner, assert_no_failures, copy_checkpoint, run_distributed, run_trainer
from epscale.config import ConfigError, load_config
from epscale.model import Transformer, build_model
from epscale.parallel.pipeline import StageChunk, keep_stages
from epscale.training import checkpoint as ckpt
from epscale.training.checkpoint.state import build_state
from epscale.training.data.prepare import prepare
from epscale.training.dist import SingleProcessDims
from test_train import assert_losses_close

STEPS = 3
BASE = {"model.dim": 32, "model.num_layers": 4, "model.num_heads": 2, "model.seq_len": 32,
        "model.vocab_size": 264, "model.dense_hidden_dim": 64, "moe.hidden_dim": 32,
        "moe.num_experts": 4, "moe.top_k": 2, "moe.aux_loss_coeff": 0.01,
        "moe.bias_update_speed": 0.01, "parallel.ep": 1, "parallel.dp": 1, "train.lr": 3e-3,
        "train.steps": STEPS, "train.warmup_steps": 1, "train.eval_every": STEPS,
        "train.eval_batches": 1, "train.ckpt_every": 2, "train.collective_timeout_s": 0,
        "train.preflight": False, "name": "ppembed", "data.doc_masking": True,
        "model.tie_embeddings": True, "model.mtp_depth": 1, "train.mtp_loss_weight": 0.3}
MB2 = {"train.micro_batch_size": 2, "train.grad_accum": 4}   # one process: 8 sequences
MB1 = {"train.micro_batch_size": 1, "train.grad_accum": 8}
PP2 = {"parallel.pp": 2, "train.micro_batch_size": 2, "train.grad_accum": 2}  # x 2 data ranks
V = {"parallel.pp": 2, "train.micro_batch_size": 1, "train.grad_accum": 4}  # V: m >= 2 pp
UNTIED = {"model.tie_embeddings": False}

# the one-process references: name -> overrides on BASE
REFERENCES = {"mb2": MB2, "mb1": MB1, "mb2 depth2": {**MB2, "model.mtp_depth": 2},
              "mb2 untied": {**MB2, **UNTIED}, "mb2 tied only": {**MB2, "model.mtp_depth": 0}}
# name -> (the reference, overrides on BASE) at world 4
CASES = {
    "1f1b ep2": ("mb2", {**PP2, "parallel.ep": 2}),
    "1f1b fsdp2 ep2 zero3": ("mb2", {**PP2, "parallel.fsdp": True, "parallel.ep": 2}),
    "dualpipev fsdp2 ep2 zero1 overlapped pairs": (
        "mb1", {**V, "parallel.pp_schedule": "dualpipev", "parallel.fsdp": True,
                "parallel.ep": 2, "parallel.zero": 1}),
    "dualpipev dp2 overlap none": ("mb1", {**V, "parallel.pp_schedule": "dualpipev",
                                           "parallel.dp": 2, "parallel.overlap": "none"}),
    # the split backward recomputes the blocks (the MTP block's too) for each part
    "zbv ep2 ac-full": ("mb1", {**V, "parallel.pp_schedule": "zbv", "parallel.ep": 2,
                                "train.activation_checkpointing": "full"}),
    "gpipe dp2 mtp depth 2": ("mb2 depth2", {**PP2, "parallel.pp_schedule": "gpipe",
                                             "parallel.dp": 2, "model.mtp_depth": 2}),
    "interleaved ep2 untied mtp": ("mb2 untied", {
        **PP2, **UNTIED, "parallel.pp_schedule": "interleaved_1f1b",
        "parallel.pp_virtual_stages": 2, "parallel.ep": 2}),
    # the last stage with the MTP module and the head alone (Megatron's DeepSeek-V3 layout;
    # the trainer's default where the module outweighs a stage of blocks)
    "1f1b ep2 mtp alone on the last stage": ("mb2", {**PP2, "parallel.ep": 2,
                                                     "parallel.pp_layers_per_stage": [4, 0]}),
    "dualpipev fsdp2 ep2 zero1 mtp alone": (
        "mb1", {**V, "parallel.pp_schedule": "dualpipev", "parallel.fsdp": True,
                "parallel.ep": 2, "parallel.zero": 1, "parallel.pp_layers_per_stage": [1, 2, 1, 0]}),
    "zero_bubble dp2 tied without mtp": ("mb2 tied only", {
        **PP2, "parallel.pp_schedule": "zero_bubble", "parallel.pp_virtual_stages": 2,
        "parallel.dp": 2, "model.mtp_depth": 0}),
}
# checkpoints: (a run above or the one-process 'mb2', saved at step 2) -> (name, overrides)
RESUMES = {
    "1f1b ep2": [("1f1b ep2 resumed", CASES["1f1b ep2"][1]),
                 ("1f1b ep2 -> pp1 fsdp4 ep2", {"parallel.fsdp": True, "parallel.ep": 2,
                                                "train.micro_batch_size": 2,
                                                "train.grad_accum": 1})],
    "dualpipev fsdp2 ep2 zero1 overlapped pairs": [
        ("dualpipev resumed", CASES["dualpipev fsdp2 ep2 zero1 overlapped pairs"][1]),
        ("dualpipev -> pp1 dp4", {"parallel.dp": 4, "train.micro_batch_size": 1,
                                  "train.grad_accum": 2})],
    "mb2": [("pp1 -> 1f1b ep2", CASES["1f1b ep2"][1]),
            ("pp1 -> 1f1b fsdp2 ep2", CASES["1f1b fsdp2 ep2 zero3"][1])],
    "mb1": [("pp1 -> dualpipev dp2", CASES["dualpipev dp2 overlap none"][1])],
}


def _documents(root: Path) -> Path:
    """Prepared data of short documents (3 to 10 words, each ending in an EOS), so that a
    32-token window crosses a document boundary or two: the masks matter."""
    out = root / "data"
    if out.exists():
        return out
    rng = random.Random(0)
    words = Path(__file__).read_text().split()
    folder = root / "docs"
    folder.mkdir(parents=True)
    for i in range(400):
        (folder / f"{i:04d}.txt").write_text(" ".join(rng.choices(words, k=rng.randint(3, 10))))
    prepare([folder], "bytes", out, val_fraction=0.1, progress=False)
    return out


def _cfg(data: Path, over: dict):
    merged = {**BASE, "data.source": str(data), **over}
    return load_config(None, [f"{k}={v}" for k, v in merged.items()])


def _records(records) -> dict[int, dict]:
    return {r["step"]: {k: r.get(k) for k in ("loss", "mtp_loss", "grad_norm", "val_loss")}
            for r in records}


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _embeddings(trainer) -> dict:
    """This rank's embedding and copy (local shards) and their AdamW moments."""
    out = {}
    for key, module in (("original", trainer.model.tok_embeddings),
                        ("copy", trainer.model.stage_embedding)):
        if module is not None:
            state = trainer.opt.state[module.weight]
            out[key] = [_local(module.weight)] + [_local(state[k]) for k in ("exp_avg",
                                                                              "exp_avg_sq")]
    return out


def _copies_equal(trainer) -> list[bool]:
    """Collective: for every pair (the embedding on a rank of stage 0, its copy on the rank
    of the last stage with the same stage rank), whether weights and moments are equal bit
    for bit."""
    mine = (trainer.dims.stage_rank, _embeddings(trainer))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    originals = {r: e["original"] for r, e in every if "original" in e}
    copies = {r: e["copy"] for r, e in every if "copy" in e}
    assert sorted(originals) == sorted(copies) == list(range(trainer.dims.stage_size))
    return [all(torch.equal(a, b) for a, b in zip(originals[r], copies[r])) for r in originals]


def _train(data: Path, run_dir: Path, world: int, over: dict) -> dict:
    held = {}
    records = run_trainer(_cfg(data, over), run_dir, world, inspect=lambda t: held.update(t=t))
    return {"records": _records(records), "copies equal": _copies_equal(held["t"])
            if held["t"].pp > 1 else None}


def _worker(rank, world, data, tmp, one_process_runs):
    data, tmp = Path(data), Path(tmp)
    runner, out = CaseRunner(rank), {}
    for name, (_ref, over) in CASES.items():
        with runner.case(name):
            out[name] = _train(data, tmp / name.replace(" ", "_"), world, over)
    for source, continuations in RESUMES.items():
        src = Path(one_process_runs) / source if source in REFERENCES else \
            tmp / source.replace(" ", "_")
        for name, over in continuations:
            with runner.case(name):
                run_dir = tmp / name.replace(" ", "_").replace(">", "")
                copy_checkpoint(src, 2, run_dir, rank)
                out[name] = _train(data, run_dir, world, over)
    return runner.failures, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = _documents(tmp_path_factory.mktemp("data"))
    one, tmp = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("w4")
    refs = {name: _train(data, one / name, 1, over)["records"]
            for name, over in REFERENCES.items()}
    results = run_distributed(_worker, 4, args=(str(data), str(tmp), str(one)), timeout_s=600)
    assert_no_failures([f for f, _ in results])
    return refs, results[0][1], one, tmp


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_trains_like_one_process(runs, name):
    """Loss (the next-token loss alone), MTP loss, gradient norm (the copy counted once:
    a copy whose gradient were not summed, or counted twice, moves it) and validation loss
    of one process at the same global batch; step 1 from the same weights."""
    refs, got, _one, _tmp = runs
    ref, records = refs[CASES[name][0]], got[name]["records"]
    assert sorted(records) == list(range(1, STEPS + 1))
    keys = ("loss", "grad_norm") + (("mtp_loss",) if records[1]["mtp_loss"] is not None else ())
    assert (records[1]["mtp_loss"] is None) == (ref[1]["mtp_loss"] is None)
    for key in keys:
        assert_losses_close({s: r[key] for s, r in records.items()},
                            {s: r[key] for s, r in ref.items()}, same_weights=(1,))
    assert records[STEPS]["val_loss"] == pytest.approx(ref[STEPS]["val_loss"], rel=5e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_embedding_and_copy_stay_equal_bit_for_bit(runs, name):
    """After the steps (clipped, AdamW) the first stage's embedding and the last stage's
    copy hold the same weights and moments on every stage rank (sharded by FSDP, or one
    rank holding both under the V schedules)."""
    _refs, got, _one, _tmp = runs
    assert got[name]["copies equal"] and all(got[name]["copies equal"])


@pytest.mark.parametrize("name, ref", [("1f1b fsdp2 ep2 zero3", "mb2"),
                                       ("dualpipev fsdp2 ep2 zero1 overlapped pairs", "mb1")])
def test_weights_after_the_steps_are_one_process(runs, name, ref, tmp_path):
    """The final checkpoint (written without the copy: the same names as one process's)
    holds one process's weights within a tenth of one AdamW step (lr: the most a weight
    moves per step): the gradients' summation order, which AdamW's division by the root
    of its second moment can magnify where a gradient is near zero (1e-4 seen)."""
    _refs, _got, one, tmp = runs
    ours = _export(ckpt.step_dir(tmp / name.replace(" ", "_"), STEPS), tmp_path / "a.pt")
    theirs = _export(ckpt.step_dir(one / ref, STEPS), tmp_path / "b.pt")
    assert set(ours["model"]) == set(theirs["model"]) and "tok_embeddings.weight" in ours["model"]
    assert not any("stage_embedding" in k for k in ours["model"]) and set(ours["optim"]) == \
        set(theirs["optim"])
    lr = BASE["train.lr"]
    for key, t in ours["model"].items():
        torch.testing.assert_close(t, theirs["model"][key], rtol=0, atol=0.1 * lr, msg=key)


def _export(step_dir: Path, out: Path) -> dict:
    ckpt.export_full(step_dir, out)
    return torch.load(out, weights_only=True)


def test_checkpoints_resume_bit_for_bit_and_move_between_pp(runs):
    """Written at pp=2 (1F1B: the copy on the other rank, renamed on load; DualPipeV: on the
    rank of the embedding, copied after the load) a checkpoint resumes at the same layout
    bit for bit and continues at pp=1 (FSDP, replicated) as the uninterrupted run; one
    written at pp=1 continues at pp=2 (replicated, FSDP shards, a V) as the one-process
    run, the copy loaded equal to the embedding."""
    refs, got, _one, _tmp = runs
    pairs = [("1f1b ep2 resumed", "1f1b ep2", True), ("1f1b ep2 -> pp1 fsdp4 ep2", "1f1b ep2", False),
             ("dualpipev resumed", "dualpipev fsdp2 ep2 zero1 overlapped pairs", True),
             ("dualpipev -> pp1 dp4", "dualpipev fsdp2 ep2 zero1 overlapped pairs", False)]
    for name, full, exact in pairs:
        records, whole = got[name]["records"], got[full]["records"]
        assert sorted(records) == [3], name
        if exact:
            assert records[3] == whole[3], name
        for key in ("loss", "mtp_loss", "grad_norm"):
            assert records[3][key] == pytest.approx(whole[3][key], rel=1e-5), (name, key)
    for name, ref in (("pp1 -> 1f1b ep2", "mb2"), ("pp1 -> 1f1b fsdp2 ep2", "mb2"),
                      ("pp1 -> dualpipev dp2", "mb1")):
        records = got[name]["records"]
        assert all(got[name]["copies equal"])
        for key in ("loss", "mtp_loss", "grad_norm"):
            assert records[3][key] == pytest.approx(refs[ref][3][key], rel=1e-5), (name, key)


# ------------------------------------------------------------------ in process, float64
def _tiny(**over):
    items = {**{k: v for k, v in BASE.items() if k.startswith(("model.", "moe."))},
             "model.seq_len": 16, "model.vocab_size": 64, "moe.experts_impl": "grouped_mm",
             **over}
    return load_config(None, [f"{k}={v}" for k, v in items.items()])


def _stage(cfg, full: Transformer, stages: list[int]) -> tuple[Transformer, list[StageChunk]]:
    """``full``'s stages ``stages`` of a 2-stage split, as a pipeline rank holds them (its
    last-stage copy of the embedding holding the embedding's values)."""
    part = build_model(cfg).double()
    part.load_state_dict(full.state_dict())
    keep_stages(part, stages, [2, 2])
    if part.stage_embedding is not None:
        part.stage_embedding.to(torch.float64)
        with torch.no_grad():
            part.stage_embedding.weight.copy_(full.tok_embeddings.weight)
    return part, [StageChunk(part, s, 2, range(2 * s, 2 * s + 2), mtp_weight=0.3)
                  for s in stages]


@pytest.mark.parametrize("mask", ["dense", "flex"])
def test_two_stages_are_the_whole_model_in_float64(mask):
    """Stage 0 then stage 1 (the ids as the pipeline hands them) give the whole model's
    loss and MTP loss with document masking (the dense mask, and FlexAttention's block
    mask, forward only on CPU); in backward, the embedding's gradient plus its copy's is
    the whole model's embedding gradient and every other gradient is the whole model's."""
    cfg = _tiny()
    full = build_model(cfg).double()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(4, 64, (2, 16), generator=g)
    x[0, 5], x[0, 11], x[1, 3] = 3, 3, 3
    y = torch.randint(4, 64, (2, 16), generator=g)
    first, (c0,) = _stage(cfg, full, [0])
    last, (c1,) = _stage(cfg, full, [1])
    for net in (full, first, last):
        net.set_document_masking(3, mask)
    with torch.set_grad_enabled(mask == "dense"):
        out = c1(c0(x, targets_BS=y), targets_BS=y, tokens_BS=x)
        want = full.loss(x, y)
    assert out.shape == (1,) and (out[0] - want).abs() < 1e-12
    if mask == "flex":
        return
    assert (c1.mtp_losses[0] - full.mtp_loss()).abs() < 1e-12
    out.sum().backward()
    (want + 0.3 * full.mtp_loss() + full.aux_loss()).backward()
    grads = {**{n: p.grad for n, p in first.named_parameters()},
             **{n: p.grad for n, p in last.named_parameters()}}
    summed = grads.pop("tok_embeddings.weight") + grads.pop("stage_embedding.weight")
    assert torch.allclose(summed, full.tok_embeddings.weight.grad, rtol=1e-10, atol=1e-13)
    for name, p in full.named_parameters():
        if name != "tok_embeddings.weight":
            assert torch.allclose(grads[name], p.grad, rtol=1e-10, atol=1e-13), name


def test_only_the_last_stage_holds_the_copy_and_the_modules():
    from epscale.model import build_meta_model

    cfg = _tiny()
    held = {}
    for rank, stages in enumerate(([0], [1], [0, 1])):
        m = build_meta_model(cfg)
        keep_stages(m, stages, [2, 2])
        held[rank] = (m.tok_embeddings is not None, m.stage_embedding is not None,
                      m.mtp is not None)
    assert held == {0: (True, False, False), 1: (False, True, True), 2: (True, True, True)}
    plain = build_meta_model(_tiny(**{"model.mtp_depth": 0, "model.tie_embeddings": False}))
    keep_stages(plain, [1], [2, 2])
    assert plain.stage_embedding is None   # an untied head without MTP needs no copy


def test_checkpoint_state_names_never_the_copy():
    """Saved: the copy is left out; loaded on a rank without the embedding: the copy reads
    the embedding's tensor (weights and AdamW moments), under its name."""
    from epscale.training.optim import build_optimizer

    cfg = _tiny()
    last = build_model(cfg)
    keep_stages(last, [1], [2, 2])
    last.stage_embedding.to("cpu")
    opt = build_optimizer(last, cfg.train)
    dims = SingleProcessDims()
    saved = build_state(last, opt, dims)
    assert not any("embedding" in k for k in saved["model"]) and \
        not any("embedding" in k for k in saved["optim"])
    loaded = build_state(last, opt, dims, load=True)
    copy = last.stage_embedding.weight
    assert loaded["model"]["tok_embeddings.weight"].data_ptr() == copy.data_ptr()
    assert loaded["optim"]["tok_embeddings.weight"]["exp_avg"] is \
        opt.state[copy]["exp_avg"]


@pytest.mark.parametrize("over", [{"model.tie_embeddings": True}, {"model.mtp_depth": 1},
                                  {"data.doc_masking": True}])
def test_pipelines_take_the_tied_head_mtp_and_document_masking(tmp_path, over):
    from test_train import tiny_cfg

    cfg = tiny_cfg(tmp_path, **{"parallel.pp": 2, "model.num_layers": 4,
                                "model.tie_embeddings": False, **over})
    assert cfg.parallel.pp == 2
    with pytest.raises(ConfigError, match=r"train\.compile"):  # still refused, as before
        tiny_cfg(tmp_path, **{"parallel.pp": 2, "model.num_layers": 4, **over,
                              "parallel.pp_schedule": "dualpipev", "train.compile": True})


def test_a_last_stage_without_layers_needs_mtp_modules(tmp_path):
    """``parallel.pp_layers_per_stage`` may give the last stage 0 layers only when it holds
    the MTP modules; no other stage may be empty; the default split takes that layout where
    the modules outweigh a stage of blocks (a large head and vocabulary here)."""
    from epscale.plan.pipeline import layers_per_stage
    from test_train import tiny_cfg

    pp2 = {"parallel.pp": 2, "model.num_layers": 4, "model.tie_embeddings": False,
           "train.grad_accum": 2}
    assert tiny_cfg(tmp_path, **pp2, **{"model.mtp_depth": 1,
                                        "parallel.pp_layers_per_stage": [4, 0]}) is not None
    with pytest.raises(ConfigError, match=r"'parallel.pp_layers_per_stage' = \[4, 0\] is "
                                          r"invalid: gives the last stage no layer.*mtp_depth"):
        tiny_cfg(tmp_path, **pp2, **{"parallel.pp_layers_per_stage": [4, 0]})
    with pytest.raises(ConfigError, match=r"must be a list of positive layer counts"):
        tiny_cfg(tmp_path, **pp2, **{"model.mtp_depth": 1,
                                     "parallel.pp_layers_per_stage": [0, 4]})
    heavy = tiny_cfg(tmp_path, **{**pp2, "parallel.pp": 3, "model.num_layers": 4,
                                  "train.grad_accum": 3, "model.mtp_depth": 1,
                                  "model.vocab_size": 32768})
    assert layers_per_stage(heavy)[-1] == 0 and sum(layers_per_stage(heavy)) == 4


def test_the_memory_model_frees_a_whole_backward_at_its_input_half(tmp_path):
    """The last stage of a tied head with MTP modules runs its weight gradients with its
    input gradients (``StageChunk.splits_backward``), so its activation sets go at the
    input half (I), not at a deferred weight pass (W): the memory model follows. Under
    interleaved zero-bubble, whose W comes late, that rank holds less; the V schedules run
    the last stage's W right after its I, so nothing moves there."""
    from epscale.plan.layout import Layout
    from epscale.plan.memory import pipeline_memory
    from epscale.plan.pipeline import in_flight, schedule_actions

    heavy_last = {s: 3.0 if s == 7 else 1.0 for s in range(8)}   # pp=4, 2 stages per rank
    acts = schedule_actions("zero_bubble", 4, 16, 2, 3)           # rank 3 holds stage 7
    assert in_flight(acts, heavy_last) == (16.0, 8)
    assert in_flight(acts, heavy_last, frozenset({7})) == (10.0, 8)
    for schedule in ("zbv", "dualpipev"):
        for rank in range(4):
            acts = schedule_actions(schedule, 4, 16, 2, rank)
            assert in_flight(acts, heavy_last) == in_flight(acts, heavy_last, frozenset({7}))

    def last_rank(tied: bool):
        cfg = load_config(None, [f"data.source={tmp_path}", "model.num_layers=4",
                                 "model.mtp_depth=1", f"model.tie_embeddings={str(tied).lower()}",
                                 "parallel.pp=2", "parallel.pp_schedule=zero_bubble",
                                 "parallel.pp_virtual_stages=2", "train.grad_accum=8"])
        return pipeline_memory(cfg, Layout.from_config(cfg, 2))[1]

    tied, untied = last_rank(True), last_rank(False)
    assert tied.stage_activations == untied.stage_activations
    assert tied.memory.activations < untied.memory.activations
