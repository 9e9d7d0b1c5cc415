"""CUDA graphs' CPU-testable parts: the capture ladder, when graphs are on, and the static padded inputs.

Without a GPU nothing is captured: ``enable_cuda_graphs(capture=False)`` runs the very static, padded buffers a
graph would replay, eagerly. The GPU half (a replay bit-identical to eager, step times) is
``benchmarks/gpu_step_check.py --device cuda``."""

from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.attention import AttentionMetadata, store_kv
from engine.cuda_graphs import RaggedGraphs, StepGraphs, capture_sizes, ragged_sizes, use_cuda_graphs
from engine.llm import EngineConfig
from spec_decode import LLM
from tests import checkpoints

# Lengths and budgets that make the decode batch shrink inside one padded size (5 -> 4 -> ... rows in a graph
# of 8),
# so rows a finished request used become padding; the first step, with a 40-token prompt, is a ragged one.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 50)), [5] * 16, [100]]
MAX_TOKENS = [24, 9, 17, 30, 5]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return checkpoints.write_tiny_drafter(tmp_path_factory.mktemp("drafter"), num_layers=2, block_size=4)


def test_the_ladder_pads_every_batch_to_a_captured_size():
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(1) == [1]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    graphs = StepGraphs(lambda ids, positions, meta: (ids,), device="cpu", query_lens=(1,), max_batch=12,
                        max_pages=2, page_size=4, causal=True, backend="torch", capture=False)
    assert [graphs.padded(b) for b in (1, 3, 5, 9, 12)] == [1, 4, 8, 12, 12]
    assert graphs.accepts(12, 1) and not graphs.accepts(13, 1) and not graphs.accepts(4, 2)


def test_graphs_are_on_only_where_they_can_be_captured():
    assert use_cuda_graphs("auto", "cuda", "triton", tensor_parallel=False)
    assert not use_cuda_graphs("auto", "cpu", "torch", tensor_parallel=False)
    assert not use_cuda_graphs("auto", "cuda", "torch", tensor_parallel=False)
    assert not use_cuda_graphs("auto", "cuda", "triton", tensor_parallel=True)
    assert not use_cuda_graphs("off", "cuda", "triton", tensor_parallel=False)
    with pytest.raises(ValueError, match="cuda_graphs=on but the device is cpu, not CUDA"):
        use_cuda_graphs("on", "cpu", "triton", tensor_parallel=False)
    with pytest.raises(ValueError, match="tensor-parallel"):
        use_cuda_graphs("on", "cuda", "triton", tensor_parallel=True)
    with pytest.raises(ValueError, match="cuda_graphs must be one of"):
        EngineConfig(model="x", cuda_graphs="yes")


