"""Hugging Face import and export under expert parallelism, on 2 real gloo processes: a
DeepSeek-V3 import (shared experts, group-limited sigmoid routing, dense first layer)
loaded at ep=2 gives the logits of ep=1 (and transformers'); a checkpoint saved at ep=2
exports to exactly the files an ep=1 checkpoint exports to.

transformers is imported inside the test only: the spawned workers import this module
and need none of it."""

from __future__ import annotations

import shutil

import pytest
import torch
from dist_utils import run_distributed
from safetensors.torch import load_file

import epscale
from epscale.config import to_dict
from epscale.interop.generate import load_model
from epscale.interop.hf import import_hf, run_config
from epscale.interop.hf_export import export_hf
from epscale.model import build_model
from epscale.training import checkpoint as ckpt


def _ep_worker(rank, world, run, out, toks):
    dims = epscale.ParallelDims(dp=1, ep=world)
    path = ckpt.resolve(run)
    cfg = run_config(path, ckpt.read_meta(path))
    model = build_model(cfg, seed=rank + 5)  # a different init on each rank: all of it loaded
    epscale.parallelize(model, dims, dispatcher=cfg.parallel.dispatcher)
    ckpt.load(path, model, None, dims, restore_rng=False)
    local_experts = model.moe_layers()[0].experts.w1.shape[0]
    with torch.no_grad():
        logits = model.eval()(toks[rank:rank + 1])
    ckpt.save(out, 1, model, None, dims, {"config": to_dict(cfg)})
    return logits.numpy(), local_experts  # plain arrays: tensors would travel by shared memory


def test_import_at_ep2_and_export_from_ep2(tmp_path):
    pytest.importorskip("transformers")
    from test_hf_models import (  # transformers only in this process
        CASES,
        randomize,
        tokens,
    )

    cls, hf_cfg = CASES["deepseek_v3-yarn"]()
    torch.manual_seed(0)
    ref = randomize(cls(hf_cfg).eval())
    ref.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    import_hf(tmp_path / "hf", run, ["parallel.ep=2"], report=lambda m: None)
    toks = tokens(S=16)
    one, _, _ = load_model(run)
    with torch.no_grad():
        want = one(toks)
        torch.testing.assert_close(want, ref(toks).logits, rtol=1e-4, atol=1e-4)
    results = run_distributed(_ep_worker, 2, args=(str(run), str(tmp_path / "ep2"), toks))
    for rank, (logits, local_experts) in enumerate(results):
        assert local_experts == 4  # 8 experts split over ep=2
        torch.testing.assert_close(torch.from_numpy(logits), want[rank:rank + 1], rtol=1e-4, atol=1e-4)
    meta = ckpt.read_meta(ckpt.resolve(tmp_path / "ep2"))
    assert (meta["ep"], meta["world_size"]) == (2, 2)
    # as if trained on in the run directory itself: the import's hf_source/ beside it
    shutil.copytree(run / "hf_source", tmp_path / "ep2" / "hf_source")
    a = export_hf(run, tmp_path / "from_ep1", report=lambda m: None)
    b = export_hf(tmp_path / "ep2", tmp_path / "from_ep2", report=lambda m: None)
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert (a / "config.json").read_text() == (b / "config.json").read_text()
