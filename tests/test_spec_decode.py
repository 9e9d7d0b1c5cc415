"""DFlash speculative decoding on tiny random checkpoints: lossless output, drafter math, layout, headroom."""

import json
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.checkpoint import CheckpointError
from engine.llm_engine import Proposal
from kv import LayerOwner
from kv.layout import LayoutConfig, decide_layout
from spec_decode import LLM, dflash
from spec_decode.drafter import DFlashConfig, DFlashDrafter, checkpoint_shapes
from tests import checkpoints

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 42)), [5] * 16, [100], list(range(60, 68))]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return checkpoints.write_tiny_drafter(tmp_path_factory.mktemp("drafter"), num_layers=2, block_size=4)


@pytest.fixture(scope="module")
def reference(tiny_target):
    """Target-only greedy outputs: the truth every speculative run must reproduce."""
    llm = LLM(tiny_target, page_size=16)
    return {tuple(p): o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY))}


class OracleDrafts:
    """Replaces the drafter's tokens by the target's own continuation with every ``miss``-th draft
    corrupted, so steps accept whole blocks, partial blocks and nothing. The real drafter still runs
    (its block K/V are still written); only the proposed token ids change."""

    def __init__(self, speculator, reference, miss):
        self.inner_propose = speculator.propose
        self.reference = reference
        self.miss = miss
        self.calls = 0

    def __call__(self, rows):
        proposals = self.inner_propose(rows)
        out = []
        for row, proposal in zip(rows, proposals):
            r = row.request
            truth = self.reference[tuple(r.prompt_token_ids)]
            done = len(r.output_token_ids)
            tokens = list(truth[done:done + proposal.num_drafts])
            tokens += [0] * (proposal.num_drafts - len(tokens))
            self.calls += 1
            if self.miss and self.calls % self.miss == 0:
                k = self.calls % len(tokens)
                tokens[k] = (tokens[k] + 1) % 128
            out.append(Proposal(torch.tensor(tokens)))
        return out


