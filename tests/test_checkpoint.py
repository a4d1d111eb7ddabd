"""Sharded checkpoints in one process: exact round trip of model, AdamW state and expert
biases; atomic saves; corrupt and partial checkpoints detected (with their path) and the
previous one used; pruning; export/import to one full state dict; model mismatch errors.
(Resharding across process counts is tested in test_train.py with real process groups.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from epscale.training import checkpoint as ckpt
from epscale.config import load_config, to_dict
from epscale.model import build_model
from epscale.training.dist import SingleProcessDims
from epscale.training.optim import build_optimizer

DIMS = SingleProcessDims()


def cfg(*over):
    return load_config(None, ["model.dim=32", "model.num_layers=2", "model.num_heads=2",
                              "model.seq_len=16", "moe.hidden_dim=16", "moe.num_experts=4",
                              *over])


def trained(c, steps=2, seed=0):
    """A model + AdamW after a few steps, with non-zero expert biases."""
    model = build_model(c, seed=seed)
    opt = build_optimizer(model, c.train)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 16), generator=g)
        (model.loss(x, x) + model.aux_loss()).backward()
        opt.step()
        opt.zero_grad()
    for i, moe in enumerate(model.moe_layers()):
        moe.router.expert_bias.copy_(torch.arange(4.0) * (i + 1) / 10)
    return model, opt


def assert_same(m1, o1, m2, o2):
    for (n, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n
    p1, p2 = dict(m1.named_parameters()), dict(m2.named_parameters())
    for n in p1:
        s1, s2 = o1.state[p1[n]], o2.state[p2[n]]
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s1[k], s2[k]), (n, k)


def test_round_trip_is_exact(tmp_path):
    c = cfg()
    m1, o1 = trained(c)
    path = ckpt.save(tmp_path, 7, m1, o1, DIMS, {"data": {"position": 42}})
    assert path == tmp_path / "checkpoints" / "step_00000007"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 7 and meta["data"]["position"] == 42 and ".metadata" in meta["files"]
    assert not list((tmp_path / "checkpoints").glob(".tmp*"))
    m2, o2 = trained(c, steps=1, seed=1)  # different weights and optimizer state
    got = ckpt.load(path, m2, o2, DIMS)
    assert got["step"] == 7
    assert_same(m1, o1, m2, o2)
    assert m2.moe_layers()[1].router.expert_bias.tolist() == pytest.approx([0, 0.2, 0.4, 0.6])


def test_corrupt_and_partial_checkpoints_fall_back_to_the_previous(tmp_path):
    c = cfg()
    m, o = trained(c)
    for step in (1, 2, 3):
        ckpt.save(tmp_path, step, m, o, DIMS, {}, keep=5)
    # step 3: flip one byte in a shard (same size, wrong hash)
    shard = next((tmp_path / "checkpoints" / "step_00000003").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # step 4: a save that died before meta.json; step 5: an interrupted temporary dir
    partial = tmp_path / "checkpoints" / "step_00000004"
    shutil.copytree(tmp_path / "checkpoints" / "step_00000002", partial)
    (partial / "meta.json").unlink()
    (tmp_path / "checkpoints" / ".tmp_step_00000005").mkdir()
    reports = []
    path, meta = ckpt.latest_valid(tmp_path, report=reports.append)
    assert meta["step"] == 2 and path.name == "step_00000002"
    assert "step_00000004" in reports[0] and "no meta.json" in reports[0]
    assert "step_00000003" in reports[1] and "SHA-256" in reports[1]
    # truncated file: caught by size without hashing
    shard2 = next((tmp_path / "checkpoints" / "step_00000002").glob("*.distcp"))
    shard2.write_bytes(shard2.read_bytes()[:100])
    with pytest.raises(ckpt.CheckpointError, match="step_00000002.*expected"):
        ckpt.validate(tmp_path / "checkpoints" / "step_00000002", verify_hashes=False)
    assert ckpt.latest_valid(tmp_path, report=reports.append)[1]["step"] == 1


def test_only_the_newest_k_are_kept(tmp_path):
    m, o = trained(cfg(), steps=1)
    for step in (10, 20, 30):
        ckpt.save(tmp_path, step, m, o, DIMS, {}, keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [20, 30]


def test_mismatched_model_is_a_clear_error(tmp_path):
    m, o = trained(cfg())
    path = ckpt.save(tmp_path, 1, m, o, DIMS, {})
    other = build_model(cfg("moe.hidden_dim=24"))
    with pytest.raises(ckpt.CheckpointError, match=r"step_00000001.*does not fit.*w1"):
        ckpt.load(path, other, None, DIMS)


def test_export_and_import_full_state_dict(tmp_path):
    c = cfg()
    m1, o1 = trained(c)
    ckpt.save(tmp_path / "run", 5, m1, o1, DIMS, {"data": {"position": 80}, "config": to_dict(c)})
    out = tmp_path / "full.pt"
    rc = subprocess.run([sys.executable, "-m", "epscale", "checkpoint", "export",
                         str(tmp_path / "run"), str(out)], capture_output=True, text=True)
    assert rc.returncode == 0, rc.stderr
    blob = torch.load(out, weights_only=True)
    assert blob["meta"]["step"] == 5 and blob["meta"]["data"]["position"] == 80
    fresh = build_model(c, seed=9)
    fresh.load_state_dict(blob["model"])  # a plain, full state dict
    for (n, a), (_, b) in zip(m1.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), n
    # import it into another run directory and load it back with the optimizer
    path = ckpt.import_full(out, tmp_path / "run2")
    assert path.name == "step_00000005"
    assert load_config(tmp_path / "run2" / "config.yaml").model == c.model  # for --run-dir resumes
    m2, o2 = trained(c, steps=1, seed=3)
    meta = ckpt.load(path, m2, o2, DIMS)
    assert meta["data"]["position"] == 80
    assert_same(m1, o1, m2, o2)
    # a bare model state dict imports too (fresh optimizer on load)
    torch.save(m1.state_dict(), tmp_path / "bare.pt")
    p3 = ckpt.import_full(tmp_path / "bare.pt", tmp_path / "run3", step=11)
    m3, o3 = trained(c, steps=1, seed=4)
    ckpt.load(p3, m3, o3, DIMS)
    assert torch.equal(m3.tok_embeddings.weight, m1.tok_embeddings.weight)


def test_import_rejects_other_files(tmp_path):
    (tmp_path / "x.pt").write_bytes(b"not a torch file")
    with pytest.raises(ckpt.CheckpointError, match="x.pt"):
        ckpt.import_full(tmp_path / "x.pt", tmp_path / "run")
    with pytest.raises(ckpt.CheckpointError, match="holds no complete checkpoint"):
        ckpt.export_full(tmp_path, tmp_path / "o.pt")


def test_bf16_moments_round_trip_and_load_from_fp32(tmp_path):
    """train.optimizer_state_dtype = bfloat16: the checkpoint stores the bf16 moments and
    loads them back exactly (and in bf16); an fp32-moment checkpoint loads into bf16
    moments rounded, and the weights exactly."""
    c = cfg("train.optimizer_state_dtype=bfloat16")
    m1, o1 = trained(c)
    path = ckpt.save(tmp_path / "bf16", 3, m1, o1, DIMS, {})
    m2, o2 = trained(c, steps=1, seed=1)
    ckpt.load(path, m2, o2, DIMS)
    assert_same(m1, o1, m2, o2)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in o2.state.values())
    m32, o32 = trained(cfg())
    path32 = ckpt.save(tmp_path / "fp32", 3, m32, o32, DIMS, {})
    ckpt.load(path32, m2, o2, DIMS)
    p32, p2 = dict(m32.named_parameters()), dict(m2.named_parameters())
    for n in p32:
        assert torch.equal(p32[n], p2[n]), n
        for k in ("exp_avg", "exp_avg_sq"):
            got = o2.state[p2[n]][k]
            assert got.dtype == torch.bfloat16 and torch.equal(got, o32.state[p32[n]][k].bfloat16())
