"""The memory estimate (``epscale.plan.memory``) against what epscale builds and keeps: the
parameter shapes are the built model's, one by one; the bytes a forward keeps for
backward are what torch's profiler sees it leave allocated (within 5%), for each
recomputation mode and both expert paths; the layout arithmetic (EP, redundant slots,
FSDP's shares, dtypes) holds. FSDP's real shards are checked against the estimate in
tests/test_fsdp.py."""

from __future__ import annotations

import pytest
import torch

from epscale.config import ConfigError, ParallelConfig, RunConfig, load_config
from epscale.metrics.held import forward_kept_bytes, live_allocated_bytes, median_kept_bytes
from epscale.metrics.held import measured_model as held_model
from epscale.model import Transformer, build_model
from epscale.moe.layer import moe_layers
from epscale.parallel.activation import apply_activation_checkpointing, apply_activation_storage
from epscale.plan.layout import Layout
from epscale.plan.memory import Activations, estimate, local_numel, memory_per_rank, param_shapes
from epscale.plan.sizing import model_size
from test_sizing import CASES, _cfg

CPU_NORM = "composite"   # what the CPU runs RMSNorm as (plan.memory.NORM_KERNELS): it keeps the fp32 output too


@pytest.mark.parametrize("case", sorted(CASES))
def test_param_shapes_are_the_built_models(case):
    cfg = _cfg(*CASES[case])
    net = Transformer(cfg.model, cfg.moe)
    built = {n: tuple(p.shape) for n, p in net.named_parameters()}
    assert {p.name: p.shape for p in param_shapes(cfg.model, cfg.moe)} == built


def test_layout_arithmetic():
    cfg = _cfg({}, dict(num_experts=8))
    size = model_size(cfg)
    one = memory_per_rank(cfg, world=1, ep=1, compute_dtype="float32")
    four = memory_per_rank(cfg, world=4, ep=4)
    assert one.params_per_rank == size.total_params
    assert four.params_per_rank == size.total_params - size.expert_params * 3 / 4
    # fp32 master weights and gradients, two fp32 AdamW moments, whatever the compute dtype
    for m in (one, memory_per_rank(cfg, world=1, ep=1, compute_dtype="bfloat16")):
        assert m.params == m.grads == 4 * m.params_per_rank and m.optimizer == 8 * m.params_per_rank
    bf = memory_per_rank(cfg, world=1, ep=1, compute_dtype="bfloat16")
    assert one.activations > bf.activations > one.activations / 2   # norms and logits stay fp32
    # 4 redundant slots over ep=4: one more expert copy per rank
    red = RunConfig(model=cfg.model, moe=cfg.moe, parallel=ParallelConfig(ep=4, redundant_experts=4))
    assert memory_per_rank(red, world=4).params_per_rank == four.params_per_rank + size.expert_params / 8
    # FSDP over 4 ranks: each holds about a quarter (whole rows: a little more), plus the
    # gathered block; HSDP 2 x 2 holds half
    f4 = memory_per_rank(cfg, world=4, ep=4, fsdp=True)
    assert size.total_params / 4 <= f4.params_per_rank < size.total_params / 4 * 1.1
    assert f4.gathered > 0 and one.gathered == 0
    h = memory_per_rank(cfg, world=4, ep=2, fsdp=True, dp_replicate=2)
    assert size.total_params / 2 <= h.params_per_rank < size.total_params / 2 * 1.1
    # recomputation keeps less after the forward and rebuilds one block in backward
    full = memory_per_rank(cfg, world=1, ep=1, activation_checkpointing="full", compute_dtype="float32")
    sel = memory_per_rank(cfg, world=1, ep=1, activation_checkpointing="selective",
                          compute_dtype="float32")
    assert full.activations < sel.activations < one.activations
    assert full.recompute > 0 and one.recompute == 0
    with pytest.raises(ConfigError, match="'parallel.ep' = 3 is invalid: must divide moe.num_experts"):
        memory_per_rank(cfg, world=3, ep=3)
    with pytest.raises(ConfigError, match="compute dtype 'int3'"):
        memory_per_rank(cfg, compute_dtype="int3")
    with pytest.raises(ConfigError, match="'parallel.dp_replicate' = 3 is invalid: must divide the 4 processes"):
        memory_per_rank(cfg, world=4, ep=2, fsdp=True, dp_replicate=3)