def test_padded_rows_store_nothing_even_where_an_earlier_batch_stored():
    """A batch of 3 after a batch of 4 in the same graph size: row 4's inputs are left from the first batch, and
    its slot must not be written again (it may be a freed page now another request's)."""
    page_size, heads, dim = 4, 1, 2
    k_cache = torch.zeros(8, page_size, heads, dim)
    v_cache = torch.zeros(8, page_size, heads, dim)

    def forward(ids, positions, meta):
        values = ids.float().view(-1, 1, 1).expand(-1, heads, dim).contiguous()
        store_kv(values, values, k_cache, v_cache, meta.slot_mapping)
        return (ids * 10, meta.seq_lens.clone())

    graphs = StepGraphs(forward, device="cpu", query_lens=(1,), max_batch=4, max_pages=2, page_size=page_size,
                        causal=True, backend="torch", capture=False)

    def batch(ids, slots, seq_lens):
        tables = torch.tensor([[s // page_size, 0] for s in slots], dtype=torch.int32)
        meta = AttentionMetadata(torch.arange(len(ids) + 1, dtype=torch.int32),
                                 torch.tensor(seq_lens, dtype=torch.int32), tables, torch.tensor(slots), 1,
                                 max(seq_lens))
        return graphs.run(len(ids), 1, torch.tensor(ids), torch.tensor(slots) % page_size, meta)

    out, lens = batch([1, 2, 3, 4], [0, 5, 10, 29], [1, 2, 3, 2])
    assert out.tolist() == [10, 20, 30, 40] and lens.tolist() == [1, 2, 3, 2]
    assert k_cache[7, 1, 0, 0] == 4                      # slot 29: page 7, offset 1
    k_cache[7, 1] = -1.0                                 # the page changed hands since
    out, lens = batch([6, 7, 8], [1, 6, 11], [2, 3, 4])
    assert out.tolist() == [60, 70, 80] and lens.tolist() == [2, 3, 4]
    assert k_cache[7, 1, 0, 0] == -1.0                   # the padded row stored nothing
    assert graphs.seq_lens.tolist() == [2, 3, 4, 1] and graphs.slots.tolist()[:4] == [1, 6, 11, -1]
    assert [k_cache[s // page_size, s % page_size, 0, 0].item() for s in (1, 6, 11)] == [6, 7, 8]


def test_ragged_token_counts_ladder():
    assert ragged_sizes(1024) == [*range(32, 257, 32), 320, 384, 448, 512, *range(640, 1025, 128)]
    assert ragged_sizes(512, min_tokens=33) == [64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    assert ragged_sizes(100) == [32, 64, 96, 100] and ragged_sizes(20) == [20]
    with pytest.raises(ValueError, match="min_tokens <= max_tokens"):
        ragged_sizes(20, min_tokens=21)


def test_a_ragged_step_computes_its_positions_and_slots_in_the_graph_and_its_padding_stores_nothing():
    """Rows of 5, 2 and 1 tokens from different starts: the graph's positions, slots, query starts and lengths are
    those of the rows (slot = page of the position in the row's table * page size + offset); the 24 tokens that pad
    the step to 32 store nothing, and a later, smaller step stores nothing where the earlier one's tokens were
    (their ids are still in the static inputs)."""
    page_size = 4
    cache = torch.zeros(8, page_size, 1, 1)
    seen = {}

    def forward(ids, positions, meta):
        values = ids.float().view(-1, 1, 1)
        store_kv(values, values, cache, cache.clone(), meta.slot_mapping)
        seen.update(slots=meta.slot_mapping.clone(), starts=meta.query_start_loc.clone(), lens=meta.seq_lens.clone(),
                    tables=meta.block_tables.clone(), max_query_len=meta.max_query_len)
        return ids * 10, positions.clone()

    graphs = RaggedGraphs(forward, device="cpu", max_tokens=64, max_batch=4, max_pages=4, page_size=page_size,
                          causal=True, backend="torch", capture=False)
    table = torch.tensor([[5, 0, 0, 0], [2, 6, 0, 0], [1, 3, 7, 0]], dtype=torch.int32)
    ids = torch.arange(1, 9)
    out, positions = graphs.run([3, 0, 9], [5, 2, 1], [1, 0, 2], table, [ids])
    assert out.tolist() == (ids * 10).tolist() and positions.tolist() == [3, 4, 5, 6, 7, 0, 1, 9]
    assert seen["max_query_len"] == 32 and seen["slots"].shape == (32,)
    assert seen["slots"].tolist() == [11, 24, 25, 26, 27, 20, 21, 29] + [-1] * 24
    assert seen["starts"].tolist() == [0, 5, 7, 8, 8] and seen["lens"].tolist() == [8, 2, 10, 0]
    assert seen["tables"][:3].tolist() == table[[1, 0, 2]].tolist()           # each row's own table
    stored = {s: cache.view(-1)[s].item() for s in (11, 24, 25, 26, 27, 20, 21, 29)}
    assert list(stored.values()) == list(range(1, 9)) and cache.count_nonzero() == 8

    cache.view(-1)[24:28] = -1.0                       # pages 6 changed hands since
    out, positions = graphs.run([1], [2], [0], table, [torch.tensor([40, 41])])
    assert out.tolist() == [400, 410] and positions.tolist() == [1, 2]
    assert seen["slots"].tolist()[:3] == [21, 22, -1] and seen["lens"].tolist() == [3, 0, 0, 0]
    assert cache.view(-1)[24:28].tolist() == [-1.0] * 4 and cache.view(-1)[21:23].tolist() == [40, 41]
    assert graphs.steps_run == 2


@pytest.mark.parametrize("with_drafter", [False, True])
def test_static_padded_steps_give_the_eager_tokens_and_acceptance(tiny_target, drafter_dir, with_drafter):
    """The graphs' static padded inputs (run eagerly here) decode exactly what the eager engine decodes: tokens and
    per-step acceptance, while the batch shrinks inside a padded size; and decode steps did go through them."""
    def generate(graphed):
        llm = LLM(tiny_target, draft=drafter_dir if with_drafter else None, page_size=4, max_num_seqs=8)
        if graphed:
            llm.engine.enable_cuda_graphs(capture=False)
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
        for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
            llm.engine.add_request(prompt, p, request_id=str(i))
        done = {}
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                if out.finished:
                    done[out.request_id] = (out.token_ids, out.acceptance_lengths)
        return done, llm.engine

    eager, _ = generate(False)
    graphed, engine = generate(True)
    assert graphed == eager
    assert engine.kv.pages_in_use() == 0
    runs = [(type(g).__name__, g.steps_run) for g in engine.graphs]
    kinds = ["StepGraphs", "RaggedGraphs"] * (2 if with_drafter else 1)     # the drafter's: blocks, context stores
    assert [kind for kind, _ in runs] == kinds and all(n > (5 if kind == "StepGraphs" else 0) for kind, n in runs), runs


def test_the_drafter_graph_stores_the_verified_context_as_the_eager_store_does():
    """With graphs, a step's accepted context waits for the next draft and the drafter graph stores it before
    drafting (no eager store). On the trained demo pair (a random drafter accepts nothing, so a misplaced context
    would go unseen), three prompts at once, one aborted midway: the tokens and every step's acceptance equal the
    eager engine's."""
    demo = Path(__file__).resolve().parents[1] / "models" / "demo"
    prompts = ["import os\nimport sys\n", "def add(a, b):\n    return", "class Stack:\n    def __init__(self):\n"]

    def generate(graphed):
        llm = LLM(str(demo / "target"), draft=str(demo / "drafter"), page_size=16, max_num_seqs=4)
        if graphed:
            llm.engine.enable_cuda_graphs(capture=False)
        for i, (prompt, n) in enumerate(zip(prompts, (24, 17, 30))):
            llm.engine.add_request(llm.engine.tokenizer.encode(prompt), SamplingParams(max_tokens=n, ignore_eos=True),
                                   request_id=str(i))
        done, steps = {}, 0
        while llm.engine.has_unfinished():
            done.update((o.request_id, (o.token_ids, o.acceptance_lengths)) for o in llm.engine.step() if o.finished)
            steps += 1
            if steps == 4:
                llm.engine.abort("1")      # its context from this step is pending: it must not be stored
        return done, llm.engine

    eager, _ = generate(False)
    graphed, engine = generate(True)
    assert graphed == eager
    assert max(al for _, als in eager.values() for al in als) > 2          # drafts were accepted: drafting is covered
    assert engine.speculator.contexts_in_graph > 10                # the graph did store the context
    assert not engine.speculator._pending and engine.kv.pages_in_use() == 0



def test_the_deferred_context_survives_short_budgets_and_preemption():
    """The graphs' deferred context store when steps are not uniform: a token budget of 20 leaves some rows fewer
    drafts (drafted eagerly, the pending context stored first) or none (stored before the target forward), and
    20 pages of 4 tokens for four growing requests preempt some (their pending context dropped; recomputed
    later). Demo pair: tokens and per-step acceptance equal the eager engine's; no page is left."""
    demo = Path(__file__).resolve().parents[1] / "models" / "demo"
    prompts = ["import os\n", "def add(a, b):\n", "class Stack:\n", "for i in range(10):\n"]

    def generate(graphed):
        llm = LLM(str(demo / "target"), draft=str(demo / "drafter"), page_size=4, num_pages=20, max_num_seqs=4,
                  max_num_batched_tokens=20, enable_prefix_caching=False)
        if graphed:
            llm.engine.enable_cuda_graphs(capture=False)
        reqs = [llm.engine.add_request(llm.engine.tokenizer.encode(prompt),
                                       SamplingParams(max_tokens=20, ignore_eos=True), request_id=str(i))
                for i, prompt in enumerate(prompts)]
        done = {}
        while llm.engine.has_unfinished():
            done.update((o.request_id, (o.token_ids, o.acceptance_lengths)) for o in llm.engine.step() if o.finished)
        return done, llm.engine, reqs

    eager, _, _ = generate(False)
    graphed, engine, reqs = generate(True)
    assert graphed == eager and len(eager) == 4
    assert sum(r.num_preemptions for r in reqs) > 0                             # the pool did run short
    stats = engine.spec_stats
    assert stats.num_draft_tokens < stats.num_drafts * engine.speculator.num_spec_tokens    # and the budget
    assert engine.speculator.contexts_in_graph > 0 and engine.kv.pages_in_use() == 0


def test_ragged_graphs_give_the_eager_outputs_across_chunks_prefix_hits_and_sampling_options():
    """Steps with a prompt through the ragged graphs' static padded inputs (run eagerly here): long prompts in
    chunks of a 48-token budget beside decoding rows, a repeated prompt (a prefix hit: its last few tokens are a
    short row among others), and rows with penalties, a logit bias, logprobs and seeded sampling. Demo pair: tokens,
    logprobs and per-step acceptance equal the eager engine's, every ragged graph kind ran, no page is left; and
    ``cuda_graphs: decode`` (``ragged=False``) captures only the uniform steps."""
    demo = Path(__file__).resolve().parents[1] / "models" / "demo"
    text = ["import os\nimport sys\n" * 6, "def add(a, b):\n    return a + b\n" * 4, "import os\nimport sys\n" * 6,
            "class Stack:\n    def __init__(self):\n        self.items = []\n"]
    params = [SamplingParams(max_tokens=14, ignore_eos=True),
              SamplingParams(max_tokens=11, ignore_eos=True, repetition_penalty=1.3, logit_bias=((5, 2.0),)),
              SamplingParams(max_tokens=9, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=7)]

    def generate(ragged):
        llm = LLM(str(demo / "target"), draft=str(demo / "drafter"), page_size=16, max_num_seqs=4,
                  max_num_batched_tokens=48)
        if ragged is not None:
            llm.engine.enable_cuda_graphs(capture=False, ragged=ragged)
        done, step = {}, 0
        while step < 4 or llm.engine.has_unfinished():
            if step < 4:     # one request a step: chunks, prefix hits and decodes mix
                llm.engine.add_request(llm.tokenizer.encode(text[step]), params[step], request_id=str(step))
            step += 1
            for o in llm.engine.step():
                if o.finished:
                    done[o.request_id] = (o.token_ids, o.acceptance_lengths, o.num_cached_tokens,
                                          [(lp.token_id, round(lp.logprob, 4)) for lp in o.logprobs or []])
        return done, llm.engine

    eager, _ = generate(None)
    graphed, engine = generate(True)
    assert graphed == eager and len(eager) == 4 and eager["2"][3]           # request 2 had logprobs
    assert eager["2"][2] >= 16                                     # and a prefix hit on request 0's pages
    ragged_runs = [g.steps_run for g in engine.graphs if isinstance(g, RaggedGraphs)]
    assert len(ragged_runs) == 2 and all(n >= 3 for n in ragged_runs), ragged_runs
    assert engine.kv.pages_in_use() == 0
    _, decode_only = generate(False)
    assert [type(g).__name__ for g in decode_only.graphs] == ["StepGraphs", "StepGraphs"]
    assert use_cuda_graphs("decode", "cuda", "triton", tensor_parallel=False)


def test_a_prompts_few_tokens_after_a_prefix_hit_run_through_the_ragged_graphs():
    """A prompt that the prefix cache holds but for its last few tokens is one short row, all rows of one length,
    yet a prompt step (only its last token's logits are wanted): it takes the ragged graphs (it ran eagerly before,
    2-3x slower than the whole prompt graphed on an H100), with the eager engine's tokens; the decode steps after
    it stay on the decode graphs."""
    demo = Path(__file__).resolve().parents[1] / "models" / "demo"
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def generate(graphs: bool):
        llm = LLM(str(demo / "target"), draft=str(demo / "drafter"), page_size=16, max_num_seqs=4)
        if graphs:
            llm.engine.enable_cuda_graphs(capture=False, ragged=True)
        first = llm.tokenizer.encode("import os\nimport sys\n" * 8)
        llm.engine.add_request(first, params, request_id="first")
        while llm.engine.has_unfinished():
            llm.engine.step()
        runs = [g.steps_run for g in llm.engine.graphs]
        llm.engine.add_request(first[:32] + [7, 8, 9], params, request_id="hit")
        out = llm.engine.step()[0]
        assert out.num_cached_tokens == 32 and len(out.new_token_ids) == 1
        prompt_step = [g.steps_run - n for g, n in zip(llm.engine.graphs, runs)]
        tokens = list(out.token_ids)
        while llm.engine.has_unfinished():
            tokens += [t for o in llm.engine.step() for t in o.new_token_ids]
        return tokens, prompt_step, llm.engine

    eager, _, _ = generate(False)
    graphed, prompt_step, engine = generate(True)
    assert graphed == eager and len(eager) == 6
    target_ragged = engine.graphs.index(engine.runner.ragged)
    assert prompt_step[target_ragged] == 1, prompt_step
    assert sum(n for g, n in zip(engine.graphs, prompt_step) if isinstance(g, StepGraphs)) == 0, prompt_step
    assert engine.kv.pages_in_use() == 0