@pytest.mark.parametrize("shared", ["on", "off"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_speculation_is_lossless(tiny_target, drafter_dir, reference, shared, page_size):
    llm = LLM(tiny_target, draft=drafter_dir, page_size=page_size, shared_draft_kv=shared,
              max_num_batched_tokens=40)
    assert llm.kv_layout.unified == (shared == "on")
    outs = llm.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == reference[tuple(p)]
        assert len(o.acceptance_lengths) == o.spec.num_drafts > 0
    assert llm.engine.kv.pages_in_use() == 0


@pytest.mark.parametrize("shared", ["on", "off"])
@pytest.mark.parametrize("miss", [0, 3])
def test_accepted_blocks_roll_back_exactly(tiny_target, drafter_dir, reference, shared, miss, monkeypatch):
    llm = LLM(tiny_target, draft=drafter_dir, page_size=4, shared_draft_kv=shared)
    spec = llm.engine.speculator
    monkeypatch.setattr(spec, "propose", OracleDrafts(spec, reference, miss))
    for batch in (PROMPTS[:1], PROMPTS):
        outs = llm.generate(batch, GREEDY)
        for p, o in zip(batch, outs):
            assert o.token_ids == reference[tuple(p)]
    stats = llm.engine.spec_stats
    if miss == 0:
        # Oracle drafts: every step but the last of each request accepts its whole block (AL = K + 1).
        assert max(stats.acceptance_lengths) == 4 and stats.mean_acceptance_length > 3.0
    else:
        assert 1 in stats.acceptance_lengths and 4 in stats.acceptance_lengths
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[-1]
    assert llm.engine.kv.pages_in_use() == 0


def test_batch_sizes_do_not_change_output(tiny_target, drafter_dir, reference):
    llm = LLM(tiny_target, draft=drafter_dir, page_size=4, max_num_seqs=2, max_num_batched_tokens=12)
    for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        assert o.token_ids == reference[tuple(p)]


def dense_drafter_logits(target_dir, drafter_dir, context_ids, anchor, block_size):
    """An independent DFlash drafter on contiguous tensors, written from the published math."""
    from safetensors.torch import load_file
    from transformers import Qwen3ForCausalLM

    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    cfg = json.loads((drafter_dir / "config.json").read_text())
    w = load_file(str(drafter_dir / "model.safetensors"))
    ids = cfg["dflash_config"]["target_layer_ids"]
    mask = cfg["dflash_config"]["mask_token_id"]
    nh, nkv, hd, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]

    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):           # x [N, heads, hd]
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        f = torch.outer(pos.float(), inv)
        cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    with torch.no_grad():
        hs = target(torch.tensor([context_ids]), output_hidden_states=True).hidden_states
        ctx = torch.cat([hs[i + 1][0] for i in ids], -1)
        ctx = norm(ctx @ w["fc.weight"].T, w["hidden_norm.weight"])
        n = len(context_ids)
        ctx_pos = torch.arange(n)
        blk_pos = torch.arange(n, n + block_size)
        h = target.model.embed_tokens(torch.tensor([anchor] + [mask] * (block_size - 1)))
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            x = norm(h, w[p + "input_layernorm.weight"])
            q = rope(norm((x @ w[p + "self_attn.q_proj.weight"].T).view(-1, nh, hd), w[p + "self_attn.q_norm.weight"]), blk_pos)

            def kv(src, pos):
                k = norm((src @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd), w[p + "self_attn.k_norm.weight"])
                return rope(k, pos), (src @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)

            kc, vc = kv(ctx, ctx_pos)
            kb, vb = kv(x, blk_pos)
            k = torch.cat([kc, kb]).repeat_interleave(nh // nkv, dim=1)
            v = torch.cat([vc, vb]).repeat_interleave(nh // nkv, dim=1)
            att = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5      # no mask: non-causal
            o = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(block_size, -1)
            h = h + o @ w[p + "self_attn.o_proj.weight"].T
            x = norm(h, w[p + "post_attention_layernorm.weight"])
            gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
            h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        logits = norm(h, w["norm.weight"]) @ target.lm_head.weight.T
    return logits[1:]


@pytest.mark.parametrize("shared", ["on", "off"])
def test_drafter_matches_independent_dense_implementation(tiny_target, drafter_dir, shared):
    llm = LLM(tiny_target, draft=drafter_dir, page_size=4, shared_draft_kv=shared, max_num_batched_tokens=8)
    engine = llm.engine
    prompt = list(range(30, 49))       # 19 tokens: three prefill chunks of 8, 8 and 3
    r = engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    while r.num_computed_tokens < len(prompt):
        engine.step()
    assert r.num_draft_context == len(prompt) and len(r.output_token_ids) == 1
    got = engine.speculator.draft_logits([r], 3)[0]
    want = dense_drafter_logits(tiny_target, drafter_dir, prompt, r.output_token_ids[0], 4)
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    engine.abort(r.request_id)
    assert engine.kv.pages_in_use() == 0


def rel_err(got, want):
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("shared", ["on", "off"])
def test_training_forward_matches_paged_serving_forward(tiny_target, drafter_dir, shared, monkeypatch):
    """The one drafter, same weights: its dense training forward (two anchored blocks in one sequence under
    the anchor mask) gives the logits its paged serving forward gives for the same block, float32."""
    from spec_decode.training import anchor_block_mask

    llm = LLM(tiny_target, draft=drafter_dir, page_size=4, shared_draft_kv=shared, max_num_batched_tokens=8)
    engine, spec = llm.engine, llm.engine.speculator
    captured = []                       # the target features serving projects into the draft layers' pages
    store = spec.store_context
    monkeypatch.setattr(spec, "store_context", lambda items: (captured.extend(h for _, _, h in items), store(items)))
    prompt = list(range(30, 49))        # 19 tokens: three prefill chunks of 8, 8 and 3
    r = engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    while r.num_computed_tokens < len(prompt):
        engine.step()
    served = spec.draft_logits([r], 3)[0]                                   # [3, V]
    engine.abort(r.request_id)

    drafter, target = spec.drafter, engine.model
    n, B = len(prompt), drafter.block_size
    with torch.inference_mode():
        features = torch.cat(captured)[None]                                # [1, n, 2H]
        anchors = torch.tensor([[6, n]])                                    # block 1 is the served one
        positions = anchors[:, :, None] + torch.arange(B)                   # [1, 2, B]
        block = torch.full((1, 2, B), drafter.config.mask_token_id)
        block[0, :, 0] = torch.tensor([prompt[6], r.output_token_ids[0]])
        embeds = target.embed(block.view(1, -1))
        hidden = drafter(embeds, positions.view(1, -1), features, torch.arange(n)[None],
                         anchor_block_mask(anchors, n, B))
        trained = drafter.compute_logits(hidden.view(1, 2, B, -1)[0, :, 1:], target.lm_head)   # [2, 3, V]
        # Block 0 under the mask == block 0 alone over the context before its anchor.
        alone = drafter(embeds[:, :B], positions[0, :1], features[:, :6], torch.arange(6)[None])
        alone = drafter.compute_logits(alone[0, 1:], target.lm_head)
    assert rel_err(trained[1], served) < 1e-5
    assert rel_err(trained[0], alone) < 1e-5
    assert trained[1].argmax(-1).tolist() == served.argmax(-1).tolist()


def test_drafter_checkpoint_round_trip(tmp_path):
    from safetensors.torch import load_file

    # The bundled drafter, loaded and saved again, is the same checkpoint: config.json text, names, values.
    demo = Path(__file__).resolve().parents[1] / "models" / "demo" / "drafter"
    DFlashDrafter.from_pretrained(demo, dtype=torch.bfloat16).save_pretrained(tmp_path / "demo")
    assert (tmp_path / "demo" / "config.json").read_text() == (demo / "config.json").read_text()
    want, got = load_file(str(demo / "model.safetensors")), load_file(str(tmp_path / "demo" / "model.safetensors"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)

    # A freshly initialised drafter: save -> load keeps its config and (bf16-rounded) weights.
    config = DFlashConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=128, block_size=4, mask_token_id=1,
                          target_layer_ids=(0, 2), num_target_layers=3)
    fresh = DFlashDrafter.initialized(config, generator=torch.Generator().manual_seed(0))
    fresh.save_pretrained(tmp_path / "fresh")
    saved = load_file(str(tmp_path / "fresh" / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in saved.items()} == checkpoint_shapes(config)
    assert all(v.dtype == torch.bfloat16 for v in saved.values())
    loaded = DFlashDrafter.from_pretrained(tmp_path / "fresh")
    assert loaded.config == config
    for name, t in fresh.checkpoint_tensors().items():
        assert torch.equal(loaded.checkpoint_tensors()[name], t.to(torch.bfloat16).float()), name
    assert fresh.state_dict().keys() == loaded.state_dict().keys()


def test_tiny_drafter_training_runs_end_to_end(tmp_path):
    """The training loop on a tiny target: a few steps move the weights, the saved drafter evaluates, and
    the engine serves the trained pair losslessly."""
    import dataclasses
    import math

    from spec_decode import training as T

    preset = dataclasses.replace(T.PRESETS["smoke"], drafter_max_steps=3, drafter_time_budget_s=120.0,
                                 drafter_batch=4, anchors_per_seq=2, drafter_warmup_steps=1)
    torch.manual_seed(0)
    vocab, device = 128, torch.device("cpu")
    target = T.make_target(preset, vocab, eos_id=0).eval()
    target.save_pretrained(tmp_path / "target")
    sequences = torch.randint(4, vocab, (8, 32))
    prompt_lens = torch.full((8,), 8)
    drafter = DFlashDrafter.initialized(T.drafter_config(preset, vocab, mask_token_id=1))
    before = {k: v.clone() for k, v in drafter.checkpoint_tensors().items()}
    metrics = T.train_drafter(drafter, target, sequences, prompt_lens, preset, device, log=lambda message: None)
    assert metrics["steps"] == 3 and math.isfinite(metrics["final_loss"])
    after = drafter.checkpoint_tensors()
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    drafter.save_pretrained(tmp_path / "drafter")

    prompt = [5, 6, 7, 8, 9]
    result = T.evaluate_acceptance(target, DFlashDrafter.from_pretrained(tmp_path / "drafter"), [prompt], 8)
    assert result["exact_match_prompts"] == 1
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    base = LLM(tmp_path / "target").generate([prompt], params)[0]
    spec = LLM(tmp_path / "target", draft=tmp_path / "drafter").generate([prompt], params)[0]
    assert spec.token_ids == base.token_ids and spec.spec.num_drafts > 0


def test_fp8_target_and_bf16_draft_share_one_manager(tiny_target, drafter_dir):
    llm = LLM(tiny_target, draft=drafter_dir, kv_cache_dtype="fp8", draft_kv_cache_dtype="bf16", page_size=4,
              num_pages=16)
    assert llm.kv_layout.unified
    (pool,) = llm.engine.kv.pools
    t_k, _ = pool.kv_views(LayerOwner.TARGET, 1)
    d_k, d_v = pool.kv_views(LayerOwner.DRAFT, 1)
    assert t_k.dtype == torch.float8_e4m3fn and t_k.element_size() == 1
    assert d_k.dtype == torch.bfloat16 and d_k.element_size() == 2
    # Write known values through the draft view; read them back from the raw bytes at the layer's offset.
    loc = pool.location(LayerOwner.DRAFT, 1)
    d_v[5] = torch.arange(d_v[5].numel(), dtype=torch.bfloat16).view_as(d_v[5])
    raw = pool.groups[loc.group].buffer.view(-1)
    start = 5 * loc.page_stride + loc.offset_in_page + loc.kv_bytes
    back = raw[start:start + loc.kv_bytes].view(torch.bfloat16)
    # Pages are head-major in memory: [kv head, token, head dim].
    written = torch.arange(d_v[5].numel(), dtype=torch.bfloat16).view_as(d_v[5])
    assert torch.equal(back, written.transpose(0, 1).reshape(-1))
    # And the engine still decodes through the mixed pool.
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and llm.engine.kv.pages_in_use() == 0


GATE_CASES = {
    "draft page size": dict(draft_page_size=8),
    "page size 3 is not supported": dict(page_size=3),
    "dynamic": dict(static_drafting=False),
    "pipeline parallelism": dict(pipeline_parallel_size=2),
    "context parallelism": dict(context_parallel_size=2),
    "KV compression": dict(kv_compression="h2o"),
    "attention backends differ": dict(draft_attention_backend="triton"),
}


@pytest.mark.parametrize("reason", sorted(GATE_CASES))
def test_each_failed_gate_falls_back_or_raises(reason):
    config = LayoutConfig(**{"page_size": 16, **GATE_CASES[reason]})
    layout = decide_layout("auto", config)
    assert not layout.unified and any(reason.split()[0] in r for r in layout.reasons)
    with pytest.raises(ValueError, match="shared_draft_kv=on"):
        decide_layout("on", config)
    # A peer failing the gate blocks unification too.
    peer_layout = decide_layout("auto", LayoutConfig(page_size=16), peers=[config])
    assert not peer_layout.unified and peer_layout.reasons[0].startswith("peer 0")


def test_gates_all_passing_unify_and_off_separates():
    assert decide_layout("auto", LayoutConfig(page_size=16)).unified
    assert decide_layout("on", LayoutConfig(page_size=16)).unified
    assert not decide_layout("off", LayoutConfig(page_size=16)).unified
    with pytest.raises(ValueError, match="shared_draft_kv must be one of"):
        decide_layout("sometimes", LayoutConfig(page_size=16))


def test_engine_gate_decision_is_readable(tiny_target, drafter_dir, caplog):
    llm = LLM(tiny_target, draft=drafter_dir, page_size=3, shared_draft_kv="auto")
    assert not llm.kv_layout.unified and "page size 3" in llm.kv_layout.describe()
    assert any("separate draft KV pool" in m for m in caplog.messages)
    assert len(llm.engine.kv.pools) == 2
    with pytest.raises(ValueError, match="page size 3"):
        LLM(tiny_target, draft=drafter_dir, page_size=3, shared_draft_kv="on")


@pytest.mark.parametrize("shared", ["on", "off"])
def test_drafted_slots_stay_inside_allocated_pages(tiny_target, drafter_dir, reference, shared, monkeypatch):
    """A prompt ending exactly on a page boundary, and steps accepting the whole block."""
    llm = LLM(tiny_target, draft=drafter_dir, page_size=4, shared_draft_kv=shared)
    engine = llm.engine
    spec = engine.speculator
    monkeypatch.setattr(spec, "propose", OracleDrafts(spec, reference, 0))
    written = []
    real = dflash.build_metadata

    def recording(kv, space, rows, **kw):
        positions, meta = real(kv, space, rows, **kw)
        for row, start in zip(rows, meta.query_start_loc[:-1].tolist()):
            pages = set(kv.block_table(row.request_id, space))
            slots = meta.slot_mapping[start:start + row.num_tokens].tolist()
            written.append((row, [s // kv.page_size for s in slots], pages))
        return positions, meta

    monkeypatch.setattr(dflash, "build_metadata", recording)
    prompt = PROMPTS[3]                 # 16 tokens: four full pages
    assert len(prompt) % 4 == 0
    out = llm.generate([prompt], GREEDY)[0]
    assert out.token_ids == reference[tuple(prompt)]
    assert max(out.acceptance_lengths) == 4
    blocks = [w for w in written if w[0].num_tokens == 4]
    assert blocks and all(set(pages_written) <= pages for _, pages_written, pages in written)
    # The first block starts at position 16: it needs a fifth page that the prompt alone would not.
    first_block = blocks[0]
    assert first_block[0].start == len(prompt)
    assert engine.kv.pages_in_use() == 0


def test_block_width_is_reserved_at_admission(tiny_target, drafter_dir):
    llm = LLM(tiny_target, draft=drafter_dir, page_size=4, num_extra_kv_tokens=1)
    kv = llm.engine.kv
    assert kv.lookahead_tokens == 4                      # max(num_extra_kv_tokens, block width)
    engine = llm.engine
    r = engine.add_request(list(range(1, 17)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert len(kv.block_table(r.request_id)) >= -(-(16 + 1 + 3) // 4)
    engine.abort(r.request_id)


def test_drafter_that_does_not_fit_its_target_is_refused(tiny_target, tmp_path):
    cases = {
        "hidden_size": dict(hidden_size=32),
        "vocab_size": dict(vocab_size=64),
        "mask_token_id": dict(mask_token_id=500),
        "target_layer_ids": dict(target_layer_ids=(0, 7)),
    }
    for name, override in cases.items():
        kwargs = {"target_layer_ids": override.pop("target_layer_ids", (0, 1)),
                  "mask_token_id": override.pop("mask_token_id", 127)}
        d = checkpoints.write_tiny_drafter(tmp_path / name, **kwargs, **override)
        with pytest.raises(CheckpointError, match=name):
            LLM(tiny_target, draft=d)


def test_default_target_layer_ids():
    from spec_decode.drafter import default_target_layer_ids

    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(2, 1) == [1]


PENALISED = dict(frequency_penalty=2.0, presence_penalty=1.0, repetition_penalty=1.5, logit_bias={0: 1.0, 5: -1.5})


def penalised_by_hand(logits, prompt, output):
    """The PENALISED options applied to one row of logits, written out token by token."""
    x = logits.clone()
    for t, b in PENALISED["logit_bias"].items():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / 1.5 if x[t] > 0 else x[t] * 1.5
    for t in set(output):
        x[t] -= 2.0 * output.count(t) + 1.0
    return x


@pytest.mark.parametrize("case", ["plain", "penalised"])
def test_speculative_sampling_follows_target_distribution(case):
    """Rejection sampling over a 6-token vocabulary, 8,000 requests in one batch: the emitted first token follows
    p, not q; penalised, p at verify row k counts the k drafts before it."""
    from engine.sampler import LogitsBlock, LogitsState, adjust_logits, probabilities, rejection_sample

    torch.manual_seed(0)
    target_logits = torch.randn(3, 6) * 1.5
    draft_logits = torch.randn(2, 6) * 1.5
    params = SamplingParams(temperature=1.0, **(PENALISED if case == "penalised" else {}))
    q = probabilities(draft_logits, SamplingParams(temperature=1.0))
    n = 8000
    drafts = torch.multinomial(q, n, replacement=True).T                   # [n, 2]: each request's two drafts
    logits = target_logits.repeat(n, 1)
    if case == "penalised":
        prompt, output = [1], [2]              # the request so far
        state = LogitsState(params, prompt, vocab_size=6, eos_token_ids=(), device=torch.device("cpu"))
        state.add(output)
        p0 = penalised_by_hand(target_logits[0], prompt, output).softmax(-1)
        after = int(torch.minimum(p0, q[0]).argmax())   # the most often accepted draft: most samples after it
        p1 = penalised_by_hand(target_logits[1], prompt, output + [after]).softmax(-1)
        stale_p1 = penalised_by_hand(target_logits[1], prompt, output).softmax(-1)
        logits = adjust_logits(logits, [LogitsBlock(state, 3 * r, 3, len(output), drafts[r])
                                        for r in range(n)])
    else:
        p0, p1 = probabilities(target_logits[:2], params)
        after = 3
    p = probabilities(logits, params).view(n, 3, 6)
    tokens, num_accepted = rejection_sample(drafts, q.expand(n, 2, 6), p, [None] * n)
    assert ((tokens[:, :2] == drafts) | (torch.arange(2)[None, :] >= num_accepted[:, None])).all()
    first = torch.bincount(tokens[:, 0], minlength=6).float()
    follows = (num_accepted >= 1) & (tokens[:, 0] == after)
    second = torch.bincount(tokens[follows, 1], minlength=6).float()
    n_second = int(follows.sum())
    # Chi-square against p with 5 degrees of freedom: 20.5 is the 0.1% critical value.
    expected = p0 * n
    chi2 = ((first - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5, (first / n, p0)
    # The token after ``after`` follows p[1] (the target's distribution at that position).
    expected2 = p1 * n_second
    assert ((second - expected2) ** 2 / expected2).sum().item() < 20.5
    # And the draft distribution itself would be rejected by the same test (the test has power).
    chi2_q = ((first - q[0] * n) ** 2 / (q[0] * n)).sum().item()
    assert chi2_q > 20.5
    if case == "penalised":
        # As would counts that miss the draft accepted before row 1.
        assert ((second - stale_p1 * n_second) ** 2 / (stale_p1 * n_second)).sum().item() > 20.5


def test_batched_sampling_mixes_parameters_per_row_and_seeded_rows_repeat():
    """One ``probabilities`` call over rows of different parameters equals each row's alone; a seeded row's draws
    (plain and rejection sampling) depend on its generator alone, not on the rows batched beside it."""
    from engine.sampler import draw, probabilities, rejection_sample

    torch.manual_seed(3)
    logits = torch.randn(4, 50) * 2
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(), SamplingParams(temperature=1.3, top_p=0.8),
              SamplingParams(temperature=1.0, top_k=10, top_p=0.5)]
    together = probabilities(logits, params)
    alone = torch.cat([probabilities(logits[i:i + 1], p) for i, p in enumerate(params)])
    assert torch.equal(together, alone)
    assert torch.equal(together[1], torch.nn.functional.one_hot(logits[1].argmax(), 50).float())   # greedy
    assert int((together[0] > 0).sum()) == 5 and torch.allclose(together.sum(-1), torch.ones(4))

    def seeded(seed):
        return torch.Generator().manual_seed(seed)

    probs = together[[0, 2, 3]]
    a = draw(probs, [seeded(1), None, seeded(2)])
    b = draw(probs, [seeded(1), seeded(9), seeded(2)])
    assert a[0] == b[0] and a[2] == b[2]
    q = torch.randn(3, 4, 50).softmax(-1)
    p = torch.randn(3, 5, 50).softmax(-1)
    drafts = torch.stack([torch.multinomial(q[r], 1).squeeze(-1) for r in range(3)])
    t1, n1 = rejection_sample(drafts, q, p, [seeded(5), None, seeded(6)])
    t2, n2 = rejection_sample(drafts, q, p, [seeded(5), seeded(7), seeded(6)])
    for r in (0, 2):
        assert n1[r] == n2[r] and torch.equal(t1[r, :n1[r] + 1], t2[r, :n2[r] + 1])


def test_seeded_speculative_sampling_is_reproducible(tiny_target, drafter_dir):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True)
    a = LLM(tiny_target, draft=drafter_dir, page_size=4).generate(PROMPTS[:3], params)
    b = LLM(tiny_target, draft=drafter_dir, page_size=4).generate(PROMPTS[:3], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    other = LLM(tiny_target, draft=drafter_dir, page_size=4).generate(
        PROMPTS[:3], SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=8, ignore_eos=True))
    assert [o.token_ids for o in a] != [o.token_ids for o in other]


def test_a_seeded_request_preempted_and_recomputed_draws_as_it_would_alone(tiny_target, drafter_dir):
    """Preemption must not change a seeded request's output: its recompute stops short of the last token, which
    goes as a decode row with its drafts, as it would have unpreempted (a recompute that sampled that token
    instead would draw other numbers than the speculative step it replaces)."""
    params = SamplingParams(max_tokens=24, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True)
    alone = LLM(tiny_target, draft=drafter_dir, page_size=4).generate([PROMPTS[0]], params)[0]
    llm = LLM(tiny_target, draft=drafter_dir, page_size=4, num_pages=14, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    engine = llm.engine
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[5]]
    others = [engine.add_request(p, GREEDY) for p in prompts]
    seeded = engine.add_request(PROMPTS[0], params)       # the newest: the first one preempted
    while engine.has_unfinished():
        engine.step()
    assert seeded.num_preemptions > 0
    assert engine.scheduler.num_preemptions == sum(r.num_preemptions for r in others + [seeded])
    assert seeded.output_token_ids == alone.token_ids
    assert [r.output_token_ids for r in others] == [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert engine.kv.pages_in_use() == 0


def test_a_seeded_request_draws_alike_whatever_the_prefix_cache_holds(tiny_target, drafter_dir):
    """A prompt one token past a page boundary, seeded: the second time the prefix cache leaves one token to compute,
    a row shaped like a decode row. It must not take drafts (its first token would be drawn by rejection sampling
    instead of as from a whole prompt), so both answers are the same."""
    params = SamplingParams(max_tokens=24, temperature=0.8, top_k=20, top_p=0.9, seed=9, ignore_eos=True)
    llm = LLM(tiny_target, draft=drafter_dir, page_size=4)
    prompt = PROMPTS[2][:13]                 # 3 full pages and one token
    cold, warm = llm.generate([prompt], params)[0], llm.generate([prompt], params)[0]
    assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, 12)
    assert warm.token_ids == cold.token_ids


@pytest.mark.parametrize("shared", ["on", "off"])
def test_prefix_reuse_with_drafter(tiny_target, drafter_dir, reference, shared):
    llm = LLM(tiny_target, draft=drafter_dir, page_size=4, shared_draft_kv=shared)
    engine = llm.engine
    prompt = PROMPTS[2]                 # 32 tokens
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt[:30] + [7]], GREEDY)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 28
    assert first.token_ids == reference[tuple(prompt)]
    # Same context, same drafts: acceptance is unchanged by reuse.
    again = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 28
    assert again.token_ids == first.token_ids and again.acceptance_lengths == first.acceptance_lengths
    assert engine.kv.pages_in_use() == 0


def test_incomplete_draft_pages_are_recomputed(tiny_target, drafter_dir, reference):
    """Pages whose draft layers never received the context (as after a target-only transfer) are not
    reused by a drafting request: its drafter context is recomputed and the output stays lossless."""
    llm = LLM(tiny_target, draft=drafter_dir, page_size=4)
    engine = llm.engine
    prompt = PROMPTS[2]
    donor = LLM(tiny_target, draft=drafter_dir, page_size=4).engine
    held = donor.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), hold_pages=True)
    while donor.has_unfinished():
        donor.step()
    r = engine.reserve_transfer(prompt, held.output_token_ids[0], GREEDY)
    # Copy the target layers' pages only, as a transfer without draft layers would.
    src, dst = donor.kv.block_table(held.request_id), engine.kv.block_table(r.request_id)
    n = -(-len(prompt) // 4)
    for i in range(tiny_target_layers(engine)):
        for s_view, d_view in zip(donor.kv.pools[0].kv_views(LayerOwner.TARGET, i),
                                  engine.kv.pools[0].kv_views(LayerOwner.TARGET, i)):
            d_view[torch.tensor(dst[:n])] = s_view[torch.tensor(src[:n])]
    donor.release(held.request_id)
    engine.finish_transfer(r.request_id, True, draft_context=False)
    while engine.has_unfinished():
        engine.step()
    assert r.output_token_ids == reference[tuple(prompt)]
    # The next request with the same prompt cannot reuse draft-less pages: it recomputes them.
    again = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 0
    assert again.token_ids == reference[tuple(prompt)]
    assert engine.kv.pages_in_use() == 0 and donor.kv.pages_in_use() == 0


def tiny_target_layers(engine):
    return engine.model.config.num_hidden_layers


def test_demo_pair_is_lossless_and_accepts_on_held_out_code():
    """The bundled pair on held-out prompts: exact greedy equality, and the acceptance the README reports."""
    demo = Path(__file__).resolve().parents[1] / "models" / "demo"
    lines = (demo.parents[1] / "benchmarks" / "prompts" / "heldout.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines[:8]]
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    base = LLM(demo / "target", page_size=16).generate(prompts, params)
    llm = LLM(demo / "target", draft=demo / "drafter", page_size=16, kv_cache_dtype="fp8",
              draft_kv_cache_dtype="bf16")
    assert llm.kv_layout.unified
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] != [] and all(len(o.token_ids) == 128 for o in outs)
    # FP8 target KV changes the target's own greedy path slightly; compare against the same cache dtype.
    fp8_base = LLM(demo / "target", page_size=16, kv_cache_dtype="fp8").generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in fp8_base]
    bf16 = LLM(demo / "target", draft=demo / "drafter", page_size=16).generate(prompts, params)
    assert [o.token_ids for o in bf16] == [o.token_ids for o in base]
    steps = sum(len(o.acceptance_lengths) for o in bf16)
    mean_al = sum(sum(o.acceptance_lengths) for o in bf16) / steps
    assert mean_al >= 2.5, mean_al


def test_drafts_never_run_past_the_context(tiny_target, drafter_dir):
    """Near the end of the context a row drafts fewer tokens (at the last position none): the block's positions
    stay inside the model's rotary table, and the output is still the target's."""
    prompt = [(5 * j) % 100 + 1 for j in range(512 - 6)]         # the tiny target's context is 512
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    spec = LLM(tiny_target, draft=drafter_dir, num_pages=40).generate([prompt], params)[0]
    plain = LLM(tiny_target, num_pages=40).generate([prompt], params)[0]
    assert spec.token_ids == plain.token_ids and spec.finish_reason == "length"
    assert spec.spec.num_drafts > 0


def test_accept_greedy_keeps_the_matching_drafts_and_adds_the_target_token():
    from engine.sampler import accept_greedy

    drafts = torch.tensor([[5, 6, 7]] * 4)
    target = torch.tensor([[5, 6, 7, 8],      # all accepted: the bonus after them
                           [5, 9, 7, 8],      # first mismatch: the target's token there
                           [1, 6, 7, 8],      # none
                           [5, 6, 3, 3]])     # a match after a mismatch does not count
    tokens, accepted = accept_greedy(drafts, target)
    assert accepted.tolist() == [3, 1, 0, 2]
    assert [row[:n + 1] for row, n in zip(tokens.tolist(), accepted.tolist())] == [[5, 6, 7, 8], [5, 9], [1], [5, 6, 3]]


def test_greedy_and_sampled_requests_in_one_batch_each_keep_their_own_output(tiny_target, drafter_dir, reference):
    """Greedy rows of a step are verified from one argmax of every logits row (one host transfer): each greedy
    request must still get its own slice of it beside sampled and plain rows, and each seeded sampled request
    the draws it gets alone."""
    sampled = SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=11, ignore_eos=True)
    alone = {i: LLM(tiny_target, draft=drafter_dir, page_size=4).generate([PROMPTS[i]], sampled)[0].token_ids
             for i in (1, 3)}
    engine = LLM(tiny_target, draft=drafter_dir, page_size=4).engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, sampled if i in alone else GREEDY, request_id=str(i))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.token_ids
    for i, p in enumerate(PROMPTS):
        assert done[i] == (alone[i] if i in alone else reference[tuple(p)]), i


def test_a_step_brings_its_tokens_to_the_host_once(tiny_target, drafter_dir, monkeypatch):
    """Drafts stay on the device, and every row's tokens (greedy and sampled, plain and speculative, penalised or
    not) are decided there: a step reads device values on the host once (``tolist``), whatever its batch. On a
    GPU each such read waits for the device; a per-request read would make the step wait once per request."""
    engine = LLM(tiny_target, draft=drafter_dir, page_size=4).engine
    kinds = [GREEDY, SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=3, ignore_eos=True),
             SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, ignore_eos=True),
             SamplingParams(max_tokens=24, presence_penalty=0.5, logit_bias={3: 2.0}, ignore_eos=True)]
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, kinds[i % len(kinds)], request_id=str(i))
    reads = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if self.device == engine.model.device:
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    per_step, drafted = [], 0
    while engine.has_unfinished():
        reads.clear()
        engine.step()
        per_step.append(list(reads))
        drafted = engine.spec_stats.num_drafts
    monkeypatch.undo()
    assert drafted > 0
    assert all(r == ["tolist"] for r in per_step), per_step


