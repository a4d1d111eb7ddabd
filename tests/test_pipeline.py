"""Pipeline parallelism in the real trainer on real gloo process groups: pp=2 x ep=2 and
pp=2 x FSDP dp_shard=2 (ep=2 inside) under 1F1B and interleaved 1F1B, pp=2 x dp=2 under
GPipe and interleaved zero-bubble, ZB-V and DualPipeV (its overlapped forward/backward pairs
interleaved or, with parallel.overlap none, one after the other; with full, selective and
light recomputation too; with FSDP at ZeRO-1: tests/test_zero.py), and pp=4, train the tiny model with
the losses, gradient norms, validation loss and per-layer expert loads of one process at
the same global batch; a pp=2 x ep=2 checkpoint resumes bit for bit and continues at pp=1
(FSDP dp_shard=4 x ep=4) and at pp=4 (ep=1). Bad layouts fail before anything starts, naming the keys.

One spawn of 4 ranks runs every multi-process case (the trainer leaves the process group
it did not create); the one-process references run here. Every micro-batch holds 2
sequences at every layout (the loader hands out the same 2-sequence micro-batches
whatever the world), so the per-micro-batch balance loss is the same sum too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_utils import (CaseRunner, assert_no_failures, backward_on_its_own_thread, copy_checkpoint,
                        run_distributed, run_trainer)
from epscale.config import ConfigError, load_config
from epscale.config.schema import PP_SCHEDULES
from epscale.parallel.pipeline import AuxLossIntoBackward, keep_stages, stage_layers, stage_placement
from epscale.plan.pipeline import bubble_fraction, layers_per_stage, micro_batch_problem
from epscale.plan.layout import Layout
from epscale.training.elastic import fit_batch
from test_train import assert_losses_close, tiny_cfg

STEPS = 3
BASE = {"train.steps": STEPS, "train.eval_every": 0, "train.ckpt_every": 0,
        "train.micro_batch_size": 2, "train.collective_timeout_s": 0, "train.preflight": False,
        "model.num_layers": 4, "model.tie_embeddings": False, "moe.bias_update_speed": 0.01}
PP2 = {"parallel.pp": 2}
DUALPIPEV = {**PP2, "parallel.ep": 2, "parallel.pp_schedule": "dualpipev",
             "train.micro_batch_size": 1, "train.grad_accum": 4}

# name -> overrides on BASE; "micro" says which one-process reference holds the same
# micro-batches: 2 sequences each (8 per step), or 1 (the V schedules need m >= 2 pp = 4
# micro-batches per data-parallel rank).
CASES = {
    "pp2 ep2 1f1b": {**PP2, "parallel.ep": 2, "train.grad_accum": 2},
    "pp2 ep2 interleaved": {**PP2, "parallel.ep": 2, "parallel.pp_schedule": "interleaved_1f1b",
                            "parallel.pp_virtual_stages": 2, "train.grad_accum": 2},
    "pp2 fsdp2 ep2 1f1b": {**PP2, "parallel.fsdp": True, "parallel.ep": 2,
                           "train.grad_accum": 2},
    "pp2 fsdp2 ep2 interleaved ac-full": {
        **PP2, "parallel.fsdp": True, "parallel.ep": 2, "parallel.pp_schedule": "interleaved_1f1b",
        "parallel.pp_virtual_stages": 2, "train.grad_accum": 2,
        "train.activation_checkpointing": "full"},
    "pp2 dp2 gpipe": {**PP2, "parallel.dp": 2, "parallel.pp_schedule": "gpipe",
                      "train.grad_accum": 2},
    "pp2 dp2 zero_bubble": {**PP2, "parallel.dp": 2, "parallel.pp_schedule": "zero_bubble",
                            "parallel.pp_virtual_stages": 2, "train.grad_accum": 2},
    "pp2 ep2 zbv": {**PP2, "parallel.ep": 2, "parallel.pp_schedule": "zbv",
                    "train.micro_batch_size": 1, "train.grad_accum": 4},
    "pp2 ep2 dualpipev": DUALPIPEV,  # parallel.overlap auto: the paired F/B interleave
    "pp2 ep2 dualpipev overlap-none": {**DUALPIPEV, "parallel.overlap": "none"},
    "pp2 ep2 dualpipev ac-full": {**DUALPIPEV, "train.activation_checkpointing": "full"},
    # selective recomputation: the split backward (I, W) recomputes a block twice
    "pp2 ep2 dualpipev ac-selective": {**DUALPIPEV,
                                       "train.activation_checkpointing": "selective"},
    # light recomputation; moe_act acts on the grouped-GEMM experts only
    "pp2 ep2 dualpipev recompute norm moe_act": {
        **DUALPIPEV, "train.recompute_modules": "[norm,moe_act]",
        "moe.experts_impl": "grouped_mm"},
    "pp4 1f1b": {"parallel.pp": 4, "train.grad_accum": 4},
}
# the deepseek-v3 recipe's modes: MLA, DeepSeek's light recomputation (the experts apply
# the gate weights), fp8 storage (the attention's output included), FSDP at ZeRO-1 under
# DualPipeV with its overlapped pairs: against one process in the same modes
DSV3_MODES = {"model.attention": "mla", "model.q_lora_rank": 16, "model.kv_lora_rank": 16,
              "model.qk_nope_head_dim": 8, "model.qk_rope_head_dim": 8, "model.v_head_dim": 8,
              "train.recompute_modules": "[norm,mla_up_proj,moe_act]",
              "train.activation_storage": "fp8", "moe.experts_impl": "grouped_mm"}
DSV3_CASE = "pp2 fsdp2 ep2 dualpipev zero1, deepseek-v3 recomputation and fp8 storage"
CASES[DSV3_CASE] = {**DUALPIPEV, "parallel.fsdp": True, "parallel.zero": 1, **DSV3_MODES}
REFERENCES = {2: {"train.micro_batch_size": 2, "train.grad_accum": 4},
              1: {"train.micro_batch_size": 1, "train.grad_accum": 8},
              "dsv3": {"train.micro_batch_size": 1, "train.grad_accum": 8, **DSV3_MODES}}
REFERENCE_OF = {DSV3_CASE: "dsv3"}   # else by micro-batch size
TORCH_BUFFERS = "pp2 ep2 dualpipev, torch's receive buffers"
ENGINE_THREAD = "pp2 ep2 dualpipev, every backward on a thread of its own"
RESUME = {**PP2, "parallel.ep": 2, "train.grad_accum": 2, "train.steps": 4}


def _summary(records) -> list[dict]:
    return [{"step": r["step"], "loss": r["loss"], "grad_norm": r["grad_norm"],
             "val_loss": r.get("val_loss"), "num_tokens": r["num_tokens"],
             "layers": [(lay["layer"], lay["tokens_per_expert"]) for lay in r["layers"]]}
            for r in records]


def _run(corpus_dir: Path, run_dir: Path, world: int, over: dict, seen: dict | None = None,
         inspect=None) -> list[dict]:
    """``seen``, if given, gets this rank's receive buffers counted over the run (peaks)
    and the counts the memory model gives them; ``inspect(trainer)`` as run_trainer's."""
    cfg = tiny_cfg(corpus_dir, **{**BASE, **over})
    got = {}

    def look(t):
        got.setdefault("t", t)
        if inspect is not None:
            inspect(t)

    records = run_trainer(cfg, run_dir, world, inspect=look)
    if seen is not None:
        from epscale.plan.memory import receive_buffers_in_flight

        t = got["t"]
        pool = t.stepper.pipeline.receive_buffers
        seen.update(measured=dict(pool.peak), live=sum(pool.count.values()),
                    model=receive_buffers_in_flight(cfg, Layout.from_config(cfg, world),
                                                    t.dims.pp_rank))
    return _summary(records)


