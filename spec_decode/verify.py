"""Acceptance rules: greedy exact match, and rejection sampling that keeps the target's distribution."""

from __future__ import annotations

import torch

from engine.sampler import accept_greedy, probabilities, sample_from
from engine.sequence import SamplingParams


def verify_greedy(drafts: list[int], target_logits: torch.Tensor) -> list[int]:
    """Accept the drafts that match the target's argmax, then add the target's next token (the bonus).
    (The engine verifies greedy rows of a whole step itself, from one argmax: ``engine.sampler.accept_greedy``.)"""
    return accept_greedy(drafts, target_logits.argmax(-1).tolist())


def verify_sampling(drafts: list[int], draft_probs: torch.Tensor, target_logits: torch.Tensor,
                    params: SamplingParams, generator: torch.Generator | None) -> list[int]:
    """Speculative sampling: accept draft k with probability min(1, p_k(x) / q_k(x)); on the first
    rejection sample from normalise(max(p_k - q_k, 0)); if all pass, sample the bonus from p_K."""
    p = probabilities(target_logits, params).cpu()         # [K+1, V]
    q = draft_probs.float().cpu()                          # [K, V]
    uniform = torch.rand(len(drafts), generator=generator)
    for k, token in enumerate(drafts):
        p_x, q_x = float(p[k, token]), float(q[k, token])
        if q_x > 0 and uniform[k].item() * q_x < p_x:
            continue
        residual = (p[k] - q[k]).clamp_min(0)
        total = float(residual.sum())
        # p == q on the support gives an empty residual; then sampling from p is exact.
        dist = residual / total if total > 0 else p[k]
        return drafts[:k] + [int(sample_from(dist.unsqueeze(0), generator)[0])]
    return drafts + [int(sample_from(p[len(drafts)].unsqueeze(0), generator)[0])]
