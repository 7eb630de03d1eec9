"""The sm90 Gluon sparse MLA kernel (``sparse_mla(..., _kernel="gluon")``, openmla/ops/gluon/sparse.py): an offline
sm90 compile report on the CPU, the refusals, and the kernel against the fp32 reference on an sm90 GPU (``hopper``
marker: heads 64 / 128 (and masked 40 / 96), rows 1 / 37 / 300, top-k 64 / 100 / 2048, blocks 1 / 64, invalid
entries, lengths, sinks, splits, both cache dtypes, NaN in every unused slot)."""

import importlib.util
import itertools

import pytest
import torch

import openmla
from openmla.device import INTERPRET
from openmla.ops.gluon import sparse as gs
from openmla.ops.gluon.decode import SMEM_LIMIT
from openmla.reference import ds_mla_row_ref, sparse_mla_ref
from openmla.reference.v4 import rope_cache_ref, v4_block_bytes
from openmla.utils.sm90_report import run_report_script
from openmla.utils.testing import TOLERANCES, assert_close, random_v4_cache

SCALE = 576**-0.5
INF = float("inf")
HAS_NVIDIA_BACKEND = importlib.util.find_spec("triton.backends.nvidia") is not None

# (FMT, D_QK, NUM_SPLITS, HAS_LEN, HAS_SINK, PAGE, HAS_EXTRA, E_HAS_LEN, E_PAGE, HAS_ROPE): the two-warpgroup
# consumers' specialisations: fp8_v4 rows (their default), by split, lengths, sinks, pages (power-of-two, unit, the
# extra source's own), one or two sources and the fused inverse RoPE; the plain fp8_ds_mla path; bf16 rows' plain
# code (private since "asym", the reference of the variants). The bf16 defaults are ASYM_VARIANTS below
COMPILE_VARIANTS = [
    (0, 576, 1, True, True, 64, False, False, 64, False),
    (1, 576, 1, True, True, 64, False, False, 64, False),
    (1, 576, 4, False, True, 1, False, False, 1, False),
    (2, 512, 1, True, True, 256, True, True, 64, True),  # V4 decode / paged prefill
    (2, 512, 4, True, True, 256, True, True, 64, True),
    (2, 512, 1, True, True, 256, True, False, 2, False),
    (2, 512, 1, False, False, 1, True, True, 1, True),
    (2, 512, 1, True, True, 64, False, False, 64, False),  # fp8_v4, one source
]
# fp8_v4 (FMT 2): its consumers run on 216 registers and some specialisations spill 8 bytes there (one LDL a tile,
# the row-max scratch address; sm90 offline, triton 3.6; V4 decode / paged prefill with the inverse RoPE: none), so
# it is bounded by format, not zero
SPILL_BOUND = {2: 8}
# "staged" fp8_v4: the consumers dequantise (224 registers) and spill up to 16 bytes (one LDL a tile)
STAGED_SPILL_BOUND = {1: 0, 2: 16}
# the private variants (sparse_mla(_gluon_opts=...), OPTS bits of gs.GLUON_OPTS) on V3.2 specialisations: the same
# bounds (no spill), the 11th field is OPTS
OPTS_VARIANTS = [
    (2, 512, 1, True, True, 256, True, True, 64, True, 2),  # lazy, V4 decode / paged prefill (fp8_v4)
    (2, 512, 1, True, True, 256, True, True, 64, True, 4),  # staged fp8_v4: two sources, the inverse RoPE
    (2, 512, 1, True, True, 256, True, True, 64, True, 6),  # staged + lazy
    (2, 512, 4, True, True, 64, False, False, 64, False, 4),  # one source, splits
    (1, 576, 1, True, True, 64, False, False, 64, False, 1),  # nanpack
    (1, 576, 4, False, True, 1, False, False, 1, False, 3),  # nanpack + lazy
    (0, 576, 1, True, True, 64, False, False, 64, False, 2),  # lazy, bf16 rows (their default before "asym")
    (1, 576, 1, True, True, 64, False, False, 64, False, 4),  # staged
    (1, 576, 1, True, True, 64, False, False, 64, False, 7),  # staged + nanpack + lazy: the fp8_ds_mla default
    (1, 576, 4, False, True, 1, False, False, 1, False, 7),
    (1, 576, 1, False, False, 64, False, False, 64, False, 7),
]

# the head of both offline compile scripts: compile_sm90(fn, cons, views) builds the sparse kernels' signature
# (pointer types by argument name, cache views by format, 16-divisible pointers and strides, as the JIT specialises
# them) and compiles it for sm90
_COMPILE_PRELUDE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from openmla.utils.sm90_report import resource_report


