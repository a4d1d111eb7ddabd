"""``train.compile``: the trainer with every transformer block through ``torch.compile``
(inductor, which on CPU builds C++ kernels with the system compiler) trains like the eager
trainer on the same config: one process at ep=1, where each MoE block is one graph
(``fullgraph=True``: a graph break would raise), and two gloo ranks at ep=2 (the
dispatcher's exchanges run eagerly between compiled parts) with full recomputation (the
recomputed forward reruns the compiled graphs; tokens counted once), against the eager one
process at the same global batch. ep=2 without recomputation is left out: it compiles the
same graphs, and a cold inductor cache costs about a minute of CPU per case in CI. Selective recomputation is
refused before launch, with the reason.

Cost: inductor compiles each distinct graph once per process (both blocks share theirs:
same structure), so the cases share processes: the one-process runs here (eager, then
compiled), the two ranks in one spawn. Runs stop after 3 of 10 steps (``stop_at``): no final validation, whose
no-grad forward would compile graphs of its own.

Tolerances: bf16 compute (the compiled grouped GEMM takes bf16). Eager rounds every
operation's output to bf16; inductor fuses chains of element-wise operations and keeps
their intermediates in fp32, and the eager CPU path runs the experts in its own kernel
while the compiled one runs torch's grouped GEMM: the same sums in another order and
with fewer roundings. Losses then agree within 2e-3 relative (half a bf16 unit in the last
place; seen: 4e-5 at step 1, up to 4e-4 after AdamW's sign-like first updates), gradient
norms within 1e-2 (seen: 1.1e-3).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_utils import CaseRunner, assert_no_failures, run_distributed, run_trainer
from epscale.config import ConfigError
from test_train import tiny_cfg

STOP = 3
# 2 MoE blocks (no dense layer: one block structure, one compile), bf16, global batch 4
BASE = {"model.dim": 32, "model.num_heads": 4, "model.seq_len": 32, "moe.hidden_dim": 32,
        "moe.num_experts": 4, "model.num_dense_layers": 0, "train.dtype": "bfloat16",
        "train.steps": 10, "train.eval_every": 0, "train.ckpt_every": 0,
        "train.collective_timeout_s": 0, "train.preflight": False,
        "moe.aux_loss_scope": "global"}
TOKENS_PER_STEP = 4 * 32 * 2  # sequences x seq_len x top_k, each counted once


def _cfg(corpus_dir: Path, world: int, **over):
    return tiny_cfg(corpus_dir, **{**BASE, "train.micro_batch_size": 4 // world, **over})


def _summary(records) -> dict:
    return {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records],
            "tokens": [[sum(lay["tokens_per_expert"]) for lay in r["layers"]] for r in records]}


def _run(corpus_dir, run_dir, world, **over) -> tuple[dict, list[str]]:
    notes: list[str] = []
    records = run_trainer(_cfg(corpus_dir, world, **over), run_dir, world, stop_at=STOP,
                          inspect=lambda t: notes.extend(t.fsdp_notes))
    return _summary(records), notes


def _assert_close_steps(got: dict, eager: dict) -> None:
    """The tolerances above on the losses and gradient norms of every step."""
    torch.testing.assert_close(got["loss"], eager["loss"], rtol=2e-3, atol=0)
    torch.testing.assert_close(got["grad_norm"], eager["grad_norm"], rtol=1e-2, atol=0)


def _assert_like_eager(got: dict, eager: dict) -> None:
    assert len(got["loss"]) == len(eager["loss"]) == STOP
    _assert_close_steps(got, eager)
    assert got["tokens"] == [[TOKENS_PER_STEP] * 2] * STOP, got["tokens"]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("corpus")


@pytest.fixture(scope="module")
def eager(corpus_dir, tmp_path_factory) -> dict:
    summary, notes = _run(corpus_dir, tmp_path_factory.mktemp("eager"), 1)
    assert not any(n.startswith("compile") for n in notes)
    return summary


@pytest.mark.timeout(900)  # compiling is CPU-bound: slow on a busy machine
def test_one_process_compiles_each_block_as_one_graph(eager, corpus_dir, tmp_path):
    from torch._dynamo.utils import counters

    from epscale.parallel.compile import CompiledForward

    blocks, notes = [], []

    def inspect(t):
        blocks.extend(t.model.layers.values())
        notes.extend(t.fsdp_notes)

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    plain = run_trainer(_cfg(corpus_dir, 1, **{"train.compile": True}), tmp_path / "c", 1,
                        stop_at=STOP, inspect=inspect)
    got = _summary(plain)
    assert len(blocks) == 2
    # one graph for both blocks, all steps: nothing per layer or per forward in a guard
    # (the metrics hook once held the layer's index and host counts: a graph per MoE
    # layer, and at a model's depth past dynamo's recompilation limit)
    assert counters["stats"]["unique_graphs"] - before == 1
    assert "compile: torch.compile per block: 2 block(s) as one graph (fullgraph)" in notes
    for block in blocks:  # fullgraph: a graph break would have raised at the first step
        assert isinstance(block._forward, CompiledForward) and block._forward.fullgraph
        assert not block.ffn.dispatch_eagerly
    _assert_like_eager(got, eager)
    torch._dynamo.reset()


@pytest.mark.timeout(900)
def test_mtp_block_compiles_as_one_graph_and_trains_like_eager(corpus_dir, tmp_path):
    """``model.mtp_depth: 1`` compiled: the multi-token-prediction module's block is
    compiled as the main blocks are (one graph: it is a block of the same structure), its
    projection and norms run eagerly around it, and the main and MTP losses follow the
    eager run's (the tolerances above)."""
    from epscale.parallel.compile import CompiledForward

    over = {"model.mtp_depth": 1, "train.mtp_loss_weight": 0.3}
    mtp_blocks = []

    def summary(records) -> dict:
        return {**_summary(records), "mtp_loss": [r["mtp_loss"] for r in records]}

    eager = summary(run_trainer(_cfg(corpus_dir, 1, **over), tmp_path / "e", 1, stop_at=STOP))
    got = summary(run_trainer(_cfg(corpus_dir, 1, **over, **{"train.compile": True}),
                              tmp_path / "c", 1, stop_at=STOP,
                              inspect=lambda t: mtp_blocks.extend(
                                  m.block for m in t.model.mtp.values())))
    assert len(mtp_blocks) == 1
    assert isinstance(mtp_blocks[0]._forward, CompiledForward) and mtp_blocks[0]._forward.fullgraph
    # the MTP block's routed tokens are counted with the main blocks' (3 MoE layers)
    assert got["tokens"] == [[TOKENS_PER_STEP] * 3] * STOP, got["tokens"]
    # step 1 (the same weights): as the main model's tolerances; later steps drift further
    # (seen: gradient norm 2e-5 at step 1, 6e-3 at 2, 1.1e-2 at 3, the MTP loss 5e-4)
    for key in ("loss", "mtp_loss"):
        torch.testing.assert_close(got[key], eager[key], rtol=2e-3, atol=0)
    torch.testing.assert_close(got["grad_norm"][0], eager["grad_norm"][0], rtol=1e-3, atol=0)
    torch.testing.assert_close(got["grad_norm"], eager["grad_norm"], rtol=3e-2, atol=0)
    torch._dynamo.reset()


