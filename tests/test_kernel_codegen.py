"""The layer kernels and the decode attention kernel compiled for an H100 (sm_90) by Triton's own compiler, on any
machine (no GPU needed). The interpreter that runs them in the other CPU tests never lowers them, so a kernel that
only fails to compile for a GPU, or whose tiles lost their pipelining, would pass every CPU test. These compile
the variants a few-row step launches, with the specialisations a real call gets (16-byte aligned pointers, sizes
and strides multiples of 16, except what a kernel declares unspecialised), in a process of their own (this one may
run Triton's interpreter, which compiles nothing), and read the PTX."""

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.triton
ROOT = Path(__file__).resolve().parents[1]

# (name, kernel, runtime argument types, constexprs, stages)
BF16_POINTERS = ("x_ptr", "w_ptr", "out_ptr", "g_ptr", "res_ptr")
LINEARS = {f"{prologue}{'+residual' if residual else ''}": (
    "_skinny_linear_kernel", {**{p: "*bf16" for p in BF16_POINTERS}, "eps": "fp32"},
    dict(PROLOGUE=prologue, RESIDUAL=residual, ROUND="bf16", BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
         DOT_FP32=False), stages)
    for prologue, residual, block_n, block_k, stages in [("none", False, 64, 128, 3), ("norm", False, 64, 128, 3),
                                                         ("none", True, 32, 128, 6), ("silu", True, 32, 256, 6)]}
LINEARS["none swiglu"] = (LINEARS["none"][0], LINEARS["none"][1], {**LINEARS["none"][2], "BLOCK_N": 32, "SWIGLU": True},
                          3)       # gate_up with SwiGLU in its epilogue: 32 columns, 64 weight rows
LINEARS["none 32 rows"] = (LINEARS["none"][0], LINEARS["none"][1], {**LINEARS["none"][2], "BLOCK_M": 32}, 3)
QK_TYPES = {**{p: "*bf16" for p in ("qkv_ptr", "q_ptr", "k_ptr", "q_norm_ptr", "k_norm_ptr", "cos_ptr", "sin_ptr")},
            "pos_ptr": "*i64", "slot_ptr": "*i64", "k_scale": "fp32", "v_scale": "fp32", "eps": "fp32"}
QK_NORM_ROPE = {f"{cache} store={store}": (
    "_qk_norm_rope_kernel", {**QK_TYPES, "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}"},
    dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, PAGE_SIZE=16, ROUND="bf16", STORE=store), 3)
    for cache in ("fp8e4nv", "bf16") for store in (True, False)}
# The split-KV decode kernel at Qwen3-8B's heads (GQA group 4, head dim 128) with each cache dtype's tiling; FP8 V
# widened as it arrives and at the product.
DECODE = {f"decode {cache}{' widened' if widen else ''}": (
    "triton_attention._decode_split_kernel",
    {"q_ptr": "*bf16", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}", "out_ptr": "*bf16",
     "partial_out_ptr": "*bf16", "partial_lse_ptr": "*fp32", "block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32",
     "seq_lens_ptr": "*i32", "qk_scale_log2": "fp32", "v_scale": "fp32"},
    dict(GROUP=4, CAUSAL=False, PAGE_SIZE=16, BLOCK_M=16, BLOCK_N=block_n, HEAD_DIM=128, BLOCK_D=128, DOT_DTYPE=dot,
         SINGLE_SPLIT=False, PREFETCH_PAGES=prefetch, MAX_SPLIT_TILES=2048 // block_n, WIDEN_V=widen,
         SAME_PAGE_STRIDE=True), 3)
    for cache, block_n, dot, prefetch, widen in (("fp8e4nv", 128, "fp16", True, False),
                                                 ("fp8e4nv", 128, "fp16", True, True),
                                                 ("bf16", 64, "bf16", False, False))}
# Decode tokens' splits merged by the last program of each (seq, kv head) (``_merge_in_last_program``).
_FP8_DECODE = DECODE["decode fp8e4nv"]
MERGED = {"decode fp8e4nv merged": (_FP8_DECODE[0], {**_FP8_DECODE[1], "partial_out_ptr": "*fp32",
                                                     "merge_count_ptr": "*i32"},
                                    {**_FP8_DECODE[2], "MERGE_ROWS": 4, "MERGE_SPLITS": 16}, 3)}