def _worker(rank, world, corpus_dir, tmp):
    corpus_dir, tmp = Path(corpus_dir), Path(tmp)
    runner, out = CaseRunner(rank), {"pairs": {}}
    for name, over in CASES.items():
        with runner.case(name):
            held = {}
            out[name] = _run(corpus_dir, tmp / name.replace(" ", "_"), world, over,
                             seen=out.setdefault(f"{name} recv", {}),
                             inspect=lambda t: held.update(pipeline=t.stepper.pipeline))
            stats = held["pipeline"].pair_stats  # DualPipeV's overlapped pairs
            out["pairs"][name] = None if stats is None else (stats.pairs, stats.switches)
    with runner.case(ENGINE_THREAD), backward_on_its_own_thread():  # as CUDA's engine runs it
        held = {}
        out[ENGINE_THREAD] = _run(corpus_dir, tmp / "engine_thread", world,
                                  CASES["pp2 ep2 dualpipev"],
                                  inspect=lambda t: held.update(pipeline=t.stepper.pipeline))
        stats = held["pipeline"].pair_stats
        out["pairs"][ENGINE_THREAD] = (stats.pairs, stats.switches)
    with runner.case(TORCH_BUFFERS):  # torch's own buffers, all m held all step
        import epscale.parallel.pipeline as pipeline_module
        from epscale.parallel.pipeline_buffers import ReceiveBuffers

        hold = pipeline_module.hold_receive_buffers_in_flight
        pipeline_module.hold_receive_buffers_in_flight = lambda stages: ReceiveBuffers()
        try:
            out[TORCH_BUFFERS] = _run(corpus_dir, tmp / "torch_buffers", world,
                                      CASES["pp2 ep2 dualpipev"])
        finally:
            pipeline_module.hold_receive_buffers_in_flight = hold
    with runner.case("resume and reshard"):
        full = tmp / "uninterrupted"
        out["uninterrupted"] = _run(corpus_dir, full, world, {**RESUME, "train.ckpt_every": 2})
        for name, over in (("resumed pp2", RESUME),
                           ("continued at pp1 fsdp4 x ep4", {"parallel.fsdp": True,
                                                             "parallel.ep": 4,
                                                             "train.grad_accum": 1,
                                                             "train.steps": 4}),
                           ("continued at pp4", {"parallel.pp": 4, "train.grad_accum": 4,
                                                 "train.steps": 4})):
            run_dir = tmp / name.replace(" ", "_")
            copy_checkpoint(full, 2, run_dir, rank)
            out[name] = _run(corpus_dir, run_dir, world, over)
    return runner.failures, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    corpus_dir = tmp_path_factory.mktemp("corpus")
    tmp, tmp1 = tmp_path_factory.mktemp("w4"), tmp_path_factory.mktemp("w1")
    refs = {mb: _run(corpus_dir, tmp1 / f"ref_mb{mb}", 1, over) for mb, over in REFERENCES.items()}
    refs["resume"] = _run(corpus_dir, tmp1 / "ref_resume",  1, {**REFERENCES[2], "train.steps": 4})
    results = run_distributed(_worker, 4, args=(str(corpus_dir), str(tmp)), timeout_s=600)
    assert_no_failures([f for f, _ in results])
    got = results[0][1]
    got["recv by rank"] = [{k: v for k, v in out.items() if k.endswith(" recv")}
                           for _, out in results]
    return refs, got