def test_steps_read_a_request_history_without_copying_it(tiny_target, drafter_dir, reference):
    """A step's host work per request is what it reads, not the request's length: no step, admission or prefix
    cache commit builds prompt + output as one list, or copies more of the prompt than a chunk (O(context) a request
    a step, ~50 us at 32k tokens). With both made to fail, chunked prompts, a prefix hit and speculation give the
    same tokens, and pages come back."""
    budget = 12

    class Watched(list):
        """A prompt that refuses to be joined with the output or copied beyond one chunk."""

        def __add__(self, other):
            raise AssertionError("a step joined a request's prompt and output")

        def __getitem__(self, index):
            if isinstance(index, slice) and len(range(*index.indices(len(self)))) > budget:
                raise AssertionError(f"a step copied {len(range(*index.indices(len(self))))} prompt tokens")
            return super().__getitem__(index)

    llm = LLM(tiny_target, draft=drafter_dir, page_size=4, max_num_batched_tokens=budget)
    engine = llm.engine
    prompts = PROMPTS + [PROMPTS[2] + [7, 8]]          # the last one's first 32 tokens hit the prefix cache
    requests = []
    for p in prompts:
        requests.append(engine.add_request(p, GREEDY))
        requests[-1].prompt_token_ids = Watched(requests[-1].prompt_token_ids)
        for _ in range(6):                             # the earlier ones' pages are cached before the last one comes
            engine.step()
    while engine.has_unfinished():
        engine.step()
    for p, r in zip(PROMPTS, requests):
        assert r.output_token_ids == reference[tuple(p)]
    assert requests[-1].num_cached_tokens > 0
    assert engine.kv.pages_in_use() == 0


