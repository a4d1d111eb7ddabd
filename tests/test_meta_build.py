"""The replicated dp x ep layout (no FSDP, no pipeline) is built on the meta device like
the others (issue #31): the trainer never builds the whole model on a rank, each rank
allocates only its experts' rows (or its slots of a redundant-expert placement), and
those hold the values a one-process build of the seed holds for the same experts. That
the replicated layouts still train like one process is checked by tests/test_train.py
(plain and redundant-expert EP) and tests/test_fsdp.py; this file checks the build itself, in the real
trainer on two gloo ranks (one spawn for every case)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_utils import CaseRunner, assert_no_failures, run_distributed, run_trainer
from test_train import tiny_cfg

BASE = {"train.steps": 1, "train.eval_every": 0, "train.ckpt_every": 0,
        "train.micro_batch_size": 2, "train.collective_timeout_s": 0, "train.preflight": False,
        "model.num_layers": 2}
CASES = {
    "replicated dp1 x ep2": {"parallel.ep": 2},
    "replicated dp2 x ep1": {"parallel.ep": 1, "parallel.dp": 2},
    "replicated ep2, 2 redundant slots": {"parallel.ep": 2, "parallel.redundant_experts": 2},
}


def _check_build(t, cfg) -> None:
    from epscale.model import build_model
    from epscale.parallel.materialize import full_view, placed_expert_rows
    from epscale.parallel.shard import is_expert_param

    ref = dict(build_model(cfg).named_parameters())   # the one-process build, for reference
    placed = placed_expert_rows(t.model)
    ep, E = t.dims.ep, cfg.moe.num_experts
    slots = (E + cfg.parallel.redundant_experts) // ep
    for name, p in t.model.named_parameters():
        assert not p.is_meta and p.device.type == "cpu", name
        if name in placed:   # each slot row: its logical expert's row
            logical, total = placed[name]
            assert total == E and p.shape[0] == slots == len(logical), name
            assert torch.equal(p.detach(), ref[name][logical]), name
            continue
        local, shape, offset = full_view(p, t.dims)
        assert tuple(ref[name].shape) == shape, (name, shape)
        want = ref[name][tuple(slice(o, o + n) for o, n in zip(offset, local.shape))]
        assert torch.equal(local.detach(), want), name
        # a rank's share: its experts' rows of an expert weight, every dense weight
        rows = E // ep if is_expert_param(p) else ref[name].shape[0] if p.dim() else 1
        assert (p.shape[0] if p.dim() else 1) == rows, name
    assert bool(placed) == bool(cfg.parallel.redundant_experts)


def _worker(rank, world, corpus_dir, tmp):
    import epscale.training.loop as loop

    def no_full_build(*args, **kwargs):
        raise AssertionError("the trainer built the whole model on a rank of a parallel layout")

    loop.build_model = no_full_build   # this spawned process only
    runner = CaseRunner(rank)
    for name, over in CASES.items():
        with runner.case(name):
            cfg = tiny_cfg(Path(corpus_dir), **{**BASE, **over})
            run_trainer(cfg, Path(tmp) / name.replace(" ", "_").replace(",", ""), world,
                        inspect=lambda t, cfg=cfg: _check_build(t, cfg))
    return runner.failures, runner.num_cases


@pytest.mark.cpu_only
def test_replicated_layouts_build_on_meta_and_hold_one_process_values(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    results = run_distributed(_worker, 2, args=(str(corpus), str(tmp_path)), timeout_s=300)
    assert_no_failures(results, min_cases=len(CASES))