def _by_step(records, key):
    return {r["step"]: r[key] for r in records}


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_layout_trains_like_one_process(runs, name):
    """Losses and gradient norms (the gradients themselves: AdamW would hide a scaled
    one) as one process at the same global batch; step 1 starts from the same weights."""
    refs, got = runs
    over = {**BASE, **CASES[name]}
    ref = refs[REFERENCE_OF.get(name, over["train.micro_batch_size"])]
    records = got[name]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        assert_losses_close(_by_step(records, key), _by_step(ref, key), same_weights=(1,))
    assert records[-1]["val_loss"] == pytest.approx(ref[-1]["val_loss"], rel=5e-4)
    assert records[0]["num_tokens"] == ref[0]["num_tokens"]  # counted once, not per stage


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_receive_buffers_held_only_in_flight(runs, name):
    """Each receive buffer holds storage only while its micro-batch is in flight (the
    losses above are those of one process with it): on every rank the most buffers held
    at once are the memory model's count, fewer than torch's one per micro-batch where
    the schedule keeps fewer in flight, and none once the step (and validation) is done."""
    _, got = runs
    over = {**BASE, **CASES[name]}
    m = over["train.grad_accum"]
    seen = [ranks[f"{name} recv"] for ranks in got["recv by rank"]]
    for rank, one in enumerate(seen):
        assert one["measured"] == one["model"], (rank, one)
        assert one["live"] == 0, (rank, one)   # all freed after the step and validation
    if name == "pp4 1f1b":  # torch held m = 4 on every receiving rank; in flight: pp - r
        assert [one["measured"]["act"] for one in seen] == [0, 3, 2, 1]
        assert [one["measured"]["grad"] for one in seen] == [1, 1, 1, 0]
    v = 1 if PP_SCHEDULES[over.get("parallel.pp_schedule", "1f1b")] == "single" else 2
    assert 0 < max(one["measured"]["act"] for one in seen) <= m * v