def test_a_history_view_indexes_and_slices_as_the_joined_list():
    from engine.sequence import TokenHistory

    prompt, output = list(range(10, 17)), [90, 91, 92]
    view, joined = TokenHistory(prompt, output), prompt + output
    assert len(view) == len(joined) and list(view) == joined
    for i in range(-len(joined), len(joined)):
        assert view[i] == joined[i]
    for bad in (len(joined), -len(joined) - 1):
        with pytest.raises(IndexError):
            view[bad]
    for start in range(-3, len(joined) + 2):
        for stop in range(-3, len(joined) + 2):
            assert view[start:stop] == joined[start:stop], (start, stop)
    assert view[::2] == joined[::2] and view[-4:] == joined[-4:] and view[:] == joined
    output.append(93)                        # a view, not a copy: later tokens show
    assert view[-1] == 93 and len(view) == len(joined) + 1


def test_a_transfer_shares_the_cached_prefix_pages_only_when_asked(tiny_target, drafter_dir):
    """The decode side of a transfer takes the prompt's leading full pages from its prefix cache (drafter context
    complete) when asked, and says how many tokens they cover: the READ skips them. Without reuse (the ablation,
    which clears the draft layers of every page it holds) it owns every page. A failed READ frees both, and the
    cached pages stay cached."""
    llm = LLM(tiny_target, draft=drafter_dir, page_size=4)
    engine = llm.engine
    prompt = PROMPTS[2]                                       # 32 tokens: 8 pages
    first = llm.generate([prompt], GREEDY)[0].token_ids[0]    # its pages are cached, drafter context included
    own = engine.reserve_transfer(prompt, first, GREEDY, request_id="own", reuse_prefix=False)
    shared = engine.reserve_transfer(prompt, first, GREEDY, request_id="shared")
    assert own.num_reused_tokens == 0 and shared.num_reused_tokens == 28      # all but the last token's page
    own_table, shared_table = engine.kv.block_table("own", 0), engine.kv.block_table("shared", 0)
    assert not set(own_table) & set(shared_table[:7])
    for request_id in ("own", "shared"):
        engine.finish_transfer(request_id, landed=False)
    assert engine.kv.pages_in_use() == 0
    again = engine.reserve_transfer(prompt, first, GREEDY, request_id="again")
    assert again.num_reused_tokens == 28 and engine.kv.block_table("again", 0)[:7] == shared_table[:7]
    engine.finish_transfer("again", landed=False)
    assert engine.kv.pages_in_use() == 0


