"""Sampling: greedy, temperature, top-k, top-p, with a per-request generator for seeded requests; the logit
adjustments (penalties, bias, the min_tokens mask) applied before it."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from engine.sequence import SamplingParams
from kv.device_tables import upload


class LogitsState:
    """A request's logit adjustments as ``[V]`` tensors on the device, only those its parameters use: the bias,
    the tokens min_tokens masks, its output token counts and its prompt's tokens (the repetition penalty)."""

    @torch.inference_mode(False)      # updated in place by steps in and out of inference mode: normal tensors
    def __init__(self, params: SamplingParams, prompt_token_ids: Sequence[int], vocab_size: int,
                 eos_token_ids: Collection[int], device: torch.device):
        self.params = params
        self.device = device
        self.bias = self.stop_mask = self.counts = self.prompt_mask = None
        self.counted_ahead = False      # the next ``add``'s tokens were counted on the device already
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
        """Count newly emitted output tokens (not again those ``count_ahead`` counted)."""
        if self.counted_ahead:
            self.counted_ahead = False
            return
        if self.counts is not None and tokens:
            ids = upload(tokens, torch.int64, self.device)
            self.counts.index_add_(0, ids, torch.ones(len(tokens), device=self.device))

    def count_ahead(self, tokens: torch.Tensor, weights: torch.Tensor) -> None:
        """Count a step's output ``tokens`` (``weights``: 1 for each token emitted, 0 for the rest of its row) on the
        device, before the host has read them, for the step launched from them; the host's ``add`` of those tokens
        is then skipped. The host appends every emitted token of a row that goes on (only a row that ends, whose
        counts are not needed again, appends fewer)."""
        if self.counts is not None:
            self.counts.index_add_(0, tokens, weights.to(self.counts.dtype))
            self.counted_ahead = True


@dataclass(frozen=True)
class LogitsBlock:
    """``num_rows`` consecutive logit rows of one request from ``start``: row k predicts the token after its
    ``num_output`` output tokens and ``drafts[:k]`` (a verification block; no drafts: one position, or a
    drafter's block whose drafts are not known yet). A block of a step launched ahead of the host may follow
    ``emitted_ahead`` more output tokens (a ``[]`` int64 tensor on the device: the launched step's tokens, which
    the host has not read yet); only the min_tokens mask reads the length."""

    state: LogitsState
    start: int
    num_rows: int
    num_output: int
    drafts: torch.Tensor | None = None       # [K] int64 on the device
    emitted_ahead: torch.Tensor | None = None


def adjust_logits(logits: torch.Tensor, blocks: Sequence[LogitsBlock]) -> torch.Tensor:
    """``logits`` [N, V] with the blocks' rows adjusted, out of place, in vLLM's order: bias, the min_tokens mask,
    then the repetition, frequency and presence penalties, with counts per row (drafts before it included)."""
    device = logits.device
    rows, owner, first, before = [], [], [], []
    draft_at, drafts = [], []      # the drafts stay on the device: where they go in ``prev``, and the tensors
    for b, block in enumerate(blocks):
        first.extend([len(rows)] * block.num_rows)
        # The token counted from row k + 1 on (row 0 adds none: it follows the output alone): draft k.
        if block.drafts is not None and block.num_rows > 1:
            counted = block.drafts[:block.num_rows - 1]
            draft_at.extend(range(len(rows) + 1, len(rows) + 1 + counted.shape[0]))
            drafts.append(counted)
        rows.extend(range(block.start, block.start + block.num_rows))
        owner.extend([b] * block.num_rows)
        before.extend(range(block.num_output, block.num_output + block.num_rows))
    rows_t, owner_t, first_t, before_t, prev_t = upload([rows, owner, first, before, [-1] * len(rows)], torch.int64,
                                                        device)
    if drafts:
        prev_t.index_copy_(0, upload(draft_at, torch.int64, device), torch.cat(drafts))
    x = logits.index_select(0, rows_t)                                    # [R, V]
    states = [block.state for block in blocks]

    def table(name: str, fill) -> torch.Tensor:
        """The blocks' ``[V]`` tensors ``name`` stacked, ``fill`` where a block has none, one row per logit row."""
        rows_of = [getattr(s, name) for s in states]
        like = next(t for t in rows_of if t is not None)
        blank = torch.full_like(like, fill)
        return torch.stack([blank if t is None else t for t in rows_of]).index_select(0, owner_t)

    def per_row(values: list[float]) -> torch.Tensor:
        return upload(values, x.dtype, device).index_select(0, owner_t)[:, None]

    if any(s.bias is not None for s in states):
        x = x + table("bias", 0.0)
    if any(s.stop_mask is not None for s in states):
        min_tokens = upload([s.params.min_tokens for s in states], torch.int64, device).index_select(0, owner_t)
        if any(b.emitted_ahead is not None for b in blocks):
            zero = torch.zeros((), dtype=torch.int64, device=device)
            emitted = torch.stack([zero if b.emitted_ahead is None else b.emitted_ahead for b in blocks])
            before_t = before_t + emitted.index_select(0, owner_t)
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


