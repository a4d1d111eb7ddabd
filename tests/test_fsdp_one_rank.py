"""FSDP on one rank (one GPU: world 1, ep 1, so efsdp 1): the dense and the expert mesh
are the same one-rank group, and FSDP2 wants one mesh description per group. It trains
like one process without FSDP, under every recomputation mode (the GPU check's training
stages run this layout on one GPU)."""

from __future__ import annotations

import pytest

from epscale.training.loop import train
from test_train import losses_by_step, tiny_cfg

BASE = {"train.steps": 3, "train.eval_every": 0, "train.ckpt_every": 0,
        "train.micro_batch_size": 2, "train.preflight": False, "train.dtype": "float32"}


@pytest.mark.cpu_only
def test_one_rank_fsdp_trains_like_one_process(tmp_path):
    want = losses_by_step(train(tiny_cfg(tmp_path, **BASE), tmp_path / "plain").records)
    for ac in ("none", "selective", "full"):
        cfg = tiny_cfg(tmp_path, **{**BASE, "parallel.fsdp": True,
                                    "train.activation_checkpointing": ac})
        got = losses_by_step(train(cfg, tmp_path / f"fsdp_{ac}").records)
        assert got == pytest.approx(want, rel=1e-5), (ac, got, want)