def test_a_prompt_that_ended_in_its_first_step_serves_the_next_one_draft_context_included():
    """Demo pair: a request with max_tokens 1 ends in its prompt step; its prompt's full pages, draft layers
    included, serve the next request that begins alike (pages whose draft part was never stored are no use to a
    drafting request: no hit). That request decodes the tokens and per-step acceptance of one that found the same
    pages cached by a request still running, and the tokens of an engine without the prefix."""
    demo = Path(__file__).resolve().parents[1] / "models" / "demo"
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)

    def run(first_max_tokens: int | None):
        llm = LLM(str(demo / "target"), draft=str(demo / "drafter"), page_size=16)
        prompt = llm.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n" * 3)
        if first_max_tokens is not None:
            llm.generate([prompt], SamplingParams(max_tokens=first_max_tokens, ignore_eos=True))
        out = llm.generate([prompt + llm.tokenizer.encode("\n\nprint(")], greedy)[0]
        assert llm.engine.kv.pages_in_use() == 0
        return out, len(prompt)

    ended, n = run(1)
    running, _ = run(2)
    fresh, _ = run(None)
    assert ended.num_cached_tokens == running.num_cached_tokens == n // 16 * 16 > 0 and fresh.num_cached_tokens == 0
    assert ended.token_ids == running.token_ids == fresh.token_ids
    assert ended.acceptance_lengths == running.acceptance_lengths


