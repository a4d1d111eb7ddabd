"""The 'deepep' dispatcher's one buffer per process, on CPU: a stand-in ``deep_ep`` module
(injected into sys.modules inside the worker only; deep_ep needs CUDA) records every
``deep_ep.Buffer`` built and its sizes.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_utils import CaseRunner, assert_no_failures, run_distributed

NVL_PER_BYTE = {"dispatch": 3, "combine": 5}  # the stand-in's size hint: factor x bytes x ranks


def _fake_deep_ep(built: list) -> types.ModuleType:
    class Config:
        def __init__(self, factor: int):
            self.factor = factor

        def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
            return self.factor * hidden_bytes * num_ranks

        def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
            return 7 * self.factor * hidden_bytes * num_ranks

    class Buffer:
        def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0):
            built.append((dist.get_process_group_ranks(group), num_nvl_bytes, num_rdma_bytes))

        @staticmethod
        def capture():  # an event on the current stream (not used on this path)
            return None

        @staticmethod
        def get_dispatch_config(num_ranks: int) -> Config:
            return Config(NVL_PER_BYTE["dispatch"])

        @staticmethod
        def get_combine_config(num_ranks: int) -> Config:
            return Config(NVL_PER_BYTE["combine"])

    mod = types.ModuleType("deep_ep")
    mod.Buffer = Buffer
    return mod


def _worker(rank: int, world: int):
    import epscale
    from epscale import ConfigError
    from epscale.dispatch import deepep, registry

    runner = CaseRunner(rank)
    built: list = []
    dims = epscale.ParallelDims(dp=1, ep=world)
    dims_ep1 = epscale.ParallelDims(dp=world, ep=1)

    def moe(dim: int):
        return epscale.MoE(epscale.MoEConfig(dim=dim, hidden_dim=8, num_experts=2 * world,
                                             top_k=2))

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "deep_ep", _fake_deep_ep(built))
        mp.setattr(deepep, "deepep_available", lambda: (True, ""))  # the CUDA check only
        with runner.case("one buffer for all layers, sized for the widest"):
            model = nn.Sequential(moe(8), moe(24), moe(16))
            epscale.parallelize(model, dims, dispatcher="deepep")
            widest = 24 * 2  # bf16 bytes per token of the widest layer
            assert built == [(list(range(world)), max(NVL_PER_BYTE.values()) * widest * world, 0)]
            shared = {id(m.dispatcher.shared) for m in model}
            assert len(shared) == 1 and model[0].dispatcher.shared.hidden_bytes == widest
        with runner.case("a wider layer is refused, not served by a grown buffer"):
            assert isinstance(model[0].dispatcher, deepep.DeepEPDispatcher)
            n = len(built)
            idx_TK = torch.zeros(3, 2, dtype=torch.long)
            with pytest.raises(ValueError, match="sized for 48"):
                model[0].dispatcher.dispatch(torch.zeros(3, 32), idx_TK, torch.ones(3, 2))
            assert len(built) == n
        with runner.case("make_dispatcher deepep needs the shared buffer"):
            with pytest.raises(ValueError, match="needs deepep_buffer"):
                registry.make_dispatcher("deepep", 2 * world, dims)
        with runner.case("error deepep at ep=1"):
            n = len(built)
            with pytest.raises(ConfigError, match=r"'dispatcher' = 'deepep' needs ep > 1 \(got "
                               r"ep=1\): .*nothing to exchange; use dispatcher='local'"):
                epscale.parallelize(moe(8), dims_ep1, dispatcher="deepep")
            assert len(built) == n
    dist.barrier()
    return runner.failures, runner.num_cases


def test_deepep_one_buffer_per_process():
    assert_no_failures(run_distributed(_worker, 2), min_cases=4)


def test_deepep_at_ep1_refused_before_launch(tmp_path):
    from epscale import ConfigError
    from epscale.config.recipes import load_config
    from epscale.training.prelaunch import check_run

    cfg = load_config(Path(__file__).parents[1] / "configs" / "tiny.yaml", ["parallel.dispatcher=deepep", "parallel.ep=1"])
    with pytest.raises(ConfigError, match="'deepep' needs ep > 1 .*use dispatcher='local'"):
        check_run(cfg, tmp_path / "run", 2)
    assert not (tmp_path / "run").exists()