def test_freeing_receive_buffers_changes_no_bit(runs):
    """DualPipeV (receives, passes on the rank, overlapped and split backwards) trains bit
    for bit as with torch's own receive buffers."""
    _, got = runs
    assert len(got[TORCH_BUFFERS]) == STEPS
    assert got[TORCH_BUFFERS] == got["pp2 ep2 dualpipev"]


def test_dualpipev_pairs_interleave_and_train_as_one_after_the_other(runs):
    """parallel.overlap auto runs DualPipeV's paired forward and backward of two
    micro-batches interleaved at their exchanges (without recomputation, with full,
    selective or light recomputation: a recomputed forward hands over at its exchanges
    too), 'none' one after the other; the same operations on the same tensors: the same
    losses and gradient norms at every step (and as one process: the test above; the light
    recomputation case runs the grouped-GEMM experts: the same up to rounding)."""
    _refs, got = runs
    pairs = got["pairs"]
    assert pairs["pp2 ep2 dualpipev overlap-none"] is None
    for name in ("pp2 ep2 dualpipev", "pp2 ep2 dualpipev ac-full",
                 "pp2 ep2 dualpipev ac-selective", "pp2 ep2 dualpipev recompute norm moe_act"):
        # m = 4, pp = 2: torch's DualPipeV pairs 3 forwards with backwards per rank and step
        n, switches = pairs[name]
        assert n == 3 * STEPS, (name, pairs[name])
        # at least: the forward hands over at its first exchange, the backward at its first
        assert switches >= 2 * n, (name, pairs[name])
        for key in ("loss", "grad_norm"):
            assert_losses_close(_by_step(got[name], key),
                                _by_step(got["pp2 ep2 dualpipev overlap-none"], key),
                                same_weights=range(1, STEPS + 1))


def test_dualpipev_pairs_hand_off_where_the_engine_runs_the_backward(runs):
    """With every backward on a thread of its own (CUDA's autograd engine runs a pair's
    backward on its device thread while the stage's caller waits), DualPipeV's pairs hand
    over at the same exchanges as with the helper thread, and train bit for bit alike."""
    _refs, got = runs
    assert got["pairs"][ENGINE_THREAD] == got["pairs"]["pp2 ep2 dualpipev"]
    assert got[ENGINE_THREAD] == got["pp2 ep2 dualpipev"]


@pytest.mark.parametrize("name", ["pp2 ep2 1f1b", "pp2 fsdp2 ep2 interleaved ac-full", "pp4 1f1b"])
def test_pipeline_metrics_list_every_layer_once_with_its_loads(runs, name):
    """Each MoE layer once, under its global index, with one process's expert loads (the
    same weights at step 1: the same routing, token for token)."""
    refs, got = runs
    first = got[name][0]
    assert [lid for lid, _ in first["layers"]] == [0, 1, 2, 3]
    assert first["layers"] == refs[2][0]["layers"]


def test_pipeline_checkpoint_resumes_exactly_and_reshards(runs):
    refs, got = runs
    full = {r["step"]: (r["loss"], r["grad_norm"]) for r in got["uninterrupted"]}
    resumed = got["resumed pp2"]
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:  # bit for bit: the same layout continues from its own checkpoint
        assert (r["loss"], r["grad_norm"]) == full[r["step"]]
    # the uninterrupted pp=2 run trains as one process
    assert_losses_close(_by_step(got["uninterrupted"], "loss"), _by_step(refs["resume"], "loss"),
                        same_weights=(1,))
    for name in ("continued at pp1 fsdp4 x ep4", "continued at pp4"):
        records = got[name]
        assert [r["step"] for r in records] == [3, 4]
        assert_losses_close(_by_step(records, "loss"), {s: v[0] for s, v in full.items()},
                            same_weights=(3,))