# Each kernel of a few-row step compiled to launch programmatically dependent (``triton_attention.PDL``).
NORM_TYPES = {**{p: "*bf16" for p in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "sum_ptr")}, "eps": "fp32"}
PDL_VARIANTS = {f"{name} pdl": (kernel, types, {**constexprs, "PDL": True}, stages)
                for name, (kernel, types, constexprs, stages) in {
    "linear": (*LINEARS["none+residual"][:2], {**LINEARS["none+residual"][2], "PREFETCH_K": 512}, 6),
    "linear swiglu": (*LINEARS["none swiglu"][:2], {**LINEARS["none swiglu"][2], "PREFETCH_K": 512}, 3),
    "qk_norm_rope": QK_NORM_ROPE["fp8e4nv store=True"],
    "decode": DECODE["decode fp8e4nv"],
    "reduce": ("triton_attention._decode_reduce_kernel",
               {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "out_ptr": "*bf16",
                "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32"},
               dict(BLOCK_N=128, MAX_SPLIT_TILES=16, HEAD_DIM=128, BLOCK_S=16, BLOCK_D=128), 1),
    "rms_norm": ("_rms_norm_kernel", NORM_TYPES, dict(HAS_RESIDUAL=True, ROUND="bf16", BLOCK=4096), 1),
    "silu_mul": ("_silu_mul_kernel", {"x_ptr": "*bf16", "out_ptr": "*bf16"}, dict(ROUND="bf16", BLOCK=1024), 1),
}.items()}