def test_expert_shares_split_whole_experts_or_the_hidden_dim():
    cfg = _cfg({}, dict(num_experts=6, hidden_dim=24))
    w1 = next(p for p in param_shapes(cfg.model, cfg.moe) if p.name.endswith("experts.w1"))
    # ep=2: 3 experts per rank; efsdp=3 splits them whole, efsdp=2 splits the hidden dim
    assert local_numel(w1, Layout(world=6, ep=2, fsdp=True)) == 1 * 32 * 24
    assert local_numel(w1, Layout(world=4, ep=2, fsdp=True)) == 3 * 32 * 12
    assert local_numel(w1, Layout(world=2, ep=2)) == 3 * 32 * 24


MEASURE = ["model.dim=64", "model.num_layers=3", "model.num_heads=4", "model.seq_len=128",
           "model.dense_hidden_dim=128", "model.num_dense_layers=1", "model.vocab_size=256",
           "moe.hidden_dim=96", "moe.num_experts=8", "moe.top_k=2", "train.micro_batch_size=2"]


def measured_model(over: list[str], rule: str, ac: str, modules: tuple[str, ...] = (),
                   storage: str = "compute"):
    """(config, model) of the overrides ``over``, its weights in bf16 under the "bf16 fsdp"
    rule, recomputing ``ac`` (or with ``ac`` 'none' the parts ``modules``), its activations
    stored as ``storage``, with fresh MoE buffers (allocated inside the forward)."""
    cfg = load_config(None, over)
    return cfg, held_model(cfg, rule == "bf16 fsdp", ac, modules, storage)


@pytest.mark.parametrize("rule", ["fp32", "bf16 autocast", "bf16 fsdp"])
@pytest.mark.parametrize("impl", ["cpu_fused", "grouped_mm"])
@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_kept_activations_are_what_a_forward_keeps(impl, ac, rule):
    """Each dtype rule of the trainer: fp32; bf16 autocast over fp32 weights (no FSDP: an
    fp32 residual stream, each product casting its input and weight, the cast weights
    kept for backward); bf16 under FSDP's MixedPrecisionPolicy, which hands every module
    bf16 parameters: one process does the same by casting them before the forward (the
    gathered copies FSDP makes are the estimate's ``gathered``, not activations)."""
    cfg, net = measured_model(MEASURE + [f"moe.experts_impl={impl}"], rule, ac)
    B, S = cfg.train.micro_batch_size, cfg.model.seq_len
    x, y = torch.randint(0, 256, (B, S)), torch.randint(0, 256, (B, S))

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rule == "bf16 autocast"):
            return net.loss(x, y) + net.aux_loss()

    for _ in range(2):                # warm-up: lazily built tables and caches
        forward().backward()
        net.zero_grad(set_to_none=True)
    # the median of three forwards: one run in the full suite once measured 56 KB less
    # (of 660 KB) on the CPU kernel under full recomputation: likely the profiler's stale
    # free sizes, which forward_kept_bytes no longer counts
    # (test_forward_kept_bytes_ignores_frees_of_blocks_allocated_before)
    kept = median_kept_bytes(forward, net)
    lay = Layout.from_config(cfg, 1, ep=1, fsdp=rule == "bf16 fsdp")
    dtype = "float32" if rule == "fp32" else "bfloat16"
    est = estimate(cfg, lay, Activations(ac, dtype, impl, norm_kernel=CPU_NORM))
    assert est.activations == pytest.approx(kept, rel=0.05), (kept, est.activations)


def test_forward_kept_bytes_ignores_frees_of_blocks_allocated_before():
    """The profiler's CPU reporter keeps a block's size by address while profiling and
    never drops it when the block is freed outside the profiler: a later block malloc puts
    at that address outside the profiler, freed inside the next measurement, is reported
    freed with the old block's size (here 4096 B for each 2048 B block that took such an
    address, memory the measured function never allocated). forward_kept_bytes counts a
    free only against an allocation of its own record: 0, and what is kept inside is
    counted exactly."""
    kept_by_fn = []
    got, _ = forward_kept_bytes(lambda: kept_by_fn.extend(torch.empty(1024) for _ in range(64)))
    assert got == 64 * 4096
    stale = {t.data_ptr() for t in kept_by_fn}
    kept_by_fn.clear()                                     # freed outside the profiler
    before = [torch.empty(512) for _ in range(64)]         # allocated outside it
    if not any(t.data_ptr() in stale for t in before):
        pytest.skip("malloc gave none of the 64 freed blocks' addresses to the next 64 here")
    assert forward_kept_bytes(before.clear)[0] == 0
    assert live_allocated_bytes([(1, 64), (2, 32), (1, -64), (3, -4096), (1, 16)]) == 48


