"""sparse_mla against the fp32 reference: heads, top-k widths, block sizes, both cache dtypes, sentinels,
lengths, sinks, the extra source, ragged indices, splits, NaN in unused pages, buffers and errors."""

import itertools

import pytest
import torch

import openmla
from openmla.reference import apply_attn_sink_ref, ds_mla_row_ref, sparse_mla_ref
from openmla.utils.testing import TOLERANCES, assert_close, on_gpu, pick

SCALE = 576**-0.5
INF = float("inf")


def _cache(device, num_blocks, block_size, kv_cache_dtype, dtype=torch.bfloat16, width=576):
    """A paged cache of random rows (values ~ N(0, 1)); an fp8_ds_mla cache is encoded by the reference
    writer (SPEC §2.3)."""
    rows = torch.randn(num_blocks * block_size, width)
    if kv_cache_dtype == "auto":
        return rows.to(dtype).view(num_blocks, block_size, width).to(device)
    enc = ds_mla_row_ref(rows[:, :512], rows[:, 512:])
    return enc.view(num_blocks, block_size, 656).to(device)


def _poison_unused(cache, kv_cache_dtype, *index_sets):
    """NaN in every slot no index set selects (they must never be read)."""
    num_slots = cache.shape[0] * cache.shape[1]
    used = torch.zeros(num_slots, dtype=torch.bool)
    for rows, counted in index_sets:
        ok = counted & (rows >= 0) & (rows < num_slots)
        used[rows[ok].long()] = True
    flat = cache.view(num_slots, cache.shape[-1])
    bad = (~used).nonzero().flatten().to(cache.device)
    if kv_cache_dtype == "auto":
        flat[bad] = float("nan")
    else:
        flat[bad] = 0xFF  # e4m3 NaN bytes, NaN fp32 scales, NaN bf16 rope