def _worker(rank, world, corpus_dir, tmp, cases):
    import torch._inductor.config

    # each rank compiles in its own process, not in a pool of compile workers of its own
    # (two ranks on two cores: the pools' start-up only adds processes; the same kernels)
    torch._inductor.config.compile_threads = 1
    runner = CaseRunner(rank)
    out = {}
    for name, over in cases.items():
        with runner.case(name):
            out[name] = _run(Path(corpus_dir), Path(tmp) / name.replace(" ", "_"), world, **over)
    return runner.failures, runner.num_cases, out


# DualPipeV splits each backward into its input and weight halves (the input half retains
# the graph): compiled blocks there need AOTAutograd's donated buffers off, or the first
# backward fails (parallel/compile.py); 4 blocks, one per stage, full recomputation
PP_SPLIT = {"parallel.pp": 2, "parallel.pp_schedule": "dualpipev", "parallel.overlap": "none",
            "model.num_layers": 4, "train.micro_batch_size": 1, "train.grad_accum": 4,
            "train.activation_checkpointing": "full"}


@pytest.mark.timeout(900)
def test_two_ranks_compiled_train_like_one_eager_process(eager, corpus_dir, tmp_path):
    """ep=2 with full recomputation against one eager process at the same global batch,
    and a DualPipeV pipeline (pp=2, a split backward) with full recomputation against one
    compiled process with the same micro-batches."""
    cases = {"ep2 ac-full": {"parallel.ep": 2, "train.compile": True,
                             "train.activation_checkpointing": "full"},
             "pp2 dualpipev ac-full": {**PP_SPLIT, "train.compile": True}}
    results = run_distributed(_worker, 2, args=(str(corpus_dir), str(tmp_path), cases),
                              timeout_s=840)
    assert_no_failures([r[:2] for r in results], min_cases=len(cases))
    got, notes = results[0][2]["ep2 ac-full"]
    assert any("graph break around dispatch -> experts -> combine" in n
               and "experts compiled on their own in 2" in n for n in notes), notes
    _assert_like_eager(got, eager)
    assert results[1][2]["ep2 ac-full"][0] == got  # the ranks agree on the step records
    piped, notes = results[0][2]["pp2 dualpipev ac-full"]
    assert "compile: torch.compile per block: 2 block(s) as one graph (fullgraph)" in notes
    # one compiled process with the same micro-batches of one sequence: the same compiled
    # arithmetic (seen: equal bit for bit; compiled against eager differs by up to 2% in
    # a step-1 gradient norm at micro-batches of one sequence here)
    reference, _ = _run(corpus_dir, tmp_path / "compiled4", 1, **{
        "model.num_layers": 4, "train.micro_batch_size": 1, "train.grad_accum": 4,
        "train.activation_checkpointing": "full", "train.compile": True})
    assert piped["tokens"] == reference["tokens"] == [[TOKENS_PER_STEP] * 4] * STOP
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(piped[key], reference[key], rtol=1e-5, atol=0)


def test_bad_compile_value_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="train.compile.*'fast'"):
        tiny_cfg(tmp_path, **{"train.compile": "fast"})


def test_compile_with_selective_recomputation_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"train.compile.*activation_checkpointing = "
                                          r"selective.*Use train.activation_checkpointing = full"):
        tiny_cfg(tmp_path, **{"train.compile": True,
                              "train.activation_checkpointing": "selective"})
