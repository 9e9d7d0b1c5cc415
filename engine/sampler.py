"""Sampling: greedy, temperature, top-k, top-p, with a per-request generator for seeded requests; the logit
adjustments (penalties, bias, the min_tokens mask) applied before it, and the logprobs reported with it."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from engine.sequence import SamplingParams, TokenLogprob


class LogitsState:
    """A request's logit adjustments as ``[V]`` tensors on the device, only those its parameters use: the bias,
    the tokens min_tokens masks, its output token counts and its prompt's tokens (the repetition penalty)."""

    def __init__(self, params: SamplingParams, prompt_token_ids: Sequence[int], vocab_size: int,
                 eos_token_ids: Collection[int], device: torch.device):
        self.params = params
        self.device = device
        self.bias = self.stop_mask = self.counts = self.prompt_mask = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self.bias = torch.zeros(vocab_size, device=device)
            self.bias[torch.tensor(ids, device=device)] = torch.tensor(values, device=device)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        if params.min_tokens and stops:
            self.stop_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.stop_mask[torch.tensor(sorted(stops), device=device)] = True
        if params.penalised:
            self.counts = torch.zeros(vocab_size, device=device)
        if params.repetition_penalty != 1.0:
            self.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.prompt_mask[torch.tensor(list(prompt_token_ids), device=device)] = True

    @classmethod
    def for_request(cls, params: SamplingParams, prompt_token_ids: Sequence[int], vocab_size: int,
                    eos_token_ids: Collection[int], device: torch.device) -> "LogitsState | None":
        """The state, or None when the parameters change no logit (the plain path does no extra work)."""
        state = cls(params, prompt_token_ids, vocab_size, eos_token_ids, device)
        if state.bias is None and state.stop_mask is None and state.counts is None:
            return None
        return state

    def add(self, tokens: Sequence[int]) -> None:
        """Count newly emitted output tokens."""
        if self.counts is not None and tokens:
            ids = torch.tensor(tokens, device=self.device)
            self.counts.index_add_(0, ids, torch.ones(len(tokens), device=self.device))


@dataclass(frozen=True)
class LogitsBlock:
    """``num_rows`` consecutive logit rows of one request from ``start``: row k predicts the token after its
    ``num_output`` output tokens and ``drafts[:k]`` (a verification block; no drafts: one position, or a
    drafter's block whose drafts are not known yet)."""

    state: LogitsState
    start: int
    num_rows: int
    num_output: int
    drafts: Sequence[int] = ()


def adjust_logits(logits: torch.Tensor, blocks: Sequence[LogitsBlock]) -> torch.Tensor:
    """``logits`` [N, V] with the blocks' rows adjusted, out of place, in vLLM's order: bias, the min_tokens mask,
    then the repetition, frequency and presence penalties, with counts per row (drafts before it included)."""
    device = logits.device
    rows, owner, first, before, prev = [], [], [], [], []
    for b, block in enumerate(blocks):
        drafts = list(block.drafts[:block.num_rows - 1])
        first.extend([len(rows)] * block.num_rows)
        rows.extend(range(block.start, block.start + block.num_rows))
        owner.extend([b] * block.num_rows)
        before.extend(range(block.num_output, block.num_output + block.num_rows))
        # The token counted from row k + 1 on (row 0 adds none: it follows the output alone).
        prev.extend([-1] + drafts + [-1] * (block.num_rows - 1 - len(drafts)))
    rows_t, owner_t, first_t, before_t, prev_t = torch.tensor([rows, owner, first, before, prev], device=device)
    x = logits.index_select(0, rows_t)                                    # [R, V]
    states = [block.state for block in blocks]

    def table(name: str, fill) -> torch.Tensor:
        """The blocks' ``[V]`` tensors ``name`` stacked, ``fill`` where a block has none, one row per logit row."""
        rows_of = [getattr(s, name) for s in states]
        like = next(t for t in rows_of if t is not None)
        blank = torch.full_like(like, fill)
        return torch.stack([blank if t is None else t for t in rows_of]).index_select(0, owner_t)

    def per_row(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, device=device, dtype=x.dtype).index_select(0, owner_t)[:, None]

    if any(s.bias is not None for s in states):
        x = x + table("bias", 0.0)
    if any(s.stop_mask is not None for s in states):
        min_tokens = torch.tensor([s.params.min_tokens for s in states], device=device).index_select(0, owner_t)
        x = x.masked_fill(table("stop_mask", False) & (before_t < min_tokens)[:, None], float("-inf"))
    if any(s.counts is not None for s in states):
        # Counts before row k = the output's counts + drafts[:k]: a cumulative one-hot over the flat rows,
        # less its value at the block's first row (whose own one-hot is empty).
        onehot = torch.zeros_like(x).scatter_(1, prev_t.clamp_min(0)[:, None], (prev_t >= 0).to(x.dtype)[:, None])
        cum = onehot.cumsum(0)
        counts = table("counts", 0.0) + cum - cum.index_select(0, first_t)
        seen = counts > 0
        if any(s.prompt_mask is not None for s in states):
            rep = per_row([s.params.repetition_penalty for s in states])
            penalise = seen | table("prompt_mask", False)
            x = torch.where(penalise, torch.where(x > 0, x / rep, x * rep), x)
        x = x - per_row([s.params.frequency_penalty for s in states]) * counts \
            - per_row([s.params.presence_penalty for s in states]) * seen.to(x.dtype)
    return logits.index_copy(0, rows_t, x)


def token_logprobs(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int],
                   num_top: Sequence[int]) -> list[TokenLogprob]:
    """``tokens[i]``'s log-probability under row ``rows[i]`` of raw ``logits`` and that row's ``num_top[i]`` best
    tokens, all rows in one batch (two copies to the host, whatever the number of rows)."""
    device = logits.device
    logprobs = logits.index_select(0, torch.tensor(rows, device=device)).float().log_softmax(-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=device)[:, None])
    top_values, top_ids = logprobs.topk(max(num_top), dim=-1)
    values = torch.cat([chosen, top_values], 1).tolist()
    ids = top_ids.tolist()
    return [TokenLogprob(token, v[0], tuple(zip(i[:n], v[1:n + 1])))
            for token, v, i, n in zip(tokens, values, ids, num_top)]


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
           generators: Sequence[torch.Generator | None], greedy_ids: Sequence[int] | None = None) -> list[int]:
    """One token for each row of ``logits`` [B, V]; greedy rows in one argmax (``greedy_ids``: that argmax,
    already on the host)."""
    out = list(greedy_ids) if greedy_ids is not None else logits.argmax(-1).tolist()
    for i, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            out[i] = int(sample_from(probabilities(logits[i:i + 1], p), g)[0])
    return out


def accept_greedy(drafts: Sequence[int], target_ids: Sequence[int]) -> list[int]:
    """Greedy verification: the drafts that match the target's argmax, then the target's next token (the bonus).

    ``target_ids[k]`` is the target's argmax after the anchor and the first k drafts (``len(drafts) + 1`` of them),
    so draft k is accepted while ``drafts[k] == target_ids[k]``.
    """
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_ids[accepted]:
        accepted += 1
    return list(drafts[:accepted]) + [target_ids[accepted]]