def probabilities(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor:
    """The distributions rows of ``logits`` [N, V] sample from, all rows at once: ``[N, V]`` float32. ``params``:
    one for every row, or one per row. Greedy rows are one-hot; the others are temperature-scaled, then cut to
    their top-k and top-p (one sort for all rows, and none when no row filters)."""
    rows = logits.shape[0]
    per_row = [params] * rows if isinstance(params, SamplingParams) else list(params)
    if len(per_row) != rows:
        raise ValueError(f"{len(per_row)} sampling parameters for {rows} logit rows")
    device, vocab = logits.device, logits.shape[-1]
    greedy = [p.greedy for p in per_row]
    x = logits.float() / upload([1.0 if g else p.temperature for g, p in zip(greedy, per_row)], torch.float32,
                                device)[:, None]
    top_k = [p.top_k if not g and p.top_k and p.top_k < vocab else vocab for g, p in zip(greedy, per_row)]
    top_p = [1.0 if g else p.top_p for g, p in zip(greedy, per_row)]
    if min(top_k) < vocab or min(top_p) < 1.0:
        ordered, order = x.sort(-1, descending=True)
        # Top-k keeps every token at least as likely as the k-th (ties stay in).
        kth = ordered.gather(1, upload(top_k, torch.int64, device)[:, None] - 1)
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
        # Top-p drops a token when the mass before it already reaches top_p (the first token always stays).
        mass = ordered.softmax(-1)
        drop = (mass.cumsum(-1) - mass) >= upload(top_p, torch.float32, device)[:, None]
        x = torch.full_like(x, float("-inf")).scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1)
    if any(greedy):
        one_hot = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
        probs = torch.where(upload(greedy, torch.bool, device)[:, None], one_hot, probs)
    return probs


def _noise(shape: Sequence[int], generators: Sequence[torch.Generator | None], device: torch.device,
           fill) -> torch.Tensor:
    """A tensor of ``shape`` [R, ...] filled by ``fill(tensor, generator)``: block r from ``generators[r]`` when it
    has one (a seeded request), the others in one draw from the default generator."""
    out = torch.empty(shape, device=device)
    seeded = [r for r, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        fill(out, None)
    for r in seeded:
        fill(out[r], generators[r])
    return out


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """A token per distribution of ``probs`` [R, ..., V] (block r belongs to the request of ``generators[r]``), on
    the device and without a host sync: the exponential race argmax(p / E), E ~ Exp(1), which draws token t with
    probability p[t]. A seeded request's generator lives on the device: its draws repeat on one kind of device."""
    noise = _noise(probs.shape, generators, probs.device, lambda t, g: t.exponential_(generator=g))
    return probs.div(noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(-1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``logits`` [B, V], on the device (greedy rows take the argmax)."""
    return draw(probabilities(logits, params), generators)


def rejection_sample(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                     generators: Sequence[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for R requests of K drafts each, batched on the device.

    ``drafts`` [R, K] were drawn from the drafter's ``q`` [R, K, V]; ``p`` [R, K+1, V] is the target's distribution
    after the anchor and each draft. Draft k is accepted with probability min(1, p(x) / q(x)) while every draft
    before it was; at the first rejection a token is drawn from normalise(max(p - q, 0)) there, and after K
    acceptances from p[K]. The output follows p exactly. Returns ``(tokens [R, K+1], num_accepted [R])``: request r
    emits ``tokens[r, :num_accepted[r] + 1]``.
    """
    num_rows, k = drafts.shape
    device = p.device
    uniform = _noise((num_rows, k), generators, device, lambda t, g: t.uniform_(generator=g))
    index = drafts[..., None]
    p_x, q_x = p[:, :k].gather(2, index).squeeze(-1), q.float().gather(2, index).squeeze(-1)
    accepted = (q_x > 0) & (uniform * q_x < p_x)
    num_accepted = accepted.long().cumprod(1).sum(1)
    rows = torch.arange(num_rows, device=device)
    p_at = p[rows, num_accepted]                                          # [R, V]
    q_at = q.float()[rows, num_accepted.clamp_max(k - 1)] * (num_accepted < k)[:, None]   # 0 after K acceptances
    residual = (p_at - q_at).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    # p == q on the support leaves an empty residual; drawing from p is exact then.
    last = draw(torch.where(total > 0, residual / total.clamp_min(torch.finfo(total.dtype).tiny), p_at), generators)
    tokens = torch.cat([drafts, drafts.new_zeros(num_rows, 1)], 1).scatter(1, num_accepted[:, None], last[:, None])
    return tokens, num_accepted


def accept_greedy(drafts: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of R rows of K drafts on the device: the drafts that match the target's argmax, then the
    target's next token (the bonus). ``target_ids[r, k]`` is the argmax after the anchor and the first k drafts
    (K + 1 of them), so draft k is accepted while every ``drafts[r, j] == target_ids[r, j]`` for j <= k. Returns
    ``(tokens [R, K+1], num_accepted [R])`` as ``rejection_sample`` does."""
    num_accepted = (drafts == target_ids[:, :-1]).long().cumprod(1).sum(1)
    bonus = target_ids.gather(1, num_accepted[:, None])
    tokens = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], 1).scatter(1, num_accepted[:, None], bonus)
    return tokens, num_accepted