def compile_sm90(fn, cons, views, num_warps):
    ptr = {"q": "*bf16", "idx": "*i32", "lens": "*i32", "eidx": "*i32", "elens": "*i32", "sink": "*fp32",
           "out": "*bf16", "lse": "*fp32", "o_part": "*fp32", "lse_part": "*fp32", "rope_pos": "*i32",
           "cos_sin": "*fp32"}
    ptr.update({f"{src}kv{k}": t for src in ("", "e") for k, t in views.items()})
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in cons:
            sig[name] = "constexpr"
        elif name in ptr:
            sig[name] = ptr[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "scale_log2":
            sig[name] = "fp32"
        elif name.startswith("stride_") and name not in ("stride_i_t", "stride_ei_t", "stride_cs"):
            sig[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
    return triton.compile(GluonASTSource(fn, sig, constexprs=cons, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps))
"""

_COMPILE_SCRIPT = (
    _COMPILE_PRELUDE
    + r"""
from openmla.ops.gluon import sparse as gs

report = []
for v in json.loads(sys.argv[1]):
    fmt, d_qk, splits, has_len, has_sink, page, extra, e_len, e_page, rope = v[:10]
    opts = v[10] if len(v) > 10 else 0
    fn = gs._sparse_mla_gluon_fwd_kernel
    cons = dict(PAGE=page, E_PAGE=e_page, FMT=fmt, D_QK=d_qk, N_HB=2, NUM_SPLITS=splits, HAS_LEN=has_len,
                HAS_EXTRA=extra, E_HAS_LEN=e_len, HAS_SINK=has_sink, HAS_ROPE=rope, ROPE=64 if rope else 2,
                BLOCK_N=gs.BLOCK_N, STAGES=gs.STAGES, FP8_PASSES=gs.FP8_PASSES,
                PRODUCER_REGS=gs.producer_regs(fmt, d_qk, opts), num_warps=4 if opts & 16 else gs.NUM_WARPS,
                OPTS=opts)
    cons["WALK"] = bool(len(v) > 11 and v[11])  # a constexpr, as the launcher's (not an i32 with both paths)
    kvt = "*bf16" if fmt == 0 else "*u8"
    f32 = {0: kvt, 1: "*fp32", 2: "*fp32" if opts & 4 else kvt}[fmt]  # staged fp8_v4: the exponent words
    views = {"": kvt, "_f32": f32, "_b16": "*bf16" if fmt else kvt}
    k = compile_sm90(fn, cons, views, cons["num_warps"])
    ptx = k.asm["ptx"]
    r = resource_report(k)
    r.update(variant=v, qk=ptx.count("wgmma.mma_async.sync.aligned.m64n32k16"),
             qk64=ptx.count("wgmma.mma_async.sync.aligned.m64n64k16"),
             pv=ptx.count("wgmma.mma_async.sync.aligned.m64n256k16"), cp_async=ptx.count("cp.async.cg.shared.global"),
             cp_async4=ptx.count("cp.async.ca.shared.global"), noinc=ptx.count("cp.async.mbarrier.arrive.noinc"),
             mul_bf16x2=ptx.count("mul.rn.bf16x2"))
    report.append(r)
print("REPORT" + json.dumps(report))
"""
)


@pytest.mark.skipif(not gs.GLUON_AVAILABLE or not HAS_NVIDIA_BACKEND, reason="needs triton's Gluon and NVIDIA backend")
def test_sparse_gluon_compiles_for_sm90():
    # offline sm90 compile (no GPU needed): no spill (but SPILL_BOUND), fits the shared memory, 12 warps (8 consumers
    # + the producer warpgroup) with registers moved by setmaxnreg; the scores are m64n32k16 (each warpgroup scores 32
    # of the 64 keys: 9 (V3.2) or 8 (V4) chunks x 4 k-steps), P V m64n256k16 (each warpgroup 256 of the 512 columns);
    # bf16 rows by cp.async (9 or 8 [64, 64] copies, 4 a thread), fp8 rows by loads; "staged" fp8 rows by cp.async
    # only (e4m3 bytes 16 a thread, rope 4, 16 bytes each; the scales 2 of 4 bytes, V4's exponents 1) on the staged
    # producer's registers
    reports = run_report_script(_COMPILE_SCRIPT, COMPILE_VARIANTS + OPTS_VARIANTS)
    for r in reports:
        v = tuple(r["variant"])
        name = "FMT={} D_QK={} NUM_SPLITS={} HAS_LEN={} HAS_SINK={} PAGE={} HAS_EXTRA={} E_HAS_LEN={} E_PAGE={} " \
               "HAS_ROPE={}".format(*v[:10]) + (f" OPTS={v[10]}" if len(v) > 10 else "")  # fmt: skip
        chunks = v[1] // 64
        staged = len(v) > 10 and v[10] & gs.GLUON_OPTS["staged"]
        bound = STAGED_SPILL_BOUND[v[0]] if staged else SPILL_BOUND.get(v[0], 0)
        assert r["regs"] <= 255 and r["stack"] <= bound and r["local"] == 0, f"{name}: spills {r}"
        assert r["shared"] + r["static_shared"] <= SMEM_LIMIT, f"{name}: shared memory {r}"
        assert r["num_warps"] == 12 and r["setmaxnreg"], f"{name}: {r}"
        assert r["qk"] == 4 * chunks and r["pv"] == 4 and r["wgmma"] == 4 * chunks + 4, f"{name}: wgmma {r}"
        # V4 rows (D 512) of one split: the output by 16-byte stores (stores.row_store_layout), 8 a thread and
        # warpgroup; V3.2 rows: from the MMA layout (no shared memory left for the conversion)
        assert (r["st_v4"] >= 8) == (v[1] == 512 and v[2] == 1), f"{name}: output stores {r}"
        # fp8_v4 rows are dequantised by bf16x2 products (power-of-two scales, _dequant_pow2), the others in fp32
        assert (r["mul_bf16x2"] > 0) == (v[0] == 2), f"{name}: dequantisation {r}"
        if v[0] == 0:
            assert r["cp_async"] == 4 * chunks and r["noinc"] == 1, f"{name}: cp.async {r}"
        elif staged:  # V3.2: 16 + 4 16-byte copies, 2 of the scales; V4: 16 + 4, 1 exponent word
            assert r["cp_async"] == 20 and r["cp_async4"] == 3 - v[0] and r["noinc"] == 1, f"{name}: cp.async {r}"
            assert str(gs.STAGED_PRODUCER_REGS[v[0]]) in r["setmaxnreg"], f"{name}: {r}"
        else:
            assert r["cp_async"] == 0, f"{name}: {r}"


# "asym" (OPTS 16): bf16 / fp8_ds_mla / fp8_v4 rows, splits, two sources, the inverse RoPE; the scoring warpgroup (at
# the 256-register limit) keeps a few loop values in local memory: this many bytes at most (sm90 offline, Triton 3.6;
# the item walk's counters added 8: its key loop holds 3 local loads / stores, 8 before the walk)
ASYM_VARIANTS = [
    (0, 576, 1, True, True, 64, False, False, 64, False, 18, True),  # asym + lazy, the walk: the bf16 prefill default
    (0, 512, 1, True, True, 256, True, True, 64, True, 18, True),  # the walk, V4 bf16, two sources, the inverse RoPE
    (0, 576, 1, True, True, 64, False, False, 64, False, 18),  # asym + lazy: the bf16 default at 1-3 items an SM
    (0, 576, 4, True, False, 1, False, False, 1, False, 18),
    (0, 576, 1, True, False, 64, True, False, 16, False, 18),  # V3.2 bf16 rows with a second source
    (0, 512, 1, True, True, 256, True, True, 64, True, 18),  # V4 bf16, two sources, the inverse RoPE
    (0, 512, 1, True, True, 1, False, False, 1, True, 18),  # a gathered V4 workspace
    (0, 512, 4, True, True, 1, False, False, 1, True, 18),
    (1, 576, 1, True, True, 64, False, False, 64, False, 19),  # on fp8 rows (private: slower there)
    (2, 512, 1, True, True, 256, True, True, 64, True, 18),
]
# by cache format: the private fp8 "asym" builds spill more; the bf16 walk build (the V3.2 prefill default) compiles to
# 56, 64 or 72 bytes as Triton 3.6's iteration order varies with the hash seed and the module's source (stop 54:
# seeds 0-3 gave 72 / 64 / 64 / 64 on the same source, and a source edit elsewhere in the module moved seed 0 from 56)
ASYM_SPILL_BOUND = {0: 72, 1: 88, 2: 80}


@pytest.mark.skipif(not gs.GLUON_AVAILABLE or not HAS_NVIDIA_BACKEND, reason="needs triton's Gluon and NVIDIA backend")
def test_sparse_gluon_asym_compiles_for_sm90():
    # "asym": 12 warps (the scoring warpgroup, the P V warpgroup, the producer) with setmaxnreg; the whole score tile
    # m64n64k16 in one warpgroup (9 or 8 chunks x 4 k-steps, at tile 0 and in the loop), P V m64n256k16 (the
    # scorer's half in the loop and after it, the other warpgroup's half: 3 x 4); within the shared memory
    for r in run_report_script(_COMPILE_SCRIPT, ASYM_VARIANTS):
        v, chunks = tuple(r["variant"]), r["variant"][1] // 64
        assert r["regs"] <= 255 and r["stack"] <= ASYM_SPILL_BOUND[v[0]] and r["local"] == 0, f"{v}: spills {r}"
        assert r["shared"] + r["static_shared"] <= SMEM_LIMIT, f"{v}: shared memory {r}"
        assert r["num_warps"] == 12 and str(gs.ASYM_PV_REGS) in r["setmaxnreg"], f"{v}: {r}"
        assert r["qk"] == 0 and r["qk64"] == 2 * 4 * chunks and r["pv"] == 12, f"{v}: wgmma {r}"
        assert (r["st_v4"] >= 8) == (v[1] == 512 and v[2] == 1), f"{v}: output stores {r}"
        if v[0] == 0:  # the bf16 producer, as with the two-warpgroup consumers (the walk: and each item's Q); the
            # compiler may copy the item loop's body (the plain walk of one item a program: 3 copies), each copy of
            # a tile's or Q's 4 x chunks cp.async ending in one noinc arrive
            walk = len(v) > 11 and v[11]
            assert r["cp_async"] == 4 * chunks * r["noinc"] and r["noinc"] >= 1 + walk, f"{v}: cp.async {r}"


def test_sparse_gluon_opts_validation(device):
    # _gluon_opts names -> OPTS bits; unknown names ("onestore": tried and dropped), V4 / two-source calls and the
    # fp8 variants on a bf16 cache are refused
    assert gs.gluon_opts_bits((), "auto", 576, False) == 0
    # the defaults (sparse_mla without _gluon_opts): V3.2 one-source calls only, each a valid variant set
    assert gs.default_opts("fp8_ds_mla", 576, False) == ("staged", "nanpack", "lazy")
    assert gs.default_opts("auto", 576, False) == gs.default_opts("auto", 512, True) == ("asym", "lazy")
    assert gs.default_opts("fp8_v4", 512, False) == gs.default_opts("fp8_v4", 512, True) == ()
    for fmt, opts in gs.DEFAULT_OPTS.items():
        gs.gluon_opts_bits(opts, fmt, 576, False)
    assert gs.gluon_opts_bits(("nanpack", "lazy"), "fp8_ds_mla", 576, False) == 3
    assert gs.gluon_opts_bits(("lazy",), "auto", 576, False) == 2
    for d_qk, extra in ((576, False), (512, True)):  # the bf16 default, any row width and sources
        assert gs.gluon_opts_bits(gs.default_opts("auto", d_qk, extra), "auto", d_qk, extra) == 18
    assert gs.gluon_opts_bits(("staged", "nanpack"), "fp8_ds_mla", 576, False) == 5
    assert gs.gluon_opts_bits(("lazy",), "fp8_v4", 512, True) == gs.gluon_opts_bits(("lazy",), "auto", 576, True) == 2
    assert gs.gluon_opts_bits(("staged", "lazy"), "fp8_v4", 512, True) == 6
    assert gs.gluon_opts_bits(("staged",), "fp8_v4", 512, False) == 4
    assert gs.gluon_opts_bits(("asym", "lazy"), "fp8_v4", 512, True) == 18
    assert gs.gluon_opts_bits(("asym", "lazy"), "auto", 576, False) == 18
    assert gs.gluon_opts_bits(("asym", "nanpack"), "fp8_ds_mla", 576, False) == 17
    assert gs.gluon_opts_bits(("ring",), "fp8_v4", 512, True, 16) == 32
    assert gs.gluon_opts_bits(("ring", "nanpack"), "fp8_ds_mla", 576, False, 8) == 33
    for args in [(("prefetch",), "fp8_ds_mla", 576, False), ("lazy", "auto", 576, False),
                 (("nanpack",), "fp8_v4", 512, False), (("nanpack", "lazy"), "fp8_ds_mla", 576, True),
                 (("staged", "nanpack"), "fp8_v4", 512, True),
                 (("staged",), "auto", 512, True),
                 (("nanpack",), "auto", 576, False), (("staged",), "auto", 576, False),
                 (("staged",), "fp8_ds_mla", 576, True),
                 (("onestore",), "fp8_ds_mla", 576, False),
                 (("asym", "staged"), "fp8_ds_mla", 576, False),
                 (("ring", "staged"), "fp8_v4", 512, True), (("ring", "asym"), "fp8_v4", 512, True),
                 (("ring",), "fp8_ds_mla", 576, False), (("ring",), "fp8_ds_mla", 576, True, 16),
                 (("ring",), "fp8_v4", 512, True, 32), (("ring",), "auto", 576, False, 16),
                 (("ring", "lazy"), "fp8_v4", 512, True, 128), (("ring",), "fp8_v4", 512, True, 64),
                 (("ring", "lazy"), "fp8_v4", 512, True, 16),
                 (("ring", "nanpack"), "fp8_v4", 512, True, 16)]:  # fmt: skip
        with pytest.raises(ValueError, match="_gluon_opts"):
            gs.gluon_opts_bits(*args)
    q = torch.randn(1, 64, 576, device=device).bfloat16()
    cache = torch.randn(2, 16, 576, device=device).bfloat16()
    idx = torch.zeros(1, 4, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="_gluon_opts needs _kernel='gluon'"):
        openmla.sparse_mla(q, cache, idx, SCALE, _gluon_opts=("lazy",))


def test_sparse_gluon_refusals(device):
    # "auto" takes the Gluon kernel at any head count wherever it applies (sm90): V3.2 rows and V4 calls alike (D 512,
    # a second source, the inverse RoPE), bit for bit the "gluon" result, else the Triton one; "gluon" refuses what
    # it does not take (a CPU device here, or an unsupported layout on a GPU) with a ValueError naming the reason; an
    # unknown name is refused
    q = torch.randn(2, 64, 576, device=device).bfloat16()
    cache = torch.randn(4, 16, 576, device=device).bfloat16()
    idx = torch.randint(0, 64, (2, 8), dtype=torch.int32, device=device)
    gluon_here = gs.gluon_sparse_unsupported(q, cache, "auto", 512) is None and not INTERPRET
    for heads, kernel in ((64, "gluon" if gluon_here else "triton"), (16, "gluon" if gluon_here else "triton")):
        a, la = openmla.sparse_mla(q[:, :heads], cache, idx, SCALE)
        b, lb = openmla.sparse_mla(q[:, :heads], cache, idx, SCALE, _kernel=kernel)
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        torch.testing.assert_close(la, lb, atol=0, rtol=0)
    q4, cache4 = q[..., :512].contiguous(), cache[..., :512].contiguous()
    pos = torch.arange(2, dtype=torch.int32, device=device)
    cs = rope_cache_ref(1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)), 8).to(device)
    v4_calls = [
        (q4, cache4, {}),  # V4 rows
        (q, cache, dict(extra_kv_cache=cache, extra_indices=idx)),  # a second source
        (q4, cache4, dict(extra_kv_cache=cache4[:2], extra_indices=idx // 2)),
        (q4, cache4, dict(inv_rope_positions=pos, cos_sin_cache=cs)),  # the inverse RoPE
    ]
    for qq, cc, kw in v4_calls:  # "auto" is the Gluon kernel there where it runs, bit for bit, else the Triton one
        a, la = openmla.sparse_mla(qq, cc, idx, SCALE, **kw)
        b, lb = openmla.sparse_mla(qq, cc, idx, SCALE, _kernel="gluon" if gluon_here else "triton", **kw)
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        torch.testing.assert_close(la, lb, atol=0, rtol=0)
        if not gluon_here:
            with pytest.raises(ValueError, match="_kernel='gluon'"):
                openmla.sparse_mla(qq, cc, idx, SCALE, _kernel="gluon", **kw)
    with pytest.raises(ValueError, match="_kernel must be"):
        openmla.sparse_mla(q, cache, idx, SCALE, _kernel="cuda")
    ragged = openmla.build_ragged_indices_from_dense(idx, torch.full_like(idx[:, 0], 8))
    fp8 = _cache(device, 4, 16, "fp8_ds_mla")
    refused = [
        (q, cache, idx, dict(_tiling_override=(32, 8, 2))),
        (q, cache, ragged, {}),  # ragged indices, main or extra
        (q4, cache4, idx, dict(extra_kv_cache=cache4, extra_indices=ragged)),
        (q.half(), cache.half(), idx, {}),  # fp16 q
        (q, fp8, idx, dict(kv_cache_dtype="fp8_ds_mla", extra_kv_cache=fp8, extra_indices=idx)),  # V3.2 fp8 + extra
    ]
    if device.type != "cuda":
        refused.append((q, cache, idx, {}))  # no CUDA device at all
    for qq, cc, ii, kw in refused:
        with pytest.raises(ValueError, match="_kernel='gluon'"):
            openmla.sparse_mla(qq, cc, ii, SCALE, _kernel="gluon", **kw)


# ---------------------------------------------------------------------------------------------------
# GPU (sm90) tests

# a barrier-phase bug hangs rather than fails: with pytest-timeout installed each GPU test gets a limit (the
# "thread" method dumps the stacks and ends the session), covering its compiles
GPU_TEST_TIMEOUT_S = 180


def _gpu_test(fn):
    fn = pytest.mark.hopper(fn)
    if importlib.util.find_spec("pytest_timeout") is not None:
        fn = pytest.mark.timeout(GPU_TEST_TIMEOUT_S, method="thread")(fn)
    return fn


def _cache(device, num_blocks, block_size, kv_cache_dtype):
    """A paged cache of N(0, 1) rows: bf16, or fp8_ds_mla bytes from the reference writer (SPEC §2.3)."""
    rows = torch.randn(num_blocks * block_size, 576)
    if kv_cache_dtype == "auto":
        return rows.bfloat16().view(num_blocks, block_size, 576).to(device)
    return ds_mla_row_ref(rows[:, :512], rows[:, 512:]).view(num_blocks, block_size, 656).to(device)


def _indices(T, K, num_slots, device, seed=7):
    """[T, K] int32 slots and lengths [T]: -1 / num_slots / -7 inside the prefix, slot 0, a duplicate, an
    all-invalid row, a length-0 row, lengths shorter than K and -1 after them."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, num_slots, (T, K), generator=g, dtype=torch.int32)
    lens = torch.randint(1, K + 1, (T,), generator=g, dtype=torch.int32)
    lens[0] = K  # a full row
    idx[:, 1] = 0
    idx[:, 2] = idx[:, 3]
    bad = torch.rand(T, K, generator=g) < 0.1  # invalid entries mixed in
    idx = torch.where(bad, torch.where(torch.rand(T, K, generator=g) < 0.5, -1, num_slots), idx)
    idx[0, K // 2] = -7
    if T >= 3:
        idx[1, :] = -1  # no valid key
        lens[2] = 0  # nothing counts
    for t in range(T):
        tail = idx[t, int(lens[t]) :]
        idx[t, int(lens[t]) :] = torch.where(torch.rand(tail.numel(), generator=g) < 0.5, -1, tail)
    return idx.to(device=device, dtype=torch.int32), lens.to(device)


def _poison_unused(cache, kv_cache_dtype, idx, lens):
    """NaN (bf16) or 0xFF bytes (NaN e4m3, NaN scales, NaN rope) in every slot the counted entries do not name."""
    num_slots = cache.shape[0] * cache.shape[1]
    K = idx.shape[1]
    counted = torch.arange(K, device=idx.device)[None, :] < (lens[:, None] if lens is not None else K)
    ok = counted & (idx >= 0) & (idx < num_slots)
    used = torch.zeros(num_slots, dtype=torch.bool, device=cache.device)
    used[idx[ok].long()] = True
    flat = cache.view(num_slots, cache.shape[-1])
    flat[~used] = float("nan") if kv_cache_dtype == "auto" else 0xFF


# LSE tolerances as tests/test_sparse_mla.py's: fp8 rows are rounded to bf16 after dequantising (the reference keeps
# the fp32 product)
_LSE_TOL = {"auto": (1e-3, 1e-3, 1e-6), "fp8_ds_mla": (1e-2, 1e-3, 1e-5)}


def _check(q, cache, idx, kv_cache_dtype, **kw):
    ref_kw = {k: v for k, v in kw.items() if not k.startswith("_")}
    out, lse = openmla.sparse_mla(q, cache, idx, SCALE, kv_cache_dtype=kv_cache_dtype, _kernel="gluon", **kw)
    ref_out, ref_lse = sparse_mla_ref(q, cache, idx, SCALE, kv_cache_dtype=kv_cache_dtype, **ref_kw)
    assert out.dtype == torch.bfloat16 and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, *_LSE_TOL[kv_cache_dtype])
    return out, lse


def _run(H, T, K, block_size, kv_cache_dtype, device, lens=True, **kw):
    num_blocks = max(2, -(-max(4 * K, 8192) // block_size))
    cache = _cache(device, num_blocks, block_size, kv_cache_dtype)
    idx, ln = _indices(T, K, num_blocks * block_size, device)
    ln = ln if lens else None
    _poison_unused(cache, kv_cache_dtype, idx, ln)
    q = torch.randn(T, H, 576, device=device).bfloat16()
    out, lse = _check(q, cache, idx, kv_cache_dtype, topk_length=ln, **kw)
    if T >= 3 and lens:  # the all-invalid row and the length-0 row: out 0, lse -inf
        assert bool((out[1:3] == 0).all()) and bool(torch.isneginf(lse[1:3]).all())
    return out, lse


CACHE_DTYPES = ["auto", "fp8_ds_mla"]
_MAIN = list(itertools.product([64, 128], [64, 100, 2048], [1, 64], CACHE_DTYPES))
# the private variants (_gluon_opts): each V3.2 GPU test below runs the default and each variant ("nanpack",
# "staged" only with the fp8_ds_mla cache: _opts_kw skips them on bf16 rows)
# (None: the defaults of gs.DEFAULT_OPTS; (): the plain code; the others cover every bit, bit-identical ones in
# test_sparse_gluon_staged_matches_default)
GLUON_OPTS = [None, (), ("nanpack", "lazy"), ("staged", "nanpack", "lazy"), ("staged",), ("asym", "lazy"), ("asym",)]
_FP8_ONLY = ("nanpack", "staged")


def _opts_id(opts):
    return "default" if opts is None else "+".join(opts) or "plain"


def _opts_kw(opts, kv_cache_dtype):
    if opts is None:
        return {}
    if any(o in opts for o in _FP8_ONLY) and kv_cache_dtype != "fp8_ds_mla":
        pytest.skip("nanpack / staged change the fp8_ds_mla path only")
    return {"_gluon_opts": opts}


@_gpu_test
@pytest.mark.parametrize("opts", GLUON_OPTS, ids=_opts_id)
@pytest.mark.parametrize("heads,topk,block_size,kv_cache_dtype", _MAIN, ids=lambda v: str(v))
def test_sparse_gluon(heads, topk, block_size, kv_cache_dtype, opts, device):
    _run(heads, 37, topk, block_size, kv_cache_dtype, device, **_opts_kw(opts, kv_cache_dtype))


@_gpu_test
@pytest.mark.parametrize("opts", GLUON_OPTS, ids=_opts_id)
@pytest.mark.parametrize("kv_cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("heads,rows", [(64, 1), (128, 1), (64, 300), (128, 300)])
def test_sparse_gluon_rows(heads, rows, kv_cache_dtype, opts, device):
    # one row (the planner splits it over the SMs) and 300 rows (no split), top-k 2048, no lengths
    _run(heads, rows, 2048, 64, kv_cache_dtype, device, lens=rows > 1, **_opts_kw(opts, kv_cache_dtype))


@_gpu_test
@pytest.mark.parametrize("opts", GLUON_OPTS, ids=_opts_id)
@pytest.mark.parametrize("heads", [40, 96])
def test_sparse_gluon_masked_heads(heads, opts, device):
    # head counts that are not a multiple of 64: the last head block's rows past H are masked
    for kv_cache_dtype in CACHE_DTYPES:
        if opts is not None and any(o in opts for o in _FP8_ONLY) and kv_cache_dtype != "fp8_ds_mla":
            continue
        _run(heads, 37, 100, 64, kv_cache_dtype, device, **({} if opts is None else {"_gluon_opts": opts}))


@_gpu_test
@pytest.mark.parametrize("opts", GLUON_OPTS, ids=_opts_id)
@pytest.mark.parametrize("kv_cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_sparse_gluon_splits_and_sinks(splits, kv_cache_dtype, opts, device):
    # forced split counts (partials + the Triton merge; splits past a short row are empty) with sinks -inf /
    # finite / +inf / 100 per head
    H = 128
    sink = torch.linspace(-2, 2, H, device=device)
    sink[0], sink[1], sink[2] = -INF, INF, 100.0
    out, lse = _run(H, 37, 2048, 64, kv_cache_dtype, device, attn_sink=sink, _num_splits_override=splits,
                    **_opts_kw(opts, kv_cache_dtype))  # fmt: skip
    assert bool((out[:, 1] == 0).all())  # a sink of +inf gives 0


def _nan_in_selected_fp8_rows(device):
    """An fp8_ds_mla cache (4 blocks of 16) and index rows [3, 24] whose first row selects a slot with a NaN e4m3
    byte, one with a NaN scale and one with a NaN rope value."""
    cache = _cache(device, 4, 16, "fp8_ds_mla")
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 64, (3, 24), generator=g, dtype=torch.int32).to(device)
    flat = cache.view(64, 656)
    s0, s1, s2 = (int(v) for v in idx[0, :3])
    flat[s0, 5] = 0x7F
    flat[s1, 512:516] = 0xFF
    flat[s2, 600:602] = 0xFF
    return cache, idx


@_gpu_test
@pytest.mark.parametrize("opts", GLUON_OPTS, ids=_opts_id)
def test_sparse_gluon_nan_in_selected_fp8_rows(opts, device):
    # fp8_ds_mla: a NaN e4m3 byte, a NaN scale (its whole group of 128) and a NaN rope value in selected rows count
    # as 0
    cache, idx = _nan_in_selected_fp8_rows(device)
    q = torch.randn(3, 64, 576, device=device).bfloat16()
    _check(q, cache, idx, "fp8_ds_mla", **_opts_kw(opts, "fp8_ds_mla"))


@_gpu_test
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("heads", [64, 128, 40])
def test_sparse_gluon_staged_matches_default(heads, splits, device):
    # "staged" dequantises in the consumers into the same bf16 operands the plain producer writes, and runs the same
    # MMAs and softmax on them ("nanpack": the same bf16 values): out and lse equal the plain code's bit for bit
    # (invalid entries, lengths 0,
    # NaN in every unused slot and in a few selected rows' bytes, the planner's splits and forced ones)
    T, K = 37, 2048
    cache = _cache(device, 4 * K // 64, 64, "fp8_ds_mla")
    idx, ln = _indices(T, K, cache.shape[0] * 64, device, seed=3)
    _poison_unused(cache, "fp8_ds_mla", idx, ln)
    flat = cache.view(-1, 656)
    row0 = idx[0][(idx[0] >= 0) & (idx[0] < flat.shape[0])]  # row 0 counts all K entries
    s0, s1, s2 = (int(v) for v in row0[4:7])
    flat[s0, 9] = 0x7F
    flat[s1, 516:520] = 0xFF
    flat[s2, 640:642] = 0xFF
    q = torch.randn(T, heads, 576, device=device).bfloat16()
    kw = dict(kv_cache_dtype="fp8_ds_mla", topk_length=ln, _kernel="gluon")
    if splits:
        kw["_num_splits_override"] = splits
    a, la = openmla.sparse_mla(q, cache, idx, SCALE, _gluon_opts=(), **kw)
    for opts in (("staged",), ("staged", "nanpack")):
        b, lb = openmla.sparse_mla(q, cache, idx, SCALE, _gluon_opts=opts, **kw)
        torch.testing.assert_close(b, a, atol=0, rtol=0)
        torch.testing.assert_close(lb, la, atol=0, rtol=0)


@_gpu_test
def test_sparse_gluon_buffers_and_strides(device):
    # out / lse buffers (as CUDA graphs pass them) and a q whose rows are a slice of wider ones
    T, H, K = 9, 128, 300
    cache = _cache(device, 64, 64, "fp8_ds_mla")
    idx, lens = _indices(T, K, 64 * 64, device)
    q = torch.randn(T, H, 640, device=device).bfloat16()[..., :576]
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=device)
    lse = torch.empty(T, H, dtype=torch.float32, device=device)
    o, ls = openmla.sparse_mla(q, cache, idx, SCALE, kv_cache_dtype="fp8_ds_mla", topk_length=lens, out=out, lse=lse,
                               _kernel="gluon")  # fmt: skip
    assert o.data_ptr() == out.data_ptr() and ls.data_ptr() == lse.data_ptr()
    ref_out, ref_lse = sparse_mla_ref(q, cache, idx, SCALE, kv_cache_dtype="fp8_ds_mla", topk_length=lens)
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, *_LSE_TOL["fp8_ds_mla"])


# ---------------------------------------------------------------------------------------------------
# V4 on the GPU (D = d_v = 512, K = V = the whole row): a main source and an extra one with their own block sizes,
# fp8_v4 or bf16, lengths, sinks, the fused inverse RoPE, splits; every unused slot is NaN (0xFF bytes in fp8_v4)

V4_SCALE = 512**-0.5
V4_DTYPES = ["fp8_v4", "auto"]
# fp8_v4 rows are exact in bf16 (e4m3 x a power of two, bf16 rope): the kernel's bf16 operands change no score
_V4_LSE_TOL = {"auto": (1e-3, 1e-3, 1e-6), "fp8_v4": (1e-2, 1e-3, 1e-6)}


def _used(idx, lens, num_slots):
    K = idx.shape[1]
    counted = torch.arange(K, device=idx.device)[None, :] < (lens[:, None] if lens is not None else K)
    ok = counted & (idx >= 0) & (idx < num_slots)
    return torch.unique(idx[ok].long()).cpu()


def _v4_cache(device, num_blocks, block_size, kv_cache_dtype, used, seed):
    """openmla.utils.testing.random_v4_cache from a seed."""
    return random_v4_cache(num_blocks, block_size, kv_cache_dtype, used, device, torch.Generator().manual_seed(seed))


def _v4_run(H, T, kv_cache_dtype, device, *, K=128, K2=512, bs=256, e_bs=64, lens=True, elens=True, extra=True,
            rope=True, sink=None, seed=0, kernel="gluon", **kw):  # fmt: skip
    """One V4 call through ``kernel`` (the Gluon one) against the fp32 reference; returns (out, lse, idx lens, extra
    lens)."""
    nb, e_nb = max(2, -(-4096 // bs)), max(2, -(-4096 // e_bs))
    idx, ln = _indices(T, K, nb * bs, device, seed=seed)
    ln = ln if lens else None
    args = dict(kv_cache_dtype=kv_cache_dtype, topk_length=ln, attn_sink=sink)
    cache = _v4_cache(device, nb, bs, kv_cache_dtype, _used(idx, ln, nb * bs), seed)
    if extra:
        eidx, eln = _indices(T, K2, e_nb * e_bs, device, seed=seed + 1)
        eln = eln if elens else None
        if elens and T >= 4:
            eln[3] = 0  # a row with main keys only
        ecache = _v4_cache(device, e_nb, e_bs, kv_cache_dtype, _used(eidx, eln, e_nb * e_bs), seed + 1)
        args.update(extra_kv_cache=ecache, extra_indices=eidx, extra_topk_length=eln)
    else:
        eln = None
    if rope:
        num_pos = 4096
        cs = rope_cache_ref(1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)), num_pos)
        pos = torch.randint(0, num_pos, (T,), generator=torch.Generator().manual_seed(seed + 2), dtype=torch.int32)
        args.update(inv_rope_positions=pos.to(device), cos_sin_cache=cs.to(device))
    q = torch.randn(T, H, 512, generator=torch.Generator().manual_seed(seed + 3)).bfloat16().to(device)
    out, lse = openmla.sparse_mla(q, cache, idx, V4_SCALE, _kernel=kernel, **args, **kw)
    ref_out, ref_lse = sparse_mla_ref(q, cache, idx, V4_SCALE, **args)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H, 512) and lse.shape == (T, H)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, *_V4_LSE_TOL[kv_cache_dtype])
    if T >= 3 and lens and (not extra or elens):  # row 1: no valid key in either source; row 2: lengths 0 in both
        assert bool((out[1:3] == 0).all()) and bool(torch.isneginf(lse[1:3]).all())
    return out, lse, ln, eln


@_gpu_test
@pytest.mark.parametrize("kv_cache_dtype", V4_DTYPES)
@pytest.mark.parametrize("heads,rows", list(itertools.product([64, 128, 96], [1, 37, 300])))
def test_sparse_gluon_v4(heads, rows, kv_cache_dtype, device):
    # V4 decode / prefill rows: SWA-like main source (blocks of 256) + compressed-like extra source (blocks of 64),
    # both with lengths (shorter, 0) and invalid entries, the fused inverse RoPE; the planner's splits at 1 row
    _v4_run(heads, rows, kv_cache_dtype, device)


@_gpu_test
@pytest.mark.parametrize("kv_cache_dtype", V4_DTYPES)
@pytest.mark.parametrize("heads,rows,splits", [(64, 1, None), (128, 37, None), (96, 300, None), (128, 37, 3)])
def test_sparse_gluon_v4_lazy(heads, rows, splits, kv_cache_dtype, device):
    # the private "lazy" variant on V4 calls (two sources, lengths, the inverse RoPE, sinks, splits)
    sink = torch.linspace(-2, 2, heads, device=device)
    kw = {"_num_splits_override": splits} if splits else {}
    _v4_run(heads, rows, kv_cache_dtype, device, sink=sink, seed=rows, _gluon_opts=("lazy",), **kw)


@_gpu_test
@pytest.mark.parametrize("opts", [("asym",), ("asym", "lazy")], ids=lambda v: "+".join(v))
@pytest.mark.parametrize("kv_cache_dtype", V4_DTYPES)
@pytest.mark.parametrize("heads,rows,splits,extra", [(64, 1, None, True), (128, 37, None, True), (96, 300, None, True),
                                                     (128, 37, 3, True), (64, 37, None, False)])  # fmt: skip
def test_sparse_gluon_v4_asym(opts, heads, rows, splits, extra, kv_cache_dtype, device):
    # "asym" on V4 calls (two sources or one, lengths, the inverse RoPE in warpgroup 1's half, sinks, splits)
    kw = dict(extra=extra, sink=torch.linspace(-2, 2, heads, device=device), seed=rows + heads)
    if splits:
        kw["_num_splits_override"] = splits
    _v4_run(heads, rows, kv_cache_dtype, device, _gluon_opts=opts, **kw)


@_gpu_test
@pytest.mark.parametrize("opts", [("staged",), ("staged", "lazy")], ids=lambda v: "+".join(v))
@pytest.mark.parametrize("heads,rows,splits,extra", [(64, 37, None, True), (128, 1, None, True), (96, 300, None, True),
                                                     (128, 37, 3, True), (64, 37, None, False)])  # fmt: skip
def test_sparse_gluon_v4_staged(opts, heads, rows, splits, extra, device):
    # the 64-head kernel's staging of fp8_v4 rows, "staged" (the consumers dequantise raw rows cp.async'd by the
    # producer), against the reference, and bit for bit against the plain code where the softmax is the same (no
    # "lazy"): invalid entries, lengths 0, sinks, splits, the inverse RoPE, one or two sources
    kw = dict(K=128, K2=512, bs=64, e_bs=64, extra=extra, sink=torch.linspace(-2, 2, heads, device=device),
              seed=rows + heads)  # fmt: skip
    if splits:
        kw["_num_splits_override"] = splits
    b, lb, _, _ = _v4_run(heads, rows, "fp8_v4", device, _gluon_opts=opts, **kw)
    if "lazy" not in opts:
        a, la, _, _ = _v4_run(heads, rows, "fp8_v4", device, _gluon_opts=(), **kw)
        torch.testing.assert_close(b, a, atol=0, rtol=0)
        torch.testing.assert_close(lb, la, atol=0, rtol=0)


def test_sparse_gluon_v4_staged_needs_aligned_blocks():
    # unpadded fp8_v4 blocks of an odd size (3 x 584 B) are 8- but not 16-byte aligned: "staged" (16-byte cp.async)
    # refuses them; the padded blocks openmla allocates (2304 B here) are aligned at any block size
    if not (gs.GLUON_AVAILABLE and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        pytest.skip("needs an sm90 (Hopper) GPU")
    dev = "cuda"
    padded = _v4_cache(dev, 8, 3, "fp8_v4", torch.arange(24), 0)
    cache = padded.contiguous()
    assert padded.stride(0) % 16 == 0 and cache.stride(0) == 3 * 584
    q = torch.randn(2, 64, 512, device=dev).bfloat16()
    idx = torch.zeros(2, 4, dtype=torch.int32, device=dev)
    kw = dict(kv_cache_dtype="fp8_v4", _kernel="gluon")
    a, _ = openmla.sparse_mla(q, padded, idx, V4_SCALE, _gluon_opts=("staged",), **kw)
    b, _ = openmla.sparse_mla(q, padded, idx, V4_SCALE, _gluon_opts=(), **kw)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="16-byte aligned"):
        openmla.sparse_mla(q, cache, idx, V4_SCALE, kv_cache_dtype="fp8_v4", _kernel="gluon",
                           _gluon_opts=("staged",))  # fmt: skip


@_gpu_test
@pytest.mark.parametrize("kv_cache_dtype", V4_DTYPES)
@pytest.mark.parametrize("bs,e_bs,K,K2", [(64, 2, 100, 64), (1, 256, 64, 300), (256, 1, 128, 1024)])
def test_sparse_gluon_v4_block_sizes(bs, e_bs, K, K2, kv_cache_dtype, device):
    # other block sizes (1, 2, 64, 256) and widths (tiles straddling the two sources at any offset)
    _v4_run(64, 37, kv_cache_dtype, device, K=K, K2=K2, bs=bs, e_bs=e_bs, seed=bs + e_bs)


@_gpu_test
@pytest.mark.parametrize("kv_cache_dtype", V4_DTYPES)
@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("rope", [True, False])
def test_sparse_gluon_v4_splits_sinks_rope(splits, rope, kv_cache_dtype, device):
    # forced splits (partials + the Triton merge, which applies the sink and the inverse RoPE; one split: the
    # kernel's epilogue does) with sinks -inf / +inf / 100 / finite per head
    H = 128
    sink = torch.linspace(-2, 2, H, device=device)
    sink[0], sink[1], sink[2] = -INF, INF, 100.0
    out, _, _, _ = _v4_run(H, 37, kv_cache_dtype, device, rope=rope, sink=sink, _num_splits_override=splits, seed=11)
    assert bool((out[:, 1] == 0).all())  # a sink of +inf gives 0


@_gpu_test
@pytest.mark.parametrize("kv_cache_dtype", V4_DTYPES)
def test_sparse_gluon_v4_one_source_and_lengths(kv_cache_dtype, device, kernel="gluon"):
    # one source (a gathered workspace or SWA-only layers), with and without lengths / RoPE; an extra source whose
    # lengths are all 0 (only main keys count) and a main source whose lengths are all 0 (only extra keys)
    _v4_run(64, 37, kv_cache_dtype, device, extra=False, seed=21, kernel=kernel)
    _v4_run(128, 300, kv_cache_dtype, device, extra=False, rope=False, lens=False, seed=22, kernel=kernel)
    _v4_run(64, 37, kv_cache_dtype, device, elens=False, seed=23, kernel=kernel)
    T = 37
    zeros = torch.zeros(T, dtype=torch.int32, device=device)
    for name in ("extra_topk_length", "topk_length"):
        # compare with the call that drops that source altogether
        g = torch.Generator().manual_seed(24)
        q = torch.randn(T, 64, 512, generator=g).bfloat16().to(device)
        idx, ln = _indices(T, 128, 4096, device, seed=24)
        eidx, eln = _indices(T, 256, 4096, device, seed=25)
        cache = _v4_cache(device, 16, 256, kv_cache_dtype, _used(idx, ln, 4096), 24)
        ecache = _v4_cache(device, 64, 64, kv_cache_dtype, _used(eidx, eln, 4096), 25)
        kw = dict(kv_cache_dtype=kv_cache_dtype, topk_length=ln, extra_kv_cache=ecache, extra_indices=eidx,
                  extra_topk_length=eln)  # fmt: skip
        kw[name] = zeros
        out, lse = openmla.sparse_mla(q, cache, idx, V4_SCALE, _kernel=kernel, **kw)
        if name == "extra_topk_length":
            ref_args = dict(kv_cache_dtype=kv_cache_dtype, topk_length=ln)
            ref_out, ref_lse = sparse_mla_ref(q, cache, idx, V4_SCALE, **ref_args)
        else:
            ref_args = dict(kv_cache_dtype=kv_cache_dtype, topk_length=eln)
            ref_out, ref_lse = sparse_mla_ref(q, ecache, eidx, V4_SCALE, **ref_args)
        assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
        assert_close("lse", ref_lse, lse, *_V4_LSE_TOL[kv_cache_dtype])


@_gpu_test
@pytest.mark.parametrize("opts,heads", [(None, 64), (("staged",), 64), (None, 16), (("ring",), 16)],
                         ids=["default", "staged", "narrow", "narrow-ring"])  # fmt: skip
def test_sparse_gluon_v4_nan_in_selected_rows(opts, heads, device, kernel="gluon"):
    # fp8_v4: a NaN e4m3 byte, an exponent byte 255 (its whole group of 64) and a NaN rope value in selected rows of
    # both sources count as 0 (exponent byte 0, 2^-127, too); "staged": the same rules in the consumers'
    # dequantisation; the narrow kernel (16 heads) with its plain producers and with "ring"
    T, K, bs = 3, 24, 16
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 64, (T, K), generator=g, dtype=torch.int32)
    eidx = torch.randint(0, 64, (T, K), generator=g, dtype=torch.int32)
    cache = _v4_cache(device, 4, bs, "fp8_v4", torch.arange(64), 5)
    ecache = _v4_cache(device, 8, 8, "fp8_v4", torch.arange(64), 6)
    for c, page, sl in ((cache, bs, idx), (ecache, 8, eidx)):
        blk = v4_block_bytes(c)
        s0, s1, s2, s3 = (int(v) for v in sl[0, :4])
        blk[s0 // page, (s0 % page) * 576 + 5] = 0x7F  # NaN e4m3
        blk[s1 // page, page * 576 + (s1 % page) * 8 + 2] = 0xFF  # NaN scale of group 2
        blk[s2 // page, (s2 % page) * 576 + 448 + 6 : (s2 % page) * 576 + 448 + 8] = 0xFF  # NaN rope value
        blk[s3 // page, page * 576 + (s3 % page) * 8 + 4] = 0  # 2^-127
    q = torch.randn(T, heads, 512, generator=g).bfloat16().to(device)
    kw = dict(kv_cache_dtype="fp8_v4", extra_kv_cache=ecache, extra_indices=eidx.to(device))
    out, lse = openmla.sparse_mla(q, cache, idx.to(device), V4_SCALE, _kernel=kernel,
                                  **({} if opts is None else {"_gluon_opts": opts}), **kw)  # fmt: skip
    ref_out, ref_lse = sparse_mla_ref(q, cache, idx.to(device), V4_SCALE, **kw)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, *_V4_LSE_TOL["fp8_v4"])


@_gpu_test
@pytest.mark.parametrize("kv_cache_dtype", V4_DTYPES)
def test_sparse_gluon_v4_matches_triton(kv_cache_dtype, device):
    # the same V4 call through both kernels: the dequantised rows are the same bf16 values, so the two differ only by
    # accumulation order (P in bf16 both); one split each, and the planner's
    H, T = 128, 37
    sink = torch.linspace(-1, 1, H, device=device)
    for splits in (1, None):
        kw = {} if splits is None else dict(_num_splits_override=splits)
        a, la, _, _ = _v4_run(H, T, kv_cache_dtype, device, sink=sink, seed=31, **kw)
        b, lb, _, _ = _v4_run(H, T, kv_cache_dtype, device, sink=sink, seed=31, kernel="triton", **kw)
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(la, lb, atol=1e-3, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------
# The narrow kernel (H <= 32, openmla/ops/gluon/sparse_narrow.py): S^T = K Q^T and O^T = V^T P^T with the heads as
# the wgmma's N (8, 16 or 32); the default at those head counts, "wide" the 64-head kernel there

NARROW_HEADS = [1, 6, 8, 16, 20, 32]

_NARROW_COMPILE_SCRIPT = (
    _COMPILE_PRELUDE
    + r"""
from openmla.ops.gluon import sparse_narrow as gn

report = []
for v in json.loads(sys.argv[1]):
    fmt, d_qk, hb, splits, has_len, has_sink, page, extra, e_len, e_page, rope = v[:11]
    ring = len(v) > 11 and v[11]
    fn = gn._sparse_mla_gluon_narrow_kernel
    cons = dict(PAGE=page, E_PAGE=e_page, FMT=fmt, D_QK=d_qk, HB=hb, NUM_SPLITS=splits, HAS_LEN=has_len,
                HAS_EXTRA=extra, E_HAS_LEN=e_len, HAS_SINK=has_sink, HAS_ROPE=rope, ROPE=64 if rope else 2,
                BLOCK_N=gn.BLOCK_N, STAGES=gn.STAGES, FP8_PASSES=gn.FP8_PASSES,
                PRODUCER_REGS=gn.PRODUCER_REGS[fmt], num_warps=gn.NUM_WARPS, NANPACK=fmt == 1, RING=ring)
    kvt = "*bf16" if fmt == 0 else "*u8"
    views = {"": kvt, "_f32": "*fp32" if fmt == 1 or ring else kvt, "_b16": "*bf16" if fmt else kvt}
    k = compile_sm90(fn, cons, views, gn.NUM_WARPS)
    r = resource_report(k)
    r.update(variant=v, shapes=sorted(set(re.findall(r"wgmma.mma_async.sync.aligned.(m\d+n\d+k\d+)", k.asm["ptx"]))),
             cp_async=k.asm["ptx"].count("cp.async.cg.shared.global"),
             noinc=k.asm["ptx"].count("cp.async.mbarrier.arrive.noinc"))
    report.append(r)
print("REPORT" + json.dumps(report))
"""
)
# (FMT, D_QK, HB, NUM_SPLITS, HAS_LEN, HAS_SINK, PAGE, HAS_EXTRA, E_HAS_LEN, E_PAGE, HAS_ROPE): V3.2 bf16 / fp8_ds_mla
# rows at each N, split or not; V4 fp8_v4 / bf16 with the extra source and the fused inverse RoPE
NARROW_COMPILE_VARIANTS = [
    (1, 576, 16, 1, True, True, 64, False, False, 64, False),
    (1, 576, 32, 4, False, False, 1, False, False, 1, False),
    (1, 576, 8, 1, True, False, 64, False, False, 64, False),
    (0, 576, 32, 1, True, True, 64, False, False, 64, False),
    (2, 512, 16, 1, True, True, 256, True, True, 64, True),
    (2, 512, 32, 4, True, True, 256, True, True, 2, True),
    (0, 512, 8, 1, True, True, 1, False, False, 1, True),
    (2, 512, 16, 1, True, True, 256, True, True, 64, True, True),  # "ring": raw stages beside the ring at HB 16
    (2, 512, 8, 4, True, True, 64, False, False, 64, False, True),
    (1, 576, 16, 1, True, True, 64, False, False, 64, False, True),  # "ring" on fp8_ds_mla rows: half-tile stages
]


@pytest.mark.skipif(not gs.GLUON_AVAILABLE or not HAS_NVIDIA_BACKEND, reason="needs triton's Gluon and NVIDIA backend")
def test_sparse_gluon_narrow_compiles_for_sm90():
    # offline sm90 compile: no spill, fits the shared memory, 12 warps (the consumer warpgroup + two producer ones)
    # with setmaxnreg; every MMA is m64n<HB>k16: S^T 9 (V3.2) or 8 (V4) chunks x 4 k-steps, O^T 8 M-repeats x 4
    from openmla.ops.gluon import sparse_narrow as gn

    for r in run_report_script(_NARROW_COMPILE_SCRIPT, NARROW_COMPILE_VARIANTS):
        v = tuple(r["variant"])
        assert r["regs"] <= 255 and r["stack"] == 0 and r["local"] == 0, f"{v}: spills {r}"
        assert r["shared"] + r["static_shared"] <= min(SMEM_LIMIT, gn._smem_bytes(v[1], v[2], len(v) > 11)), f"{v}: {r}"
        assert r["num_warps"] == 12 and r["setmaxnreg"], f"{v}: {r}"
        assert r["shapes"] == [f"m64n{v[2]}k16"] and r["wgmma"] == 4 * (v[1] // 64) + 32, f"{v}: wgmma {r}"
        if len(v) > 11:  # "ring": the producers' row copies (V4: 7 e4m3 groups, 2 a thread, + rope 4; V3.2 half
            # tiles: 4 chunks of 128, 2 a thread, + rope 2), 16 bytes each, ending in noinc arrives
            assert r["cp_async"] >= 2 * (18 if v[0] == 2 else 10) and r["noinc"] >= 2, f"{v}: cp.async {r}"


def test_sparse_gluon_narrow_opts():
    # H <= 32 runs the narrow kernel unless "wide"; it takes "nanpack" on fp8_ds_mla rows only (its default there)
    from openmla.ops.gluon import sparse_narrow as gn

    assert gs.is_narrow(1) and gs.is_narrow(32) and not gs.is_narrow(33) and not gs.is_narrow(16, gs.GLUON_OPTS["wide"])
    assert [gn.narrow_block_h(h) for h in (1, 6, 8, 9, 16, 20, 32)] == [8, 8, 8, 16, 16, 32, 32]
    assert gs.default_opts("fp8_ds_mla", 576, False, 16) == ("nanpack",)
    assert gs.default_opts("auto", 576, False, 16) == gs.default_opts("fp8_v4", 512, True, 8) == ()
    assert gs.default_opts("fp8_ds_mla", 576, False, 64) == ("staged", "nanpack", "lazy")
    assert gs.gluon_opts_bits(("nanpack",), "fp8_ds_mla", 576, False, 16) == 1
    assert gs.gluon_opts_bits((), "fp8_v4", 512, True, 16) == 0
    # "wide": the 64-head kernel's rules
    assert gs.gluon_opts_bits(("wide", "staged", "nanpack", "lazy"), "fp8_ds_mla", 576, False, 16) == 15
    for args in [(("staged",), "fp8_ds_mla", 576, False, 16), (("lazy",), "auto", 576, False, 8),
                 (("nanpack",), "auto", 576, False, 16), (("staged",), "fp8_v4", 512, True, 32),
                 (("wide",), "fp8_ds_mla", 576, False, 64)]:  # fmt: skip
        with pytest.raises(ValueError, match="narrow kernel|'wide'"):
            gs.gluon_opts_bits(*args)


_NARROW_MAIN = [
    (h, k, bs, dt) for h in NARROW_HEADS for k, bs in ((100, 1), (2048, 64), (64, 16)) for dt in CACHE_DTYPES
]


@_gpu_test
@pytest.mark.parametrize("heads,topk,block_size,kv_cache_dtype", _NARROW_MAIN, ids=lambda v: str(v))
def test_sparse_gluon_narrow(heads, topk, block_size, kv_cache_dtype, device):
    # 37 rows with invalid entries, index 0, duplicates, an all-invalid row, a length-0 row, NaN in every unused slot
    _run(heads, 37, topk, block_size, kv_cache_dtype, device)


@_gpu_test
@pytest.mark.parametrize("heads,rows,topk,block_size,splits", [(16, 37, 2048, 64, None), (8, 300, 2048, 64, 1),
                                                               (1, 37, 100, 1, None), (12, 37, 64, 16, 3),
                                                               (16, 1, 2048, 64, None)])  # fmt: skip
def test_sparse_gluon_narrow_ring_ds(heads, rows, topk, block_size, splits, device):
    # "ring" on fp8_ds_mla rows (half tiles cp.async'd into a raw stage per producer) against the reference, and bit for
    # bit against the narrow kernel's plain producers (the same bf16 operands, the same consumer): invalid entries,
    # index 0, duplicates, an all-invalid row, a length-0 row, NaN in every unused slot, splits
    num_blocks = max(2, -(-max(4 * topk, 8192) // block_size))
    cache = _cache(device, num_blocks, block_size, "fp8_ds_mla")
    idx, ln = _indices(rows, topk, num_blocks * block_size, device)
    _poison_unused(cache, "fp8_ds_mla", idx, ln)
    q = torch.randn(rows, heads, 576, device=device).bfloat16()
    kw = {} if splits is None else {"_num_splits_override": splits}
    a, la = _check(q, cache, idx, "fp8_ds_mla", topk_length=ln, _gluon_opts=("ring", "nanpack"), **kw)
    b, lb = openmla.sparse_mla(q, cache, idx, SCALE, kv_cache_dtype="fp8_ds_mla", topk_length=ln, _kernel="gluon",
                               _gluon_opts=("nanpack",), **kw)  # fmt: skip
    assert torch.equal(a, b) and torch.equal(la, lb)


@_gpu_test
@pytest.mark.parametrize("kv_cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("heads,rows", [(16, 1), (32, 1), (8, 300), (16, 300)])
def test_sparse_gluon_narrow_rows(heads, rows, kv_cache_dtype, device):
    # one row (the planner splits it over the SMs) and 300 rows, top-k 2048
    _run(heads, rows, 2048, 64, kv_cache_dtype, device, lens=rows > 1)


@_gpu_test
@pytest.mark.parametrize("kv_cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("heads", [16, 20])
def test_sparse_gluon_narrow_splits_and_sinks(heads, splits, kv_cache_dtype, device):
    sink = torch.linspace(-2, 2, heads, device=device)
    sink[0], sink[1], sink[2] = -INF, INF, 100.0
    out, _ = _run(heads, 37, 2048, 64, kv_cache_dtype, device, attn_sink=sink, _num_splits_override=splits)
    assert bool((out[:, 1] == 0).all())  # a sink of +inf gives 0


@_gpu_test
def test_sparse_gluon_narrow_nan_in_selected_fp8_rows(device):
    # a NaN e4m3 byte, a NaN scale and a NaN rope value in selected rows count as 0 (with and without nanpack)
    cache, idx = _nan_in_selected_fp8_rows(device)
    q = torch.randn(3, 16, 576, device=device).bfloat16()
    for opts in (None, ()):
        _check(q, cache, idx, "fp8_ds_mla", **({} if opts is None else {"_gluon_opts": opts}))


@_gpu_test
@pytest.mark.parametrize("kv_cache_dtype", CACHE_DTYPES)
def test_sparse_gluon_narrow_matches_wide(kv_cache_dtype, device):
    # the narrow kernel and the 64-head one ("wide") on the same inputs: the same bf16 rows, so they differ only by
    # accumulation order
    torch.manual_seed(3)
    cache = _cache(device, 256, 64, kv_cache_dtype)
    idx, ln = _indices(37, 2048, 256 * 64, device)
    q = torch.randn(37, 16, 576, device=device).bfloat16()
    a, la = _check(q, cache, idx, kv_cache_dtype, topk_length=ln)
    b, lb = _check(q, cache, idx, kv_cache_dtype, topk_length=ln, _gluon_opts=("wide",))
    torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(la, lb, atol=1e-3, rtol=1e-4)


@_gpu_test
@pytest.mark.parametrize("kv_cache_dtype", V4_DTYPES)
@pytest.mark.parametrize("heads,rows", list(itertools.product([1, 8, 16, 20, 32], [1, 37, 300])))
def test_sparse_gluon_narrow_v4(heads, rows, kv_cache_dtype, device):
    # V4 rows: two sources with their own block sizes and lengths, sinks, the fused inverse RoPE (one split: in the
    # kernel's epilogue; the planner's splits at 1 row: in the merge)
    _v4_run(heads, rows, kv_cache_dtype, device, sink=torch.linspace(-2, 2, heads, device=device), seed=heads + rows)


def test_sparse_gluon_fp8_default_bits():
    # the defaults add "ring" for fp8_v4 rows and for fp8_ds_mla rows of one source at H <= 16, in one split with
    # 16-byte aligned blocks (openmla's fp8_v4 caches pad a block to a multiple of 576 bytes; an unpadded cache of odd
    # blocks is not; fp8_ds_mla rows of 656 bytes always are); nothing at 17-128 heads (fp8_v4 33-64: the plain code)
    c, e = openmla.allocate_v4_cache(4, 3), openmla.allocate_v4_cache(2, 2)
    odd = torch.zeros(4, 3, 584, dtype=torch.uint8)  # block stride 1752
    ds = torch.zeros(4, 3, 656, dtype=torch.uint8)
    ring, staged = gs.GLUON_OPTS["ring"], gs.GLUON_OPTS["staged"] | gs.GLUON_OPTS["lazy"]
    assert gs.fp8_default_bits(c, e, "fp8_v4", 16, 1) == gs.fp8_default_bits(c, None, "fp8_v4", 1, 1) == ring
    assert gs.fp8_default_bits(ds, None, "fp8_ds_mla", 16, 1) == ring
    assert gs.fp8_default_bits(ds, None, "fp8_ds_mla", 1, 1) == ring
    for args in [(c, e, "fp8_v4", 17, 1), (c, e, "fp8_v4", 32, 1), (c, e, "fp8_v4", 33, 1), (c, e, "fp8_v4", 64, 1),
                 (c, None, "fp8_v4", 64, 1), (c, e, "fp8_v4", 65, 1), (c, e, "fp8_v4", 128, 1),
                 (c, e, "fp8_v4", 16, 2), (c, e, "fp8_v4", 64, 3), (c, odd, "fp8_v4", 16, 1),
                 (odd, None, "fp8_v4", 64, 1), (ds, None, "fp8_ds_mla", 17, 1), (ds, None, "fp8_ds_mla", 64, 1),
                 (ds, None, "fp8_ds_mla", 16, 2), (ds, ds, "fp8_ds_mla", 16, 1),
                 (torch.zeros(4, 3, 664, dtype=torch.uint8)[:, :, :656], None, "fp8_ds_mla", 16, 1),  # 664-byte rows
                 (torch.zeros(4, 3, 576, dtype=torch.bfloat16), None, "auto", 16, 1)]:  # fmt: skip
        assert gs.fp8_default_bits(*args) == 0, args
    # rows in a 672-byte stride: aligned
    assert gs.fp8_default_bits(torch.zeros(4, 3, 672, dtype=torch.uint8)[:, :, :656], None, "fp8_ds_mla", 16, 1) == ring
    for bits, names, fmt, d, extra in ((ring, ("ring",), "fp8_v4", 512, True),
                                       (ring | 1, ("ring", "nanpack"), "fp8_ds_mla", 576, False),
                                       (staged, ("staged", "lazy"), "fp8_v4", 512, True)):  # fmt: skip
        assert gs.gluon_opts_bits(names, fmt, d, extra, 64 if bits == staged else 16) == bits


@_gpu_test
@pytest.mark.parametrize("heads,rows,splits,extra,bs,e_bs", [
    (16, 37, None, True, 256, 64), (1, 300, 1, True, 256, 64), (8, 37, 3, True, 64, 2), (16, 1, None, False, 64, 64),
    (12, 37, 1, True, 1, 256)])  # fmt: skip
def test_sparse_gluon_narrow_v4_ring(heads, rows, splits, extra, bs, e_bs, device):
    # "ring" (fp8_v4 rows cp.async'd into a raw stage per producer, dequantised from there) against the reference, and
    # bit for bit against the narrow kernel's plain producers (the same bf16 operands, the same consumer): both sources
    # with their own block sizes and lengths, invalid entries, sinks, the inverse RoPE, splits
    kw = dict(bs=bs, e_bs=e_bs, extra=extra, sink=torch.linspace(-2, 2, heads, device=device), seed=heads + rows)
    if splits:
        kw["_num_splits_override"] = splits
    a, la, _, _ = _v4_run(heads, rows, "fp8_v4", device, _gluon_opts=("ring",), **kw)
    b, lb, _, _ = _v4_run(heads, rows, "fp8_v4", device, _gluon_opts=(), **kw)
    assert torch.equal(a, b) and torch.equal(la, lb)
    if splits in (None, 1) and rows > 100:  # the defaults run "ring" in one split (the planner's at 300 rows)
        c, lc, _, _ = _v4_run(heads, rows, "fp8_v4", device, **kw)
        assert torch.equal(a, c) and torch.equal(la, lc)


@_gpu_test
@pytest.mark.parametrize("kv_cache_dtype", V4_DTYPES)
@pytest.mark.parametrize("splits,rope,extra", [(1, True, False), (1, False, True), (3, True, True), (5, False, False)])
def test_sparse_gluon_narrow_v4_splits_rope(splits, rope, extra, kv_cache_dtype, device):
    _v4_run(16, 37, kv_cache_dtype, device, rope=rope, extra=extra, _num_splits_override=splits, seed=splits)


@_gpu_test
@pytest.mark.parametrize("kv_cache_dtype", V4_DTYPES)
@pytest.mark.parametrize("bs,e_bs,K,K2", [(64, 2, 100, 64), (1, 256, 64, 300)])
def test_sparse_gluon_narrow_v4_block_sizes(bs, e_bs, K, K2, kv_cache_dtype, device):
    _v4_run(8, 37, kv_cache_dtype, device, K=K, K2=K2, bs=bs, e_bs=e_bs, seed=K)