# --------------------------------------------------------------------------------------
# in-process pieces
# --------------------------------------------------------------------------------------


def test_stage_placement_by_schedule():
    assert stage_placement("1f1b", 4) == [[0], [1], [2], [3]]
    assert stage_placement("interleaved_1f1b", 2, 3) == [[0, 2, 4], [1, 3, 5]]
    assert stage_placement("zbv", 3) == [[0, 5], [1, 4], [2, 3]]
    assert stage_placement("dualpipev", 2, 2) == [[0, 3], [1, 2]]


def test_layers_per_stage_balances_compute(tmp_path):
    def split(**over):
        return layers_per_stage(tiny_cfg(tmp_path, **{"model.tie_embeddings": False, **over}))

    # a heavy head (large vocabulary) leaves the last stage fewer blocks
    heavy_head = split(**{"model.num_layers": 8, "parallel.pp": 2, "model.vocab_size": 32768})
    assert heavy_head[0] > heavy_head[1] and sum(heavy_head) == 8
    # dense first-k blocks (cheaper than the MoE ones here) go to the first stage in
    # greater number
    dense_first = split(**{"model.num_layers": 8, "parallel.pp": 4, "model.num_dense_layers": 4,
                           "model.dense_hidden_dim": 32, "moe.hidden_dim": 256, "moe.top_k": 4})
    assert dense_first[0] > dense_first[-2] and sum(dense_first) == 8
    assert split(**{"model.num_layers": 6, "parallel.pp": 2,
                    "parallel.pp_layers_per_stage": [1, 5]}) == [1, 5]


def test_keep_stages_keeps_names():
    cfg = load_config(None, ["model.num_layers=4", "model.tie_embeddings=false", "model.dim=32",
                             "model.num_heads=2", "moe.dim=32"])
    from epscale.model import build_meta_model

    full = set(dict(build_meta_model(cfg).named_parameters()))
    parts = []
    for stages in stage_placement("zbv", 2):
        m = build_meta_model(cfg)
        keep_stages(m, stages, [1, 1, 1, 1])
        parts.append(set(dict(m.named_parameters())))
    assert parts[0] | parts[1] == full and not parts[0] & parts[1]
    assert "tok_embeddings.weight" in parts[0] and "output.weight" in parts[0]  # V: both ends
    assert any(n.startswith("layers.3.") for n in parts[0])
    assert [list(r) for r in stage_layers([1, 2, 1])] == [[0], [1, 2], [3]]


def test_aux_loss_reaches_the_objective_in_backward():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.tensor(2.0, requires_grad=True)
    aux = (w * x).sum() * 0.1
    y = AuxLossIntoBackward.apply(x * 1.0, aux)
    assert torch.equal(y, x)
    (y * 3).sum().backward()
    # as if the loss were (3 y).sum() + aux
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ((3 * x2).sum() + (w2 * x2).sum() * 0.1).backward()
    assert torch.allclose(x.grad, x2.grad) and torch.allclose(w.grad, w2.grad)


@pytest.mark.parametrize("contexts", ["selective", "attention_core"])
def test_selective_recomputation_runs_again_for_a_split_backward(contexts):
    """The split backward of the zero-bubble and V schedules (inputs, then weights: two
    graph tasks over one retained graph) recomputes a selectively checkpointed region
    twice: the second recomputation gets the kept products and host values again (torch's
    own contexts hand them out once) and the gradients are those without recomputation,
    bit for bit (the same operations in float64)."""
    from torch.utils.checkpoint import checkpoint

    from epscale.dispatch.host import host_ints
    from epscale.parallel import activation

    context_fn = (activation._selective_contexts if contexts == "selective"
                  else activation._keep_outputs(lambda op: op in activation.PRODUCTS))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, dtype=torch.float64, generator=g, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    reads = []

    def region(x_TD):
        reads.append(host_ints(torch.tensor([len(reads)])))
        return torch.tanh(x_TD @ w).sin()

    y = checkpoint(region, x, use_reentrant=False, context_fn=context_fn)
    (dx,) = torch.autograd.grad(y.sum(), x, retain_graph=True)   # inputs: recomputes
    (dw,) = torch.autograd.grad(y.sum(), w)                       # weights: again
    want_dx, want_dw = torch.autograd.grad(region(x).sum(), (x, w))
    assert torch.equal(dx, want_dx) and torch.equal(dw, want_dw)
    if contexts == "selective":  # read once, replayed twice, then the plain call's read
        assert reads == [[0], [0], [0], [3]], reads


