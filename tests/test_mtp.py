"""DeepSeek-V3's multi-token prediction (``model.mtp_depth``, ``train.mtp_loss_weight``): the
modules' losses against a plain float64 reference written here from their parameters
(document masking included), depth 0 is the model without them, the MTP term's gradient
reaches the shared embedding and head, the config refuses what it cannot run, the
trainer on 2 ranks (FSDP + EP 2, the MTP block's experts sharded and its MoE layer in
the step statistics; ZeRO-1 with full recomputation; the replicated layout with light
recomputation) follows one process at the same global batch and resumes bit for
bit from its checkpoint (loaded into one process exactly), sizing and the memory model
count the modules (the kept bytes measured as tests/test_memory.py does), the step model
takes the depth from the config, and a Hugging Face DeepSeek-V3 folder round-trips the
modules. One spawn holds every distributed case."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_utils import CaseRunner, assert_no_failures, copy_checkpoint, run_distributed, run_trainer
from epscale.config import ConfigError, load_config, load_recipe
from epscale.metrics.held import median_kept_bytes
from epscale.model import Transformer, build_model
from epscale.moe.layer import moe_layers, named_moe_layers
from epscale.parallel.activation import transformer_blocks
from test_memory import measured_model
from epscale.plan import load_cluster, simulate
from epscale.plan.layout import Layout
from epscale.plan.memory import Activations, estimate, param_shapes
from epscale.plan.routing import RoutingSpec
from epscale.plan.shapes import Work
from epscale.plan.sizing import model_size
from epscale.training import checkpoint as ckpt
from epscale.training.loop import train
from test_fsdp import _cfg as same_batch_cfg
from test_train import assert_loads_exactly, assert_losses_close

TINY = ["model.dim=32", "model.num_layers=2", "model.num_heads=4", "model.seq_len=16",
        "model.vocab_size=64", "model.dense_hidden_dim=48", "moe.hidden_dim=24",
        "moe.num_experts=4", "moe.top_k=2", "moe.experts_impl=grouped_mm"]
EOS = 3


def _tiny(depth: int, *extra: str):
    return load_config(None, TINY + [f"model.mtp_depth={depth}", *extra])


def _rms(v: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_mtp_losses(net: Transformer, x: torch.Tensor, y: torch.Tensor,
                          eos: int | None) -> list[torch.Tensor]:
    """The report's section 2.2 by hand, from the modules' parameters: module k takes
    h^{k-1} (h^0 the main model's last block output) and the embedding of token i + k,
    h'_i = eh_proj [enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)], one block, its final norm and
    the shared head predict t_{i+k+1} = y[i + k]; positions i >= S - k are not counted,
    nor (with document masking) those with an EOS among tokens i .. i + k."""
    eps, S = net.cfg.norm_eps, x.shape[1]
    mask = net.attention_mask(x)
    h = net.hidden(x)
    losses = []
    for k, mod in enumerate(net.mtp.values(), start=1):
        ahead = torch.cat((x[:, k:], x[:, :k]), dim=1)      # t_{i+k} (wrapped at the end)
        e = net.tok_embeddings.weight[ahead]
        z = torch.cat((_rms(e, mod.enorm.weight, eps), _rms(h, mod.hnorm.weight, eps)), -1)
        h = mod.block(z @ mod.eh_proj.weight.t(), None, mask) if mask is not None \
            else mod.block(z @ mod.eh_proj.weight.t())
        logp = (_rms(h, mod.norm.weight, eps) @ net.head_weight().t()).log_softmax(-1)
        terms = []
        for b in range(x.shape[0]):
            for i in range(S - k):
                if eos is not None and (x[b, i:i + k + 1] == eos).any():
                    continue
                terms.append(-logp[b, i, y[b, i + k]])
        losses.append(torch.stack(terms).mean())
    return losses


@pytest.mark.parametrize("doc_masking", [False, True])
def test_mtp_losses_match_a_plain_float64_reference(doc_masking):
    """Within 1e-6: epscale's RMSNorm computes in fp32 whatever its input (the reference's
    norms run in float64); a wiring error (order of the concatenation, a shift, a norm)
    moves the loss by far more."""
    cfg = _tiny(2, "model.tie_embeddings=false")
    net = build_model(cfg).double()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(4, 64, (2, 16), generator=g)
    x[0, 5], x[0, 11], x[1, 13] = EOS, EOS, EOS
    y = torch.cat((x[:, 1:], torch.randint(4, 64, (2, 1), generator=g)), dim=1)
    if doc_masking:
        net.set_document_masking(EOS, "dense")
    main = net.loss(x, y)
    got = net.last_mtp_losses
    ref = _reference_mtp_losses(net, x, y, EOS if doc_masking else None)
    assert len(got) == 2 and all(t.dtype == torch.float64 for t in got)
    for k, (a, b) in enumerate(zip(got, ref), start=1):
        assert a.item() == pytest.approx(b.item(), rel=1e-6), k
    assert net.mtp_loss().item() == pytest.approx((ref[0] + ref[1]).item() / 2, rel=1e-6)
    # the gradients of the weighted total against the reference's, every parameter
    params = [p for p in net.parameters()]
    total = main + 0.3 * net.mtp_loss()
    g_got = torch.autograd.grad(total, params, allow_unused=True)
    g_ref = torch.autograd.grad(net.loss(x, y) + 0.3 * torch.stack(ref).mean(), params,
                                allow_unused=True)
    for (name, _p), a, b in zip(net.named_parameters(), g_got, g_ref):
        if a is None or b is None:
            assert a is None and b is None, name
            continue
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name


def test_shifted_targets_skip_the_end_and_document_joins():
    net = Transformer(_tiny(2).model, _tiny(2).moe)
    x = torch.tensor([[10, 11, EOS, 12, 13, 14, EOS, 15]])
    y = torch.tensor([[11, EOS, 12, 13, 14, EOS, 15, 16]])
    assert net.mtp_targets(x, y, 1).tolist() == [[EOS, 12, 13, 14, EOS, 15, 16, -100]]
    net.set_document_masking(EOS)
    # depth 1, position i predicts y[i + 1]: no EOS among tokens i, i + 1
    # depth 1: position i predicts y[i + 1] (an EOS target is kept: the document's end),
    # unless tokens i or i + 1 are an EOS
    assert net.mtp_targets(x, y, 1).tolist() == [[EOS, -100, -100, 14, EOS, -100, -100, -100]]
    assert net.mtp_targets(x, y, 2).tolist() == [[-100, -100, -100, EOS, -100, -100, -100, -100]]
    x2 = torch.tensor([[10, 11, 12, 13, EOS, 14, 15, 16]])
    y2 = torch.tensor([[11, 12, 13, EOS, 14, 15, 16, 17]])
    assert net.mtp_targets(x2, y2, 2).tolist() == [[13, EOS, -100, -100, -100, 17, -100, -100]]


def test_depth_0_is_the_model_without_modules():
    """Same names, same initial values (they depend on the name only), same main loss;
    the MTP model's extra parameters all live under ``mtp.``; no MTP loss at depth 0, nor
    in eval mode."""
    plain, mtp = build_model(_tiny(0)), build_model(_tiny(1))
    assert plain.mtp is None and plain.mtp_loss().item() == 0.0
    sd0, sd1 = plain.state_dict(), mtp.state_dict()
    assert set(sd1) - set(sd0) == {k for k in sd1 if k.startswith("mtp.")} != set()
    assert all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    x = torch.randint(0, 64, (2, 16))
    y = torch.randint(0, 64, (2, 16))
    assert torch.equal(plain.loss(x, y), mtp.loss(x, y))
    assert len(mtp.last_mtp_losses) == 1
    assert torch.equal(plain(x), mtp(x))                     # logits ignore the modules
    mtp.eval()
    mtp.loss(x, y)
    assert mtp.last_mtp_losses == [] and mtp.mtp_loss().item() == 0.0
    # the MTP block is a transformer block (FSDP unit, recomputed, compiled) and its MoE
    # layer is listed with the others (balancing, statistics, placement), id num_layers
    assert transformer_blocks(mtp)[-1] is mtp.mtp["2"].block
    assert [lid for lid, _n, _m in named_moe_layers(mtp)] == [0, 1, 2]
    assert moe_layers(mtp)[-1] is mtp.mtp["2"].block.ffn


@pytest.mark.parametrize("tied", [True, False])
def test_mtp_gradient_reaches_the_shared_embedding_and_head(tied):
    net = build_model(_tiny(1, f"model.tie_embeddings={str(tied).lower()}"))
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    net.loss(x, y)
    net.mtp_loss().backward()
    assert net.tok_embeddings.weight.grad.abs().sum() > 0
    assert net.head_weight().grad.abs().sum() > 0
    assert net.layers["0"].attention.wq.weight.grad.abs().sum() > 0   # through h^0
    assert net.norm.weight.grad is None                  # the main final norm is not on its path
    if not tied:
        # only the rows of tokens in x (through h^0 and the tokens ahead)
        unseen = sorted(set(range(64)) - set(x.flatten().tolist()))
        if unseen:
            assert net.tok_embeddings.weight.grad[unseen].abs().sum() == 0


def test_config_errors():
    with pytest.raises(ConfigError, match=r"'model.mtp_depth' = -1 is invalid: must be an "
                                          r"integer >= 0"):
        _tiny(-1)
    with pytest.raises(ConfigError, match=r"'train.mtp_loss_weight' = -0.1 is invalid: must "
                                          r"be a finite number >= 0"):
        _tiny(1, "train.mtp_loss_weight=-0.1")
    with pytest.raises(ConfigError, match=r"'model.mtp_depth' = True is invalid"):
        _tiny(0, "model.mtp_depth=true")
    assert _tiny(1).train.mtp_loss_weight == 0.3 and _tiny(0).model.mtp_depth == 0
    # pipelines take the modules (on the last stage): the recipe's own PP16 layout trains them
    assert load_config(None, TINY + ["model.mtp_depth=1", "parallel.pp=2", "parallel.dp=1",
                                     "model.tie_embeddings=false"]).model.mtp_depth == 1
    assert load_recipe("deepseek-v3", []).parallel.pp == 16


def test_sizing_counts_the_modules_and_the_step_model_takes_the_depth():
    for extra in ([], ["model.tie_embeddings=false", "model.num_dense_layers=1",
                       "moe.num_shared_experts=1"]):
        cfg = _tiny(2, *extra)
        net = Transformer(cfg.model, cfg.moe)
        built = {n: tuple(p.shape) for n, p in net.named_parameters()}
        assert {p.name: p.shape for p in param_shapes(cfg.model, cfg.moe)} == built
        size = model_size(cfg)
        assert size.total_params == sum(p.numel() for p in net.parameters())
        assert size.mtp_params == sum(p.numel() for n, p in net.named_parameters()
                                      if n.startswith("mtp."))
        assert size.num_moe_layers == len(net.moe_layers())
    # DeepSeek-V3 with one module: 11.61B more (HF's ~14B also counts the module's own
    # copies of the 129,280 x 7,168 embedding and head, 1.85B, which epscale shares)
    base = ["parallel.pp=1", "parallel.pp_schedule=1f1b"]
    v3, v3_mtp = (model_size(load_recipe("deepseek-v3", base + [f"model.mtp_depth={d}"]))
                  for d in (0, 1))
    assert v3_mtp.mtp_params == v3_mtp.total_params - v3.total_params
    assert v3_mtp.mtp_params / 1e9 == pytest.approx(11.61, abs=0.01)
    assert (v3_mtp.mtp_params + 2 * 129280 * 7168) / 1e9 == pytest.approx(13.46, abs=0.01)
    # the step model: the recipe's depth is what Work(mtp_depth=...) charges
    tiny = ["scale=tiny", "parallel.pp=1", "parallel.pp_schedule=1f1b"]
    cl = load_cluster("h100-node")
    kw = dict(strategies=("none",), dispatchers=("alltoall",), step_samples=2,
              sample_tokens=256, routing=RoutingSpec.parse("uniform"))
    own = simulate(load_recipe("deepseek-v3", tiny), cl, **kw)   # the recipe's own module
    plain = tiny + ["model.mtp_depth=0"]
    work = simulate(load_recipe("deepseek-v3", plain), cl, work=Work(mtp_depth=1), **kw)
    none = simulate(load_recipe("deepseek-v3", plain), cl, **kw)
    assert load_recipe("deepseek-v3").model.mtp_depth == 1
    assert own[0].as_dict() == work[0].as_dict()
    assert own[0].step_time_s > none[0].step_time_s


MEASURE = ["model.dim=64", "model.num_layers=3", "model.num_heads=4", "model.seq_len=128",
           "model.dense_hidden_dim=128", "model.num_dense_layers=1", "model.vocab_size=256",
           "moe.hidden_dim=96", "moe.num_experts=8", "moe.top_k=2", "train.micro_batch_size=2"]


LIGHT_FP8 = (("norm", "moe_act"), "fp8")   # DeepSeek-V3's light recomputation (no MLA)


@pytest.mark.parametrize("depth,rule,ac,impl,light", [
    (1, "fp32", "none", "grouped_mm", None), (2, "bf16 fsdp", "full", "cpu_fused", None),
    (1, "bf16 autocast", "selective", "grouped_mm", None),
    (1, "bf16 fsdp", "none", "grouped_mm", LIGHT_FP8)])
def test_memory_model_counts_what_the_modules_keep(depth, rule, ac, impl, light):
    """As tests/test_memory.py measures a forward: within 5% for the whole model; also
    with the norms and the expert activation recomputed and fp8 storage (``light``), where
    the MTP block stores its FFN and attention rows in fp8 as the main blocks do."""
    modules, storage = light or ((), "compute")
    cfg, net = measured_model(MEASURE + [f"moe.experts_impl={impl}", f"model.mtp_depth={depth}"],
                              rule, ac, modules, storage)
    x, y = torch.randint(0, 256, (2, 128)), torch.randint(0, 256, (2, 128))

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rule == "bf16 autocast"):
            return net.loss(x, y) + 0.3 * net.mtp_loss() + net.aux_loss()

    forward().backward()
    net.zero_grad(set_to_none=True)
    kept = median_kept_bytes(forward, net)
    lay = Layout.from_config(cfg, 1, ep=1, fsdp=rule == "bf16 fsdp")
    acts = Activations(ac, "float32" if rule == "fp32" else "bfloat16", impl, modules, storage,
                       "composite")   # the CPU runs RMSNorm decomposed
    est = estimate(cfg, lay, acts)
    assert est.activations == pytest.approx(kept, rel=0.05), (kept, est.activations)
    # the modules' parameters, gradients and AdamW state are in the held state
    plain = estimate(load_config(None, MEASURE + [f"moe.experts_impl={impl}"]), lay, acts)
    extra = model_size(cfg).mtp_params
    assert est.params_per_rank - plain.params_per_rank == extra
    assert (est.params, est.grads, est.optimizer) == (4 * est.params_per_rank,
                                                      4 * est.params_per_rank,
                                                      8 * est.params_per_rank)


# ------------------------------------------------------------------ the trainer, 2 ranks
MTP = {"model.mtp_depth": 1, "train.steps": 4, "train.mtp_loss_weight": 0.3}
SPLIT = {"parallel.fsdp": True, "parallel.ep": 2}


def _records(records) -> dict[int, tuple[float, float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"], r["mtp_loss"]) for r in records}


def _run(corpus_dir: Path, run_dir: Path, world: int, over: dict) -> dict:
    return _records(run_trainer(same_batch_cfg(corpus_dir, world, over), run_dir, world))


def _worker(rank, world, corpus_dir, tmp):
    corpus_dir, tmp = Path(corpus_dir), Path(tmp)
    runner, out = CaseRunner(rank), {}
    with runner.case("fsdp ep2"):
        out["fsdp ep2"] = _run(corpus_dir, tmp / "fsdp", world,
                               {**MTP, **SPLIT, "train.ckpt_every": 2})
    with runner.case("fsdp ep2 resumed"):
        copy_checkpoint(tmp / "fsdp", 2, tmp / "resumed", rank)
        out["fsdp ep2 resumed"] = _run(corpus_dir, tmp / "resumed", world,
                                       {**MTP, **SPLIT, "train.ckpt_every": 2})
    with runner.case("fsdp ep2 zero1 ac-full"):
        out["fsdp ep2 zero1 ac-full"] = _run(corpus_dir, tmp / "ac", world,
                                             {**MTP, **SPLIT, "train.steps": 2,
                                              "parallel.zero": 1,
                                              "train.activation_checkpointing": "full"})
    with runner.case("ep2 replicated light recompute"):
        out["ep2 replicated light recompute"] = _run(
            corpus_dir, tmp / "rep", world, {**MTP, "parallel.ep": 2, "train.steps": 2,
                                             "train.recompute_modules": "[norm,router]"})
    with runner.case("hsdp 2x1"):
        # the deepseek-v3 recipe's layout without a pipeline is HSDP (its comment)
        out["hsdp 2x1"] = _run(corpus_dir, tmp / "hsdp", world,
                               {**MTP, "parallel.fsdp": True, "parallel.dp_replicate": 2,
                                "parallel.ep": 1, "train.steps": 2})
    return runner.failures, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    corpus_dir = tmp_path_factory.mktemp("corpus")
    tmp2, tmp1 = tmp_path_factory.mktemp("w2"), tmp_path_factory.mktemp("w1")
    r2 = run_distributed(_worker, 2, args=(str(corpus_dir), str(tmp2)), timeout_s=300)
    assert_no_failures([f for f, _ in r2])
    one = train(same_batch_cfg(corpus_dir, 1, MTP), tmp1 / "one").records
    plain = train(same_batch_cfg(corpus_dir, 1, {"train.steps": 1}), tmp1 / "plain").records
    return r2[0][1], _records(one), plain, tmp2, corpus_dir


def test_two_ranks_follow_one_process(runs):
    """FSDP over 2 ranks with the experts (the MTP block's too) over EP 2, the same at
    ZeRO-1 under full recomputation, and the replicated layout (DDP's buckets) with EP 2
    and the norms and routers recomputed, and HSDP (2 replicas of 1-rank shards): the main
    loss, the MTP loss and the gradient norm of one process at the same global batch."""
    got, ref, _plain, _tmp, _c = runs
    for name in ("fsdp ep2", "fsdp ep2 zero1 ac-full", "ep2 replicated light recompute",
                 "hsdp 2x1"):
        for i in range(3):
            assert_losses_close({s: v[i] for s, v in got[name].items()},
                                {s: v[i] for s, v in ref.items()}, same_weights={1})


def test_step_records_keep_loss_the_main_loss(runs):
    """``loss`` is the next-token loss (step 1: a model without modules has the same);
    ``mtp_loss`` is recorded beside it and the modules learn."""
    _got, ref, plain, _tmp, _c = runs
    assert plain[0]["step"] == 1 and "mtp_loss" not in plain[0]
    assert ref[1][0] == pytest.approx(plain[0]["loss"], rel=1e-6)
    assert ref[4][2] < ref[1][2]


def test_resume_is_bitwise_and_the_checkpoint_loads_in_one_process(runs, tmp_path):
    got, _ref, _plain, tmp2, corpus_dir = runs
    full, resumed = got["fsdp ep2"], got["fsdp ep2 resumed"]
    assert sorted(resumed) == [3, 4] and all(resumed[s] == full[s] for s in resumed)
    assert_loads_exactly(tmp_path, ckpt.step_dir(tmp2 / "fsdp", 2), **{"model.mtp_depth": 1})


# ------------------------------------------------------------------ Hugging Face
def test_hugging_face_round_trip(tmp_path):
    """DeepSeek-V3's layout: module k as layer num_hidden_layers + k - 1 with enorm, hnorm,
    eh_proj, shared_head.norm / head and embed_tokens; transformers' model loads the
    folder (leaving those layers aside) with our logits; the import builds the modules
    again with every tensor as saved; a copy that differs is refused; a family without
    MTP layers is refused."""
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open
    from safetensors.torch import save_file

    from epscale.interop.files import HFError
    from epscale.interop.hf import from_pretrained
    from epscale.interop.hf_export import to_pretrained
    from epscale.interop.hf_families import choose

    over = ["scale=tiny", "parallel.ep=1", "parallel.dp=1", "parallel.pp=1",
            "parallel.pp_schedule=1f1b", "model.dim=32", "moe.dim=32", "model.num_heads=4",
            "model.seq_len=32", "model.dense_hidden_dim=48", "moe.hidden_dim=16",
            "moe.num_experts=16", "model.kv_lora_rank=16", "model.q_lora_rank=16",
            "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8",
            "model.mtp_depth=2"]
    cfg = load_recipe("deepseek-v3", over)
    L = cfg.model.num_layers
    net = build_model(cfg).eval()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
        for moe in net.moe_layers():
            moe.router.expert_bias.normal_()
    out = tmp_path / "hf"
    to_pretrained(net, cfg, out)
    import json
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 2
    names = {}
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            names.update({k: s.get_tensor(k) for k in s.keys()})
    for i in (L, L + 1):
        for key in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                    "self_attn.kv_b_proj.weight", "mlp.experts.0.gate_proj.weight"):
            assert f"model.layers.{i}.{key}" in names, key
        assert torch.equal(names[f"model.layers.{i}.embed_tokens.weight"],
                           names["model.embed_tokens.weight"])
        assert torch.equal(names[f"model.layers.{i}.shared_head.head.weight"],
                           names["lm_head.weight"])
    back, cfg2 = from_pretrained(out)
    assert cfg2.model.mtp_depth == 2
    sd, sd2 = net.state_dict(), back.state_dict()
    assert set(sd) == set(sd2) and all(torch.equal(sd[k], sd2[k]) for k in sd)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    x = torch.randint(0, cfg.model.vocab_size, (1, 12))
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, net(x), atol=1e-4)
    # model.mtp_depth=0 as an override leaves the modules out (with a note)
    with pytest.warns(UserWarning, match="multi-token-prediction.*model.mtp_depth = 0"):
        plain, _ = from_pretrained(out, ["model.mtp_depth=0"])
    assert plain.mtp is None
    # a copy of the head that differs from lm_head is refused
    shard = next(out.glob("*.safetensors"))
    with safe_open(str(shard), "pt") as s:
        tensors = {k: s.get_tensor(k) for k in s.keys()}
    key = next(k for k in tensors if k.endswith("shared_head.head.weight"))
    tensors[key] = tensors[key] + 1
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(HFError, match="differs from 'lm_head.weight'"):
        from_pretrained(out)
    with pytest.raises(HFError, match="only deepseek_v3 stores multi-token-prediction"):
        choose(cfg, "glm4_moe")