def _compile_all(variants: dict) -> dict:
    """Run in a fresh process without the interpreter: each variant's shared memory and PTX."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    out = {}
    for name, (kernel, types, constexprs, stages) in variants.items():
        module, _, kernel = kernel.rpartition(".")
        fn = getattr(importlib.import_module(f"engine.{module or 'triton_ops'}"), kernel)
        # Constexprs left out take their defaults, as in a call.
        constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
        signature = {arg: types.get(arg, "constexpr" if arg in constexprs else "i32") for arg in fn.arg_names}
        # What the kernel declares unspecialised stays so (sizes that vary by step, metadata slices' pointers).
        plain = {fn.arg_names[i] if isinstance(i, int) else i
                 for i in [*fn.do_not_specialize, *fn.do_not_specialize_on_alignment]}
        attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
                 if arg not in plain and (signature[arg].startswith("*") or signature[arg] == "i32")}
        compiled = triton_compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages})
        out[name] = {"shared": compiled.metadata.shared, "ptx": compiled.asm["ptx"]}
    return out


@pytest.fixture(scope="module")
def codegen():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = ("import json, sys; from tests.test_kernel_codegen import DECODE, LINEARS, MERGED, PDL_VARIANTS, "
              "QK_NORM_ROPE, _compile_all; json.dump(_compile_all({**LINEARS, **QK_NORM_ROPE, **DECODE, **MERGED, "
              "**PDL_VARIANTS}), sys.stdout)")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("name", list(LINEARS))
def test_each_few_row_linear_variant_compiles_with_its_weight_tiles_pipelined(codegen, name):
    """qkv / gate_up (the norm folded in), o (the residual add), down (SwiGLU and the add) and the plain product
    compile for sm_90 with the tiles of an 8B-shaped step: tiles loaded by cp.async into several stages of shared
    memory (the weight streams while earlier tiles multiply), products on the tensor cores, and each folded op
    present only where it is folded in; gate_up with SwiGLU in its epilogue stages its gate and up tiles together;
    a 32-row input tile (17-32 rows) stages it whole."""
    _, _, constexprs, _ = LINEARS[name]
    ptx, shared = codegen[name]["ptx"], codegen[name]["shared"]
    x_tiles = 2 if constexprs["PROLOGUE"] == "silu" else 1
    swiglu = constexprs.get("SWIGLU", False)
    stage_bytes = (constexprs["BLOCK_M"] * x_tiles + constexprs["BLOCK_N"] * (2 if swiglu else 1)) * \
        constexprs["BLOCK_K"] * 2
    assert re.search(r"cp\.async\.(cg|ca)", ptx)
    assert shared >= 2 * stage_bytes, (shared, stage_bytes)
    assert re.search(r"mma\.sync|wgmma", ptx)
    assert ("ex2.approx" in ptx) == (constexprs["PROLOGUE"] == "silu" or swiglu)
    assert ("rsqrt" in ptx) == (constexprs["PROLOGUE"] == "norm")


@pytest.mark.parametrize("name", list(QK_NORM_ROPE))
def test_the_q_k_norm_rope_kernel_compiles_with_and_without_the_kv_store(codegen, name):
    """The q/k norm + RoPE kernel for sm_90, with the K/V store folded in (FP8 and bf16 pages) and without: only
    the FP8 store writes single bytes."""
    _, _, constexprs, _ = QK_NORM_ROPE[name]
    ptx = codegen[name]["ptx"]
    assert "rsqrt" in ptx
    byte_stores = re.search(r"st\.global(\.\w+)*\.(b8|u8)\b", ptx) is not None
    assert byte_stores == (constexprs["STORE"] and name.startswith("fp8"))


@pytest.mark.parametrize("name", list(DECODE))
def test_the_split_kv_decode_kernel_compiles_for_each_cache_dtype(codegen, name):
    """The decode attention kernel for sm_90 with the tiles each cache dtype takes: K/V tiles through cp.async
    stages, both products on the tensor cores, and FP8 pages widened to fp16 two values an instruction (the
    conversion its speed rests on), bf16 pages not converted at all."""
    ptx = codegen[name]["ptx"]
    assert re.search(r"cp\.async\.(cg|ca)", ptx)
    assert re.search(r"mma\.sync|wgmma", ptx)
    assert bool(re.search(r"cvt\.rn\.f16x2\.e4m3x2", ptx)) == ("fp8e4nv" in name)


def test_fp8_v_widened_as_it_arrives_reaches_the_tensor_cores_without_byte_wide_loads(codegen):
    """The P @ V product reads V transposed from shared memory. An FP8 tile widened at the product is read a byte at
    a time (sm_90 has no 8-bit transposed ldmatrix); widened as it arrives (``WIDEN_V``) it is stored as fp16 and
    read by 16-bit transposed ldmatrix, with no byte-wide shared-memory load left in the kernel."""
    byte_loads = r"ld\.shared\.[bu]8\b"
    transposed = r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16"
    widened, at_product = codegen["decode fp8e4nv widened"]["ptx"], codegen["decode fp8e4nv"]["ptx"]
    assert re.search(byte_loads, at_product) and not re.search(transposed, at_product)
    assert re.search(transposed, widened) and not re.search(byte_loads, widened)


def test_the_last_split_reads_the_others_partials_only_after_they_are_published(codegen):
    """Merged in the split kernel, a decode token's splits publish their partials in order: every thread's
    partial stores, a block barrier, then one thread's acquire-release count at GPU scope; after that count (and
    the barrier that shares its result) the last program resets the counter and reads the partials past L1, 16
    bytes at a time. The plain kernel has no atomic."""
    ptx = codegen["decode fp8e4nv merged"]["ptx"]
    count = re.search(r"atom\.global\.gpu\.acq_rel\.add\.u32", ptx)
    assert count and "atom" not in codegen["decode fp8e4nv"]["ptx"]
    before, after = ptx[:count.start()], ptx[count.end():]
    assert before.rfind("bar.sync") > before.rfind("st.global")
    reset = re.search(r"atom\.global\.gpu\.\w+\.exch", after)
    partials = re.search(r"ld\.global\.cg\.v4\.b32", after)
    assert reset and partials and after.find("bar.sync") < reset.start() < partials.start()
    assert not re.search(r"ld\.global\.(?!cg)", after[reset.start():])


@pytest.mark.parametrize("name", list(PDL_VARIANTS))
def test_a_kernel_launched_dependent_waits_for_the_one_before_it_ahead_of_any_memory_access(codegen, name):
    """Launched programmatically dependent (``triton_attention.PDL``), a kernel starts while the one before it
    still runs: each compiled variant waits for it (``griddepcontrol.wait``) before its first global load, store or
    cp.async, then lets the next kernel launch. The few-row linear prefetches its leading weight lines into L2
    before it waits, and only those (gate's and up's rows with SwiGLU in its epilogue). Compiled without PDL, no
    kernel has either."""
    ptx = codegen[name]["ptx"]
    body = ptx[ptx.index("{", ptx.index(".entry")):]
    wait, launch = body.find("griddepcontrol.wait"), body.find("griddepcontrol.launch_dependents")
    first_access = re.search(r"\b(ld|st|atom|red)\.global|cp\.async", body)
    assert 0 <= wait < launch and first_access and wait < first_access.start(), (wait, launch, first_access)
    prefetches = [m.start() for m in re.finditer(r"prefetch\.global\.L2", body)]
    assert bool(prefetches) == name.startswith("linear") and all(at < wait for at in prefetches)
    if prefetches:             # a line per 64 weights of each row (gate's and up's with SwiGLU), over 128 threads
        constexprs = PDL_VARIANTS[name][2]
        lines = constexprs["BLOCK_N"] * constexprs["PREFETCH_K"] // 64 * (2 if constexprs.get("SWIGLU") else 1)
        assert len(prefetches) == lines // 128, (len(prefetches), lines)
    for plain in ("none+residual", "fp8e4nv store=True", "decode fp8e4nv"):
        assert "griddepcontrol" not in codegen[plain]["ptx"] and "prefetch.global" not in codegen[plain]["ptx"]
