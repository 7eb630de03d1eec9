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
from openmla.utils.sm90_report import run_report_script
from openmla.utils.testing import TOLERANCES, assert_close

SCALE = 576**-0.5
INF = float("inf")
HAS_NVIDIA_BACKEND = importlib.util.find_spec("triton.backends.nvidia") is not None

# (FMT, NUM_SPLITS, HAS_LEN, HAS_SINK, PAGE): every specialisation the launcher reaches, by cache format, split or
# not, with and without lengths / sinks, power-of-two and unit pages
COMPILE_VARIANTS = [
    (0, 1, True, True, 64),
    (0, 4, True, False, 1),
    (0, 1, False, False, 64),
    (1, 1, True, True, 64),
    (1, 4, False, True, 1),
    (1, 1, False, False, 64),
]

_COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from openmla.utils.sm90_report import resource_report
from openmla.ops.gluon import sparse as gs

report = []
for fmt, splits, has_len, has_sink, page in json.loads(sys.argv[1]):
    fn = gs._sparse_mla_gluon_fwd_kernel
    cons = dict(PAGE=page, FMT=fmt, N_HB=2, NUM_SPLITS=splits, HAS_LEN=has_len, HAS_SINK=has_sink,
                BLOCK_N=gs.BLOCK_N, STAGES=gs.STAGES, FP8_PASSES=gs.FP8_PASSES, PRODUCER_REGS=gs.PRODUCER_REGS[fmt],
                num_warps=gs.NUM_WARPS)
    kvt = "*bf16" if fmt == 0 else "*u8"
    ptr = {"q": "*bf16", "kv": kvt, "kv_f32": "*fp32" if fmt else kvt, "kv_b16": "*bf16" if fmt else kvt,
           "idx": "*i32", "lens": "*i32", "sink": "*fp32", "out": "*bf16", "lse": "*fp32", "o_part": "*fp32",
           "lse_part": "*fp32"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in cons:
            sig[name] = "constexpr"
        elif name in ptr:
            sig[name] = ptr[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "scale_log2":
            sig[name] = "fp32"
        elif name.startswith("stride_") and name != "stride_i_t":  # as the JIT specialises multiples of 16
            sig[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
    k = triton.compile(GluonASTSource(fn, sig, constexprs=cons, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=gs.NUM_WARPS))
    ptx = k.asm["ptx"]
    r = resource_report(k)
    r.update(variant=[fmt, splits, has_len, has_sink, page], qk=ptx.count("wgmma.mma_async.sync.aligned.m64n32k16"),
             pv=ptx.count("wgmma.mma_async.sync.aligned.m64n256k16"), cp_async=ptx.count("cp.async.cg.shared.global"),
             noinc=ptx.count("cp.async.mbarrier.arrive.noinc"))
    report.append(r)
print("REPORT" + json.dumps(report))
"""


@pytest.mark.skipif(not gs.GLUON_AVAILABLE or not HAS_NVIDIA_BACKEND, reason="needs triton's Gluon and NVIDIA backend")
def test_sparse_gluon_compiles_for_sm90():
    # offline sm90 compile (no GPU needed): no spill, fits the shared memory, 12 warps (8 consumers + the producer
    # warpgroup) with registers moved by setmaxnreg; the scores are m64n32k16 (each warpgroup scores 32 of the 64
    # keys: 9 chunks x 4 k-steps), P V m64n256k16 (each warpgroup 256 of the 512 columns); bf16 rows by cp.async
    for r in run_report_script(_COMPILE_SCRIPT, COMPILE_VARIANTS):
        name = "FMT={} NUM_SPLITS={} HAS_LEN={} HAS_SINK={} PAGE={}".format(*r["variant"])
        assert r["regs"] <= 255 and r["stack"] == 0 and r["local"] == 0, f"{name}: spills {r}"
        assert r["shared"] + r["static_shared"] <= SMEM_LIMIT, f"{name}: shared memory {r}"
        assert r["num_warps"] == 12 and r["setmaxnreg"], f"{name}: {r}"
        assert r["wgmma"] == 40 and r["qk"] == 36 and r["pv"] == 4, f"{name}: wgmma {r}"
        if r["variant"][0] == 0:
            assert r["cp_async"] == 9 * 4 and r["noinc"] == 1, f"{name}: cp.async {r}"  # 9 [64, 64] copies, 4 a thread
        else:
            assert r["cp_async"] == 0, f"{name}: {r}"


def test_sparse_gluon_refusals(device):
    # "auto" takes the Gluon kernel above 32 heads where it applies (an sm90 GPU), else the Triton one; "gluon"
    # refuses what it does not take (a CPU device here, or an unsupported layout on a GPU) with a ValueError naming
    # the reason; an unknown name is refused
    q = torch.randn(2, 64, 576, device=device).bfloat16()
    cache = torch.randn(4, 16, 576, device=device).bfloat16()
    idx = torch.randint(0, 64, (2, 8), dtype=torch.int32, device=device)
    gluon_here = gs.gluon_sparse_unsupported(q, cache, "auto", 512) is None and not INTERPRET
    for heads, kernel in ((64, "gluon" if gluon_here else "triton"), (32, "triton")):
        a, la = openmla.sparse_mla(q[:, :heads], cache, idx, SCALE)
        b, lb = openmla.sparse_mla(q[:, :heads], cache, idx, SCALE, _kernel=kernel)
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        torch.testing.assert_close(la, lb, atol=0, rtol=0)
    with pytest.raises(ValueError, match="_kernel must be"):
        openmla.sparse_mla(q, cache, idx, SCALE, _kernel="cuda")
    refused = [
        dict(extra_kv_cache=cache, extra_indices=idx),  # a second source
        dict(_tiling_override=(32, 8, 2)),
    ]
    if device.type != "cuda":
        refused.append({})  # no CUDA device at all
    for kw in refused:
        with pytest.raises(ValueError, match="_kernel='gluon'"):
            openmla.sparse_mla(q, cache, idx, SCALE, _kernel="gluon", **kw)
    with pytest.raises(ValueError, match="_kernel='gluon'"):  # ragged indices
        openmla.sparse_mla(q, cache, openmla.build_ragged_indices_from_dense(idx, torch.full_like(idx[:, 0], 8)),
                           SCALE, _kernel="gluon")  # fmt: skip
    with pytest.raises(ValueError, match="_kernel='gluon'"):  # fp16 q
        openmla.sparse_mla(q.half(), cache.half(), idx, SCALE, _kernel="gluon")
    with pytest.raises(ValueError, match="_kernel='gluon'"):  # V4 rows (D = d_v = 512)
        openmla.sparse_mla(q[..., :512].contiguous(), cache[..., :512].contiguous(), idx, SCALE, _kernel="gluon")


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


@_gpu_test
@pytest.mark.parametrize("heads,topk,block_size,kv_cache_dtype", _MAIN, ids=lambda v: str(v))
def test_sparse_gluon(heads, topk, block_size, kv_cache_dtype, device):
    _run(heads, 37, topk, block_size, kv_cache_dtype, device)


@_gpu_test
@pytest.mark.parametrize("kv_cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("heads,rows", [(64, 1), (128, 1), (64, 300), (128, 300)])
def test_sparse_gluon_rows(heads, rows, kv_cache_dtype, device):
    # one row (the planner splits it over the SMs) and 300 rows (no split), top-k 2048, no lengths
    _run(heads, rows, 2048, 64, kv_cache_dtype, device, lens=rows > 1)


@_gpu_test
@pytest.mark.parametrize("heads", [40, 96])
def test_sparse_gluon_masked_heads(heads, device):
    # head counts that are not a multiple of 64: the last head block's rows past H are masked
    for kv_cache_dtype in CACHE_DTYPES:
        _run(heads, 37, 100, 64, kv_cache_dtype, device)


@_gpu_test
@pytest.mark.parametrize("kv_cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_sparse_gluon_splits_and_sinks(splits, kv_cache_dtype, device):
    # forced split counts (partials + the Triton merge; splits past a short row are empty) with sinks -inf /
    # finite / +inf / 100 per head
    H = 128
    sink = torch.linspace(-2, 2, H, device=device)
    sink[0], sink[1], sink[2] = -INF, INF, 100.0
    out, lse = _run(H, 37, 2048, 64, kv_cache_dtype, device, attn_sink=sink, _num_splits_override=splits)
    assert bool((out[:, 1] == 0).all())  # a sink of +inf gives 0


@_gpu_test
def test_sparse_gluon_nan_in_selected_fp8_rows(device):
    # fp8_ds_mla: a NaN e4m3 byte, a NaN scale (its whole group of 128) and a NaN rope value in selected rows count
    # as 0
    cache = _cache(device, 4, 16, "fp8_ds_mla")
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 64, (3, 24), generator=g, dtype=torch.int32).to(device)
    flat = cache.view(64, 656)
    s0, s1, s2 = (int(v) for v in idx[0, :3])
    flat[s0, 5] = 0x7F
    flat[s1, 512:516] = 0xFF
    flat[s2, 600:602] = 0xFF
    q = torch.randn(3, 64, 576, device=device).bfloat16()
    _check(q, cache, idx, "fp8_ds_mla")


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