def _indices(T, K, num_slots, device, with_len=True, gen=None):
    """[T, K] int32 slots with the cases the op must handle: -1 inside and after the valid prefix,
    out-of-range values (>= num_slots, < -1), slot 0, duplicates, an all-invalid row, a length-0 row."""
    g = gen or torch.Generator().manual_seed(7)
    idx = torch.randint(0, num_slots, (T, K), generator=g, dtype=torch.int32)
    if K >= 4:
        idx[:, 1] = 0  # slot 0 is a real slot
        idx[:, 2] = idx[:, 3]  # a duplicate counts twice
        idx[0, K // 2] = -1  # -1 inside the prefix
        idx[0, K // 3] = num_slots  # just past the cache
        idx[0, K - 1] = -7
    if T >= 3:
        idx[2, :] = -1  # no valid key at all
    lens = None
    if with_len:
        lens = torch.randint(1, K + 1, (T,), generator=g, dtype=torch.int32)
        if T >= 2:
            lens[1] = 0  # nothing counts
        if K >= 4:  # -1 after the valid prefix
            for t in range(T):
                idx[t, int(lens[t]) :] = torch.where(
                    torch.rand(K - int(lens[t]), generator=g) < 0.5, -1, idx[t, int(lens[t]) :]
                )
        lens = lens.to(device)
    return idx.to(device), lens


def _counted(idx, lens):
    K = idx.shape[1]
    c = torch.ones(idx.shape, dtype=torch.bool) if lens is None else torch.arange(K)[None, :] < lens.cpu()[:, None]
    return idx.cpu(), c


def _tol(q_dtype):
    # inputs are exact in the reference (the same bf16 values / fp8 bytes); the kernel rounds P (and on the
    # GPU the dequantised fp8 rows) to q's dtype before its dots
    return TOLERANCES[q_dtype]


# LSE tolerances (atol, rtol, cos) by cache dtype. fp8_ds_mla: on the GPU the kernel rounds each dequantised row
# (e4m3 x fp32 scale) to bf16 before its dot, 2^-9 relative, about 1e-3 in a score of size 1; the reference keeps
# the fp32 product, so a row with one key differs by up to a few 1e-3 (cosine difference ~1.3e-6 at top-k 1).
_LSE_TOL = {"auto": (1e-3, 1e-3, 1e-6), "fp8_ds_mla": (1e-2, 1e-3, 1e-5)}
# fp32 q: fp32 operands and IEEE dots on every cache layout, the same arithmetic as the reference up to order
_LSE_TOL_FP32 = (1e-5, 1e-5, 1e-9)


def _check(q, cache, idx, kv_cache_dtype="auto", **kw):
    ref_kw = {k: v for k, v in kw.items() if not k.startswith("_") and k not in ("validate", "out", "lse")}
    out, lse = openmla.sparse_mla(q, cache, idx, SCALE, kv_cache_dtype=kv_cache_dtype, **kw)
    ref_out, ref_lse = sparse_mla_ref(q, cache, idx, SCALE, kv_cache_dtype=kv_cache_dtype, **ref_kw)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    atol, rtol, cos = _tol(q.dtype)
    assert_close("out", ref_out, out, atol, rtol, cos)
    assert_close("lse", ref_lse, lse, *(_LSE_TOL_FP32 if q.dtype == torch.float32 else _LSE_TOL[kv_cache_dtype]))
    return out, lse


HEADS = pick([1, 6, 16], [1, 6, 16, 64, 128])
TOPK = pick([1, 100], [1, 100, 2048])
BLOCK_SIZES = [1, 16, 64]
CACHE_DTYPES = ["auto", "fp8_ds_mla"]


def _cases():
    full = list(itertools.product(HEADS, TOPK, BLOCK_SIZES, CACHE_DTYPES))
    if on_gpu():
        return full
    # CPU: every heads x dtype at K 100 and block 16; every top-k x block size at 6 heads
    keep = [c for c in full if c[1] == 100 and c[2] == 16]
    keep += [c for c in full if c[0] == 6 and c not in keep]
    return keep


@pytest.mark.parametrize(
    "heads,topk,block_size,kv_cache_dtype", _cases(), ids=lambda v: str(v) if not isinstance(v, str) else v
)
def test_sparse_mla(heads, topk, block_size, kv_cache_dtype, device):
    T = pick(4, 24)
    num_blocks = max(2, -(-pick(300, 8192) // block_size))
    cache = _cache(device, num_blocks, block_size, kv_cache_dtype)
    idx, lens = _indices(T, topk, num_blocks * block_size, device)
    _poison_unused(cache, kv_cache_dtype, _counted(idx, lens))
    q = torch.randn(T, heads, 576, device=device).bfloat16()
    out, lse = _check(q, cache, idx, kv_cache_dtype, topk_length=lens)
    if T >= 3:  # the all-invalid row and the length-0 row: out 0, lse -inf
        assert bool((out[1:3] == 0).all()) and bool(torch.isneginf(lse[1:3]).all())


@pytest.mark.parametrize("heads", pick([128], [96, 128]))
def test_sparse_mla_many_heads(heads, device):
    T, K = pick(2, 64), pick(20, 2048)
    cache = _cache(device, 64, 64, "fp8_ds_mla")
    idx, lens = _indices(T, K, 64 * 64, device)
    q = torch.randn(T, heads, 576, device=device).bfloat16()
    _check(q, cache, idx, "fp8_ds_mla", topk_length=lens)


@pytest.mark.parametrize("kv_cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("splits", pick([3, 17], [2, 5, 17]))
def test_sparse_mla_splits(splits, kv_cache_dtype, device):
    """The split path (partials + LSE merge) with sinks and the extra source; splits past a short row are empty
    (17: the merge's one-head programs over 32 split rows, most of them empty)."""
    T, H, K = pick(3, 8), pick(6, 64), pick(70, 2048)
    cache = _cache(device, 20, 16, kv_cache_dtype)
    extra = _cache(device, 9, 4, kv_cache_dtype)
    idx, lens = _indices(T, K, 320, device)
    eidx, elens = _indices(T, pick(9, 300), 36, device, gen=torch.Generator().manual_seed(3))
    sink = torch.linspace(-2, 2, H, device=device)
    sink[0] = -INF
    q = torch.randn(T, H, 576, device=device).bfloat16()
    _check(q, cache, idx, kv_cache_dtype, topk_length=lens, attn_sink=sink, extra_kv_cache=extra, extra_indices=eidx,
           extra_topk_length=elens, _num_splits_override=splits)  # fmt: skip


def test_sparse_mla_planner_splits(device):
    """One token with many keys: the planner's own choice (splits on a GPU) against the reference."""
    K = pick(64, 2048)
    cache = _cache(device, pick(8, 64), 64, "fp8_ds_mla")
    idx, _ = _indices(1, K, cache.shape[0] * 64, device, with_len=False)
    for H in pick([16], [16, 128]):
        _check(torch.randn(1, H, 576, device=device).bfloat16(), cache, idx, "fp8_ds_mla")


def test_sparse_mla_sinks(device):
    """Sinks -inf / finite / +inf per head, with empty rows: out scaled by sigmoid(lse - sink), lse sink-free;
    apply_attn_sink on the sink-free output gives the same."""
    T, H = 4, pick(6, 64)
    cache = _cache(device, 10, 16, "auto")
    idx, lens = _indices(T, 30, 160, device)
    q = torch.randn(T, H, 576, device=device).bfloat16()
    sink = torch.randn(H, device=device)
    sink[0], sink[1], sink[2] = -INF, INF, 100.0
    out, lse = _check(q, cache, idx, topk_length=lens, attn_sink=sink)
    plain, lse0 = openmla.sparse_mla(q, cache, idx, SCALE, topk_length=lens)
    assert torch.equal(lse, lse0)  # the returned LSE is sink-free
    assert bool((out[:, 1] == 0).all())  # +inf
    torch.testing.assert_close(out[:, 0], plain[:, 0], atol=0, rtol=0)  # -inf changes nothing
    applied = openmla.apply_attn_sink(plain, lse0, sink)
    assert_close("apply_attn_sink", apply_attn_sink_ref(plain, lse0, sink), applied, *TOLERANCES[torch.bfloat16])
    assert_close("apply vs fused", out.float(), applied, *TOLERANCES[torch.bfloat16])
    inplace = plain.clone()
    assert openmla.apply_attn_sink(inplace, lse0, sink, inplace=True).data_ptr() == inplace.data_ptr()
    torch.testing.assert_close(inplace, applied, atol=0, rtol=0)


@pytest.mark.parametrize("kv_cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("ragged", [False, True])
def test_sparse_mla_extra_source(kv_cache_dtype, ragged, device):
    """Two sources (different block sizes) in one softmax, dense or ragged index sets; a token whose main
    list is empty still attends to its extra keys."""
    T, H = pick(4, 32), pick(16, 128)
    main = _cache(device, 12, 16, kv_cache_dtype)
    extra = _cache(device, 5, 2, kv_cache_dtype)
    idx, lens = _indices(T, pick(40, 2048), 192, device)
    eidx, elens = _indices(T, pick(12, 512), 10, device, gen=torch.Generator().manual_seed(11))
    elens[1] = 3  # row 1 has no main key but extra ones
    eidx[1, :3] = torch.tensor([0, 5, 9], dtype=torch.int32)
    _poison_unused(main, kv_cache_dtype, _counted(idx, lens))
    _poison_unused(extra, kv_cache_dtype, _counted(eidx, elens))
    q = torch.randn(T, H, 576, device=device).bfloat16()
    if ragged:
        idx_arg = openmla.build_ragged_indices_from_dense(idx, lens)
        eidx_arg = openmla.build_ragged_indices_from_dense(eidx, elens)
        out, _ = _check(q, main, idx_arg, kv_cache_dtype, extra_kv_cache=extra, extra_indices=eidx_arg)
    else:
        out, _ = _check(q, main, idx, kv_cache_dtype, topk_length=lens, extra_kv_cache=extra, extra_indices=eidx,
                        extra_topk_length=elens)  # fmt: skip
    assert bool((out[1] != 0).any())


@pytest.mark.parametrize("splits", [None, 1, 3])
def test_sparse_mla_ragged_matches_dense(splits, device):
    """Ragged indices give the dense result bit for bit at the same split count. The planner bounds a row's keys
    by the index width (dense: K) or the flat array (ragged: T * K here), so without a forced split the two may
    plan differently (T 5, H 64, K 2048 on 132 SMs: 16 vs 26 splits): then they agree within the bf16 tolerance."""
    T, H = 5, pick(6, 64)
    cache = _cache(device, 8, 64, "fp8_ds_mla")
    idx, lens = _indices(T, pick(50, 2048), 512, device)
    q = torch.randn(T, H, 576, device=device).bfloat16()
    # forced splits: the Triton kernel (the one that takes ragged indices) on both sides, as the bit-for-bit claim is
    # its own; else the default picks (the Gluon kernel for the dense call on sm90)
    kw = {} if splits is None else {"_num_splits_override": splits, "_kernel": "triton"}
    dense, dlse = openmla.sparse_mla(q, cache, idx, SCALE, kv_cache_dtype="fp8_ds_mla", topk_length=lens, **kw)
    ragged, rlse = openmla.sparse_mla(q, cache, openmla.build_ragged_indices_from_dense(idx, lens), SCALE,
                                      kv_cache_dtype="fp8_ds_mla", **kw)  # fmt: skip
    if splits is None:
        assert_close("ragged", dense.float(), ragged, *TOLERANCES[q.dtype])
        assert_close("ragged lse", dlse, rlse, *_LSE_TOL["auto"])
    else:
        torch.testing.assert_close(ragged, dense, atol=0, rtol=0)
        torch.testing.assert_close(rlse, dlse, atol=0, rtol=0)


def test_sparse_mla_nan_in_selected_fp8_rows(device):
    """fp8_ds_mla: NaN bytes, a NaN scale and a NaN rope value in selected rows count as 0."""
    T, H = 3, pick(6, 64)
    cache = _cache(device, 4, 16, "fp8_ds_mla")
    idx, _ = _indices(T, 24, 64, device, with_len=False)
    flat = cache.view(64, 656)
    s0, s1, s2 = (int(v) for v in idx[0, :3])
    flat[s0, 5] = 0x7F  # e4m3 NaN
    flat[s1, 512:516] = 0xFF  # a NaN scale: its whole group of 128
    flat[s2, 600:602] = 0xFF  # a NaN bf16 rope value
    q = torch.randn(T, H, 576, device=device).bfloat16()
    _check(q, cache, idx, "fp8_ds_mla")


def test_sparse_mla_v4_shape_and_fp16(device):
    """D = d_v = 512 (V4: V is the whole row, no tail) and fp16 q / cache."""
    T, H = 3, pick(16, 64)
    cache = _cache(device, 6, 16, "auto", width=512)
    idx, lens = _indices(T, 33, 96, device)
    q = torch.randn(T, H, 512, device=device).bfloat16()
    _check(q, cache, idx, topk_length=lens, d_v=512)
    cache16 = _cache(device, 6, 16, "auto", dtype=torch.float16)
    q16 = torch.randn(T, H, 576, device=device).half()
    _check(q16, cache16, idx, topk_length=lens)
    _check(q16, _cache(device, 6, 16, "fp8_ds_mla"), idx, "fp8_ds_mla", topk_length=lens)


@pytest.mark.parametrize("kv_cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("heads,block_size", [(6, 16), (16, 1)])
def test_sparse_mla_fp32(heads, block_size, kv_cache_dtype, device):
    """fp32 q with an fp32 "auto" cache (the CPU oracle configuration of the V3.2 layer and engine) or fp8_ds_mla
    rows: the kernel against the reference at fp32 tolerances, with sentinels, lengths and poisoned slots."""
    T, K = 4, 40
    num_blocks = -(-200 // block_size)
    cache = _cache(device, num_blocks, block_size, kv_cache_dtype, dtype=torch.float32)
    idx, lens = _indices(T, K, num_blocks * block_size, device)
    _poison_unused(cache, kv_cache_dtype, _counted(idx, lens))
    q = torch.randn(T, heads, 576, device=device)
    out, lse = _check(q, cache, idx, kv_cache_dtype, topk_length=lens)
    assert bool((out[1:3] == 0).all()) and bool(torch.isneginf(lse[1:3]).all())


@pytest.mark.parametrize("splits", [1, 3, 9])
def test_sparse_mla_fp32_extra_source_sink_v4_shape(splits, device):
    """fp32 at V4's shape (D = d_v = 512): two fp32 sources, ragged extra indices, a sink and the split merge."""
    T, H = 3, 6
    main = _cache(device, 8, 16, "auto", dtype=torch.float32, width=512)
    extra = _cache(device, 5, 4, "auto", dtype=torch.float32, width=512)
    idx, lens = _indices(T, 30, 128, device)
    eidx, elens = _indices(T, 10, 20, device, gen=torch.Generator().manual_seed(5))
    _poison_unused(main, "auto", _counted(idx, lens))
    _poison_unused(extra, "auto", _counted(eidx, elens))
    sink = torch.linspace(-1, 1, H, device=device)
    q = torch.randn(T, H, 512, device=device)
    _check(q, main, idx, topk_length=lens, d_v=512, attn_sink=sink, extra_kv_cache=extra,
           extra_indices=openmla.build_ragged_indices_from_dense(eidx, elens), _num_splits_override=splits)  # fmt: skip


def test_sparse_mla_buffers_and_strides(device):
    """out= / lse= buffers are written in place; q with a head stride, a cache that is a slice of a larger one;
    return_lse=False."""
    T, H = 3, 6
    big = _cache(device, 10, 8, "fp8_ds_mla")
    cache = big[2:9]  # 4-byte aligned slice
    idx, lens = _indices(T, 20, 7 * 8, device)
    qbig = torch.randn(T, 2 * H, 576, device=device).bfloat16()
    q = qbig[:, ::2]
    out = torch.full((T, H, 512), 7.0, device=device).bfloat16()
    lse = torch.full((T, H), 7.0, device=device)
    r_out, r_lse = openmla.sparse_mla(q, cache, idx, SCALE, kv_cache_dtype="fp8_ds_mla", topk_length=lens,
                                      out=out, lse=lse)  # fmt: skip
    assert r_out.data_ptr() == out.data_ptr() and r_lse.data_ptr() == lse.data_ptr()
    ref_out, ref_lse = sparse_mla_ref(q, cache, idx, SCALE, kv_cache_dtype="fp8_ds_mla", topk_length=lens)
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, *_LSE_TOL["fp8_ds_mla"])
    o2, none = openmla.sparse_mla(q.contiguous(), cache.contiguous(), idx, SCALE, kv_cache_dtype="fp8_ds_mla",
                                  topk_length=lens, return_lse=False)  # fmt: skip
    assert none is None
    torch.testing.assert_close(o2, out, atol=0, rtol=0)


def test_sparse_mla_empty_batch(device):
    cache = _cache(device, 2, 16, "auto")
    q = torch.zeros(0, 4, 576, device=device).bfloat16()
    out, lse = openmla.sparse_mla(q, cache, torch.zeros(0, 8, dtype=torch.int32, device=device), SCALE)
    assert out.shape == (0, 4, 512) and lse.shape == (0, 4)


def test_sparse_mla_unvalidated_lengths_stay_in_bounds(device):
    """validate=False: lengths past K and a ragged indptr past the flat array are clamped to the rows, so the
    kernel reads nothing outside a tensor; the result equals the clamped lengths'."""
    T, H, K = 3, 6, 16
    cache = _cache(device, 4, 16, "auto")
    idx, _ = _indices(T, K, 64, device, with_len=False)
    lens = torch.tensor([K + 100, 3, -5], dtype=torch.int32, device=device)
    q = torch.randn(T, H, 576, device=device).bfloat16()
    out, lse = openmla.sparse_mla(q, cache, idx, SCALE, topk_length=lens, validate=False)
    clamped = lens.clamp(0, K)
    ref_out, ref_lse = sparse_mla_ref(q, cache, idx, SCALE, topk_length=clamped)
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)
    flat = idx.flatten()[:10].contiguous()
    indptr = torch.tensor([0, 4, 9, 50], dtype=torch.int32, device=device)  # past flat's 10 entries
    out, lse = openmla.sparse_mla(q, cache, (indptr, flat), SCALE, validate=False)
    ref_out, ref_lse = sparse_mla_ref(q, cache, (torch.tensor([0, 4, 9, 10]), flat), SCALE)
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    with pytest.raises(ValueError, match="indptr"):
        openmla.sparse_mla(q, cache, (indptr, flat), SCALE)


def test_sparse_mla_errors(device):
    T, H = 2, 4
    q = torch.randn(T, H, 576, device=device).bfloat16()
    cache = _cache(device, 2, 16, "auto")
    fp8 = _cache(device, 2, 16, "fp8_ds_mla")
    idx = torch.zeros(T, 8, dtype=torch.int32, device=device)
    f = openmla.sparse_mla
    with pytest.raises(TypeError, match="q must have dtype"):
        f(q.double(), cache, idx, SCALE)
    with pytest.raises(TypeError, match="kv_cache must have dtype"):
        f(q.float(), cache, idx, SCALE)  # an fp32 q takes an fp32 "auto" cache
    with pytest.raises(TypeError, match="extra_kv_cache must have dtype"):
        f(q.float(), cache.float(), idx, SCALE, extra_kv_cache=cache, extra_indices=idx)
    with pytest.raises(TypeError, match="kv_cache must have dtype"):
        f(q, cache.half(), idx, SCALE)
    with pytest.raises(ValueError, match="kv_cache rows must be 576"):
        f(q, cache[..., :512], idx, SCALE)
    with pytest.raises(ValueError, match='uint8 \\[num_blocks, block_size, 656\\] for "fp8_ds_mla"'):
        f(q, fp8[..., :640], idx, SCALE, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(TypeError, match="kv_cache must have dtype"):
        f(q, cache, idx, SCALE, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        f(q, cache, idx, SCALE, kv_cache_dtype="fp8")
    with pytest.raises(TypeError, match="indices must have dtype"):
        f(q, cache, idx.long(), SCALE)
    with pytest.raises(ValueError, match="indices must have shape"):
        f(q, cache, idx[:1], SCALE)
    with pytest.raises(ValueError, match="topk_length must lie in"):
        f(q, cache, idx, SCALE, topk_length=torch.tensor([9, 1], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="topk_length must have shape"):
        f(q, cache, idx, SCALE, topk_length=torch.tensor([1], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="attn_sink must have shape"):
        f(q, cache, idx, SCALE, attn_sink=torch.zeros(H + 1, device=device))
    with pytest.raises(TypeError, match="attn_sink must have dtype"):
        f(q, cache, idx, SCALE, attn_sink=torch.zeros(H, device=device).bfloat16())
    with pytest.raises(ValueError, match="extra_indices is required"):
        f(q, cache, idx, SCALE, extra_kv_cache=cache)
    with pytest.raises(ValueError, match="need extra_kv_cache"):
        f(q, cache, idx, SCALE, extra_indices=idx)
    with pytest.raises(ValueError, match="d_v"):
        f(q, cache, idx, SCALE, d_v=600)
    with pytest.raises(ValueError, match="d_v"):
        f(q, cache, idx, SCALE, d_v=500)
    with pytest.raises(ValueError, match="out must have shape"):
        f(q, cache, idx, SCALE, out=torch.zeros(T, H, 576, device=device).bfloat16())
    with pytest.raises(TypeError, match="lse must have dtype"):
        f(q, cache, idx, SCALE, lse=torch.zeros(T, H, device=device).half())
    with pytest.raises(TypeError, match="sm_scale"):
        f(q, cache, idx, None)
    with pytest.raises(ValueError, match="topk_length must be None with ragged"):
        f(q, cache, (torch.zeros(T + 1, dtype=torch.int32, device=device), idx.flatten()), SCALE,
          topk_length=torch.zeros(T, dtype=torch.int32, device=device))  # fmt: skip
    with pytest.raises(ValueError, match="4-byte aligned"):
        f(q, fp8.view(-1)[1:].view(-1)[: 2 * 16 * 656 - 656].view(1, -1, 656)[:, :16], idx, SCALE,
          kv_cache_dtype="fp8_ds_mla")  # fmt: skip
    with pytest.raises(TypeError, match="attn_sink must have dtype"):
        openmla.apply_attn_sink(torch.zeros(T, H, 8, device=device), torch.zeros(T, H, device=device),
                                torch.zeros(H, dtype=torch.int32, device=device))  # fmt: skip


_SM90_SCRIPT = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import openmla.ops.sparse as S
from openmla.utils.sm90_report import resource_report

kern = S._sparse_mla_fwd_kernel
report = []
for block_h, fmt, splits, extra, f16, rope in json.loads(sys.argv[1]):
    _, block_n, warps, stages = S._tiling(block_h, fmt, extra=extra)  # the launcher's tile (one source or two)
    d_t = 0 if fmt == 2 or rope else 64  # V4 (fp8_v4, or with the inverse RoPE): D = d_v = 512
    const = dict(PAGE=64, E_PAGE=2, FMT=fmt, D_V=512, D_T=d_t, D_TP=max(16, d_t), BLOCK_H=block_h, N_HB=2,
                 BLOCK_N=block_n, NUM_SPLITS=splits, RAGGED=False, HAS_LEN=True, HAS_EXTRA=extra, E_RAGGED=extra,
                 E_HAS_LEN=extra, HAS_SINK=True, HAS_ROPE=rope, ROPE=64, COMPUTE=tl.float16 if f16 else tl.bfloat16,
                 F16_DEQUANT=f16, DOT_PRECISION="tf32")
    cache = "*u8" if fmt else "*bf16"
    scales = "*u8" if fmt == 2 else "*fp32"
    ptrs = dict(q="*bf16", kv=cache, kv_f32=scales, kv_b16="*bf16", ekv=cache, ekv_f32=scales, ekv_b16="*bf16",
                sink="*fp32", out="*bf16", lse="*fp32", o_part="*fp32", lse_part="*fp32", rope_pos="*i32",
                cos_sin="*fp32", scale_log2="fp32")
    sig = {n: "constexpr" if n in const else ptrs.get(n, "*i32" if "idx" in n or "ptr" in n or "lens" in n else "i32")
           for n in kern.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names)
             if n not in const and (n.startswith("stride") or sig[n].startswith("*"))}
    c = triton.compile(ASTSource(kern, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    report.append(dict(variant=[block_h, fmt, splits, extra, f16, rope], **resource_report(c)))
    if splits > 1:  # the split merge with the same epilogue options
        m = S._sparse_mla_merge_fwd_kernel
        s_p, m_h, m_d, m_w = S._merge_tiling(splits, block_h * 2, 512)
        mconst = dict(S=splits, S_P=s_p, D_V=512, BLOCK_H=m_h, BLOCK_D=m_d, HAS_SINK=True, HAS_ROPE=rope, ROPE=64)
        mptrs = dict(o_part="*fp32", lse_part="*fp32", sink="*fp32", out="*bf16", lse="*fp32", rope_pos="*i32",
                     cos_sin="*fp32")
        msig = {n: "constexpr" if n in mconst else mptrs.get(n, "i32") for n in m.arg_names}
        c = triton.compile(ASTSource(m, msig, constexprs=mconst), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=m_w))
        report.append(dict(variant=["merge", fmt, splits, extra, f16, rope], **resource_report(c)))
print("REPORT" + json.dumps(report))
"""


@pytest.mark.skipif(on_gpu(), reason="the GPU runs compile the kernels for real")
def test_sparse_mla_compiles_for_sm90():
    """Offline sm90 compile (no GPU): the tiles the launcher picks compile, 64-head tiles run wgmma, and none
    spills or exceeds sm90's shared memory (bf16 and fp8 rows, V3.2 and V4 shapes, fp8_v4 and bf16 with the fused
    inverse RoPE, splits, one source or two)."""
    pytest.importorskip("triton.backends.nvidia")
    from openmla.utils.sm90_report import run_report_script

    # [BLOCK_H, FMT, NUM_SPLITS, extra source, fp16 dequant, inverse RoPE (V4 shapes with it or with fp8_v4)]
    variants = [[16, 0, 1, True, False, False], [64, 1, 4, True, False, False], [64, 1, 1, False, True, False],
                [64, 2, 1, True, False, True], [64, 2, 4, True, False, True], [16, 2, 1, True, False, True],
                [32, 2, 1, True, False, True], [64, 0, 1, True, False, True],
                [64, 0, 1, True, False, False],
                # one source (V3.2 decode and prefill, a gathered V4 workspace): the 64-key tiles
                [64, 0, 1, False, False, False], [64, 1, 1, False, False, False], [64, 1, 4, False, False, False],
                [64, 2, 1, False, False, True], [32, 1, 1, False, False, False],
                # the merge at the planner's most splits (one head a program) and at 16 (4 heads)
                [64, 1, 32, False, False, False], [64, 2, 16, True, False, True]]  # fmt: skip
    from openmla.ops.gluon.decode import SMEM_LIMIT

    for r in run_report_script(_SM90_SCRIPT, variants):
        block_h, fmt = r["variant"][:2]
        assert r["regs"] <= 255, r
        assert r["shared"] + r["static_shared"] <= SMEM_LIMIT, r  # else the launch fails with out of resources
        if block_h == "merge":
            assert r["stack"] == 0 and r["local"] == 0, r
            continue
        if block_h == 64:
            assert r["wgmma"] > 0, r
        assert r["stack"] == 0 and r["local"] == 0, r


@pytest.mark.parametrize("seed", range(pick(4, 12)))
def test_sparse_mla_random_configs(seed, device):
    """Random mixes of heads, widths, block sizes, dtypes, lengths, sinks, an extra source (dense or ragged) and
    splits against the reference."""
    g = torch.Generator().manual_seed(100 + seed)

    def r(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    kv_dtype = CACHE_DTYPES[r(0, 1)]
    T, H = r(1, pick(4, 40)), r(1, pick(20, 128))
    bs = [1, 3, 16, 64][r(0, 3)]
    blocks = max(1, r(64, 256) // bs)
    cache = _cache(device, blocks, bs, kv_dtype)
    idx, lens = _indices(T, r(1, pick(70, 2048)), blocks * bs, device, with_len=bool(r(0, 1)), gen=g)
    kw = {"topk_length": lens}
    if r(0, 1):
        ebs = [1, 2, 64][r(0, 2)]
        eblocks = max(1, r(8, 128) // ebs)
        kw["extra_kv_cache"] = _cache(device, eblocks, ebs, kv_dtype)
        eidx, elens = _indices(T, r(1, pick(30, 512)), eblocks * ebs, device, gen=g)
        if r(0, 1):
            kw["extra_indices"] = openmla.build_ragged_indices_from_dense(eidx, elens)
        else:
            kw["extra_indices"], kw["extra_topk_length"] = eidx, elens
    if r(0, 1):
        kw["attn_sink"] = (torch.randn(H, generator=g) * 2).to(device)
    if r(0, 1):
        kw["_num_splits_override"] = r(2, 6)
    q = torch.randn(T, H, 576, generator=g).to(device).bfloat16()
    _check(q, cache, idx, kv_dtype, **kw)


@pytest.mark.gpu
def test_sparse_ops_in_a_cuda_graph(device):
    """Index conversion, lengths, the ragged form and sparse_mla (split and not) captured in one CUDA graph and
    replayed on new inputs: no host sync inside, results equal to eager calls."""
    T, H, K, R, W, bs = 8, 64, 256, 2, 16, 64
    cache = _cache(device, R * W, bs, "fp8_ds_mla")
    table = torch.randperm(R * W, device=device).view(R, W).int()
    req = torch.tensor([0] * 4 + [1] * 4, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 4, 8], dtype=torch.int32, device=device)
    seq = torch.tensor([600, 900], dtype=torch.int32, device=device)
    tok = torch.randint(0, 600, (T, K), dtype=torch.int32, device=device)
    q = torch.randn(T, H, 576, device=device).bfloat16()
    sink = torch.randn(H, device=device)
    slots = torch.empty(T, K, dtype=torch.int32, device=device)
    lens = torch.empty(T, dtype=torch.int32, device=device)
    indptr = torch.empty(T + 1, dtype=torch.int32, device=device)
    flat = torch.empty(T * K, dtype=torch.int32, device=device)
    outs = [torch.empty(T, H, 512, dtype=torch.bfloat16, device=device) for _ in range(2)]
    lses = [torch.empty(T, H, device=device) for _ in range(2)]

    def step():
        openmla.convert_req_index_to_global_index(req, table, tok, bs, out=slots)
        openmla.sparse_seq_lens(qsl, seq, K, out=lens)
        openmla.build_ragged_indices_from_dense(slots, lens, out_indptr=indptr, out_flat=flat)
        openmla.sparse_mla(q, cache, slots, SCALE, kv_cache_dtype="fp8_ds_mla", topk_length=lens, attn_sink=sink,
                           out=outs[0], lse=lses[0])  # fmt: skip
        openmla.sparse_mla(q, cache, (indptr, flat), SCALE, kv_cache_dtype="fp8_ds_mla", attn_sink=sink,
                           out=outs[1], lse=lses[1], _num_splits_override=3)  # fmt: skip

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    tok.copy_(torch.randint(0, 600, (T, K), dtype=torch.int32, device=device))
    q.copy_(torch.randn(T, H, 576, device=device).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    ref_slots = openmla.convert_req_index_to_global_index(req, table, tok, bs)
    assert torch.equal(slots, ref_slots)
    ref_out, ref_lse = sparse_mla_ref(q, cache, ref_slots, SCALE, kv_cache_dtype="fp8_ds_mla", attn_sink=sink,
                                      topk_length=lens)  # fmt: skip
    for o, lse in zip(outs, lses):
        assert_close("out", ref_out, o, *TOLERANCES[torch.bfloat16])
        assert_close("lse", ref_lse, lse, *_LSE_TOL["fp8_ds_mla"])


@pytest.mark.parametrize("heads", pick([16], [16, 128]))
def test_sparse_mla_fp16_dequant_variant(heads, device):
    """The tuning variant _fp16_dequant (fp8 rows widened and scaled in fp16, fp16 products) against the reference."""
    T, K = pick(3, 32), pick(40, 2048)
    cache = _cache(device, 16, 64, "fp8_ds_mla")
    extra = _cache(device, 4, 2, "fp8_ds_mla")
    idx, lens = _indices(T, K, 1024, device)
    eidx, elens = _indices(T, 6, 8, device, gen=torch.Generator().manual_seed(5))
    q = torch.randn(T, heads, 576, device=device).bfloat16()
    sink = torch.randn(heads, device=device)
    _check(q, cache, idx, "fp8_ds_mla", topk_length=lens, attn_sink=sink, extra_kv_cache=extra, extra_indices=eidx,
           extra_topk_length=elens, _fp16_dequant=True)  # fmt: skip
