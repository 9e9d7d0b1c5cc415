"""Sampling: greedy, temperature, top-k, top-p, with a per-request generator for seeded requests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sequence import SamplingParams


def _filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits of one distribution with everything outside top-k / top-p set to -inf."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: ``[..., V]`` float32 (one-hot for greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return _filter_logits(logits, params).softmax(-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` [N, V], drawn with ``generator`` (on CPU for reproducibility)."""
    if generator is None:
        return torch.multinomial(probs, 1).squeeze(-1)
    draws = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1)
    return draws.to(probs.device)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token for each row of ``logits`` [B, V]; greedy rows in one argmax."""
    out = logits.argmax(-1).tolist()
    for i, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            out[i] = int(sample_from(probabilities(logits[i:i + 1], p), g)[0])
    return out
