"""Router-side balancing: the loss-free bias update (single process, gradient accumulation,
recomputation, and over 2 gloo ranks), the global-batch balance loss, running MaxVio."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import epscale
from dist_utils import CaseRunner, assert_no_failures, run_distributed
from epscale.metrics.balance import RunningMaxVio, max_vio, rank_idle
from epscale.moe.balance import update_expert_biases
from epscale.moe.layer import is_recomputing
from epscale.moe.losses import global_batch_balance_loss
from epscale.moe.losses import load_balance_loss


def _skewed_moe(E=8, K=2, dim=16, hot=0, seed=0):
    torch.manual_seed(seed)
    m = epscale.MoE(epscale.MoEConfig(dim=dim, hidden_dim=8, num_experts=E, top_k=K))
    with torch.no_grad():
        m.router.gate.weight[hot] += 0.8  # every token leans to expert `hot`
    return m


def test_update_direction_and_size_from_counts():
    model = nn.Sequential(_skewed_moe(), _skewed_moe(seed=1))
    counts = torch.tensor([[10.0, 0, 2, 2, 2, 2, 2, 4], [3.0] * 8])
    loads = update_expert_biases(model, None, 0.01, counts)
    assert torch.equal(loads, counts.double())
    b0, b1 = model[0].router.expert_bias, model[1].router.expert_bias
    mean = 3.0
    expected = 0.01 * torch.sign(mean - counts[0])
    torch.testing.assert_close(b0, expected)
    assert torch.equal(b1, torch.zeros(8))          # balanced layer: sign(0) = 0
    # the step record's {layer id: counts} form gives the same update
    update_expert_biases(model, None, 0.01, {0: counts[0].tolist(), 1: counts[1].tolist()})
    torch.testing.assert_close(b0, 2 * expected)
    update_expert_biases(model, None, 0.0, counts)  # u=0: no change
    torch.testing.assert_close(b0, 2 * expected)


def test_update_errors_name_the_problem():
    model = nn.Sequential(_skewed_moe(), _skewed_moe(seed=1))
    with pytest.raises(ValueError, match=r"no entry for MoE layer\(s\) \[1\]"):
        update_expert_biases(model, None, 0.01, {0: [1.0] * 8})
    with pytest.raises(ValueError, match="3 loads for a layer with 8 experts"):
        update_expert_biases(model, None, 0.01, torch.ones(2, 3))
    with pytest.raises(ValueError, match="loads for 1 layers"):
        update_expert_biases(model, None, 0.01, torch.ones(1, 8))
    with pytest.raises(ValueError, match="u=-1"):
        update_expert_biases(model, None, -1, torch.ones(2, 8))


def test_gradient_accumulation_sums_micro_batches_and_reset():
    m = _skewed_moe()
    xs = [torch.randn(40, 16), torch.randn(24, 16)]
    m.train()
    counts = torch.zeros(8)
    for x in xs:
        m(x)
        counts += m.last_stats["tokens_per_expert"].float()
    loads = update_expert_biases(m, None, 0.5, reset=True)
    torch.testing.assert_close(loads[0], counts.double())
    torch.testing.assert_close(m.router.expert_bias, 0.5 * torch.sign(counts.mean() - counts))
    assert float(m.tokens_per_expert.sum()) == 0.0


def test_recomputation_does_not_change_the_update():
    """A recomputed forward runs inside backward (is_recomputing() is True there); the
    per-layer sign update is the same whether or not the layer recomputes."""
    seen = []

    def probe(x):
        seen.append(is_recomputing())
        return x.sin()  # a saved activation, so the backward recomputes

    for reentrant in (False, True):
        seen.clear()
        x = torch.randn(3, requires_grad=True)
        checkpoint(probe, x, use_reentrant=reentrant).sum().backward()
        assert seen == [False, True], (reentrant, seen)
    assert not is_recomputing()

    plain, ckpt = _skewed_moe(), _skewed_moe()
    x = torch.randn(64, 16)
    plain(x).sum().backward()
    checkpoint(ckpt, x.clone().requires_grad_(), use_reentrant=False).sum().backward()
    update_expert_biases(plain, None, 0.01)
    update_expert_biases(ckpt, None, 0.01)
    torch.testing.assert_close(plain.router.expert_bias, ckpt.router.expert_bias)


def test_loss_free_balancing_brings_max_vio_down():
    """The update loop on a skewed router (the layer's own counting is tested above; the
    router alone keeps this fast): MaxVio_batch from ~1.5 to under 0.25."""
    m = _skewed_moe(E=8, K=2, hot=3)
    with torch.no_grad():
        m.router.gate.weight[3] -= 0.4
    torch.manual_seed(1)
    x = torch.randn(1024, 16) + 0.2
    vios = []
    with torch.no_grad():
        for _ in range(100):
            route = m.router(x)
            m.tokens_per_expert += torch.bincount(route.chosen_TK.flatten(), minlength=8)
            vios.append(max_vio(m.tokens_per_expert.tolist()))
            update_expert_biases(m, None, 0.01, reset=True)
    assert vios[0] > 1.0, vios[0]
    assert max(vios[-20:]) < 0.25, vios[-20:]
    # the bias is a persistent buffer: checkpoints carry it
    sd = m.state_dict()
    assert "router.expert_bias" in sd
    fresh = _skewed_moe(E=8, K=2, hot=3)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.router.expert_bias, m.router.expert_bias)


def test_running_max_vio_and_idle():
    run = RunningMaxVio()
    assert run.update([[4, 0], [1, 1]]) == [1.0, 0.0]
    assert run.batch == [1.0, 0.0]
    assert run.update([[0, 4], [1, 1]]) == [0.0, 0.0]   # over both steps: balanced
    assert run.batch == [1.0, 0.0]
    win = RunningMaxVio(window=1)
    win.update({0: [4, 0]})
    assert win.update({0: [0, 4]}) == [1.0]
    with pytest.raises(ValueError, match="shape"):
        run.update([[1, 1, 1]])
    assert rank_idle([10, 5, 0]) == [0.0, 0.5, 1.0]
    assert max_vio([2, 2, 2]) == 0.0


# ------------------------------------------------------------------ distributed (ws 2)
def _worker(rank, world):
    import torch.distributed as dist

    runner = CaseRunner(rank)
    dims = epscale.ParallelDims(dp=1, ep=world)
    with runner.case("global-batch loss equals the concatenated batch's Switch loss"):
        E, K, T = 8, 2, 30
        g = torch.Generator().manual_seed(4)
        logits = [torch.randn(T, E, generator=g) * (1 + r) for r in range(world)]
        mine = logits[rank].clone().requires_grad_(True)
        scores = mine.softmax(-1)
        chosen = scores.detach().topk(K, -1).indices
        loss = global_batch_balance_loss(scores, chosen, E, group=dims.world_group)
        (loss / world).backward()                      # what the grad sync averages
        total = loss.detach().clone()
        dist.all_reduce(total)
        allv = torch.cat(logits).requires_grad_(True)
        s_all = allv.softmax(-1)
        ref = load_balance_loss(s_all, s_all.detach().topk(K, -1).indices, E)
        ref.backward()
        torch.testing.assert_close(total / world, ref.detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(mine.grad, allv.grad[rank * T:(rank + 1) * T],
                                   atol=1e-7, rtol=1e-5)
        # and it differs from the per-rank loss when the ranks route differently
        local = load_balance_loss(scores.detach(), chosen, E)
        assert abs(float(local) - float(loss)) > 1e-4
    with runner.case("bias update all-reduces the counters over ranks"):
        m = _skewed_moe(hot=rank)                      # each rank overloads a different expert
        m(torch.randn(32 + 8 * rank, 16))
        local = m.tokens_per_expert.clone()
        loads = update_expert_biases(m, dims, 0.01)
        summed = local.clone()
        dist.all_reduce(summed)
        torch.testing.assert_close(loads[0], summed.double())
        expected = 0.01 * torch.sign(summed.mean() - summed)
        torch.testing.assert_close(m.router.expert_bias, expected)
        biases = [torch.zeros(8) for _ in range(world)]
        dist.all_gather(biases, m.router.expert_bias)
        assert all(torch.equal(b, biases[0]) for b in biases)
    return runner.failures, runner.num_cases


def test_distributed_balancing():
    results = run_distributed(_worker, 2, timeout_s=120)
    assert_no_failures(results, min_cases=2)


def test_adaptive_rule_grows_while_the_sign_holds_and_halves_on_a_flip():
    torch.manual_seed(0)
    m = epscale.MoE(epscale.MoEConfig(dim=16, hidden_dim=8, num_experts=4, top_k=1,
                                      bias_update_rule="adaptive"))
    assert {"router.expert_bias_step", "router.expert_bias_sign"} <= set(m.state_dict())
    u = 0.01
    hot = torch.tensor([[8.0, 0.0, 4.0, 4.0]])   # expert 0 over, 1 under, 2-3 at the mean
    cold = torch.tensor([[0.0, 8.0, 4.0, 4.0]])  # the signs of 0 and 1 flip
    update_expert_biases(m, None, u, hot)
    assert m.router.expert_bias.tolist() == pytest.approx([-u, u, 0, 0])
    update_expert_biases(m, None, u, hot)        # same sign: step x1.2
    assert m.router.expert_bias.tolist() == pytest.approx([-2.2 * u, 2.2 * u, 0, 0])
    update_expert_biases(m, None, u, cold)       # flipped: step halves (1.2u -> 0.6u)
    assert m.router.expert_bias.tolist() == pytest.approx([-1.6 * u, 1.6 * u, 0, 0])
    for _ in range(40):                          # bounded by 10u and u/10
        update_expert_biases(m, None, u, hot)
    assert m.router.expert_bias_step[0].item() == pytest.approx(10 * u)
    for i in range(40):
        update_expert_biases(m, None, u, hot if i % 2 else cold)
    assert m.router.expert_bias_step[0].item() == pytest.approx(u / 10)
    with pytest.raises(epscale.config.ConfigError, match="bias_update_rule"):
        epscale.MoEConfig(dim=16, hidden_dim=8, num_experts=4, top_k=1, bias_update_rule="rprop")


def test_adaptive_rule_balances_a_skewed_router_without_swinging():
    """A router leaning hard to one expert, the same fixed batch every step: the sign rule
    recovers, then swings around the balance point (a step of u moves more load than it
    corrects); the adaptive rule recovers at least as fast and settles much closer."""
    x = torch.randn(2048, 16, generator=torch.Generator().manual_seed(3))

    def run(rule):
        m = _skewed_moe(E=8, K=2, hot=0, seed=4)
        m.cfg.bias_update_rule = rule
        if rule == "adaptive":
            m.router.register_buffer("expert_bias_step", torch.zeros(8))
            m.router.register_buffer("expert_bias_sign", torch.zeros(8))
        vio = []
        for _ in range(120):
            m.reset_token_counts()
            with torch.no_grad():
                m(x)
            vio.append(max_vio(m.tokens_per_expert.tolist()))
            update_expert_biases(m, None, 0.01)
        recovered = next(i for i, v in enumerate(vio) if v < 0.3)
        return sum(vio[-40:]) / 40, recovered

    (sign, sign_at), (adaptive, adaptive_at) = run("sign"), run("adaptive")
    assert adaptive_at <= sign_at, (sign_at, adaptive_at)
    assert adaptive < 0.08 and sign > 0.12, (sign, adaptive)

