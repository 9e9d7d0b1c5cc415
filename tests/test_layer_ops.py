"""The fused Triton layer kernels (``engine.triton_ops``) against the torch reference ops they replace, and a
Triton-backend engine against the torch one (on CPU under TRITON_INTERPRET=1, set by ``scripts/test``)."""

import os
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.attention import store_kv
from engine.model import add_rms_norm, apply_rope, rms_norm, rope_table
from spec_decode import LLM as SpecLLM
from tests import checkpoints

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"

pytestmark = pytest.mark.triton
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
# float32 matches the reference to rounding; bf16 results may differ by one bf16 ulp (2**-8 relative), where
# the reference rounds after every op and the kernels once.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def ops():
    from engine import triton_ops

    return triton_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_the_residual_add(dtype):
    g = torch.Generator().manual_seed(0)
    # Rows strided (every other row of a wider buffer) and a width that is not a power of two.
    wide = torch.randn(6, 2, 96, generator=g).to(dtype).to(DEVICE)
    x = wide[:, 0]
    residual = (4 * torch.randn(6, 96, generator=g)).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype).to(DEVICE)
    out, none = ops().rms_norm(x, weight, 1e-6)
    assert none is None
    torch.testing.assert_close(out, rms_norm(x, weight, 1e-6), **TOLERANCE[dtype])
    normed, total = ops().rms_norm(x, weight, 1e-6, residual)
    want_normed, want_total = add_rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(total, want_total)           # the residual stream's sum rounds exactly as torch's add
    torch.testing.assert_close(normed, want_normed, **TOLERANCE[dtype])
    assert not torch.equal(normed, ops().rms_norm(x, weight, 1e-6)[0])    # the residual was added


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_equals_the_per_head_norm_and_rotate_half(dtype):
    heads, kv_heads, dim, tokens = 4, 2, 16, 5
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype).to(DEVICE)
    q_norm = (1 + 0.2 * torch.randn(dim, generator=g)).to(dtype).to(DEVICE)
    k_norm = (1 - 0.2 * torch.randn(dim, generator=g)).to(dtype).to(DEVICE)
    cos, sin = (t.to(dtype).to(DEVICE) for t in rope_table(dim, 10000.0, 64, DEVICE))
    positions = torch.tensor([0, 7, 8, 63, 31], device=DEVICE)
    q, k, v = ops().qk_norm_rope(qkv, heads, kv_heads, dim, q_norm, k_norm, 1e-6, positions, cos, sin)
    want_q = apply_rope(rms_norm(qkv[:, :heads * dim].unflatten(-1, (heads, dim)), q_norm, 1e-6), positions, cos, sin)
    k_part = qkv[:, heads * dim:(heads + kv_heads) * dim].unflatten(-1, (kv_heads, dim))
    want_k = apply_rope(rms_norm(k_part, k_norm, 1e-6), positions, cos, sin)
    torch.testing.assert_close(q, want_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k, want_k, **TOLERANCE[dtype])
    assert torch.equal(v, qkv[:, (heads + kv_heads) * dim:].unflatten(-1, (kv_heads, dim)))
    # Position 0 does not rotate: q there is the normed q itself (a kernel rotating at the wrong row would not be).
    torch.testing.assert_close(q[0], rms_norm(qkv[0, :heads * dim].view(heads, dim), q_norm, 1e-6),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.float16)])
