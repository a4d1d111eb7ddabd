"""Every layout a user can configure, under every recomputation mode and both dtypes,
trains like one process at the same global batch; layouts that cannot work are refused
before launch, naming the key.

Layouts: replicated dp=2 and ep=2; FSDP on one rank (efsdp = 1); FSDP dp_shard=2 with
ep=2 (efsdp = 1) and ep=1 (efsdp = 2); FSDP dp_shard=4 x ep=2 (efsdp = 2); HSDP
dp_replicate=2 x dp_shard=2 x ep=2; pp=2 x FSDP dp_shard=2 x ep=2; pp=2 replicated.
Recomputation (train.activation_checkpointing): none, selective, full. Dtypes
(train.dtype): float32, and bfloat16 by the trainer's two rules: under FSDP its
MixedPrecisionPolicy (bf16 parameters and activations, fp32 master weights and
reductions), otherwise bf16 autocast over fp32 weights (an fp32 residual stream).

All 54 cells run, cheaply: a 2-layer model of dim 32 on 32-token sequences, two steps
each, every micro-batch 2 sequences at every layout (8 per step: the per-micro-batch
balance loss sums the same terms everywhere); one spawn per world size (2 and 4) runs all
its cells, and the one-process runs (the references, and FSDP on one rank) run here.
Each cell is compared with the one-process run of its own precision rule: fp32 with
one process in fp32; bf16 under autocast with one process under autocast; bf16 under
FSDP with FSDP on one rank (whose own bf16 cells compare with its recomputation-free
run, and, loosely, with fp32). Step 1 starts from the same weights everywhere, step 2
follows one AdamW update, the validation loss after it; the gradient norm checks the
gradients themselves (AdamW would hide a scaled gradient). A hook on the first block
checks that the precision rule really ran (the dtype of a block's input and of a
projection's output).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_utils import CaseRunner, assert_no_failures, run_distributed, run_trainer
from epscale.config import ConfigError
from epscale.plan.layout import Layout
from test_train import assert_losses_close, tiny_cfg

pytestmark = pytest.mark.timeout(900)   # one fixture runs every cell; a busy machine is slow

STEPS = 2
SEQS = 8                   # sequences per step, at every layout
BASE = {"model.dim": 32, "model.num_heads": 4, "model.num_layers": 2, "model.seq_len": 32,
        "model.dense_hidden_dim": 64, "moe.hidden_dim": 32, "moe.num_experts": 4,
        "model.tie_embeddings": False, "train.steps": STEPS, "train.eval_every": 0,
        "train.eval_batches": 1, "train.ckpt_every": 0, "train.micro_batch_size": 2,
        "train.warmup_steps": 1, "train.collective_timeout_s": 0, "train.preflight": False}
FSDP = {"parallel.fsdp": True}
PP2 = {"parallel.pp": 2}

# name -> (world, data-parallel ranks, overrides)
LAYOUTS = {
    "replicated dp2": (2, 2, {"parallel.dp": 2}),
    "replicated ep2": (2, 2, {"parallel.ep": 2}),
    "pp2 replicated": (2, 1, PP2),
    "fsdp1 (efsdp1)": (1, 1, FSDP),
    "fsdp2 ep2 (efsdp1)": (2, 2, {**FSDP, "parallel.ep": 2}),
    "fsdp2 ep1 (efsdp2)": (2, 2, FSDP),
    "fsdp4 ep2 (efsdp2)": (4, 4, {**FSDP, "parallel.ep": 2}),
    "hsdp 2x2 ep2": (4, 4, {**FSDP, "parallel.ep": 2, "parallel.dp_replicate": 2}),
    "pp2 fsdp2 ep2": (4, 2, {**PP2, **FSDP, "parallel.ep": 2}),
}
RECOMPUTE = ("none", "selective", "full")
DTYPES = ("float32", "bfloat16")
CELLS = [(layout, ac, dtype) for layout in LAYOUTS for ac in RECOMPUTE for dtype in DTYPES]

# bf16 tolerances (relative). bf16 keeps 8 significant bits: one rounding moves a value
# by up to 2^-8 = 0.4%. Two correct bf16 runs of the same step differ wherever their
# roundings differ: another GEMM row split, the EP dispatcher's gather/combine against
# the local path's, a reduction in another order. Step 1 (the same weights): the loss is
# a mean over 256 tokens, its rounding differences average out (seen: <= 4e-5); the
# gradient norm is held to 1% (2.5 roundings' worth; seen: <= 0.35%, the ep=2 dispatch
# against the ep=1 local path). After one AdamW update the first step is sign-like: a
# gradient element near zero that rounds the other way moves its weight by a whole
# learning rate, so step 2's gradient norm moves by more (seen: <= 2.2%; held to 5%) while
# the losses stay close (seen: <= 3e-4; held to 2e-3). A layout error (a gradient not
# reduced, reduced twice, or averaged over the wrong ranks) changes the norm by a factor
# (sqrt 2 or more), far outside these.
BF16_STEP1 = {"loss": 2e-3, "grad_norm": 1e-2}
BF16_STEP2 = {"loss": 2e-3, "grad_norm": 5e-2, "val_loss": 2e-3}


def _overrides(layout: str, ac: str, dtype: str) -> dict:
    world, dp, over = LAYOUTS[layout]
    return {**over, "train.activation_checkpointing": ac, "train.dtype": dtype,
            "train.grad_accum": SEQS // (2 * dp)}


def _watch_precision(t, seen: dict) -> None:
    """Hooks on this rank's first block: its input's dtype, its query projection's."""
    from epscale.model import Block

    blocks = [m for m in t.model.modules() if isinstance(m, Block)
              and m.attention.wq.weight.device.type != "meta"]
    block = blocks[0]

    def note(key: str, t: torch.Tensor) -> None:   # returns None: the hooks change nothing
        seen.setdefault(key, str(t.dtype))

    block.register_forward_pre_hook(lambda m, args: note("block input", args[0]))
    block.attention.wq.register_forward_hook(lambda m, args, out: note("projection", out))


