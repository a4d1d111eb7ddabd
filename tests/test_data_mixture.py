"""Reading prepared data for training: memory-mapped shards as one stream, the keyed
permutation for large splits, mixtures in their configured proportions with exact resume
and the same global batches at another rank count, document masking in the model, and
the trainer on a mixture of prepared sources resuming bit for bit."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_data import global_batches
from test_data_prepare import stdlib_texts

from epscale.config import ConfigError, DataConfig, load_config
from epscale.model import Transformer, document_mask
from epscale.training import checkpoint as ckpt
from epscale.training.data import (DataError, DataLoader, FeistelPermutation, Mixture,
                                   ShardedTokens, Splits, WindowSampler, load_data,
                                   unigram_entropy)
from epscale.training.data import sampler as sampler_mod
from epscale.training.data.prepare import prepare
from epscale.training.loop import train
from epscale.training.prelaunch import check_data


def test_feistel_is_a_keyed_permutation():
    for n in (1, 2, 3, 17, 1000, 4097):
        p = FeistelPermutation(n, key=7)(np.arange(n))
        assert sorted(p.tolist()) == list(range(n))
    a, b = (FeistelPermutation(1000, key)(np.arange(1000)) for key in (7, 8))
    assert not np.array_equal(a, b)
    assert np.array_equal(a, FeistelPermutation(1000, 7)(np.arange(1000)))


def test_large_splits_use_the_keyed_permutation(monkeypatch):
    monkeypatch.setattr(sampler_mod, "RANDPERM_MAX", 8)  # as if the split were huge
    s = WindowSampler(np.arange(32 * 50 + 1) % 256, 32, seed=3)
    epoch0 = s.windows(np.arange(50))
    epoch1 = s.windows(np.arange(50, 100))
    assert sorted(epoch0.tolist()) == sorted(epoch1.tolist()) == list(range(50))
    assert not np.array_equal(epoch0, epoch1) and s._window(7) == epoch0[7]


def test_sharded_tokens_read_as_one_stream(tmp_path):
    parts = [np.arange(a, b, dtype="<u2") for a, b in ((0, 10), (10, 11), (11, 40))]
    paths = []
    for i, p in enumerate(parts):
        paths.append(tmp_path / f"s{i}.bin")
        p.tofile(paths[-1])
    st = ShardedTokens(paths, [p.size for p in parts], "uint16")
    whole = np.concatenate(parts)
    assert st.size == 40 and len(st) == 40
    for a, b in ((0, 40), (5, 12), (9, 11), (10, 11), (11, 40), (39, 50), (20, 20)):
        assert np.array_equal(st[a:b], whole[a:b])
    assert st.locate(10) == (paths[1], 0) and st.locate(12) == (paths[2], 1)


def _two_sources(n=32 * 1000 + 1) -> Mixture:
    """Source A holds ids 0-99, B ids 100-199: every row says where it came from."""
    rng = np.random.default_rng(0)
    a = Splits(rng.integers(0, 100, n), rng.integers(0, 100, 3000), "A", name="A", weight=0.7)
    b = Splits(rng.integers(100, 200, n), rng.integers(100, 200, 3000), "B", name="B", weight=0.3)
    return Mixture([a, b])


def _steps(mix, world, B, steps, accum=1, start_state=None):
    loaders = [DataLoader(mix, 32, B, accum, r, world, seed=5) for r in range(world)]
    if start_state is not None:
        for ld in loaders:
            ld.load_state_dict(start_state)
    return global_batches(loaders, steps, accum), loaders[0]


def test_mixture_proportions_and_no_repeats_within_an_epoch():
    mix = _two_sources()
    batches, loader = _steps(mix, 1, 8, 150)
    rows = torch.cat(batches)
    from_a = (rows[:, 0] < 100).float().mean().item()
    sigma = math.sqrt(0.7 * 0.3 / rows.shape[0])
    assert abs(from_a - 0.7) < 4 * sigma  # 1200 draws: within sampling error
    n_a = int((rows[:, 0] < 100).sum())
    assert loader.source_positions.tolist() == [n_a, rows.shape[0] - n_a]
    a_rows = rows[rows[:, 0] < 100]
    assert len({tuple(r.tolist()) for r in a_rows}) == len(a_rows)  # < one epoch: no repeats
    val = loader.val_batches(4)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(val, loader.val_batches(4)))


def test_mixture_global_batches_are_the_same_at_any_rank_count():
    mix = _two_sources()
    key = lambda t: sorted(map(tuple, t.tolist()))
    one, _ = _steps(mix, 1, 4, 5)
    two, _ = _steps(mix, 2, 2, 5)
    four, _ = _steps(mix, 4, 1, 5)
    accum, _ = _steps(mix, 2, 1, 5, accum=2)
    for a, b, c, d in zip(one, two, four, accum):
        assert key(a) == key(b) == key(c) == key(d)


def test_mixture_resumes_exactly_and_from_an_old_position_only_state():
    mix = _two_sources()
    ref, _ = _steps(mix, 2, 2, 8)
    _head, loader = _steps(mix, 2, 2, 5)
    state = loader.state_dict()
    assert state["sources"] == ["A", "B"] and sum(state["source_positions"]) == state["position"]
    tail, _ = _steps(mix, 2, 2, 3, start_state=state)
    assert all(torch.equal(a, b) for a, b in zip(ref[5:], tail))
    old, _ = _steps(mix, 2, 2, 3, start_state={"position": state["position"]})  # recomputed
    assert all(torch.equal(a, b) for a, b in zip(ref[5:], old))
    # new weights on resume: each source continues where it stopped
    mix2 = _two_sources()
    mix2.parts[0].weight, mix2.parts[1].weight = 0.5, 0.5
    ld = DataLoader(mix2, 32, 2, 1, 0, 1, seed=5)
    ld.load_state_dict(state)
    assert ld.source_positions.tolist() == state["source_positions"]


def test_unigram_entropy_of_a_mixture_and_of_sampled_shards(tmp_path):
    a = Splits(np.arange(100_000) % 100, np.arange(100) % 100, "A", weight=1.0)
    b = Splits(100 + np.arange(100_000) % 100, np.arange(100) % 100, "B", weight=1.0)
    assert unigram_entropy(Mixture([a, b]), 256) == pytest.approx(math.log(200))
    ids = (np.arange(200_000) % 50).astype("<u2")
    ids.tofile(tmp_path / "s.bin")
    st = ShardedTokens([tmp_path / "s.bin"], [ids.size], "uint16")
    assert unigram_entropy(st, 64, sample_tokens=64 * 500) == pytest.approx(math.log(50), abs=1e-3)


def test_data_sources_config_is_validated():
    cfg = DataConfig(sources=["a", {"path": "b", "weight": 3}])
    assert cfg.sources == [{"path": "a", "weight": 1.0}, {"path": "b", "weight": 3.0}]
    for bad, match in (({"sources": [{"path": "a", "weight": 0}]}, r"data\.sources\[0\]\.weight"),
                       ({"sources": [{"path": "a", "wieght": 1}]}, r"unknown key\(s\) wieght"),
                       ({"source": "x", "sources": ["a"]}, "not both")):
        with pytest.raises(ConfigError, match=match):
            DataConfig(**bad)


# --------------------------------------------------------------------------------------
# Document masking
# --------------------------------------------------------------------------------------


def _tiny_model(attention="mha") -> Transformer:
    cfg = load_config(None, ["model.dim=32", "model.num_layers=2", "model.num_heads=2",
                             "model.seq_len=32", "model.vocab_size=64", "moe.hidden_dim=32",
                             "model.dense_hidden_dim=64", "moe.num_experts=4", "moe.top_k=2",
                             f"model.attention={attention}", "model.kv_lora_rank=16",
                             "model.q_lora_rank=0", "model.qk_nope_head_dim=8",
                             "model.qk_rope_head_dim=8", "model.v_head_dim=8"])
    torch.manual_seed(0)
    return Transformer(cfg.model, cfg.moe).eval()


def test_document_mask_blocks_attention_across_documents():
    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 4]])
    m = document_mask(tokens, eos_id=0)[0, 0]
    assert m[2, :3].all() and not m[3, :3].any() and m[5, 3:6].all() and not m[7, :7].any()
    assert torch.equal(m, m & torch.ones(8, 8, dtype=torch.bool).tril())


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_doc_masking_makes_a_packed_document_see_only_itself(attention):
    model = _tiny_model(attention)
    doc_a, doc_b = torch.tensor([[5, 9, 12, 3, 0]]), torch.tensor([[7, 8, 21, 30, 11, 2]])
    packed = torch.cat([doc_a, doc_b], dim=1)
    with torch.no_grad():
        alone = model(doc_b)
        model.set_document_masking(0)
        masked = model(packed)[:, doc_a.shape[1]:]
        model.set_document_masking(None)
        plain = model(packed)[:, doc_a.shape[1]:]
    # RoPE is relative, so document B's logits are those of B on its own
    assert torch.allclose(masked, alone, atol=1e-5) and not torch.allclose(plain, alone, atol=1e-3)
    targets = torch.roll(packed, -1, 1)
    model.set_document_masking(0)
    with torch.no_grad():
        loss = model.loss(packed, targets)
        logits = model(packed)[0]
    keep = packed[0] != 0  # the target after an EOS (the next document's first token) is skipped
    expect = torch.nn.functional.cross_entropy(logits[keep], targets[0][keep])
    assert torch.allclose(loss, expect)


def test_doc_masking_needs_document_boundaries():
    with pytest.raises(DataError, match=r"data\.doc_masking needs document boundaries, but data "
                                        r"source 'stdlib' has none"):
        load_data(DataConfig(doc_masking=True), 256)


# --------------------------------------------------------------------------------------
# The trainer on a mixture of prepared sources
# --------------------------------------------------------------------------------------


def _prepared_pair(tmp_path: Path) -> tuple[Path, Path]:
    out = []
    for name, skip in (("code", 0), ("more", 40)):
        folder = tmp_path / f"{name}_txt"
        folder.mkdir()
        for i, t in enumerate(stdlib_texts(30, skip)):
            (folder / f"{i:02d}.py").write_text(t)
        prepare([folder], "bytes", tmp_path / name, val_fraction=0.2, progress=False)
        out.append(tmp_path / name)
    return out[0], out[1]


def _overrides(a: Path, b: Path, **extra) -> list[str]:
    base = {"model.dim": 32, "model.num_layers": 2, "model.num_heads": 2, "model.seq_len": 64,
            "model.vocab_size": 264, "model.dense_hidden_dim": 64, "moe.hidden_dim": 32,
            "moe.num_experts": 4, "moe.top_k": 2, "parallel.ep": 1, "parallel.dp": 1,
            "train.steps": 4, "train.micro_batch_size": 4, "train.warmup_steps": 1,
            "train.eval_every": 2, "train.eval_batches": 2, "train.ckpt_every": 2, "name": "mix",
            "data.sources": f"[{{path: {a}, weight: 0.75}}, {{path: {b}, weight: 0.25}}]",
            "data.doc_masking": True}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def test_trainer_on_a_mixture_resumes_bit_for_bit(tmp_path, capsys):
    a, b = _prepared_pair(tmp_path)
    cfg = load_config(None, _overrides(a, b))
    check_data(cfg, 1)  # the pre-launch checks accept it
    run = tmp_path / "run"
    full = train(cfg, run)
    printed = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "data: mixture of 2 sources (75% prepared" in printed
    assert "document masking on" in printed
    losses = {r["step"]: r["loss"] for r in full.records}
    assert full.step == 4 and all(math.isfinite(v) for v in losses.values())
    meta = ckpt.validate(run / "checkpoints" / "step_00000004")
    assert sum(meta["data"]["source_positions"]) == meta["data"]["position"] == 16
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(run, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step_00000004")
    again = train(cfg, resumed_dir)
    assert [r["step"] for r in again.records] == [3, 4]
    assert {r["step"]: r["loss"] for r in again.records} == {3: losses[3], 4: losses[4]}
