"""Router auxiliary losses: Switch/GShard balance loss (over the micro-batch, or over the
global batch of every rank), DeepSeek sequence-wise balance loss, ST-MoE z-loss, and
routing statistics.

Legend: T tokens, E experts, K top-k, B sequences, S tokens per sequence.
"""

from __future__ import annotations

import torch

import torch.distributed as dist

from ..ops import count_ids


def _normalized(scores_TE: torch.Tensor) -> torch.Tensor:
    # Sigmoid scores do not sum to one; balance losses use them renormalised per token.
    return scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)


def load_balance_loss(scores_TE: torch.Tensor, chosen_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch/GShard loss: E * sum_e f_e * P_e, with f_e the fraction of the T*K assignments
    that chose expert e and P_e the mean (normalised) score of e. Equals 1 when uniform."""
    T, K = chosen_TK.shape
    counts_E = count_ids(chosen_TK, num_experts).to(scores_TE.dtype)
    f_E = counts_E / max(T * K, 1)
    p_E = _normalized(scores_TE).mean(dim=0)
    return num_experts * (f_E * p_E).sum()


def sequence_balance_loss(scores_TE: torch.Tensor, chosen_TK: torch.Tensor, num_experts: int,
                          num_sequences: int) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise loss, averaged over sequences: sum_e f_e * P_e with
    f_e = E/(K*S) * count of e in the sequence and P_e the sequence's mean normalised score."""
    T, K = chosen_TK.shape
    B = num_sequences
    S = T // B
    onehot = torch.zeros(B, S * K, num_experts, dtype=scores_TE.dtype, device=scores_TE.device)
    counts_BE = onehot.scatter_(2, chosen_TK.view(B, S * K, 1), 1.0).sum(dim=1)
    f_BE = counts_BE * (num_experts / (K * S))
    p_BE = _normalized(scores_TE).view(B, S, num_experts).mean(dim=1)
    return (f_BE * p_BE).sum(dim=-1).mean()


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def router_entropy(scores_TE: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the entropy (nats) of the normalised router distribution."""
    p = _normalized(scores_TE.detach())
    return -(p * torch.log(p.clamp_min(1e-20))).sum(dim=-1).mean()


def global_batch_balance_loss(scores_TE: torch.Tensor, chosen_TK: torch.Tensor,
                              num_experts: int, group=None) -> torch.Tensor:
    """Switch/GShard balance loss with the expert fractions f_e taken over the whole group's
    batch (Qwen's global-batch balancing): ``E * sum_e f_e^group * P_e``.

    scores_TE: fp32 router scores of this rank's tokens (differentiable).
    chosen_TK: int64 chosen experts before capacity drops.
    group: the process group whose batches form the global batch: every rank that trains
        on different tokens (the world for dp x ep, the default). One all-reduce of E+1
        numbers; differentiable through P_e only (f_e is a count).
    Averaged over the group's ranks (as the gradient sync does), the loss equals the
    Switch loss of the concatenated batch when every rank has the same number of tokens.
    """
    T, K = chosen_TK.shape
    counts = count_ids(chosen_TK, num_experts).to(torch.float64)
    buf = torch.cat([counts, counts.new_full((1,), float(T * K))])  # no host-to-device copy
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(buf, group=group)
    f_E = (buf[:num_experts] / buf[num_experts].clamp_min(1.0)).to(scores_TE.dtype)
    if T == 0:
        return scores_TE.sum() * 0.0
    p_E = _normalized(scores_TE).mean(dim=0)
    return num_experts * (f_E * p_E).sum()
