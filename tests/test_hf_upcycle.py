"""Sparse upcycling of dense Llama / Qwen3 checkpoints (step-0 logits equal the dense
model's in transformers; drop-upcycling re-initialises a share of each expert), and
``epscale train --run-dir`` continuing an upcycled and an imported run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from test_hf_models import CASES, V, assert_same_function, randomize, tokens
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from epscale.cli import main
from epscale.interop.files import HFError
from epscale.interop.generate import load_model
from epscale.interop.hf import import_hf
from epscale.interop.upcycle import upcycle

DENSE = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=True)),
}
TRAIN = ["train.steps=3", "train.micro_batch_size=2", "model.seq_len=16", "train.eval_every=0",
         "train.ckpt_every=3", "train.warmup_steps=0", "train.log_every=1"]


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    out = {}
    for name, make in DENSE.items():
        torch.manual_seed(0)
        model = randomize(make().eval())
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
    return out


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    np.random.default_rng(0).integers(0, V, 40_000).astype(np.uint16).tofile(path)
    return path


def experts_w1(model, layer):
    return model.layers[str(layer)].ffn.experts.w1.detach()


@pytest.mark.parametrize("name", list(DENSE))
def test_upcycled_logits_equal_the_dense_model_at_step_0(name, dense_dirs, tmp_path):
    hf_dir, dense = dense_dirs[name]
    run = tmp_path / "up"
    assert main(["upcycle", str(hf_dir), "--experts", "4", "--top-k", "2", "--out", str(run)]) == 0
    model, cfg, _ = load_model(run)
    assert (cfg.moe.num_experts, cfg.moe.top_k, len(model.moe_layers())) == (4, 2, 2)
    toks = tokens()
    assert_same_function(model, dense, toks)
    with torch.no_grad():
        want = dense(toks).logits
    w1 = experts_w1(model, 0)
    assert all(torch.equal(w1[0], w1[e]) for e in range(4))
    # drop-upcycling: half of each expert's hidden units re-drawn, the same units in
    # gate, up and down, different units per expert; the function changes
    drop = tmp_path / "drop"
    upcycle(hf_dir, drop, 4, 2, drop_ratio=0.5, report=lambda m: None)
    dm, _, _ = load_model(drop)
    d1, d2 = experts_w1(dm, 0), dm.layers["0"].ffn.experts.w2.detach()
    changed_cols = [(d1[e] != w1[e]).any(0) for e in range(4)]
    assert all(int(c.sum()) == 24 for c in changed_cols)                    # 0.5 x F=48
    assert all(torch.equal((d2[e] != model.layers["0"].ffn.experts.w2[e]).any(1), changed_cols[e])
               for e in range(4))
    assert not torch.equal(changed_cols[0], changed_cols[1])
    with torch.no_grad():
        assert (dm(toks) - want).abs().max() > 1e-2


def test_upcycled_run_trains_and_the_experts_drift_apart(dense_dirs, token_file, tmp_path):
    run = tmp_path / "up"
    upcycle(dense_dirs["llama"][0], run, 4, 2, report=lambda m: None)
    assert main(["train", "--run-dir", str(run), *TRAIN, f"data.source={token_file}"]) == 0
    model, _, path = load_model(run)
    assert path.name == "step_00000003"
    w1 = experts_w1(model, 1)
    assert not torch.equal(w1[0], w1[1]) and not torch.equal(w1[2], w1[3])


def test_imported_run_continues_from_the_hub_weights(token_file, tmp_path):
    """A tiny learning rate: after 3 steps the weights are the imported ones moved a
    little (a fresh init would be far away), at ep=1 here (ep=2 in test_hf_ep.py)."""
    cls, hf_cfg = CASES["deepseek_v3-yarn"]()
    torch.manual_seed(0)
    ref = randomize(cls(hf_cfg).eval())
    ref.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    import_hf(tmp_path / "hf", run, report=lambda m: None)
    before, _, _ = load_model(run)
    assert main(["train", "--run-dir", str(run), *TRAIN, f"data.source={token_file}",
                 "train.lr=0.0001", "train.min_lr=0"]) == 0
    after, _, path = load_model(run)
    assert path.name == "step_00000003"
    diffs = [float((a - b).abs().max()) for a, b in zip(after.state_dict().values(),
                                                         before.state_dict().values())
             if a.is_floating_point()]
    assert max(diffs) < 0.01 and max(diffs) > 0


def test_upcycle_errors_name_the_problem(dense_dirs, tmp_path):
    hf_dir, _ = dense_dirs["llama"]
    with pytest.raises(HFError, match="moe.hidden_dim = 16 must equal the dense FFN width 48"):
        upcycle(hf_dir, tmp_path / "a", 4, 2, ["moe.hidden_dim=16"], report=lambda m: None)
    with pytest.raises(HFError, match="model_type 'deepseek_v3'.*supported: llama, qwen3"):
        cls, c = CASES["deepseek_v3-yarn"]()
        cls(c).save_pretrained(tmp_path / "moe")
        upcycle(tmp_path / "moe", tmp_path / "b", 4, 2, report=lambda m: None)
    with pytest.raises(Exception, match="top_k.*must be <= moe.num_experts"):
        upcycle(hf_dir, tmp_path / "c", 2, 4, report=lambda m: None)


def test_train_init_from_imports_and_trains_in_one_step(token_file, tmp_path):
    """train.init_from=HF_DIR: the model and moe sections from config.json (the command
    line's overrides last), the hub weights as step 0 (the same as import-hf writes), then
    training; run again, it resumes from its own checkpoint, not from the hub."""
    from epscale.training import checkpoint as ckpt

    cls, hf_cfg = CASES["mixtral"]()
    torch.manual_seed(0)
    randomize(cls(hf_cfg).eval()).save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    args = ["train", "--config", "tiny", "--run-dir", str(run), *TRAIN,
            f"data.source={token_file}", f"train.init_from={tmp_path / 'hf'}", "parallel.ep=1",
            "parallel.dp=1", "moe.aux_loss_coeff=0.02"]
    assert main(args) == 0
    model, cfg, path = load_model(run)
    assert path.name == "step_00000003"
    assert (cfg.model.dim, cfg.model.num_layers, cfg.moe.num_experts) == (32, 2, 4)   # config.json's
    assert cfg.moe.aux_loss_coeff == 0.02 and cfg.model.seq_len == 16                 # the overrides
    # step 0 holds the weights import-hf writes (plus tiny.yaml's loss-free balancing
    # state: the recipe keeps the moe keys config.json does not set)
    imported = tmp_path / "imported"
    import_hf(tmp_path / "hf", imported, ["model.seq_len=16"], report=lambda m: None)
    ckpt.export_full(ckpt.step_dir(run, 0), tmp_path / "ours.pt")
    ckpt.export_full(ckpt.step_dir(imported, 0), tmp_path / "theirs.pt")
    a, b = (torch.load(tmp_path / f"{n}.pt")["model"] for n in ("ours", "theirs"))
    assert set(b) <= set(a) and all(torch.equal(a[k], b[k]) for k in b)
    assert all(".router.expert_bias_" in k for k in set(a) - set(b))
    # again with more steps: resumes at step 3 (the hub is not read again)
    assert main([*args, "train.steps=4"]) == 0
    assert load_model(run)[2].name == "step_00000004"
