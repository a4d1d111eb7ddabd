"""Light recomputation (``train.recompute_modules``) and bf16 AdamW moments
(``train.optimizer_state_dtype``) on 2 ranks (FSDP, EP 2) train like one process at the
same global batch; a bf16-moment run resumes bit for bit from its checkpoint. One spawn
holds every case. (What each module keeps is measured against the memory model in
tests/test_memory.py; the bf16 update itself in tests/test_optim.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dist_utils import CaseRunner, assert_no_failures, copy_checkpoint, run_distributed
from epscale.training.loop import train
from test_fsdp import _trainer_case, assert_same_training, losses_by_step
from test_train import assert_loads_exactly, tiny_cfg
from epscale.training import checkpoint as ckpt

# a dense first layer (mlp), shared experts, the grouped-GEMM path (moe_act acts there)
MHA = {"train.steps": 2, "model.num_dense_layers": 1, "moe.num_shared_experts": 1,
       "moe.experts_impl": "grouped_mm"}
MLA = {**MHA, "model.attention": "mla", "model.q_lora_rank": 32, "model.kv_lora_rank": 32,
       "model.qk_nope_head_dim": 8, "model.qk_rope_head_dim": 8, "model.v_head_dim": 16}
BF16 = {"train.steps": 4, "train.optimizer_state_dtype": "bfloat16"}
FP8 = {**MHA, "train.steps": 3, "train.activation_storage": "fp8"}
FP8_MLA = {**MLA, "train.activation_storage": "fp8"}
LIGHT = ["norm", "mla_up_proj", "moe_act"]     # DeepSeek-V3's light recomputation
MODULES = ["norm", "router", "shared_experts", "mlp", "moe_act", "attention_core"]
SPLIT = {"parallel.fsdp": True, "parallel.ep": 2}
CASES = {**{f"recompute {m}": (MHA, [m]) for m in MODULES},
         "mla recompute mla_up_proj+attention_core": (MLA, ["mla_up_proj", "attention_core"]),
         "bf16 moments": ({**BF16, "train.ckpt_every": 2}, []),
         "fp8 storage moe_act": (FP8, ["moe_act"]),
         "mla light": (MLA, LIGHT),
         "fp8 storage mla light": (FP8_MLA, LIGHT)}


def _over(base: dict, modules: list[str]) -> dict:
    return {**base, **SPLIT, "train.recompute_modules": "[" + ",".join(modules) + "]"}


def _worker(rank, world, corpus_dir, tmp):
    corpus_dir, tmp = Path(corpus_dir), Path(tmp)
    runner = CaseRunner(rank)
    out = {}
    for name, (base, modules) in CASES.items():
        with runner.case(name):
            out[name] = _trainer_case(corpus_dir, tmp / name.replace(" ", "_"), world,
                                      _over(base, modules))
    with runner.case("bf16 moments resumed"):
        resumed = tmp / "bf16_resumed"
        copy_checkpoint(tmp / "bf16_moments", 2, resumed, rank)
        out["bf16 moments resumed"] = _trainer_case(corpus_dir, resumed, world, _over(BF16, []))
    return runner.failures, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    corpus_dir = tmp_path_factory.mktemp("corpus")
    tmp2, tmp1 = tmp_path_factory.mktemp("w2"), tmp_path_factory.mktemp("w1")
    r2 = run_distributed(_worker, 2, args=(str(corpus_dir), str(tmp2)), timeout_s=600)
    assert_no_failures([f for f, _ in r2])
    refs = {}
    # the 2-rank FSDP bf16-moment checkpoint of step 2, continued in one process
    one = tmp1 / "bf16_from_fsdp2"
    (one / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt.step_dir(tmp2 / "bf16_moments", 2), ckpt.step_dir(one, 2))
    for name, over in (("mha", MHA), ("mla", MLA), ("bf16", BF16), ("bf16_from_fsdp2", BF16),
                       ("fp8", {**FP8, "train.recompute_modules": "[moe_act]"}),
                       ("fp8_mla", {**FP8_MLA, "train.recompute_modules": "[" + ",".join(LIGHT) + "]"})):
        cfg = tiny_cfg(corpus_dir, **{"train.eval_every": 0, "train.ckpt_every": 0,
                                      "train.micro_batch_size": 8, "moe.aux_loss_scope": "global",
                                      "train.preflight": False, **over})
        refs[name] = losses_by_step(train(cfg, tmp1 / name).records)
    return r2[0][1], refs, tmp2


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("recompute")])
def test_each_recomputed_module_trains_like_one_process(runs, name):
    """Recomputing a part runs the same operations again: step 1 as one process does
    (same weights), step 2 after the same AdamW update."""
    got, refs, _ = runs
    assert_same_training(got[name], refs["mha"], same_weights={1})


def test_mla_up_projection_recomputed_trains_like_one_process(runs):
    got, refs, _ = runs
    assert_same_training(got["mla recompute mla_up_proj+attention_core"], refs["mla"],
                         same_weights={1})


def test_bf16_moments_train_like_one_process_resume_bitwise_and_reshard(runs, tmp_path):
    """FSDP shards the bf16 moments; the step's update is elementwise, so 2 ranks follow
    one process (a moment that rounds the other way after a different summation order
    moves one weight by a bf16 ulp of its update: within assert_losses_close's 5e-4). The
    checkpoint holds the bf16 moments: a resumed run repeats steps 3 and 4 exactly; loaded
    into one process (resharded) every moment is the saved one, bf16, and step 3 starts
    from the same weights."""
    got, refs, tmp2 = runs
    assert_same_training(got["bf16 moments"], refs["bf16"], same_weights={1})
    full, resumed = got["bf16 moments"], got["bf16 moments resumed"]
    assert sorted(resumed) == [3, 4] and all(resumed[s] == full[s] for s in resumed)
    step_dir = ckpt.step_dir(tmp2 / "bf16_moments", 2)
    assert_loads_exactly(tmp_path, step_dir, **{"train.optimizer_state_dtype": "bfloat16"})
    assert sorted(refs["bf16_from_fsdp2"]) == [3, 4]
    assert_same_training(refs["bf16_from_fsdp2"], full, same_weights={3})


def test_recompute_modules_are_validated_by_key(tmp_path):
    from epscale.config import ConfigError

    with pytest.raises(ConfigError, match=r"train.recompute_modules' = \['norm'\] is invalid: "
                                          r"cannot be combined with train.activation_checkpointing"
                                          r" = 'full'"):
        tiny_cfg(tmp_path, **{"train.recompute_modules": "[norm]",
                              "train.activation_checkpointing": "full"})
    with pytest.raises(ConfigError, match=r"train.recompute_modules' = 'moe_ac'.*'moe_act'"):
        tiny_cfg(tmp_path, **{"train.recompute_modules": "[moe_ac]"})
    with pytest.raises(ConfigError, match=r"'mla_up_proj' needs model.attention = 'mla'"):
        tiny_cfg(tmp_path, **{"train.recompute_modules": "[mla_up_proj]"})
    with pytest.raises(ConfigError, match="names a module twice"):
        tiny_cfg(tmp_path, **{"train.recompute_modules": "[norm,norm]"})
    assert tiny_cfg(tmp_path, **{"train.recompute_modules": "[]"}).train.recompute_modules == []


def test_fp8_storage_trains_like_one_process_and_near_compute_storage(runs):
    """fp8 storage (train.activation_storage: fp8) with moe_act on 2 ranks (FSDP, EP 2)
    follows one process with fp8 storage: the same rows are quantized the same way per
    1 x 128 tile whatever the layout. Against compute-dtype storage on the same 2 ranks:
    step 1's loss is the same exactly (storage changes only what backward reads), its
    gradient norm differs (fp8 rounding reached the gradients) by under 2%, and the loss
    after the update stays within 1% (the e4m3 rounding of 2^-4 at most per value)."""
    got, refs, _ = runs
    fp8, compute = got["fp8 storage moe_act"], got["recompute moe_act"]
    assert sorted(fp8) == [1, 2, 3]
    assert_same_training(fp8, refs["fp8"], same_weights={1})
    assert fp8[1][0] == compute[1][0]
    assert fp8[1][1] != compute[1][1]
    assert fp8[1][1] == pytest.approx(compute[1][1], rel=2e-2)
    assert fp8[2][0] == pytest.approx(compute[2][0], rel=1e-2)


def test_fp8_attention_storage_under_mla_up_proj_trains_like_one_process(runs):
    """DeepSeek-V3's light recomputation (norm, mla_up_proj, moe_act) with fp8 storage, the
    attention kernel's output held in fp8 from its selective region's cache: 2 ranks
    (FSDP, EP 2) follow one process with the same storage (each tensor is rounded per tile
    the same way whatever the layout). Against compute-dtype storage with the same modules
    recomputed on the same ranks: step 1's loss is the same exactly, its gradient norm
    differs (the rounding reached it) by under 2%, and the loss after the update stays
    within 1%, the bounds of the MHA case above. (The same storage with other modules
    recomputed can differ in step 1's loss by a few ulp on 2 ranks: the recomputed
    regions' forward runs other kernels, e.g. the experts' activation split out under
    moe_act.)"""
    got, refs, _ = runs
    fp8, compute = got["fp8 storage mla light"], got["mla light"]
    assert sorted(fp8) == [1, 2]
    assert_same_training(compute, refs["mla"], same_weights={1})
    assert_same_training(fp8, refs["fp8_mla"], same_weights={1})
    assert fp8[1][0] == compute[1][0]
    assert fp8[1][1] != compute[1][1]
    assert fp8[1][1] == pytest.approx(compute[1][1], rel=2e-2)
    assert fp8[2][0] == pytest.approx(compute[2][0], rel=1e-2)