def test_rmsnorm_counts_what_its_kernel_keeps():
    """On a GPU torch's rms_norm runs fused and keeps its fp32 input and the rstd; on the
    CPU it runs decomposed and keeps the fp32 normalized output too: D fp32 a token for
    each norm (the blocks' two, the final one; q/k norms per head), and nothing where the
    norms are recomputed, which keep only their input either way."""
    cfg = load_config(None, MEASURE + ["model.qk_norm=true", "model.num_kv_heads=2"])
    lay = Layout.from_config(cfg, 1, ep=1, fsdp=True)
    T, D, L, H, G = 2 * 128, 64, 3, 4, 2
    hd = D // H
    kept = {k: estimate(cfg, lay, Activations("none", "bfloat16", "grouped_mm", norm_kernel=k))
            for k in ("fused", "composite")}
    norms = 2 * L * D + D + L * (H + G) * hd          # fp32 elements a token the fused drops
    assert kept["composite"].activations - kept["fused"].activations == T * norms * 4
    assert Activations.of(cfg).norm_kernel == "fused"             # describe plans GPUs
    light = {k: estimate(cfg, lay, Activations("none", "bfloat16", "grouped_mm", ("norm",),
                                               norm_kernel=k)) for k in ("fused", "composite")}
    # recomputed block norms keep their input in either; the final and q/k norms still differ
    assert light["composite"].activations - light["fused"].activations == \
        T * (D + L * (H + G) * hd) * 4
    with pytest.raises(ConfigError, match="norm kernel 'triton' is invalid"):
        Activations(norm_kernel="triton")


def test_bf16_rules_keep_different_sets():
    """Autocast keeps an fp32 residual stream and the cast weights; FSDP's bf16 neither
    (its gathered weights are ``gathered``); fp32 keeps the most."""
    cfg = load_config(None, MEASURE)
    acts = {ac: Activations(ac, "bfloat16", "grouped_mm") for ac in ("none", "full")}
    auto, fsdp = Layout.from_config(cfg, 1, ep=1), Layout.from_config(cfg, 1, ep=1, fsdp=True)
    T, D = 2 * 128, 64
    # full recomputation keeps each block's input: fp32 under autocast, bf16 under FSDP;
    # the head's cast weight (V x D, bf16) only under autocast, and not kept: the fused
    # head casts it in its forward and again in its backward (its transient)
    auto_full, fsdp_full = estimate(cfg, auto, acts["full"]), estimate(cfg, fsdp, acts["full"])
    assert auto_full.activations - fsdp_full.activations == 3 * T * D * 2
    assert auto_full.head_chunk - fsdp_full.head_chunk == 256 * 64 * 2
    f32 = estimate(cfg, auto, Activations("none", "float32", "grouped_mm")).activations
    assert f32 > estimate(cfg, auto, acts["none"]).activations > estimate(cfg, fsdp, acts["none"]).activations


def test_recipes_at_scale_fit_by_the_estimate():
    """The 1T recipe replicated needs hundreds of GiB per rank; sharded with FSDP over its
    1,024 GPUs and recomputing, under 80 GiB."""
    from epscale.config import load_recipe

    cfg = load_recipe("ref-1t-64e")
    rep = memory_per_rank(cfg, world=1024, ep=64, fsdp=False, activation_checkpointing="none")
    assert rep.total > 400 * 2 ** 30
    fsdp = memory_per_rank(cfg, world=1024, ep=64, fsdp=True, dp_replicate=1,
                           activation_checkpointing="full")
    assert fsdp.total < 80 * 2 ** 30
    assert fsdp.params_per_rank == pytest.approx(model_size(cfg).total_params / 1024, rel=0.01)