def test_bubble_and_micro_batch_rules():
    assert bubble_fraction("1f1b", 4, 12) == pytest.approx(3 / 15)
    assert bubble_fraction("interleaved_1f1b", 4, 12, 2) == pytest.approx(3 / 27)
    assert bubble_fraction("zero_bubble", 4, 12, 2) < bubble_fraction("interleaved_1f1b", 4, 12, 2)
    assert bubble_fraction("1f1b", 1, 4) == 0.0
    assert micro_batch_problem("1f1b", 4, 3) and micro_batch_problem("1f1b", 4, 4) is None
    assert micro_batch_problem("dualpipev", 2, 3) and micro_batch_problem("zbv", 2, 4) is None
    assert micro_batch_problem("interleaved_1f1b", 2, 5)  # 2 rounds of 2 do not make 5
    assert micro_batch_problem("gpipe", 8, 1) is None


@pytest.mark.parametrize("over, key", [
    ({"parallel.pp": 4}, "parallel.pp"),  # 2 layers, 4 stages
    ({"parallel.pp": 2, "parallel.pp_layers_per_stage": [1, 2]}, "parallel.pp_layers_per_stage"),
    ({"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b"}, "parallel.pp_virtual_stages"),
    ({"parallel.pp": 2, "parallel.pp_schedule": "bogus"}, "parallel.pp_schedule"),
    ({"parallel.pp": 2, "parallel.redundant_experts": 2, "parallel.ep": 2},
     "parallel.redundant_experts"),
    ({"parallel.pp": 2, "parallel.spill_threshold": 1.5, "parallel.ep": 2},
     "parallel.spill_threshold"),
    ({"parallel.pp": 2, "parallel.pp_schedule": "dualpipev", "model.num_layers": 4,
      "train.compile": True}, "train.compile"),
])
def test_bad_pipeline_configs_name_the_key(tmp_path, over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_cfg(tmp_path, **{"model.tie_embeddings": False, **over})


def test_split_backward_schedules_with_zero3_fsdp_do_not_start(tmp_path):
    from epscale.training.prelaunch import check_run

    over = {"model.tie_embeddings": False, "parallel.pp": 2, "model.num_layers": 4,
            "parallel.fsdp": True, "parallel.pp_schedule": "zbv", "train.micro_batch_size": 1,
            "train.grad_accum": 4}
    with pytest.raises(ConfigError, match=r"parallel\.pp_schedule' = 'zbv'.*parallel\.zero: 1"):
        check_run(tiny_cfg(tmp_path, **over), None, 2)
    check_run(tiny_cfg(tmp_path, **over, **{"parallel.zero": 1}), None, 2)  # ZeRO-1 trains


def test_bad_pipeline_layouts_name_the_keys(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"model.tie_embeddings": False, "parallel.pp": 2,
                                "train.grad_accum": 1})
    with pytest.raises(ConfigError, match=r"train\.grad_accum.*parallel\.pp"):
        fit_batch(cfg, 2)  # 1F1B needs >= pp micro-batches
    with pytest.raises(ConfigError, match=r"parallel\.pp' = 2.*\(3\)"):
        Layout.from_config(cfg, 3)
    gbs = tiny_cfg(tmp_path, **{"model.tie_embeddings": False, "parallel.pp": 2,
                                "parallel.pp_schedule": "dualpipev", "model.num_layers": 4,
                                "train.global_batch_size": 12, "train.micro_batch_size": 2})
    with pytest.raises(ConfigError, match=r"train\.global_batch_size' = 12.*2 x pp = 4"):
        fit_batch(gbs, 4)  # 2 data ranks x 2 -> 3 micro-batches; DualPipeV needs 4
    fitted, note = fit_batch(gbs, 2)  # 1 data rank: 6 micro-batches
    assert fitted.train.grad_accum == 6 and "pp 2" in note
