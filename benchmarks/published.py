"""Published MoE training runs against the step model's prediction at each run's own
model, GPU, count, layout and settings (issue 33). The table is the step model's test
set: nothing in ``epscale.plan`` is fitted to it.

    PYTHONPATH=src python benchmarks/published.py [--json PATH] [--markdown] [--breakdown]
        [--gemm-check] [--launch-us US]

``--breakdown`` prints each run's predicted step by part (``SimResult.breakdown``: GEMMs,
attention, memory-bound work, recomputation, expert GEMMs, host-bound waits, exposed
communication, bubble, ZeRO/DP collectives, optimizer); ``--gemm-check`` the grouped fp8
GEMM rate against DeepGEMM's published table; ``--launch-us`` another host time per kernel
launch (the documented range is 5-20 us), to see what it moves.

Every published figure below carries its source and the quoted numbers it comes from.
Each run is simulated with forced-balanced routing (``uniform``, strategy ``none``: the
Megatron-Bridge tables force-balance the experts; DeepSeek-V3's auxiliary-loss-free
balancing keeps its experts near balance), the run's dispatcher and overlap, and the
features our trainer lacks modelled in the planner (``Work``: fp8 GEMMs, tensor
parallelism with sequence parallelism, recomputation by module), marked in the table.
Pure computation, no network: a few seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field

from epscale.config import load_recipe
from epscale.plan import load_cluster, simulate
from epscale.plan.routing import RoutingSpec
from epscale.plan.shapes import Work, expert_gemm_tflops

MB_PERF = ("Megatron-Bridge docs/performance-summary-archive.md (NVIDIA-NeMo/Megatron-Bridge, "
           "commit 0a25f911), https://docs.nvidia.com/nemo/megatron-bridge/latest/"
           "performance-summary-archive.html")

QWEN3_235B = ["model.dim=4096", "model.num_layers=94", "model.num_heads=64", "model.num_kv_heads=4",
              "model.head_dim=128", "moe.hidden_dim=1536", "moe.num_experts=128", "moe.top_k=8"]
GPT_OSS_120B = ["model.vocab_size=201088", "model.dim=2880", "model.num_layers=36",
                "model.num_heads=64", "model.num_kv_heads=8", "model.head_dim=64",
                "moe.hidden_dim=2880", "moe.num_experts=128", "moe.top_k=4"]


# An independent Megatron-Core run of the same fine-grained model (an H800 user's timing,
# not NVIDIA's tables): github.com/alibaba/Pai-Megatron-Patch issue 643 (2025-08-08),
# image pai-megatron-patch:25.04, commit 2b201af, H800, 'expert tp=1, MicroBatchSize=1',
# 'recompute=false', '--moe-expert-capacity-factor 1.0' (token dropping), CUDA graphs off
PAI_QWEN3 = ("alibaba/Pai-Megatron-Patch issue 643 (2025-08-08, H800, image 25.04, commit "
             "2b201af; 'expert tp=1, MicroBatchSize=1', 'recompute=false', "
             "'--moe-expert-capacity-factor 1.0', CUDA graphs off)")
PAI_SETTINGS = ["train.activation_checkpointing=none", "moe.capacity_factor=1.0"]
PAI_UNSAID = ("the precision, the pipeline schedule and the dispatcher (not stated: bf16, "
              "1F1B and all-to-all assumed, Megatron-Core's defaults)")

GPT_OSS_CONFIGS = ("scripts/performance/configs/gpt_oss/gpt_oss_workload_base_configs.py "
                   "(NVIDIA-NeMo/Megatron-Bridge, commit 07eea52d)")
QWEN3_CONFIGS = ("scripts/performance/configs/qwen/qwen3_workload_base_configs.py "
                 "(NVIDIA-NeMo/Megatron-Bridge, commit 01b2977e)")
# Megatron-Bridge on Blackwell: a DGX-GB200 run of 8 or 64 GPUs sits in one NVL72 NVLink domain


def nvl(gpus: int) -> dict:
    """The cluster fields of a run of ``gpus`` GPUs inside one NVL72 NVLink domain."""
    return dict(gpus_per_node=gpus)


B200_UNSAID = ("the table's MBS 1 differs from the config file's B200 entry (MBS 4, hybridep, "
               "CUDA graphs), so the dispatcher is not known: all-to-all, Megatron-Core's "
               "default, assumed")

# Megatron-Core's MoE team's own tuned runs of Qwen3-235B-A22B on 256 H100 in bf16
MZ_QWEN3 = ("yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md (commit 020b8136), "
            "'256 H100 GPUS', 'NVLink 4th Generation', 'InfiniBand 8x50 GB/s', columns Model | "
            "Dispatcher | System | Precision | #GPUs | SEQ LEN | TP | CP | EP | PP | EDP | ETP | "
            "VPP | DP | FSDP | MBS | GBS | GA | recompute | Step time (sec) | Per GPU TF; "
            "tokens/s/GPU = GBS x 4096 / (256 x step time)")
MZ_UNSAID = ("the routing (not stated: forced balance assumed; the same page's long-context "
             "table gives dropless 8-20% below forced balance)")


def mz_tokens(step_s: float) -> float:
    """tokens/s/GPU of a MoE-ModelZoo Qwen3-235B row: GBS 2,048 x 4,096 over 256 GPUs."""
    return 2048 * 4096 / (256 * step_s)


NORM_ACT = ("layernorm", "moe_act")

# NVIDIA's PyTorch-native trainer (FSDP2, torch.distributed.pipelining, DeepEP, Transformer
# Engine's linear layers and attention: the engines epscale builds on) on DGX-H100 in bf16.
AM_PERF = ("NVIDIA-NeMo/Automodel docs/performance-summary.md (commit 01926a5c, 'Last Updated: "
           "2025-10-02'; the same rows at docs.nvidia.com/nemo/automodel/latest/"
           "performance-summary.html): 'System: DGX-H100, Precision: BF16', 'Fake balanced gate "
           "is enabled to simulate ideal expert routing', 'Step times include forward and "
           "backward passes + optimizer step for the global batch'; columns #GPUs | GBS | MBS | "
           "LBS | GA | Seq Length | TP | PP | CP | EP | VP | FSDP | Kernel Optimizations | Time "
           "per Global Step (s) | Model TFLOPs/sec/GPU | Tokens/sec/GPU")
AM_CONFIGS = "examples/benchmark/configs/"
AM_SETTINGS = ["train.optimizer_state_dtype=float32", "train.recompute_modules=[]",
               "train.activation_storage=compute", "parallel.payload=bf16"]
GPT_OSS_20B = ["model.vocab_size=201088", "model.dim=2880", "model.num_layers=24",
               "model.num_heads=64", "model.num_kv_heads=8", "model.head_dim=64",
               "moe.hidden_dim=2880", "moe.num_experts=32", "moe.top_k=4"]
GPT_OSS_SOURCE = ("gpt-oss model card (OpenAI, arXiv 2508.10925) and the hub's config.json of "
                  "openai/gpt-oss-20b / -120b: 24 / 36 layers, 32 / 128 experts of width 2880, "
                  "top-4, hidden 2880, 64 query and 8 KV heads of 64, vocabulary 201088, "
                  "'sliding_window': 128 on every other layer ('layer_types' alternate "
                  "sliding_attention / full_attention), attention sinks")
# GPT-OSS's attention as FlexAttention runs it: a 128-token band on half the layers
GPT_OSS_FLEX = dict(attention_kernel="flex", attention_window=128, windowed_layers=0.5)
# Kimi K2 (moonshotai/Kimi-K2 model card: 61 layers of which 1 dense, attention hidden 7168,
# 2048 per expert, 64 attention heads, 384 experts, 8 selected, 1 shared, vocabulary 160K
# (163,840 in its config.json), MLA, SwiGLU; DeepSeek-V3's MLA ranks and dense FFN; no
# group-limited routing)
KIMI_K2 = ["model.vocab_size=163840", "model.num_heads=64", "model.num_dense_layers=1",
           "moe.num_experts=384", "moe.top_k=8", "moe.num_groups=1", "moe.topk_groups=1"]
AM_NOT_MODELLED = ("the configs were read at later commits than the table (named in the "
                   "source); multi-token prediction none (the configs build none)")


def megatron_flops_per_token(h: int, layers: int, seq: int, heads: int, groups: int, kv: int,
                             ffn: int, topk: int, vocab: int) -> float:
    """Megatron-LM's model FLOPs per token (megatron/training/training.py,
    num_floating_point_operations, MCore 0.9: GQA, SwiGLU, MoE, no MLA): 12 L h^2 x
    ((1 + G/N + s/h) x q/h + ffn/h x topk x 3/2 + V / (2 L h)). Its TFLOP/s figures are
    this times the tokens per second."""
    q = kv * heads / h
    return 12 * layers * h * h * ((1 + groups / heads + seq / h) * q + ffn / h * topk * 1.5
                                  + vocab / (2 * layers * h))


@dataclass(frozen=True)
class Run:
    name: str
    published: float                 # tokens/s/GPU
    source: str                      # document and the exact quoted figures
    recipe: str
    overrides: list[str]
    cluster: str
    nodes: int
    dispatcher: str
    overlap: str
    # head_loss "full": these frameworks keep the head's logits for backward (Megatron-Core's
    # fused cross-entropy included), none recomputes them as epscale's chunked loss does
    work: Work = Work(head_loss="full")
    modelled: str = ""               # features of the run our trainer lacks, modelled in plan/
    not_modelled: str = ""           # what neither trainer nor planner has
    cluster_set: dict = field(default_factory=dict)


def _pipe(pp: int, schedule: str, v: int, dp: int, ep: int, m: int, mbs: int, seq: int) -> list[str]:
    # the model without the recipe's MTP modules: a run's own depth is its Work.mtp_depth
    return ["model.mtp_depth=0", f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}", f"parallel.pp_virtual_stages={v}",
            "parallel.pp_layers_per_stage=null", "parallel.fsdp=false", "parallel.zero=3",
            f"parallel.dp={dp}",
            "parallel.dp_replicate=1", "parallel.dp_shard=null", f"parallel.ep={ep}",
            f"train.grad_accum={m}", f"train.micro_batch_size={mbs}", f"model.seq_len={seq}",
            "train.global_batch_size=null"]


def _fsdp(shard: int, ep: int, mbs: int, m: int, zero: int, recompute: str, pp: int = 1,
          v: int = 1) -> list[str]:
    """A PyTorch-native FSDP2 layout: ``shard`` data ranks a stage (FSDP's mesh), ``ep`` of
    them hold the experts, ``m`` micro-batches of ``mbs`` a pass. Under a pipeline torch's
    stage keeps FSDP's weights gathered and reduce-scatters once a pass: ZeRO-1's traffic."""
    out = ["model.mtp_depth=0", "parallel.fsdp=true", "parallel.dp_replicate=1",
           f"parallel.dp_shard={shard}", f"parallel.ep={ep}", f"parallel.pp={pp}",
           f"parallel.zero={zero}", f"train.grad_accum={m}", f"train.micro_batch_size={mbs}",
           "model.seq_len=4096", "train.global_batch_size=null",
           f"train.activation_checkpointing={recompute}"] + AM_SETTINGS
    if pp > 1:
        out += ["parallel.pp_schedule=interleaved_1f1b", f"parallel.pp_virtual_stages={v}",
                "parallel.pp_layers_per_stage=null"]
    return out


RUNS = [
    Run("Mixtral 8x7B, 64 H100 (Megatron-Core 0.9)",
        468e12 / megatron_flops_per_token(4096, 32, 4096, 32, 8, 128, 14336, 2, 32000),
        "Megatron-LM megatron/core/transformer/moe/README.md (commit 022bcb5a): 'we've achieved "
        "remarkable performance of **468 TFLOPS** for Mixtral 8X7B bf16 training'; layout table "
        "'Mixtral 8x7B(Dropless) | 32K | All-to-All | BF16 | 64 | 4096 | TP 1 | EP 8 | PP 4 | VP 8 | "
        "MBS 1 | GBS 256'; 8xH100 80GB, InfiniBand 8x400 Gbit/s; 'Enable p2p comm overlap when "
        "PP > 1 by setting num_layers_per_virtual_pipeline_stage'. tokens/s = 468e12 / "
        "Megatron's FLOPs per token",
        "mixtral-8x7b", _pipe(4, "interleaved_1f1b", 8, 2, 8, 16, 1, 4096) +
        ["train.activation_checkpointing=none"], "h100-64", 8, "alltoall", "none",
        Work(p2p_overlap=True, head_loss="full"), modelled="interleaved p2p overlap"),
    Run("DeepSeek-V3, 2,048 H800 (DeepSeek)", 14.8e12 / (2.664e6 * 3600),
        "DeepSeek-V3 Technical Report (arXiv 2412.19437): pre-training on '14.8T' tokens took "
        "'2664K' H800 GPU hours (Table 1); 2,048 H800; '16-way Pipeline Parallelism (PP), 64-way "
        "Expert Parallelism (EP) spanning 8 nodes, and ZeRO-1 Data Parallelism', no TP; DualPipe; "
        "'recompute all RMSNorm operations and MLA up-projections'; FP8 GEMMs; 'only 20 SMs are "
        "sufficient to fully utilize the bandwidths of IB and NVLink'; FP8 dispatch (its 'Low-Precision "
        "Storage and Communication': the activations before the MoE up-projections are "
        "quantized to FP8 before dispatch, the combine stays in BF16); batch 15360 "
        "sequences of 4K (after the ramp). Wall-clock GPU hours: restarts, evaluation and the batch "
        "ramp included",
        "deepseek-v3", _pipe(16, "dualpipev", 2, 2, 64, 120, 1, 4096) + ["parallel.payload=fp8"],
        "h800-2048", 256,
        "hierarchical", "full",
        Work(precision="fp8", recompute_modules=("layernorm", "mla_up_proj"), comm_sms=20,
             mtp_depth=1, head_loss="full"),
        modelled="fp8 GEMMs, light recompute, ZeRO-1 (as replicated DP: same traffic), DualPipe "
                 "overlap with 20 SMs for communication, MTP depth 1 (the report's 'we set the "
                 "MTP depth D to 1')",
        not_modelled="torch's DualPipeV stands for DualPipe; the backward's FP8 dispatch of the "
                     "activation gradients (our parallel.payload covers the forward dispatch)"),
    Run("DeepSeek-V2, H800 (DeepSeek)", 1e12 / (172.8e3 * 3600),
        "DeepSeek-V2 Technical Report (arXiv 2405.04434), 3.2.3: 'for training on each trillion "
        "tokens, ... DeepSeek-V2 needs only 172.8K GPU hours' on 'the H800 cluster'; 3.1.3: 'a "
        "16-way zero-bubble pipeline parallelism (Qi et al., 2023), an 8-way expert parallelism, "
        "and ZeRO-1 data parallelism', no tensor parallelism, 'a portion of the operators are "
        "recomputed', 'we overlap the computation of shared experts with the expert parallel "
        "all-to-all communication'; 3.1.2: 60 layers, hidden 5120, 128 heads, d_c 512, d_c' 1536, "
        "d_h^R 64, all FFNs but the first MoE, '2 shared experts and 160 routed experts' of "
        "width 1536, '6 experts will be activated', experts 'uniformly deployed on 8 devices "
        "(D=8)', 'sent to at most 3 devices (M=3)', batch 'keeps 9216' sequences of '4K' after "
        "the ramp, 'token-dropping strategy during training' at 'capacity factor ... 1.0' "
        "(2.2.4); vocabulary 102400 and dense FFN 12288 from deepseek-ai/DeepSeek-V2 config.json",
        "deepseek-v3", _pipe(16, "zero_bubble", 2, 16, 8, 72, 1, 4096) + [
            "model.vocab_size=102400", "model.dim=5120", "model.num_layers=60",
            "model.dense_hidden_dim=12288", "model.num_dense_layers=1", "moe.hidden_dim=1536",
            "moe.num_experts=160", "moe.top_k=6", "moe.score_func=softmax", "moe.route_norm=false",
            "moe.route_scale=16.0", "moe.num_shared_experts=2", "moe.num_groups=8",
            "moe.topk_groups=3", "moe.capacity_factor=1.0", "train.recompute_modules=[]",
            "train.activation_storage=compute"],
        "h800-2048", 256, "dedup", "none", Work(recompute_modules=(), attention_kernel="fa2", head_loss="full"),
        modelled="device-limited routing (8 groups = the 8 EP ranks, 3 of them per token), token "
                 "dropping at capacity 1.0 (no host sync), ZeRO-1 (as replicated DP: same traffic), "
                 "attention at FlashAttention-2's measured rates (3.1.3: 'MLA is also optimized "
                 "based on an improved version of FlashAttention-2')",
        not_modelled="the GPU count (not published: 2,048 H800 as DeepSeek-V3's cluster, 72 "
                     "micro-batches); Qi et al.'s one-stage-per-rank zero bubble (our zero_bubble "
                     "holds 2 stages per rank); which operators were recomputed (none charged); "
                     "the shared experts' overlap with the all-to-all (transfers charged exposed)"),
    Run("DeepSeek-V3, 1,024 H100 (Megatron-Bridge 25.09)", 1297,
        MB_PERF + ": 25.09 DGX-H100 'DeepSeekV3 (dropless) | 1024 | GBS 8192 | MBS 1 | 4096 | FSDP 0 "
        "| TP 2 | PP 8 | CP 1 | VP 4 | EP 64 | GA 128 | 1297 | 338 (330)'; the footnote reads the "
        "parenthesised figure as FP8 with 128x128 blocks, so FP8; recompute ['mla_up_proj', 'mlp'] "
        "and the hybridep dispatcher from scripts/performance/configs/deepseek/"
        "deepseek_workload_base_configs.py (DEEPSEEK_V3_PRETRAIN_CONFIG_H100_V1)",
        "deepseek-v3", _pipe(8, "interleaved_1f1b", 4, 2, 64, 128, 1, 4096), "field-report", 128,
        "hierarchical", "none",
        Work(precision="fp8", tp=2, recompute_modules=("mla_up_proj", "mlp"), p2p_overlap=True,
             mtp_depth=1, head_loss="full"),
        modelled="fp8 GEMMs, TP2 + sequence parallel, module recompute, interleaved p2p overlap, "
                 "the MTP layer of its pipeline layout ('...mL', depth 1)",
        not_modelled="its own pipeline layout string (we split the layers by cost)"),
    Run("Qwen3-30B-A3B, 16 H100 (Megatron-Bridge 26.02)", 5113,
        MB_PERF + ": 26.02 Qwen3_30B_a3B 'DGX-H100 | 16 | FP8 | GBS 1024 | MBS 1 | 4096 | FSDP 0 | "
        "TP 1 | PP 2 | CP 1 | VP 12 | EP 8 | 5113 | 118'",
        "qwen3-30b-a3b", _pipe(2, "interleaved_1f1b", 12, 1, 8, 128, 1, 4096) +
        ["train.activation_checkpointing=none"], "h100-node", 2, "dedup", "none",
        Work(precision="fp8", p2p_overlap=True, head_loss="full"), modelled="fp8 GEMMs, interleaved p2p overlap"),
    Run("Qwen3-30B-A3B, 16 H100 (Megatron-Bridge 25.11)", 5275,
        MB_PERF + ": 25.11 DGX-H100 'Qwen3_30B_a3B | 16 | FP8-CS | GBS 512 | MBS 2 | 4096 | FSDP 0 | "
        "TP 1 | PP 2 | CP 1 | VP 24 | EP 8 | GA 32 | 5275 | 121'",
        "qwen3-30b-a3b", _pipe(2, "interleaved_1f1b", 24, 1, 8, 32, 2, 4096) +
        ["train.activation_checkpointing=none"], "h100-node", 2, "dedup", "none",
        Work(precision="fp8", p2p_overlap=True, head_loss="full"), modelled="fp8 GEMMs, interleaved p2p overlap"),
    Run("Qwen3-30B-A3B, 16 H100 (Megatron-Bridge 25.09, token drop)", 10494,
        MB_PERF + ": 25.09 DGX-H100 'Qwen3_30B_a3B (tokendrop) | 16 | GBS 512 | MBS 2 | 4096 | FSDP 0 "
        "| TP 1 | PP 2 | CP 1 | VP 24 | EP 8 | GA 32 | 10494 | 241'. The 25.09 tables state no "
        "precision, but they are FP8: their footnote gives the parenthesised figures' FP8 "
        "quantization granularities 'for H100 system', and the same table's LLAMA3_8B row "
        "(14,079) matches 25.11's FP8-CS row (14,451), not a bf16 one. Token drop: a fixed "
        "capacity (factor 1 assumed) needs no host read of the split sizes",
        "qwen3-30b-a3b", _pipe(2, "interleaved_1f1b", 24, 1, 8, 32, 2, 4096) +
        ["train.activation_checkpointing=none", "moe.capacity_factor=1.0"], "h100-node", 2,
        "dedup", "none", Work(precision="fp8", p2p_overlap=True, head_loss="full"),
        modelled="fp8 GEMMs, interleaved p2p overlap, no host sync (fixed capacity)",
        not_modelled="the capacity factor (not published; 1.0 assumed, forced-balanced routing "
                     "drops almost nothing)"),
    Run("Qwen3-30B-A3B, 16 H800, PP2 EP8 (Pai-Megatron-Patch)", 128 * 8192 / (16 * 10.361),
        PAI_QWEN3 + ": 'tp=1, pp=2, ep=8 | 8192 | 128 | 16 | 10.361 | 6325' (SeqLen, "
        "GlobalBatchSize, GPUNum, TimePerIter s, Tokens/GPU/Second)",
        "qwen3-30b-a3b", _pipe(2, "1f1b", 1, 1, 8, 16, 1, 8192) + PAI_SETTINGS, "h800-2048", 2,
        "alltoall", "none", modelled="no host sync (fixed capacity)", not_modelled=PAI_UNSAID),
    Run("Qwen3-30B-A3B, 16 H800, PP4 EP4 (Pai-Megatron-Patch)", 256 * 8192 / (16 * 20.992),
        PAI_QWEN3 + ": 'tp=1, pp=4, ep=4 | 8192 | 256 | 16 | 20.992 | 6244'",
        "qwen3-30b-a3b", _pipe(4, "1f1b", 1, 1, 4, 64, 1, 8192) + PAI_SETTINGS, "h800-2048", 2,
        "alltoall", "none", modelled="no host sync (fixed capacity)", not_modelled=PAI_UNSAID),
    Run("Qwen3-235B-A22B, 256 H100 (Megatron-Bridge 26.02)", 1633,
        MB_PERF + ": 26.02 Qwen3_235B_a22B 'DGX-H100 | 256 | FP8 | GBS 8192 | MBS 1 | 4096 | FSDP 0 "
        "| TP 2 | PP 8 | CP 1 | VP 4 | EP 32 | 1633 | 242'; moe_a2a_overlap=True, alltoall "
        "dispatcher from scripts/performance/configs/qwen/qwen3_workload_base_configs.py "
        "(QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_FP8_CS_V2)",
        "qwen3-30b-a3b", QWEN3_235B + _pipe(8, "interleaved_1f1b", 4, 1, 32, 512, 1, 4096) +
        ["train.activation_checkpointing=none"], "field-report", 32, "alltoall", "full",
        Work(precision="fp8", tp=2, p2p_overlap=True, head_loss="full"),
        modelled="fp8 GEMMs, TP2 + sequence parallel, EP all-to-all overlap, interleaved p2p overlap"),
    Run("GPT-OSS-120B, 64 H100 (Megatron-Bridge 26.02)", 5993,
        MB_PERF + ": 26.02 GPT OSS 120B 'DGX-H100 | 64 | BF16 | GBS 1280 | MBS 1 | 4096 | FSDP 0 | "
        "TP 1 | PP 4 | CP 1 | VP n/a | EP 8 | 5993 | 163'; recompute_modules ['layernorm', "
        "'moe_act'] from " + GPT_OSS_CONFIGS + " (GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V2: PP 4, "
        "GBS 1280, as the table)",
        "qwen3-30b-a3b", GPT_OSS_120B + _pipe(4, "1f1b", 1, 2, 8, 80, 1, 4096) +
        ["train.activation_checkpointing=none"], "h100-64", 8, "alltoall", "none",
        Work(recompute_modules=NORM_ACT, head_loss="full"),
        modelled="light recompute (layernorm, moe_act)",
        not_modelled="sliding-window attention on half the layers (128 tokens: full causal "
                     "attention is charged, since whether Transformer Engine ran the sinks' "
                     "attention fused, skipping the tiles outside the window, or unfused is not "
                     "published: NVIDIA/TransformerEngine#2318), attention sinks, biases"),
    Run("Qwen3-235B-A22B, 256 H100, EP32 PP8 (MoE-ModelZoo)", mz_tokens(19.7),
        MZ_QWEN3 + ": '235B | DeepEP | H100 | BF16 | 256 | 4096 | 2 | 1 | 32 | 8 | 1 | 1 | 4 | 16 | "
        "/ | 1 | 2048 | 128 | norm, act | 19.7 | 245' (the 'Cross-node EP strategy' rows)",
        "qwen3-30b-a3b", QWEN3_235B + _pipe(8, "interleaved_1f1b", 4, 1, 32, 128, 1, 4096) +
        ["train.activation_checkpointing=none"], "field-report", 32, "hierarchical", "none",
        Work(tp=2, recompute_modules=NORM_ACT, p2p_overlap=True, head_loss="full"),
        modelled="TP2 + sequence parallel, light recompute (layernorm, moe_act), DeepEP as the "
                 "hierarchical dispatcher", not_modelled=MZ_UNSAID),
    Run("Qwen3-235B-A22B, 256 H100, EP32 PP8 overlap (MoE-ModelZoo)",
        mz_tokens(17.6),
        MZ_QWEN3 + ": '235B | DeepEP | H100 | BF16 | 256 | 4096 | 2 | 1 | 32 | 8 | 1 | 1 | 4 | 16 | "
        "/ | 1 | 2048 | 128 | norm, act | 17.6 | 276 | | | +1f1b overlap'; DeepEP's SMs: "
        "'--moe-deepep-num-sms ... (default 20)' (Megatron-Bridge's dispatcher tuning guide)",
        "qwen3-30b-a3b", QWEN3_235B + _pipe(8, "interleaved_1f1b", 4, 1, 32, 128, 1, 4096) +
        ["train.activation_checkpointing=none"], "field-report", 32, "hierarchical", "full",
        Work(tp=2, recompute_modules=NORM_ACT, p2p_overlap=True, comm_sms=20, head_loss="full"),
        modelled="TP2 + sequence parallel, light recompute, the 1F1B EP overlap as paired "
                 "micro-batches with DeepEP's 20 SMs taken from compute",
        not_modelled=MZ_UNSAID),
    Run("Qwen3-235B-A22B, 256 H100, EP8 FSDP (MoE-ModelZoo)", mz_tokens(17.6),
        MZ_QWEN3 + ": '235B | DeepEP | H100 | BF16 | 256 | 4096 | 2 | 1 | 8 | 1 | 32 | 1 | 1 | 128 | "
        "On | 4 | 2048 | 4 | full | 17.6 | 276' (the 'Intra-node EP strategy' rows)",
        "qwen3-30b-a3b", QWEN3_235B + _fsdp(256, 8, 4, 4, 3, "full"), "field-report", 32,
        "dedup", "none", Work(tp=2, head_loss="full"),
        modelled="TP2 + sequence parallel, Megatron's FSDP as ZeRO-3, full recompute, DeepEP "
                 "inside a node as the dedup dispatcher", not_modelled=MZ_UNSAID),
    Run("Qwen3-235B-A22B, 256 H100, TP4 EP8 PP8 (MoE-ModelZoo)", mz_tokens(29.0),
        MZ_QWEN3 + ": '235B | DeepEP | H100 | BF16 | 256 | 4096 | 4 | 1 | 8 | 8 | 4 | 1 | 4 | 8 | / | "
        "1 | 2048 | 256 | | 29.0 | 167'",
        "qwen3-30b-a3b", QWEN3_235B + _pipe(8, "interleaved_1f1b", 4, 4, 8, 256, 1, 4096) +
        ["train.activation_checkpointing=none"], "field-report", 32, "dedup", "none",
        Work(tp=4, recompute_modules=(), p2p_overlap=True, head_loss="full"),
        modelled="TP4 + sequence parallel, DeepEP inside a node as the dedup dispatcher",
        not_modelled=MZ_UNSAID),
    # Megatron-Bridge on Blackwell (presets b200-node, gb200-nvl72)
    Run("Qwen3-30B-A3B, 8 GB200 (Megatron-Bridge 26.02)", 26084,
        MB_PERF + ": 26.02 Qwen3_30B_a3B 'DGX-GB200 | 8 | MXFP8 | 512 | 4 | 4096 | 0 | 1 | 1 | 1 | "
        "n/a | 8 | 26084 | 600'; moe_flex_dispatcher_backend 'hybridep', cuda_graph_scope "
        "['attn', 'moe_router', 'moe_preprocess'], MBS 4 from " + QWEN3_CONFIGS +
        " (QWEN3_30B_A3B_PRETRAIN_CONFIG_GB200_FP8_CS_V1)",
        "qwen3-30b-a3b", _pipe(1, "1f1b", 1, 1, 8, 16, 4, 4096) +
        ["train.activation_checkpointing=none"], "gb200-nvl72", 1, "dedup", "none",
        Work(precision="fp8", head_loss="full"), cluster_set=nvl(8),
        modelled="fp8 GEMMs (MXFP8 at the fp8 rate), HybridEP as the dedup dispatcher",
        not_modelled="CUDA graphs of the attention, router and dispatch preprocessing (what "
                     "they save is host time, which the step model charges only after a host "
                     "sync, 0 here)"),
    Run("Qwen3-30B-A3B, 8 B200 (Megatron-Bridge 26.02)", 9691,
        MB_PERF + ": 26.02 Qwen3_30B_a3B 'DGX-B200 | 8 | MXFP8 | 512 | 1 | 4096 | 0 | 1 | 1 | 1 | "
        "n/a | 8 | 9691 | 223'",
        "qwen3-30b-a3b", _pipe(1, "1f1b", 1, 1, 8, 64, 1, 4096) +
        ["train.activation_checkpointing=none"], "b200-node", 1, "alltoall", "none",
        Work(precision="fp8", head_loss="full"), modelled="fp8 GEMMs (MXFP8 at the fp8 rate)",
        not_modelled=B200_UNSAID),
    Run("Qwen3-30B-A3B, 8 B200 (Megatron-Bridge 25.09, token drop)", 18066,
        MB_PERF + ": 25.09 DGX-B200 'Qwen3_30B_a3B (tokendrop) | 8 | 512 | 1 | 4096 | 0 | 1 | 1 | 1 "
        "| 1 | 8 | 64 | 18066 | 416'; the 25.09 tables state no precision: fp8 as their H100 "
        "rows (see the 25.09 H100 row)",
        "qwen3-30b-a3b", _pipe(1, "1f1b", 1, 1, 8, 64, 1, 4096) +
        ["train.activation_checkpointing=none", "moe.capacity_factor=1.0"], "b200-node", 1,
        "alltoall", "none", Work(precision="fp8", head_loss="full"),
        modelled="fp8 GEMMs, no host sync (fixed capacity)",
        not_modelled="the capacity factor (1.0 assumed); the dispatcher (all-to-all assumed)"),
    Run("GPT-OSS-120B, 64 GB200 (Megatron-Bridge 26.02)", 15784,
        MB_PERF + ": 26.02 GPT OSS 120B 'DGX-GB200 | 64 | BF16 | 1280 | 4 | 4096 | 0 | 1 | 1 | 1 | "
        "n/a | 64 | 15784 | 428'; recompute_modules ['layernorm', 'moe_act'], moe_a2a_overlap "
        "True from " + GPT_OSS_CONFIGS + " (GPT_OSS_120B_PRETRAIN_CONFIG_GB200_BF16_V2: EP 64, "
        "MBS 4, GBS 1280, as the table)",
        "qwen3-30b-a3b", GPT_OSS_120B + _pipe(1, "1f1b", 1, 1, 64, 5, 4, 4096) +
        ["train.activation_checkpointing=none"], "gb200-nvl72", 1, "alltoall", "full",
        Work(recompute_modules=NORM_ACT, head_loss="full"), cluster_set=nvl(64),
        modelled="light recompute (layernorm, moe_act), EP all-to-all overlap (paired micro-"
                 "batches)",
        not_modelled="sliding-window attention on half the layers (full causal attention "
                     "charged, as in the H100 row), attention sinks, biases"),
    # NVIDIA's PyTorch-native trainer, bf16, forced-balanced routing (AM_PERF)
    Run("DeepSeek-V3, 1,024 H100 (NeMo AutoModel, PyTorch)", 865,
        AM_PERF + ": 'DeepSeek V3 671B | 1024 | 8192 | 1 | 8 | 4 | 4096 | 1 | 4 | 1 | 64 | 8 | "
        "256 | TE + DeepEP | 37.87 | 216 | 865'; " + AM_CONFIGS + "deepseek_v3_te_deepep_1024.yaml "
        "(commit 037e04a6): interleaved1f1b, pp_microbatch_size 1, activation_checkpointing: "
        "true (every block wrapped whole), reshard_after_forward: false, attn te, "
        "enable_deepep, torch.optim.Adam; its layers_per_stage 4 (VP 4) differs from the "
        "table's VP 8, which is used",
        "deepseek-v3", _fsdp(256, 64, 1, 8, 1, "full", 4, 8), "field-report", 128,
        "hierarchical", "none", Work(head_loss="full", mtp_depth=0),
        modelled="FSDP2 under torch's interleaved 1F1B, full recomputation, DeepEP as the "
                 "hierarchical dispatcher",
        not_modelled="a step is 4 pipeline passes of 8 micro-batches (GA 4): one pass is "
                     "simulated (the same bubble a pass; the optimizer charged once a pass); "
                     + AM_NOT_MODELLED),
    Run("DeepSeek-V3, 256 H100 (NeMo AutoModel, PyTorch)", 1002,
        AM_PERF + ": 'DeepSeek V3 671B | 256 | 512 | 1 | 8 | 1 | 4096 | 1 | 4 | 1 | 64 | 8 | 64 | "
        "TE + DeepEP | 8.18 | 250 | 1,002'; " + AM_CONFIGS + "deepseek_v3_te_deepep.yaml (commit "
        "037e04a6): interleaved1f1b, pp_microbatch_size 1, layers_per_stage 2, "
        "activation_checkpointing: true, reshard_after_forward: false, attn te, enable_deepep, "
        "torch.optim.Adam",
        "deepseek-v3", _fsdp(64, 64, 1, 8, 1, "full", 4, 8), "field-report", 32,
        "hierarchical", "none", Work(head_loss="full", mtp_depth=0),
        modelled="FSDP2 under torch's interleaved 1F1B, full recomputation, DeepEP as the "
                 "hierarchical dispatcher", not_modelled=AM_NOT_MODELLED),
    Run("Kimi K2, 256 H100 (NeMo AutoModel, PyTorch)", 924,
        AM_PERF + ": 'Kimi K2 | 256 | 512 | 1 | 8 | 2 | 4096 | 1 | 8 | 1 | 32 | 4 | 32 | TE + "
        "DeepEP | 8.86 | 189 | 924'; " + AM_CONFIGS + "kimi_k2_te_deepep.yaml (commit 080dca53): "
        "pp_size 8, ep_size 32, interleaved1f1b, pp_microbatch_size 1, activation_checkpointing: "
        "true, attn te, experts gmm, dispatcher deepep, torch.optim.Adam; the model from the "
        "moonshotai/Kimi-K2 model card (61 layers, 1 dense, hidden 7168, 384 experts of 2048, "
        "8 selected + 1 shared, 64 heads, MLA, vocabulary 160K)",
        "deepseek-v3", KIMI_K2 + _fsdp(32, 32, 1, 8, 1, "full", 8, 4), "field-report", 32,
        "hierarchical", "none", Work(head_loss="full", mtp_depth=0),
        modelled="FSDP2 under torch's interleaved 1F1B, full recomputation, DeepEP as the "
                 "hierarchical dispatcher",
        not_modelled="a step is 2 pipeline passes of 8 micro-batches (GA 2): one is simulated; "
                     + AM_NOT_MODELLED),
    Run("Qwen3-30B-A3B, 8 H100 (NeMo AutoModel, PyTorch)", 12040,
        AM_PERF + ": 'Qwen3 MoE 30B | 8 | 512 | 4 | 4 | 16 | 4096 | 1 | 1 | 1 | 8 | - | 8 | TE + "
        "DeepEP | 21.773 | 277 | 12,040'; " + AM_CONFIGS + "qwen3_moe_30b_te_deepep.yaml (commit "
        "092af93e): ep_size 8, activation_checkpointing: true, reshard_after_forward not set "
        "(parallelize_model's default false), attn te, enable_deepep, torch.optim.Adam",
        "qwen3-30b-a3b", _fsdp(8, 8, 4, 16, 2, "full"), "h100-node", 1, "dedup", "none",
        Work(head_loss="full"),
        modelled="FSDP2 (weights kept gathered from forward to backward: ZeRO-2), full "
                 "recomputation, DeepEP's intranode kernels as the dedup dispatcher",
        not_modelled=AM_NOT_MODELLED),
    Run("GPT-OSS-20B, 8 H100 (NeMo AutoModel, PyTorch)", 13058,
        AM_PERF + ": 'GPT-OSS 20B | 8 | 256 | 2 | 2 | 16 | 4096 | 1 | 1 | 1 | - | - | 8 | TE + "
        "DeepEP + FlexAttn | 10.04 | 279 | 13,058'; " + AM_CONFIGS + "gptoss_20b_te_deepep.yaml "
        "(commit 037e04a6): ep_size 8 (the table prints '-'), activation_checkpointing: false, "
        "attn flex, enable_deepep, torch.optim.Adam; the model: " + GPT_OSS_SOURCE,
        "qwen3-30b-a3b", GPT_OSS_20B + _fsdp(8, 8, 2, 16, 2, "none"), "h100-node", 1, "dedup",
        "none", Work(head_loss="full", **GPT_OSS_FLEX),
        modelled="FSDP2 (ZeRO-2), FlexAttention's rates at head dim 64, the 128-token window "
                 "on half the layers by the tiles it computes, DeepEP's intranode kernels as "
                 "dedup",
        not_modelled="attention sinks, the experts' biases and clamped SwiGLU; "
                     + AM_NOT_MODELLED),
    Run("GPT-OSS-120B, 64 H100 (NeMo AutoModel, PyTorch)", 7626,
        AM_PERF + ": 'GPT-OSS 120B | 64 | 512 | 2 | 2 | 4 | 4096 | 1 | 1 | 1 | - | - | 64 | TE + "
        "DeepEP + FlexAttn | 4.30 | 231 | 7,626'; " + AM_CONFIGS + "gptoss_120b_te_deepep.yaml "
        "(commit 037e04a6): num_nodes 8, ep_size 64 (the table prints '-'), "
        "activation_checkpointing: false, reshard_after_forward: true, attn flex, "
        "enable_deepep, torch.optim.Adam; the model: " + GPT_OSS_SOURCE,
        "qwen3-30b-a3b", GPT_OSS_120B + _fsdp(64, 64, 2, 4, 3, "none"), "h100-64", 8,
        "hierarchical", "none", Work(head_loss="full", **GPT_OSS_FLEX),
        modelled="FSDP2 (ZeRO-3: reshard after forward), FlexAttention's rates at head dim 64, the 128-token "
                 "window on half the layers by the tiles it computes, DeepEP across 8 nodes "
                 "as the hierarchical dispatcher",
        not_modelled="attention sinks, the experts' biases and clamped SwiGLU; "
                     + AM_NOT_MODELLED),
]

# Published grouped-GEMM rates against the step model's (a check of the shape model on the
# expert GEMMs alone): DeepGEMM's README (deepseek-ai/DeepGEMM, February 2025), table
# "Grouped GEMMs for MoE models (contiguous layout)", FP8 with 128-wide block scaling on
# H800: (groups, m per group, n, k, TFLOPS); DeepSeek-V3's own expert shapes.
DEEPGEMM_GROUPED = [(4, 8192, 4096, 7168, 1297), (4, 8192, 7168, 2048, 1099),
                    (8, 4096, 4096, 7168, 1288), (8, 4096, 7168, 2048, 1093)]


def print_gemm_check() -> None:
    """The step model's grouped fp8 GEMM rate at DeepGEMM's published shapes."""
    cluster = load_cluster("h800-2048")
    print("DeepGEMM grouped fp8 GEMMs on H800 (README table) against the step model:")
    print(f"{'groups':>6s} {'m/group':>8s} {'n':>6s} {'k':>6s} {'published':>10s} {'model':>7s} {'ratio':>6s}")
    for g, m, n, k, tflops in DEEPGEMM_GROUPED:
        model = expert_gemm_tflops(cluster, g, m, n, k, "fp8")
        print(f"{g:6d} {m:8d} {n:6d} {k:6d} {tflops:10d} {model:7.0f} {model / tflops:6.2f}")


NOT_FOUND = [
    "Mixtral 8x22B: Megatron-Core's README gives its layout (128 GPUs, TP4 EP2 PP8 VP7) but no "
    "throughput figure.",
    "torchtitan: no published MoE throughput table was found in the stored corpus (docs, code); "
    "NeMo AutoModel's table (PyTorch-native: FSDP2, torch pipelining, DeepEP) is in instead.",
    "Megatron-MoE-ModelZoo's Qwen3-235B 'A2A' row (TP2 EP8 PP32 VPP3) is 96 pipeline stages for "
    "94 layers, a split our pipeline refuses.",
    "Megatron-Bridge 25.11 H100 Qwen3_235B row is malformed (GBS missing: '256 | FP8-CS | 1 | "
    "4096 | ...'), so the 26.02 row stands for it; the 25.11 GPT OSS 120B row (GA 2 < PP 4) is a "
    "layout our pipeline schedules refuse.",
]


def predict(run: Run, launch_us: float | None = None) -> dict:
    """The step model's prediction of one run (``launch_us``: the host's time per kernel
    launch instead of the default, to see how the documented 5-20 us range moves it)."""
    if launch_us is not None:
        run = dataclasses.replace(run, work=dataclasses.replace(run.work, launch_us=launch_us))
    cfg = load_recipe(run.recipe, run.overrides)
    cluster = dataclasses.replace(load_cluster(run.cluster), nodes=run.nodes, **run.cluster_set)
    r = simulate(cfg, cluster, RoutingSpec.parse("uniform"), strategies=("none",),
                 dispatchers=(run.dispatcher,), overlap=run.overlap, step_samples=2,
                 work=run.work)[0]
    return {"name": run.name, "gpus": cluster.world, "published": run.published,
            "predicted": r.tokens_per_s_per_gpu, "ratio": r.tokens_per_s_per_gpu / run.published,
            "step_s": r.step_time_s, "compute_s": r.compute_s, "expert_comm_s": r.expert_comm_s,
            "bubble_s": r.bubble_s, "p2p_s": r.p2p_s, "modelled": run.modelled,
            "not_modelled": run.not_modelled, "source": run.source,
            "precision": run.work.precision, "tp": run.work.tp, "breakdown": r.breakdown}


BREAKDOWN_COLUMNS = [  # (column, parts of SimResult.breakdown it sums)
    ("GEMM", ("gemm", "compute")), ("attn", ("attention",)), ("mem", ("memory",)),
    ("recomp", ("recompute", "expert_recompute")), ("TP", ("tp_comm",)),
    ("eGEMM", ("expert_gemm",)), ("emem", ("expert_memory",)), ("launch", ("launch", "overhead")),
    ("EPcomm", ("expert_comm",)), ("p2p", ("p2p",)), ("bubble", ("bubble",)),
    ("FSDP", ("fsdp_comm",)), ("DP", ("dp_comm",)), ("optim", ("optimizer",))]


def print_breakdown(rows: list[dict]) -> None:
    """Each run's predicted step by part, as shares of the step (SimResult.breakdown)."""
    print(f"{'run':58s} " + " ".join(f"{c:>6s}" for c, _ in BREAKDOWN_COLUMNS) + "  (% of step)")
    for r in rows:
        b, step = r["breakdown"], r["step_s"]
        known = {k for _, keys in BREAKDOWN_COLUMNS for k in keys}
        assert set(b) <= known, set(b) - known
        cells = [100 * sum(b.get(k, 0.0) for k in keys) / step for _, keys in BREAKDOWN_COLUMNS]
        print(f"{r['name']:58s} " + " ".join(f"{c:6.1f}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print each run's predicted step by part (GEMMs, attention, "
                         "memory-bound work, recomputation, expert GEMMs, exposed "
                         "communication, bubble, optimizer)")
    ap.add_argument("--gemm-check", action="store_true",
                    help="also print the step model's grouped fp8 GEMM rate against "
                         "DeepGEMM's published H800 figures")
    ap.add_argument("--launch-us", type=float, default=None,
                    help="the host's time to issue one kernel, microseconds (default: the "
                         "step model's, epscale.plan.shapes.HOST_LAUNCH_US)")
    args = ap.parse_args(argv)
    rows = [predict(run, args.launch_us) for run in RUNS]
    if args.markdown:
        print("| run | GPUs | published tok/s/GPU | predicted | predicted / published | "
              "modelled (not in the trainer) | not modelled |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['name']} | {r['gpus']} | {r['published']:,.0f} | {r['predicted']:,.0f} | "
                  f"{r['ratio']:.2f} | {r['modelled'] or '-'} | {r['not_modelled'] or '-'} |")
    else:
        print(f"{'run':58s} {'GPUs':>5s} {'published':>10s} {'predicted':>10s} {'ratio':>6s}  "
              f"{'step s':>7s} {'bubble':>7s} {'EP comm':>7s}")
        for r in rows:
            print(f"{r['name']:58s} {r['gpus']:5d} {r['published']:10,.0f} {r['predicted']:10,.0f} "
                  f"{r['ratio']:6.2f}  {r['step_s']:7.2f} {r['bubble_s'] / r['step_s']:7.1%} "
                  f"{r['expert_comm_s'] / r['step_s']:7.1%}")
    if args.breakdown:
        print()
        print_breakdown(rows)
    if args.gemm_check:
        print()
        print_gemm_check()
    print("\nsources:")
    for r in rows:
        print(f"- {r['name']}: {r['source']}")
    print("\nnot found:")
    for line in NOT_FOUND:
        print(f"- {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