def test_a_step_that_fails_after_a_request_ended_in_it_returns_that_requests_pages(tiny_target, drafter_dir):
    """A request that ends in a step keeps its pages until the step's drafter context store, then offers them to the
    prefix cache. If the step fails in between, they go back without being cached. The failure is injected (a
    drafter store that raises once): a real one cannot be caused on purpose here."""
    llm = LLM(tiny_target, draft=drafter_dir, page_size=4)
    engine, spec = llm.engine, llm.engine.speculator
    store, calls = spec.store_context, []

    def failing_once(items):
        calls.append(len(items))
        if len(calls) == 1:
            raise RuntimeError("injected drafter store failure")
        return store(items)

    spec.store_context = failing_once
    ends = engine.add_request(list(range(20, 33)), SamplingParams(max_tokens=1, ignore_eos=True))
    goes_on = engine.add_request(list(range(40, 50)), SamplingParams(max_tokens=6, ignore_eos=True))
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert ends.finish_reason == "length" and goes_on.finish_reason == "error"
    assert engine.kv.pages_in_use() == 0
    for r in (ends, goes_on):
        engine.abort(r.request_id)         # what the engine loop does with a failed step's requests
    again = llm.generate([list(range(20, 33))], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert again.num_cached_tokens == 0                 # nothing of the failed step was cached
    assert again.token_ids == LLM(tiny_target, page_size=4).generate(
        [list(range(20, 33))], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    assert engine.kv.pages_in_use() == 0


@pytest.mark.parametrize("name", ["demo", "gpu", "smoke"])
def test_each_training_preset_builds_a_consistent_pair(name):
    """A preset's target and drafter build (on the meta device: no memory, even for the 1.76B ``gpu`` target),
    the drafter reads existing target layers short of the last (whose Hugging Face hidden state is the final
    norm's output), and the drafter shares the target's widths."""
    from spec_decode import training as T

    preset = T.PRESETS[name]
    assert preset.name == name and preset.num_heads % preset.num_kv_heads == 0 and preset.block_size >= 2
    assert all(0 <= i < preset.num_layers - 1 for i in preset.target_layer_ids)
    assert list(preset.target_layer_ids) == sorted(set(preset.target_layer_ids))
    with torch.device("meta"):
        target = T.make_target(preset, preset.vocab_size, eos_id=0)
        drafter = DFlashDrafter.initialized(T.drafter_config(preset, preset.vocab_size, mask_token_id=1))
    assert len(target.model.layers) == preset.num_layers
    assert target.config.hidden_size == drafter.config.hidden_size == preset.hidden_size
    params = sum(p.numel() for p in target.parameters())
    if name == "gpu":      # the size its comment promises: big enough that a GPU step is bound by the GPU
        assert 1.7e9 < params < 1.8e9