def _run(corpus_dir: Path, run_dir: Path, world: int, over: dict) -> dict:
    seen: dict = {}
    records = run_trainer(tiny_cfg(corpus_dir, **{**BASE, **over}), run_dir, world,
                          inspect=lambda t: _watch_precision(t, seen), final_checkpoint=False)
    return {"steps": {r["step"]: {"loss": r["loss"], "grad_norm": r["grad_norm"]}
                      for r in records},
            "val_loss": records[-1].get("val_loss"), "seen": seen}


def _worker(rank, world, corpus_dir, tmp):
    corpus_dir, tmp = Path(corpus_dir), Path(tmp)
    runner, out = CaseRunner(rank), {}
    for cell in CELLS:
        if LAYOUTS[cell[0]][0] == world:
            with runner.case(cell):
                out[cell] = _run(corpus_dir, tmp / f"cell{len(out)}", world, _overrides(*cell))
    return runner.failures, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    corpus_dir = tmp_path_factory.mktemp("corpus")
    tmp1 = tmp_path_factory.mktemp("w1")
    got = {}
    # one process: fp32 and bf16 autocast (no FSDP), and FSDP on one rank (its cells)
    for dtype in DTYPES:
        got[("one process", "none", dtype)] = _run(
            corpus_dir, tmp1 / dtype, 1,
            {"train.dtype": dtype, "train.grad_accum": SEQS // 2})
    for cell in CELLS:
        if LAYOUTS[cell[0]][0] == 1:
            got[cell] = _run(corpus_dir, tmp1 / f"cell{len(got)}", 1, _overrides(*cell))
    for world in (2, 4):
        tmp = tmp_path_factory.mktemp(f"w{world}")
        results = run_distributed(_worker, world, args=(str(corpus_dir), str(tmp)),
                                  timeout_s=900)
        assert_no_failures([f for f, _ in results])
        got.update(results[0][1])
    return got


def _reference(layout: str, dtype: str) -> tuple:
    """The one-process run of the same precision rule."""
    if dtype == "bfloat16" and LAYOUTS[layout][2].get("parallel.fsdp"):
        return ("fsdp1 (efsdp1)", "none", "bfloat16")
    return ("one process", "none", dtype)


def _expected_dtypes(layout: str, dtype: str) -> dict:
    if dtype == "float32":
        return {"block input": "torch.float32", "projection": "torch.float32"}
    fsdp = LAYOUTS[layout][2].get("parallel.fsdp", False)
    # FSDP casts the parameters (a bf16 residual stream); autocast casts each matmul
    return {"block input": "torch.bfloat16" if fsdp else "torch.float32",
            "projection": "torch.bfloat16"}


def _assert_close(got: dict, ref: dict, tol1: dict, tol2: dict) -> None:
    assert sorted(got["steps"]) == list(range(1, STEPS + 1))
    for step, tol in ((1, tol1), (2, tol2)):
        for key in ("loss", "grad_norm"):
            a, b = got["steps"][step][key], ref["steps"][step][key]
            assert a == pytest.approx(b, rel=tol[key]), (step, key, a, b)
    assert got["val_loss"] == pytest.approx(ref["val_loss"], rel=tol2["val_loss"])


@pytest.mark.parametrize("cell", CELLS, ids=[" | ".join(c) for c in CELLS])
def test_cell_trains_like_one_process(runs, cell):
    layout, ac, dtype = cell
    got = runs[cell]
    assert got["seen"] == _expected_dtypes(layout, dtype)
    ref = runs[_reference(layout, dtype)]
    if dtype == "float32":
        # the fp32 tolerances of every layout test (tests/test_train.py)
        for key in ("loss", "grad_norm"):
            assert_losses_close({s: v[key] for s, v in got["steps"].items()},
                                {s: v[key] for s, v in ref["steps"].items()}, same_weights={1})
        assert got["val_loss"] == pytest.approx(ref["val_loss"], rel=5e-4)
    else:
        _assert_close(got, ref, BF16_STEP1, BF16_STEP2)


def test_fsdp_one_rank_bf16_is_near_fp32(runs):
    """The bf16 FSDP reference itself: the fp32 run's losses within bf16's reach (the
    first step's loss from the same weights; the rest looser)."""
    got, ref = runs[("fsdp1 (efsdp1)", "none", "bfloat16")], runs[("one process", "none", "float32")]
    _assert_close(got, ref, {"loss": 2e-3, "grad_norm": 2e-2},
                  {"loss": 2e-3, "grad_norm": 5e-2, "val_loss": 2e-3})
    assert got["steps"][1]["loss"] != ref["steps"][1]["loss"]   # it did run in bf16


REFUSED = {  # (world, overrides) -> the key the refusal names
    (2, ("parallel.dp_replicate=2", "parallel.ep=1")): "parallel.dp_replicate",
    (2, ("parallel.fsdp=true", "parallel.ep=4")): "parallel.ep",
    (4, ("parallel.fsdp=true", "parallel.dp_replicate=2", "parallel.ep=4")): "parallel.ep",
    (3, ("parallel.pp=2",)): "parallel.pp",
}


@pytest.mark.parametrize("world, over", list(REFUSED), ids=[" ".join(o) for _, o in REFUSED])
def test_layouts_that_cannot_work_are_refused_before_launch(tmp_path, world, over):
    """Refused by the layout's validation (what the launcher runs before starting any
    process), with the key in the message."""
    from epscale.config import load_config

    with pytest.raises(ConfigError, match=REFUSED[(world, over)]):
        cfg = load_config(None, ["model.tie_embeddings=false", *over])
        Layout.from_config(cfg, world)