def test_qk_norm_rope_stores_k_and_v_in_the_pages_as_store_kv_does(dtype, cache_dtype):
    """With the caches given, the kernel writes each token's k and v into its slot itself (the K/V store needs no
    kernel of its own): the pages hold exactly what ``store_kv`` writes from the returned k and v (FP8 scaled and
    saturated alike), a slot of -1 (a padding row) writes nothing, and q is the same."""
    heads, kv_heads, dim, tokens, page = 4, 2, 16, 5, 4
    g = torch.Generator().manual_seed(6)
    qkv = (2 * torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)).to(dtype).to(DEVICE)
    q_norm = (1 + 0.2 * torch.randn(dim, generator=g)).to(dtype).to(DEVICE)
    k_norm = (1 - 0.2 * torch.randn(dim, generator=g)).to(dtype).to(DEVICE)
    cos, sin = (t.to(dtype).to(DEVICE) for t in rope_table(dim, 10000.0, 64, DEVICE))
    positions = torch.tensor([0, 7, 8, 63, 31], device=DEVICE)
    slots = torch.tensor([3, 9, -1, 0, 14], device=DEVICE)
    scales = (0.05, 0.02) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)    # the smaller one saturates
    # Head-major pages, as the pool lays them out ([page, head, token, dim] in memory).
    caches = [[torch.zeros(6, kv_heads, page, dim, device=DEVICE).to(cache_dtype).transpose(1, 2) for _ in range(2)]
              for _ in range(2)]
    q, k, v = ops().qk_norm_rope(qkv, heads, kv_heads, dim, q_norm, k_norm, 1e-6, positions, cos, sin)
    store_kv(k, v, *caches[0], slots, *scales, backend="triton")
    stored = ops().qk_norm_rope(qkv, heads, kv_heads, dim, q_norm, k_norm, 1e-6, positions, cos, sin,
                                store=(*caches[1], slots, *scales))
    assert torch.equal(stored[0], q) and stored[1:] == (None, None)
    for want, got in zip(*caches):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert got.view(torch.uint8).flatten(2).any(-1).sum() == 4        # 4 slots, not the -1
    with pytest.raises(ValueError, match="a cache must be"):
        ops().qk_norm_rope(qkv, heads, kv_heads, dim, q_norm, k_norm, 1e-6, positions, cos, sin,
                           store=(caches[1][0][..., :8], caches[1][1], slots, 1.0, 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_over_the_fused_gate_up(dtype):
    g = torch.Generator().manual_seed(2)
    gate_up = (3 * torch.randn(3, 2 * 1100, generator=g)).to(dtype).to(DEVICE)   # two column blocks, a ragged tail
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops().silu_mul(gate_up), torch.nn.functional.silu(gate) * up, **TOLERANCE[dtype])


# The few-row linear: on CPU (the interpreter) with small tiles forced, on a GPU with the tiles it picks.
SKINNY_TILES = [(32, 128, 2), (64, 256, 3)] if DEVICE == "cpu" else [None]


@pytest.mark.parametrize("tiles", SKINNY_TILES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_few_row_linear_equals_the_matmul_to_rounding(dtype, tiles, monkeypatch):
    """Rows 1 to 32 (strided rows, leading dims; past 16 rows a 32-row input tile, which the kernel takes where
    ``SKINNY_MAX_ROWS`` allows) times a weight whose columns end in a partial tile, against the float32 product
    rounded once: within one ulp of the activation dtype (the sum's order differs)."""
    monkeypatch.setattr(ops(), "SKINNY_MAX_ROWS", 32)
    g = torch.Generator().manual_seed(3)
    n, k = 100, 512
    weight = (torch.randn(n, k, generator=g) / 16).to(dtype).to(DEVICE)
    for rows in (1, 5, 16, 17, 32):
        wide = torch.randn(rows, 2, k, generator=g).to(dtype).to(DEVICE)
        x = wide[:, 1]                                      # rows 2K apart
        got = ops().skinny_linear(x, weight, tiles)
        want = (x.float() @ weight.float().T).to(dtype)
        assert got.shape == (rows, n) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    batched = torch.randn(2, 3, k, generator=g).to(dtype).to(DEVICE)
    got = ops().skinny_linear(batched, weight, tiles)
    assert got.shape == (2, 3, n)
    torch.testing.assert_close(got.float(), (batched.float() @ weight.float().T).to(dtype).float(), rtol=2 ** -7,
                               atol=1e-3)


@pytest.mark.parametrize("tiles", SKINNY_TILES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_few_row_linear_folds_in_the_norm_the_swiglu_and_the_residual_add(dtype, tiles):
    """The layer's elementwise work in the few-row kernel: the product of the RMS-normed stream within rounding of
    the float32 truth (as close as norm-then-product is); SwiGLU and the residual add exactly as the kernels they
    replace round them."""
    g = torch.Generator().manual_seed(5)
    n, k = 100, 512
    weight = (torch.randn(n, k, generator=g) / 16).to(dtype).to(DEVICE)
    for rows in (1, 5, 16):
        h = (3 * torch.randn(rows, 2, k, generator=g)).to(dtype).to(DEVICE)[:, 0]        # strided rows
        norm = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
        got = ops().skinny_linear(h, weight, tiles, norm=norm, eps=1e-6)
        unfused = ops().skinny_linear(ops().rms_norm(h, norm, 1e-6)[0], weight, tiles)
        hf = h.float()
        truth = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.float()) @ weight.float().T
        scale = truth.abs().max().item()
        assert (got.float() - truth).abs().max() <= max(2 * (unfused.float() - truth).abs().max(), 2 ** -7 * scale)
        gate_up = (2 * torch.randn(rows, 2 * k, generator=g)).to(dtype).to(DEVICE)
        residual = torch.randn(rows, n, generator=g).to(dtype).to(DEVICE)
        swiglu = ops().silu_mul(gate_up)
        assert torch.equal(ops().skinny_linear(gate_up, weight, tiles, silu=True),
                           ops().skinny_linear(swiglu, weight, tiles))
        assert torch.equal(ops().skinny_linear(gate_up, weight, tiles, silu=True, residual=residual),
                           ops().skinny_linear(swiglu, weight, tiles) + residual)
        assert torch.equal(ops().skinny_linear(swiglu, weight, tiles, residual=residual),
                           ops().skinny_linear(swiglu, weight, tiles) + residual)


@pytest.mark.parametrize("tiles", SKINNY_TILES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_few_row_linear_takes_swiglu_in_its_epilogue(dtype, tiles):
    """``swiglu``: each program multiplies x by its columns' gate rows and the matching up rows of the fused
    gate_up weight (I rows below) and returns ``silu(gate) * up``: ``silu_mul`` of the plain product, to the bit,
    with the residual add after it as the stream's add rounds; ``linear_swiglu`` gives the same wherever it runs."""
    g = torch.Generator().manual_seed(6)
    inter, k = 100, 512
    gate_up = (torch.randn(2 * inter, k, generator=g) / 16).to(dtype).to(DEVICE)
    for rows in (1, 5, 16):
        x = (2 * torch.randn(rows, k, generator=g)).to(dtype).to(DEVICE)
        residual = torch.randn(rows, inter, generator=g).to(dtype).to(DEVICE)
        want = ops().silu_mul(ops().skinny_linear(x, gate_up, tiles))
        got = ops().skinny_linear(x, gate_up, tiles, swiglu=True)
        assert got.shape == (rows, inter) and torch.equal(got, want)
        assert torch.equal(ops().skinny_linear(x, gate_up, tiles, swiglu=True, residual=residual), want + residual)
        assert torch.equal(ops().linear_swiglu(x, gate_up), ops().silu_mul(ops().linear(x, gate_up)))
    with pytest.raises(ValueError, match="gate_up weight of 2 I rows"):
        ops().skinny_linear(x, gate_up[1:], tiles, swiglu=True)


def test_linear_takes_the_few_row_kernel_only_where_it_applies():
    """On a GPU: half-precision rows up to SKINNY_MAX_ROWS with K a multiple of the K tile; everything else (and
    anything on the CPU) is torch's own product, to the bit."""
    g = torch.Generator().manual_seed(4)
    weight = (torch.randn(96, 256, generator=g) / 16).to(torch.bfloat16).to(DEVICE)
    few = torch.randn(8, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    many = torch.randn(ops().SKINNY_MAX_ROWS + 1, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    on_gpu = DEVICE == "cuda"
    assert ops().skinny_fits(8, weight, torch.bfloat16) is on_gpu
    assert not ops().skinny_fits(ops().SKINNY_MAX_ROWS + 1, weight, torch.bfloat16)
    assert not ops().skinny_fits(0, weight, torch.bfloat16)
    assert not ops().skinny_fits(8, weight.float(), torch.float32)
    assert not ops().skinny_fits(8, weight[:, :200], torch.bfloat16)
    assert torch.equal(ops().linear(many, weight), torch.nn.functional.linear(many, weight))
    if on_gpu:
        assert torch.equal(ops().linear(few, weight), ops().skinny_linear(few, weight))
    else:
        assert torch.equal(ops().linear(few, weight), torch.nn.functional.linear(few, weight))


def test_the_precompiled_linears_are_every_weight_a_spec_step_multiplies_by(monkeypatch):
    """``LLMEngine.linear_weights`` (what start-up compiles the few-row kernel for) holds every weight the target's
    and the drafter's forwards pass to ``triton_ops.linear``: one missed would compile inside a step while serving.
    Recorded from the engine's start, which on a GPU captures the steps' graphs (their linears run only then)."""
    seen = set()
    linear = ops().linear

    def recording(x, weight):
        seen.add((weight.data_ptr(), tuple(weight.shape), weight.stride()))
        return linear(x, weight)

    monkeypatch.setattr(ops(), "linear", recording)
    llm = SpecLLM(str(DEMO / "target"), draft=str(DEMO / "drafter"), device=DEVICE, page_size=16,
                  attention_backend="triton")
    out = llm.generate(["import os\nimport sys\n"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert len(out.acceptance_lengths) > 1                 # drafted and verified, not only prefilled
    covered = {(w.data_ptr(), tuple(w.shape), w.stride()) for w in llm.engine.linear_weights()}
    assert seen and seen <= covered, seen - covered
    drafter = llm.engine.speculator.drafter
    assert (drafter.fc.data_ptr(), tuple(drafter.fc.shape), drafter.fc.stride()) in seen   # the drafter's too


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="contiguous last dim"):
        ops().rms_norm(torch.randn(4, 8).t(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="qkv must be"):
        ops().qk_norm_rope(torch.randn(2, 10), 1, 1, 4, torch.ones(4), torch.ones(4), 1e-6, torch.zeros(2).long(),
                           torch.ones(8, 4), torch.ones(8, 4))
    with pytest.raises(ValueError, match="activations"):
        ops().silu_mul(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 128"):
        ops().skinny_linear(torch.zeros(2, 200), torch.zeros(8, 200), (32, 128, 2))
    with pytest.raises(ValueError, match="K tile 256"):
        ops().skinny_linear(torch.zeros(2, 384), torch.zeros(8, 384), (32, 256, 2))
    with pytest.raises(ValueError, match="at most 32 rows"):
        ops().skinny_linear(torch.zeros(33, 256), torch.zeros(8, 256), (32, 128, 2))
    with pytest.raises(ValueError, match="rows of 512"):       # silu takes the gate_up projection, 2 K wide
        ops().skinny_linear(torch.zeros(2, 256), torch.zeros(8, 256), (32, 128, 2), silu=True)
    with pytest.raises(ValueError, match="norm's weight"):
        ops().skinny_linear(torch.zeros(2, 256), torch.zeros(8, 256), (32, 128, 2), norm=torch.ones(128))
    with pytest.raises(ValueError, match="residual must be 2 contiguous rows of 8"):
        ops().skinny_linear(torch.zeros(2, 256), torch.zeros(8, 256), (32, 128, 2), residual=torch.zeros(3, 8))


def test_a_triton_engine_decodes_the_torch_engine_tokens(tmp_path):
    """The target's forward through the fused kernels (norms with the residual add, q/k norm and RoPE, SwiGLU, the
    final norm) and Triton attention gives the torch path's greedy tokens, float32."""
    target = checkpoints.write_tiny_qwen3(tmp_path / "target")
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [40, 41], list(range(60, 80))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    got = {backend: [o.token_ids for o in SpecLLM(str(target), device=DEVICE, page_size=8,
                                                   attention_backend=backend).generate(prompts, params)]
           for backend in ("torch", "triton")}
    assert got["triton"] == got["torch"]
    assert all(len(tokens) == 6 for tokens in got["triton"])


def test_the_drafter_through_the_fused_kernels_drafts_what_the_torch_drafter_drafts():
    """The demo pair, whose drafter is trained (a random one accepts nothing, so a wrong draft would go unseen):
    the drafter's blocks and context stores through the fused kernels give the torch path's per-step acceptance
    lengths, and the tokens, float32."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    got = {}
    for backend in ("torch", "triton"):
        llm = SpecLLM(str(DEMO / "target"), draft=str(DEMO / "drafter"), device=DEVICE, page_size=16,
                      attention_backend=backend)
        out = llm.generate(["import os\nimport sys\n"], params)[0]
        got[backend] = (out.token_ids, out.acceptance_lengths)
    assert got["triton"] == got["torch"]
    assert max(got["torch"][1]) > 2        # the drafts were accepted: the comparison covers drafting


def test_few_row_steps_fold_the_layers_elementwise_work_into_their_linears(monkeypatch):
    """The demo pair in fp16 (bf16's rounding is slow under the interpreter) with the few-row kernel taken on this
    device too: a step of few rows (decode,
    verification, drafter blocks) runs each layer, the target's and the drafter's, as 4 linears that norm the
    residual stream, add to it and take SwiGLU as they read and write it. Its per-step acceptance and tokens equal
    those of the same engine with the norm and add kernels of their own and SwiGLU in gate_up's epilogue (the
    default), which folds nothing else; each fused variant either launched is one that start-up compiles
    (``LLMEngine.fused_linears``)."""
    def fits_here(rows, weight, dtype):         # skinny_fits without its GPU check
        return (1 <= rows <= ops().SKINNY_MAX_ROWS and dtype == weight.dtype == torch.float16 and weight.dim() == 2
                and weight.stride(-1) == 1 and weight.shape[1] % ops().SKINNY_BLOCK_K == 0)

    monkeypatch.setattr(ops(), "skinny_fits", fits_here)
    skinny = ops().skinny_linear
    fused_calls = []

    def recording(x, weight, tiles=None, **kw):
        folded = {name for name, value in kw.items() if name != "eps" and value is not None and value is not False}
        if folded:       # (start-up's warm-up passes every keyword, None or False where nothing folds)
            fused_calls.append((weight.data_ptr(), tuple(weight.shape), tuple(sorted(folded))))
        if tiles is None and DEVICE == "cpu":     # wide tiles: the interpreter's time goes by programs
            tiles = (128, 256 if weight.shape[1] % 256 == 0 else 128, 2)
        return skinny(x, weight, tiles, **kw)

    monkeypatch.setattr(ops(), "skinny_linear", recording)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    got = {}
    for fused in (True, False):
        monkeypatch.setattr(ops(), "FUSED_LAYERS", fused)
        llm = SpecLLM(str(DEMO / "target"), draft=str(DEMO / "drafter"), device=DEVICE, page_size=16,
                      attention_backend="triton", dtype="float16")
        out = llm.generate(["import os\nimport sys\n"], params)[0]
        got[fused] = (out.token_ids, out.acceptance_lengths)
        seen = set(fused_calls)
        fused_calls.clear()
        covered = {(w.data_ptr(), tuple(w.shape), tuple(sorted(kw))) for w, kw in llm.engine.fused_linears()}
        assert seen and seen <= covered, seen - covered
        for layers in (llm.engine.model.layers, llm.engine.speculator.drafter.layers):
            if fused:
                assert (layers[0].qkv.data_ptr(), tuple(layers[0].qkv.shape), ("norm",)) in seen
                assert (layers[-1].down.data_ptr(), tuple(layers[-1].down.shape), ("residual", "silu")) in seen
            else:         # only gate_up's SwiGLU epilogue
                assert (layers[-1].gate_up.data_ptr(), tuple(layers[-1].gate_up.shape), ("swiglu",)) in seen
        if not fused:
            assert {kw for _, _, kw in seen} == {("swiglu",)}
    assert got[True] == got[False]
    assert max(got[True][1]) > 2                 # drafts were accepted: drafting went through the fused layers too