def test_fit_lists_the_layouts_that_fit_fastest_first(capsys):
    import json

    from epscale.cli import main as cli_main
    from epscale.config import load_recipe

    assert cli_main(["describe", "ref-1t-64e", "--fit", "80GiB", "--json", "--top", "500"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["world"] == 1024 and 0 < info["fitting"] < info["tried"]
    times = [round(r["step_time_s"], 3) for r in info["layouts"]]
    assert times == sorted(times) and len(times) == info["fitting"]
    for r in info["layouts"]:
        assert r["memory"]["total"] <= 80 * 2 ** 30
        cfg = load_recipe("ref-1t-64e", r["overrides"])          # the overrides give the layout
        assert memory_per_rank(cfg, world=1024).total == r["memory"]["total"]
    # replicated, no layout of the 1T recipe fits without a pipeline (16 stages do); the
    # recipe's own is among those that do
    assert all(r["layout"]["fsdp"] for r in info["layouts"] if r["layout"]["pp"] == 1)
    assert any(not r["layout"]["fsdp"] for r in info["layouts"] if r["layout"]["pp"] == 16)
    own = load_recipe("ref-1t-64e").parallel
    assert any(r["layout"].get("dp_replicate") == own.dp_replicate and r["layout"]["ep"] == own.ep
               for r in info["layouts"])
    # 8 nodes: nothing fits, and it says what would help
    assert cli_main(["describe", "ref-1t-64e", "--fit", "80GiB", "--nodes", "8"]) == 0
    out = capsys.readouterr().out
    assert "none of the" in out and "fits" in out and "More nodes" in out
    assert cli_main(["describe", "ref-1t-64e", "--fit", "80"]) == 2
    assert "--fit = '80' is invalid" in capsys.readouterr().err
    # --gpus sets the world (whole nodes of the cluster): DeepSeek-V3 on its 2,048 GPUs
    assert cli_main(["describe", "deepseek-v3", "--fit", "80GiB", "--gpus", "2048", "--json",
                     "--top", "1"]) == 0
    ds = json.loads(capsys.readouterr().out)
    assert ds["world"] == 2048 and ds["layouts"][0]["memory"]["total"] <= 80 * 2 ** 30
    # the printed '#1 as overrides' line is the JSON's, whole, on one line: list values
    # ('train.recompute_modules=[norm,...]') are not taken for rich markup and dropped
    assert cli_main(["describe", "deepseek-v3", "--fit", "80GiB", "--gpus", "2048",
                     "--top", "1"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines()
                if x.startswith("#1 as overrides: "))
    assert line.split(": ", 1)[1].split() == ds["layouts"][0]["overrides"]
    assert any(o.startswith("train.recompute_modules=[") and len(o) > 26
               for o in ds["layouts"][0]["overrides"])
    cfg = load_recipe("deepseek-v3", line.split(": ", 1)[1].split())
    assert memory_per_rank(cfg, world=2048).total == ds["layouts"][0]["memory"]["total"]
    assert cli_main(["describe", "deepseek-v3", "--fit", "80GiB", "--gpus", "2047"]) == 2
    assert "give whole nodes" in capsys.readouterr().err


def test_describe_takes_a_layout(capsys):
    import json

    from epscale.cli import main as cli_main

    assert cli_main(["describe", "ref-1t-64e", "--json", "--no-fsdp", "--dp", "16", "--ac", "none"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["layout"]["world"] == 1024 and rep["layout"]["dp"] == 16
    assert cli_main(["describe", "ref-1t-64e", "--json"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["layout"]["fsdp"] and own["layout"]["dp_shard"] == 512
    assert rep["memory"]["total"] > 5 * own["memory"]["total"]
    assert own["memory"]["gathered"] > 0 and rep["memory"]["gathered"] == 0
    assert cli_main(["describe", "ref-1t-64e", "--world", "1000"]) == 2
    assert ("'parallel.ep' = 64 is invalid: must divide dp_shard = 500 (the 1000 processes / "
            "dp_replicate 2)") in capsys.readouterr().err


MLA_MEASURE = ["model.attention=mla", "model.q_lora_rank=32", "model.kv_lora_rank=32",
               "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=16"]
RECOMPUTE = ["norm", "router", "shared_experts", "mlp", "moe_act", "attention_core"]


def _kept_and_grads(net, x, y, ac: str, modules: list[str]):
    """(median bytes of three forwards, the last backward's gradients)."""
    apply_activation_checkpointing(net, ac, modules)
    for moe in moe_layers(net):
        moe.drop_kept_buffers()
    for _ in range(2):
        (net.loss(x, y) + net.aux_loss()).backward()
        net.zero_grad(set_to_none=True)
    samples = []
    for _ in range(3):
        kept, loss = forward_kept_bytes(lambda: net.loss(x, y) + net.aux_loss())
        net.zero_grad(set_to_none=True)
        loss.backward()
        samples.append(kept)
    return sorted(samples)[1], {n: p.grad.clone() for n, p in net.named_parameters()}


@pytest.mark.parametrize("case", ["grouped_mm", "cpu_fused", "mla"])
def test_recompute_modules_keep_what_the_estimate_says(case):
    """Each ``train.recompute_modules`` choice (and all at once): the bytes a forward keeps
    are the estimate's within 5% (the MHA model's drop, none minus the choice, within
    10%); fewer than without recomputation (the CPU kernel keeps no more than moe_act
    would already) and more than full recomputation; the gradients are those without
    recomputation, bit for bit (under moe_act, where the experts apply the gate weights
    before the down projection, within 1e-5 of the largest: fp32 roundings in another
    order). MLA with equal q/k and v head dims: CPU SDPA then takes its flash kernel, as
    the GPU's does (otherwise its math path keeps S x S scores)."""
    impl = "cpu_fused" if case == "cpu_fused" else "grouped_mm"
    over = MEASURE + ["moe.num_shared_experts=1", f"moe.experts_impl={impl}"]
    cfg = load_config(None, over + (MLA_MEASURE if case == "mla" else []))
    torch.manual_seed(0)
    net = build_model(cfg)
    B, S = cfg.train.micro_batch_size, cfg.model.seq_len
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 256, (B, S), generator=g), torch.randint(0, 256, (B, S), generator=g)
    lay = Layout.from_config(cfg, 1, ep=1)
    none, ref_grads = _kept_and_grads(net, x, y, "none", [])
    full, _ = _kept_and_grads(net, x, y, "full", [])
    est_none = estimate(cfg, lay, Activations("none", "float32", impl, norm_kernel=CPU_NORM)).activations
    choices = [[m] for m in RECOMPUTE + ["mla_up_proj"] * (case == "mla")]
    for mods in choices + [[m for c in choices for m in c]]:
        kept, grads = _kept_and_grads(net, x, y, "none", mods)
        est = estimate(cfg, lay, Activations("none", "float32", impl, tuple(mods),
                                            norm_kernel=CPU_NORM)).activations
        assert est == pytest.approx(kept, rel=0.05), (mods, kept, est)
        if case != "mla":
            assert est_none - est == pytest.approx(none - kept, rel=0.1, abs=4096), (mods, kept)
        if mods == ["moe_act"] and impl == "cpu_fused":
            assert est == est_none
        else:
            assert full < kept < none, (mods, full, kept, none)
        for n, grad in grads.items():
            if "moe_act" not in mods:
                assert torch.equal(grad, ref_grads[n]), (mods, n)
            else:  # the gate weights scale the activation: fp32 roundings in another order
                scale = ref_grads[n].abs().max().item()
                assert (grad - ref_grads[n]).abs().max().item() <= 1e-5 * scale, (mods, n)

def _bf16_kept(net, x, y, modules: list[str], storage: str, attention: bool = True) -> int:
    """Bytes one forward of ``net`` (bf16 parameters: FSDP's rule) keeps after a warm-up
    step (``attention``: fp8 storage holds the attention's output too)."""
    apply_activation_checkpointing(net, "none", modules)
    apply_activation_storage(net, storage)
    if not attention:
        for block in net.layers.values():
            if block.attention.fp8_storage is not None:
                block.attention.fp8_storage.held = frozenset()
    for moe in moe_layers(net):
        moe.drop_kept_buffers()
    (net.loss(x, y) + net.aux_loss()).backward()
    net.zero_grad(set_to_none=True)
    kept, loss = forward_kept_bytes(lambda: net.loss(x, y) + net.aux_loss())
    loss.backward()
    return kept


FP8_CASES = {"mha": ([], [([], "compute"), ([], "fp8"), (["norm", "moe_act"], "fp8"),
                          (["attention_core"], "fp8")]),
             "mla": (MLA_MEASURE, [([], "compute"), ([], "fp8"),
                                   (["norm", "mla_up_proj", "moe_act"], "compute"),
                                   (["norm", "mla_up_proj", "moe_act"], "fp8")])}


@pytest.mark.parametrize("case", sorted(FP8_CASES))
def test_fp8_storage_keeps_what_the_estimate_says(case):
    """``train.activation_storage: fp8`` on the local path in bf16 (FSDP's rule): the bytes a
    forward keeps are the estimate's within 5%, without and with moe_act and the norms
    recomputed (MLA: DeepSeek's light set with mla_up_proj), and what fp8 saves against
    compute-dtype storage is the estimate's within 10% (the expert rows, the SwiGLU tensors
    and the fp32 output rows the local path weights, the attention kernel's output and the
    output projection's input, at 1 byte plus a scale per tile, here of 64 and 16
    channels). The attention's share alone (its store holding nothing against holding its
    output) is the estimate's too, without and with its recomputation."""
    from epscale.plan.memory import fp8_attention_tensors

    extra, combos = FP8_CASES[case]
    cfg = load_config(None, MEASURE + ["moe.num_shared_experts=1", "moe.experts_impl=grouped_mm"]
                      + extra)
    torch.manual_seed(0)
    net = build_model(cfg)
    for p in net.parameters():
        p.data = p.data.to(torch.bfloat16)
    B, S = cfg.train.micro_batch_size, cfg.model.seq_len
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 256, (B, S), generator=g), torch.randint(0, 256, (B, S), generator=g)
    lay = Layout.from_config(cfg, 1, ep=1, fsdp=True)
    kept, est = {}, {}
    for mods, storage in combos:
        key = (tuple(mods), storage)
        acts = Activations("none", "bfloat16", "grouped_mm", tuple(mods), storage, CPU_NORM)
        kept[key] = _bf16_kept(net, x, y, mods, storage)
        est[key] = estimate(cfg, lay, acts).activations
        assert est[key] == pytest.approx(kept[key], rel=0.05), (key, kept[key], est[key])
        if storage == "fp8":
            held = fp8_attention_tensors(cfg.model, acts, tuple(mods))
            share = B * S * cfg.model.num_layers * sum(r * (n * c - c - 4 * -(-c // 128))
                                                       for r, c, n in held)
            unheld = _bf16_kept(net, x, y, mods, storage, attention=False)
            assert unheld - kept[key] == pytest.approx(share, rel=0.1, abs=1024), (key, share)
            assert (share > 0) == ("attention_core" not in mods)
    none, fp8 = ((), "compute"), ((), "fp8")
    assert est[none] - est[fp8] == pytest.approx(kept[none] - kept[fp8], rel=0.1)
    light = tuple(combos[2][0])
    assert kept[(light, "fp8")] < kept[fp8] < 0.85 * kept[none]


def test_deepseek_v3_at_its_layout_counts_dualpipev_sets_buffers_and_fp8():
    """DeepSeek-V3 at its layout (PP16 DualPipeV, FSDP 128 at ZeRO-1 with EP64, bf16): a
    middle rank holds 2 p + 1 = 33 stage sets (DualPipeV's PP + 1 at 32 stages, DeepSeek's
    own figure) and the receive buffers in flight: one input more than the sets (the
    next receive is posted before a backward frees one) and the output gradients torch
    posts ahead, far fewer than torch's 64 per stage for inputs and output gradients; fp8 storage takes from a stage of two MoE layers exactly
    twice the per-token saving of its rows. DeepSeek's light recomputation keeps less than
    selective recomputation (the experts apply the gate weights under moe_act: no output
    rows kept for the gate gradient; alltoall, which weights at the source, keeps them),
    and less again with fp8 storage: the recipe itself (light recomputation, fp8 storage)
    fits 80 GiB."""
    from epscale.config import load_recipe
    from epscale.plan.memory import (fp8_saving_per_token, pipeline_memory,
                                     receive_buffers_in_flight, recompute_dropped_per_token)

    cfg = load_recipe("deepseek-v3")
    lay = Layout.from_config(cfg)
    T, D = cfg.model.seq_len, cfg.model.dim
    light = ("norm", "mla_up_proj", "moe_act")
    acts = {name: Activations(ac, "bfloat16", "grouped_mm", mods, storage)
            for name, (ac, mods, storage) in {"light": ("none", light, "compute"),
                                              "fp8": ("none", light, "fp8"),
                                              "selective": ("selective", (), "compute")}.items()}
    ranks = {name: pipeline_memory(cfg, lay, a) for name, a in acts.items()}
    r3 = ranks["light"][3]
    assert r3.stages == (3, 28) and r3.in_flight == 33
    recv = receive_buffers_in_flight(cfg, lay, 3)
    assert recv == {"act": 34, "grad": 5}
    assert r3.memory.p2p_buffers == 39 * T * D * 2
    saving = fp8_saving_per_token(cfg.model, cfg.moe, acts["fp8"], False, light, "hierarchical")
    assert saving > 0
    assert r3.stage_activations[0] - ranks["fp8"][3].stage_activations[0] == 2 * T * saving
    peak = {name: max(r.memory.total for r in rs) for name, rs in ranks.items()}
    assert peak["fp8"] < 80 * 2 ** 30 < peak["light"] < peak["selective"]
    K = cfg.moe.top_k
    dropped = {d: recompute_dropped_per_token(cfg.model, cfg.moe, True, acts["light"], False, d)
               for d in ("hierarchical", "alltoall")}
    assert dropped["hierarchical"][0] - dropped["alltoall"][0] == K * D
    assert dropped["hierarchical"][1] - dropped["alltoall"][1] == -K   # each row's weight
    assert estimate(cfg, lay).total == peak["fp8"]
    train = cfg.train
    assert (train.activation_checkpointing, tuple(train.recompute_modules),
            train.activation_storage) == ("none", light, "fp8")


# A pipeline's memory, measured in the trainer at pp=2 (two gloo ranks, one stage each):
# torch's receive buffers at their peak (each held while its micro-batch is in flight),
# exactly, and the set one micro-batch keeps on each stage
# (within 10%), for fp32, bf16 autocast (fp32 stage outputs and receive buffers) and bf16
# under FSDP (bf16 ones; its stage sets are measured in one process above: here FSDP's
# root would leave its gathered bf16 weights, the estimate's ``gathered``, in the count).
PIPE = MEASURE + ["model.num_layers=4", "model.tie_embeddings=false", "moe.experts_impl=grouped_mm", "parallel.pp=2",
                  "train.grad_accum=2", "train.steps=1", "train.eval_every=0",
                  "train.eval_batches=1", "train.ckpt_every=0", "train.preflight=false",
                  "train.collective_timeout_s=0", "data.source={corpus}"]
PIPE_CASES = {  # name -> overrides
    "fp32": ["train.dtype=float32"],
    "bf16 autocast": ["train.dtype=bfloat16"],
    "bf16 autocast, full recompute": ["train.dtype=bfloat16",
                                      "train.activation_checkpointing=full"],
    "bf16 autocast, selective recompute": ["train.dtype=bfloat16",
                                           "train.activation_checkpointing=selective"],
    "bf16 FSDP": ["train.dtype=bfloat16", "parallel.fsdp=true"],
    # the last stage runs a multi-token-prediction module with the embedding's copy
    "fp32 tied, MTP": ["train.dtype=float32", "model.tie_embeddings=true", "model.mtp_depth=1"],
}


def _stage_kept_bytes(t, cfg) -> int:
    """What one micro-batch's forward of this rank's stage leaves for backward (its output;
    on the last stage the fused head's saved tensors and the loss, no logits, and the
    multi-token-prediction modules' sets)."""
    chunk = t.stepper.pipeline.chunks[0]
    for moe in moe_layers(chunk):
        moe.drop_kept_buffers()
    B, S, V = cfg.train.micro_batch_size, cfg.model.seq_len, cfg.model.vocab_size
    g = torch.Generator().manual_seed(0)
    if chunk.is_first:
        x = torch.randint(0, V, (B, S), generator=g)
    else:
        x = torch.randn(B, S, cfg.model.dim, generator=g).to(
            t.stepper.pipeline.act_BSD.dtype).requires_grad_(True)
    y = torch.randint(0, V, (B, S), generator=g)
    tokens = x if chunk.is_first else torch.randint(0, V, (B, S), generator=g)

    def forward():
        return chunk(x, y, tokens)

    samples = []
    for _ in range(3):
        kept, out = forward_kept_bytes(forward)
        samples.append(kept)
        del out
    return sorted(samples)[1]


# Under expert parallelism (2 ranks, dedup) the combine keeps the expert output rows in the
# compute dtype (the local path keeps an fp32 copy), and fp8 storage holds them too: the
# two ranks' kept bytes together (their rows add up to every token's K) are the estimate's.
EP_CASES = {"ep=2 bf16": ([], "compute"), "ep=2 bf16 fp8, moe_act": (["moe_act"], "fp8")}


def _ep_kept_bytes(rank, modules: list[str], storage: str) -> tuple[int, float]:
    import epscale

    cfg = load_config(None, MEASURE + ["moe.num_shared_experts=1", "moe.experts_impl=grouped_mm"])
    torch.manual_seed(0)
    net = build_model(cfg)
    epscale.parallelize(net, epscale.ParallelDims(dp=1, ep=2), dispatcher="dedup")
    for p in net.parameters():
        p.data = p.data.to(torch.bfloat16)
    B, S = cfg.train.micro_batch_size, cfg.model.seq_len
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randint(0, 256, (B, S), generator=g), torch.randint(0, 256, (B, S), generator=g)
    kept = _bf16_kept(net, x, y, modules, storage)
    lay = Layout.from_config(cfg, 2, ep=2, fsdp=True)
    acts = Activations("none", "bfloat16", "grouped_mm", tuple(modules), storage, CPU_NORM)
    return kept, estimate(cfg, lay, acts).activations


def _pipeline_worker(rank, world, corpus, tmp):
    import contextlib
    import os
    from pathlib import Path

    from dist_utils import CaseRunner, run_trainer
    from epscale.plan.memory import pipeline_memory

    runner, out = CaseRunner(rank), {}
    for name, over in PIPE_CASES.items():
        with runner.case(name):
            cfg = load_config(None, [o.format(corpus=corpus) for o in PIPE + over])
            got = {}

            def inspect(t):
                got["trainer"] = t

            with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
                run_trainer(cfg, Path(tmp) / name.replace(" ", "_").replace(",", ""), world,
                            inspect=inspect)
            t = got["trainer"]
            mine = pipeline_memory(cfg, Layout.from_config(cfg, world),
                                   Activations.of(cfg, norm_kernel=CPU_NORM))[rank]
            out[name] = {"recv": t.stepper.pipeline.receive_buffers.peak_bytes,
                         "recv_estimate": mine.memory.p2p_buffers,
                         "stage": None if cfg.parallel.fsdp else _stage_kept_bytes(t, cfg),
                         "stage_estimate": mine.stage_activations[0]}
    for name, (modules, storage) in EP_CASES.items():
        with runner.case(name):
            out[name] = _ep_kept_bytes(rank, modules, storage)
    return runner.failures, out


def test_pipeline_receive_buffers_and_stage_sets_are_measured(tmp_path):
    from dist_utils import assert_no_failures, run_distributed
    from test_train import corpus

    results = run_distributed(_pipeline_worker, 2, args=(str(corpus(tmp_path)), str(tmp_path)),
                              timeout_s=600)
    assert_no_failures([f for f, _ in results])
    for name in EP_CASES:
        (k0, est), (k1, _) = (r[1].pop(name) for r in results)
        assert 2 * est == pytest.approx(k0 + k1, rel=0.05), (name, k0, k1, est)
    for rank, (_, got) in enumerate(results):
        for name, m in got.items():
            assert m["recv"] == m["recv_estimate"], (rank, name, m)
            if m["stage"] is not None:
                assert m["stage_estimate"] == pytest.approx(m["stage"], rel=0.10), (rank, name, m)
    # the autocast stages pass fp32 (the residual stream), FSDP's bf16: half the bytes
    r1 = results[1][1]
    assert r1["bf16 autocast"]["recv"] == r1["fp32"]["recv"] == 2 * r1["bf16 FSDP"]["recv"]
