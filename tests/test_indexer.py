"""The lightning-indexer ops (key cache writer, scores, causal top-k) against the fp32 references."""

import pytest
import torch

import openmla
from openmla.ops.indexer import alloc_indexer_k_cache, indexer_k_cache_views, logits_topk
from openmla.reference import (
    concat_and_cache_indexer_k_ref,
    dequantize_indexer_k_cache_ref,
    indexer_logits_ref,
    quantize_indexer_k_ref,
    split_fp8_indexer_cache_ref,
    topk_from_logits_ref,
)
from openmla.utils.testing import assert_close, on_gpu, pick

E4M3 = torch.float8_e4m3fn
# (cache_dtype, cache dtype for "auto", q dtype)
SCORE_CASES = [
    ("auto", torch.bfloat16, torch.bfloat16),
    ("auto", torch.float16, torch.float16),
    ("auto", torch.float32, torch.float32),
    ("fp8", None, torch.bfloat16),
    ("fp8", None, torch.float32),
    ("fp8", None, E4M3),
]
# relative error of the scores: fp32 products on the CPU; on the GPU 16-bit products are exact in fp32 and
# Hopper's e4m3 MMA accumulates with fewer mantissa bits (DeepGEMM's reason for promoting partial sums)
SCORE_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4, torch.float16: 1e-4, E4M3: 5e-3}


def _ids(x):
    return str(x).replace("torch.", "")


def _nan_cache(num_blocks, block_size, D, cache_dtype, dtype, device):
    """A cache whose every byte is NaN (auto) or 0xFF (fp8: NaN keys and NaN scales): unwritten rows poison."""
    cache = alloc_indexer_k_cache(num_blocks, block_size, D, cache_dtype=cache_dtype, dtype=dtype or torch.bfloat16,
                                  device=device)  # fmt: skip
    if cache_dtype == "auto":
        cache.fill_(float("nan"))
    else:
        cache.fill_(0xFF)
    return cache


# ---------------------------------------------------------------------------------------------------------------
# key cache


@pytest.mark.parametrize("cache_dtype,dtype,scale_fmt", [
    ("auto", torch.bfloat16, None), ("auto", torch.float16, None), ("auto", torch.float32, None),
    ("fp8", None, None), ("fp8", None, "ue8m0"),
], ids=_ids)  # fmt: skip
@pytest.mark.parametrize("block_size", [1, 5, 64])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_concat_and_cache_indexer_k(cache_dtype, dtype, scale_fmt, block_size, slot_dtype, device):
    T, D = pick(11, 300), pick(32, 128)
    num_blocks = (2 * T) // block_size + 2
    k = (torch.randn(T, D, device=device) * torch.rand(T, 1, device=device) * 4).to(dtype or torch.bfloat16)
    k[1] = 0  # an all-zero key takes the 1e-4 scale floor
    slots = torch.randperm(num_blocks * block_size, device=device)[:T].to(slot_dtype)
    slots[::4] = -1
    cache = alloc_indexer_k_cache(num_blocks, block_size, D, cache_dtype=cache_dtype, dtype=dtype or torch.bfloat16,
                                  device=device)  # fmt: skip
    cache.view(torch.uint8).fill_(7)  # untouched bytes must stay as they were
    ref = concat_and_cache_indexer_k_ref(k, cache, slots, cache_dtype=cache_dtype, scale_fmt=scale_fmt)
    openmla.concat_and_cache_indexer_k(k, cache, slots, cache_dtype=cache_dtype, scale_fmt=scale_fmt)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))  # exact, untouched bytes included
    if cache_dtype == "fp8":
        keys, scales = indexer_k_cache_views(cache, cache_dtype="fp8")
        rk, rs = split_fp8_indexer_cache_ref(cache)
        assert torch.equal(keys.view(torch.uint8), rk.view(torch.uint8)) and torch.equal(scales, rs)
        got = dequantize_indexer_k_cache_ref(cache, "fp8").reshape(-1, D)[slots[slots >= 0].long()]
        want = k[slots >= 0].float()
        amax = want.abs().amax(-1, keepdim=True)
        bound = 2.0**-3 if scale_fmt == "ue8m0" else 2.0**-4  # a power-of-two scale wastes up to a bit
        assert bool(((got - want).abs() <= amax * bound + 1e-6).all())
        s = scales.reshape(-1)[slots[slots >= 0].long()]
        if scale_fmt == "ue8m0":
            assert torch.equal(torch.exp2(torch.log2(s).round()), s)


def test_fp8_scale_floor_and_saturation(device):
    D = 16
    cache = alloc_indexer_k_cache(2, 4, D, cache_dtype="fp8", device=device)
    k = torch.zeros(2, D, device=device)
    k[1, 0] = 3.0
    openmla.concat_and_cache_indexer_k(k, cache, torch.tensor([1, 6], device=device), cache_dtype="fp8")
    keys, scales = indexer_k_cache_views(cache, cache_dtype="fp8")
    assert float(scales[0, 1]) == pytest.approx(1e-4 / 448, rel=1e-6)
    assert bool((keys[0, 1].float() == 0).all())
    assert float(scales[1, 2]) == pytest.approx(3.0 / 448, rel=1e-6) and float(keys[1, 2, 0].float()) == 448


def test_cache_views_alias(device):
    cache = alloc_indexer_k_cache(3, 4, 8, cache_dtype="fp8", device=device)
    keys, scales = indexer_k_cache_views(cache, cache_dtype="fp8")
    assert keys.shape == (3, 4, 8) and keys.dtype == E4M3 and scales.shape == (3, 4)
    scales[2, 3] = 5.0
    keys[1, 0, 2] = 1.5
    rk, rs = split_fp8_indexer_cache_ref(cache)
    assert float(rs[2, 3]) == 5.0 and float(rk[1, 0, 2].float()) == 1.5
    assert indexer_k_cache_views(cache[1:], cache_dtype="fp8")[1].shape == (2, 4)


# ---------------------------------------------------------------------------------------------------------------
# scores and top-k


def _batch(lens, qlens, H, D, block_size, cache_dtype, cdtype, qdtype, device, pad_rows=0):
    """A paged batch: keys written through the kernel, unused cache rows NaN, spare block-table entries -1."""
    B = len(lens)
    W = max(-(-L // block_size) for L in lens) + 1
    num_blocks = B * W + 3
    perm = torch.randperm(num_blocks, device=device)[: B * W].reshape(B, W).int()
    block_table = perm.clone()
    cache = _nan_cache(num_blocks, block_size, D, cache_dtype, cdtype, device)
    keys, slots = [], []
    for b, L in enumerate(lens):
        block_table[b, -(-L // block_size) :] = -1  # never read
        pos = torch.arange(L, device=device)
        slots.append(perm[b, pos // block_size].long() * block_size + pos % block_size)
        keys.append(torch.randn(L, D, device=device))
    k = torch.cat(keys).to(cdtype or torch.bfloat16)
    openmla.concat_and_cache_indexer_k(k, cache, torch.cat(slots), cache_dtype=cache_dtype)
    qsl = torch.zeros(B + 1, dtype=torch.int32, device=device)
    qsl[1:] = torch.cumsum(torch.tensor(qlens, device=device), 0)
    T = sum(qlens) + pad_rows
    q = torch.randn(T, H, D, device=device)
    if qdtype == E4M3:
        q = (q * 8).to(E4M3)
    else:
        q = q.to(qdtype)
    weights = torch.randn(T, H, device=device) * D**-0.5 * H**-0.5
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, weights, cache, block_table, seq_lens, qsl


def _check_scores(name, ref, out, qdtype):
    finite = torch.isfinite(ref)
    scale = float(ref[finite].abs().max()) if bool(finite.any()) else 1.0
    rtol = SCORE_RTOL[qdtype] if on_gpu() else 1e-5
    assert_close(name, ref, out, atol=rtol * scale, rtol=rtol, cos_tol=rtol)


def _check_topk(idx, ref_logits, topk):
    """Structure (valid prefix of min(topk, pos+1) distinct causal positions, then -1) and optimality under the
    reference scores (nothing left out scores above what was chosen, up to the scores' tolerance)."""
    T, S = ref_logits.shape
    idx, ref_logits = idx.cpu().long(), ref_logits.cpu()
    for t in range(T):
        n_ok = int(torch.isfinite(ref_logits[t]).sum())
        want = min(topk, n_ok)
        row = idx[t]
        assert bool((row[want:] == -1).all()) and bool((row[:want] >= 0).all()), f"row {t}: {row.tolist()}"
        sel = row[:want]
        assert sel.unique().numel() == want
        assert bool(torch.isfinite(ref_logits[t, sel]).all()), f"row {t} selects a masked position"
        if n_ok <= topk:
            assert torch.equal(sel.sort().values, torch.arange(n_ok)), f"row {t} must be 0..pos"
            continue
        rest = torch.ones(S, dtype=torch.bool)
        rest[sel] = False
        rest &= torch.isfinite(ref_logits[t])
        span = float(ref_logits[t][torch.isfinite(ref_logits[t])].abs().max())
        tol = (SCORE_RTOL[torch.float32 if not on_gpu() else E4M3]) * span * 4
        assert float(ref_logits[t, rest].max()) <= float(ref_logits[t, sel].min()) + tol, f"row {t}"


SHAPES = {
    # lens, qlens, pad rows: decode, verify (qlen 2-3), a prefill chunk, an empty request, CUDA-graph padding rows
    "mixed": (pick([1, 9, 23, 40, 0], [1, 1000, 4097, 63, 0, 2500]), pick([1, 1, 3, 6, 0], [1, 1, 2, 1, 0, 300]), 2),
    "decode": (pick([5, 33, 64], [8192, 3000, 2049, 1]), pick([1, 1, 1], [1, 1, 1, 1]), 0),
}


LOGIT_SHAPES = [("mixed", 1), ("mixed", 5), ("mixed", pick(16, 64)), ("decode", pick(16, 64)), ("tiled", pick(16, 64)),
                ("tiled", pick(48, 192)), ("tma", pick(16, 64)), ("tiled2", pick(16, 64))]  # fmt: skip
# "tiled": the mixed batch under a tiling with several key splits a request and tiles inside one page each (the
# block numbers of a split loaded up front); block size 48 / 192: splits that start inside a page; "tma": the same
# with key tiles loaded through TMA descriptors; "tiled2": tiles of two pages (block numbers picked per key row)
TILED = pick((16, 32, 4, 3), (64, 256, 4, 3))
TILED2 = pick((32, 64, 4, 3), (128, 1024, 4, 3))


# every dtype case at every shape on the GPU; on the CPU (the interpreter computes in fp32 whatever the dtype) the
# tiling variants only for a 16-bit auto cache and the e4m3 q
LOGIT_CASES = [
    (*case, *shape)
    for case in SCORE_CASES
    for shape in LOGIT_SHAPES
    if on_gpu() or (case[1] != torch.float16 and (shape[0] in ("mixed", "decode") or case in SCORE_CASES[::5]))
]


@pytest.mark.parametrize("cache_dtype,cdtype,qdtype,shape,block_size", LOGIT_CASES, ids=_ids)
def test_indexer_logits(cache_dtype, cdtype, qdtype, shape, block_size, device):
    variant = {}
    if shape in ("tiled", "tma", "tiled2"):
        variant["_tiling"] = TILED2 if shape == "tiled2" else TILED
    if shape == "tma":  # key tiles by TMA descriptors (the interpreter runs them; sm90+ on the GPU)
        variant["_tma"] = True
    lens, qlens, pad = SHAPES["decode" if shape == "decode" else "mixed"]
    H, D = pick(3, 64), pick(20 if cache_dtype == "auto" else 32, 128)  # D 20: a masked column tail
    args = _batch(lens, qlens, H, D, block_size, cache_dtype, cdtype, qdtype, device, pad_rows=pad)
    ref = indexer_logits_ref(*args, cache_dtype=cache_dtype)
    out = openmla.indexer_logits(*args, cache_dtype=cache_dtype, **variant)
    _check_scores("logits", ref, out, qdtype)
    if shape != "mixed":
        return
    # the prefill hint spreads a request's rows over several programs (and several rows per dot): same scores
    out2 = openmla.indexer_logits(*args, cache_dtype=cache_dtype, max_query_len=max(qlens), validate=False)
    _check_scores("logits (max_query_len)", ref, out2, qdtype)


@pytest.mark.parametrize("cache_dtype,cdtype,qdtype", [SCORE_CASES[0], SCORE_CASES[5]], ids=_ids)
@pytest.mark.parametrize("topk", pick([6], [64, 2048]))
@pytest.mark.parametrize("topk_impl", ["triton", "torch", "triton-split"])
def test_indexer_topk(cache_dtype, cdtype, qdtype, topk, topk_impl, device):
    split = None
    if topk_impl == "triton-split":  # rows split over 2 programs, row lengths from the scores pass
        split, topk_impl = 2, "triton"
    lens, qlens, pad = SHAPES["mixed"]
    H, D = pick(4, 64), pick(32, 128)
    args = _batch(lens, qlens, H, D, pick(5, 64), cache_dtype, cdtype, qdtype, device, pad_rows=pad)
    ref = indexer_logits_ref(*args, cache_dtype=cache_dtype)
    idx = openmla.indexer_topk(*args, topk, cache_dtype=cache_dtype, topk_impl=topk_impl, _topk_split=split)
    assert idx.dtype == torch.int32 and idx.shape == (args[0].shape[0], topk)
    _check_topk(idx, ref, topk)
    # given the kernel's own scores the choice is exact (ties to lower positions, increasing order)
    logits = openmla.indexer_logits(*args, cache_dtype=cache_dtype)
    assert torch.equal(idx, topk_from_logits_ref(logits, topk))
    assert bool((idx[-pad:] == -1).all())  # rows after the last request


@pytest.mark.parametrize("topk_impl", ["triton", "torch"])
@pytest.mark.parametrize(
    "S,topk", [(pick(150, 5000), 7), (pick(150, 5000), pick(64, 2048)), (12, 12), (9, 40), (70, 1)]
)
@pytest.mark.parametrize("split", [None, 3])  # 3: each row split over 3 programs (the GPU splits few rows)
def test_logits_topk_ties(S, topk, topk_impl, split, device):
    T = 7
    x = torch.randn(T, S, device=device)
    x[0] = 0.0  # every score tied
    x[1, ::2] = -0.0  # -0.0 ties +0.0
    x[1, 1::2] = 0.0
    x[2] = torch.randint(-3, 3, (S,), device=device).float()  # few distinct values
    x[3, S // 3 :] = float("-inf")  # masked tail
    x[4] = float("-inf")  # nothing valid
    x[5, ::3] = float("nan")  # NaN never chosen
    x[6, :5] = float("inf")
    x[6, 5:] = 1.0
    idx = logits_topk(x, topk, topk_impl=topk_impl, _topk_split=split)
    want = topk_from_logits_ref(x, topk)
    assert torch.equal(idx, want), (idx[:, :12], want[:, :12])
    assert bool((idx[4] == -1).all())


def test_topk_auto_picks_by_rows():
    """The "auto" pick: torch.topk's threshold from _TOPK_TORCH_MIN_ROWS rows on a GPU (where it measured faster),
    the radix select below and on the CPU."""
    from openmla.ops.indexer import _TOPK_TORCH_MIN_ROWS as N
    from openmla.ops.indexer import _pick_topk_impl

    assert [_pick_topk_impl("auto", t, "cuda") for t in (1, N - 1, N, 4 * N)] == ["triton", "triton", "torch", "torch"]
    assert _pick_topk_impl("auto", 4 * N, "cpu") == "triton"
    assert [_pick_topk_impl(i, 4 * N, "cuda") for i in ("triton", "torch")] == ["triton", "torch"]


def test_topk_impls_agree_and_out_buffer(device):
    lens, qlens, pad = SHAPES["mixed"]
    args = _batch(lens, qlens, 4, 32, 5, "fp8", None, torch.bfloat16, device, pad_rows=pad)
    topk = 8
    T = args[0].shape[0]
    out = torch.full((T, topk), 123, dtype=torch.int32, device=device)
    got = openmla.indexer_topk(*args, topk, cache_dtype="fp8", out=out, validate=False, topk_impl="triton")
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out, openmla.indexer_topk(*args, topk, cache_dtype="fp8", topk_impl="torch"))
    wide = args[3].shape[1] * 5 + 77  # columns past every request: never filled, never scanned (triton)
    for impl in ("triton", "torch", "auto"):
        assert torch.equal(out, openmla.indexer_topk(*args, topk, cache_dtype="fp8", max_seq_len=wide, topk_impl=impl))
    S = args[3].shape[1] * 5 + 3  # a wider output than the block table spans: the extra columns are -inf
    buf = torch.empty(T, 2 * S, device=device)[:, :S]  # strided rows
    res = openmla.indexer_logits(*args, cache_dtype="fp8", max_seq_len=S, out=buf)
    ref = indexer_logits_ref(*args, cache_dtype="fp8", max_seq_len=S)
    assert res.data_ptr() == buf.data_ptr()
    _check_scores("logits (out=)", ref, buf, torch.bfloat16)


def test_strided_inputs(device):
    lens, qlens, pad = SHAPES["mixed"]
    q, w, cache, bt, sl, qsl = _batch(lens, qlens, 4, 32, 5, "auto", torch.float32, torch.float32, device, pad)
    ref = indexer_logits_ref(q, w, cache, bt, sl, qsl)
    q2 = torch.empty(q.shape[0], 2 * q.shape[1], q.shape[2], device=device)[:, ::2]
    q2.copy_(q)
    w2 = torch.empty(w.shape[0], w.shape[1] + 3, device=device)[:, :-3]
    w2.copy_(w)
    c2 = torch.empty(2 * cache.shape[0], *cache.shape[1:], device=device)[::2]  # blocks apart in memory
    c2.copy_(cache)
    bt2 = torch.empty(bt.shape[0], bt.shape[1] + 2, dtype=bt.dtype, device=device)[:, 1:-1]
    bt2.copy_(bt)
    _check_scores("logits (strided)", ref, openmla.indexer_logits(q2, w2, c2, bt2, sl, qsl), torch.float32)
    # int64 index tensors
    out = openmla.indexer_logits(q, w, cache, bt.long(), sl.long(), qsl.long())
    _check_scores("logits (int64 indices)", ref, out, torch.float32)


def test_causal_prefix_rule(device):
    """pos_t + 1 <= topk gives exactly 0..pos_t, whatever the scores (here all tied at 0: relu of negatives)."""
    lens, qlens = [6, 10], [6, 2]
    q, w, cache, bt, sl, qsl = _batch(lens, qlens, 2, 16, 4, "auto", torch.float32, torch.float32, device)
    idx = openmla.indexer_topk(-q.abs(), w, cache.abs(), bt, sl, qsl, 9)
    for t in range(8):
        pos = t if t < 6 else 8 + (t - 6)
        n = min(pos + 1, 9)
        assert torch.equal(idx[t, :n].cpu(), torch.arange(n, dtype=torch.int32)), idx[t]
        assert bool((idx[t, n:] == -1).all())


def test_unchecked_bad_blocks_are_skipped(device):
    """validate=False with block numbers beyond the cache: those keys score -inf, nothing is read out of bounds."""
    q, w, cache, bt, sl, qsl = _batch([9, 9], [1, 1], 2, 16, 4, "fp8", None, torch.bfloat16, device)
    bt = bt.clone()
    bt[0, 1] = cache.shape[0] + 100
    bt[1, 0] = -1
    out = openmla.indexer_logits(q, w, cache, bt, sl, qsl, cache_dtype="fp8", validate=False)
    assert bool(torch.isneginf(out[0, 4:8]).all()) and bool(torch.isfinite(out[0, :4]).all())
    assert bool(torch.isneginf(out[1, :4]).all()) and bool(torch.isfinite(out[1, 4:9]).all())


def test_errors(device):
    q, w, cache, bt, sl, qsl = _batch([9, 5], [1, 2], 2, 16, 4, "auto", torch.bfloat16, torch.bfloat16, device)
    f8 = alloc_indexer_k_cache(8, 4, 16, cache_dtype="fp8", device=device)
    with pytest.raises(TypeError, match="weights"):
        openmla.indexer_logits(q, w.bfloat16(), cache, bt, sl, qsl)
    with pytest.raises(ValueError, match="weights"):
        openmla.indexer_logits(q, w[:, :1], cache, bt, sl, qsl)
    with pytest.raises(TypeError, match="q"):
        openmla.indexer_logits(q.int(), w, cache, bt, sl, qsl)
    with pytest.raises(ValueError, match="k_cache"):
        openmla.indexer_logits(q, w, cache[..., :8], bt, sl, qsl)
    with pytest.raises(TypeError, match="fp8"):
        openmla.indexer_logits(q.to(E4M3), w, cache, bt, sl, qsl)
    with pytest.raises(TypeError, match="uint8"):
        openmla.indexer_logits(q, w, cache, bt, sl, qsl, cache_dtype="fp8")
    with pytest.raises(ValueError, match="cache_dtype"):
        openmla.indexer_logits(q, w, cache, bt, sl, qsl, cache_dtype="fp4")
    with pytest.raises(ValueError, match="contiguous"):  # an fp8 block must be contiguous
        openmla.indexer_logits(q, w, torch.zeros(8, 8, 20, dtype=torch.uint8, device=device)[:, ::2], bt, sl, qsl,
                               cache_dtype="fp8")  # fmt: skip
    with pytest.raises(ValueError, match="query_start_loc"):
        openmla.indexer_logits(q, w, cache, bt, sl, qsl[:2])
    with pytest.raises(ValueError, match="seq_lens >= its query length"):
        openmla.indexer_logits(q, w, cache, bt, torch.tensor([9, 1], dtype=torch.int32, device=device), qsl)
    with pytest.raises(ValueError, match="max_seq_len"):
        openmla.indexer_logits(q, w, cache, bt, sl, qsl, max_seq_len=6)
    with pytest.raises(ValueError, match="block_table"):
        openmla.indexer_logits(q, w, cache, bt[:, :1], sl, qsl, max_seq_len=12)
    with pytest.raises(ValueError, match="query_start_loc"):
        openmla.indexer_logits(q, w, cache, bt, sl, torch.tensor([0, 2, 1], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="topk"):
        openmla.indexer_topk(q, w, cache, bt, sl, qsl, 0)
    with pytest.raises(ValueError, match="topk_impl"):
        openmla.indexer_topk(q, w, cache, bt, sl, qsl, 4, topk_impl="heap")
    with pytest.raises(ValueError, match="topk_impl"):  # no default from elsewhere: None is not an implementation
        openmla.indexer_topk(q, w, cache, bt, sl, qsl, 4, topk_impl=None)
    # the private variants are checked as strictly as the public arguments
    for bad in ((48, 96, 4, 3), (64, 96, 4, 3), (8, 64, 4, 3), (64, 1024, 4), "64,1024,4,4", (64, 1024, 0, 4),
                (64, 1024, 4.0, 4), (64, 1024, True, 4)):  # fmt: skip
        with pytest.raises(ValueError, match="_tiling"):
            openmla.indexer_logits(q, w, cache, bt, sl, qsl, _tiling=bad)
        with pytest.raises(ValueError, match="_tiling"):
            openmla.indexer_topk(q, w, cache, bt, sl, qsl, 4, _tiling=bad)
    for bad in (1, "1", None):
        with pytest.raises(ValueError, match="_tma"):
            openmla.indexer_logits(q, w, cache, bt, sl, qsl, _tma=bad)
    logits = torch.zeros(2, 8, device=device)
    for bad in ((48, 4), (8, 4), (64,), (64, 0), "64,4", (64.0, 4)):
        with pytest.raises(ValueError, match="_topk_tiling"):
            logits_topk(logits, 4, _topk_tiling=bad)
        with pytest.raises(ValueError, match="_topk_tiling"):
            openmla.indexer_topk(q, w, cache, bt, sl, qsl, 4, _topk_tiling=bad)
    for bad in (0, -2, 2.0, "2", True):
        with pytest.raises(ValueError, match="_topk_split"):
            logits_topk(logits, 4, _topk_split=bad)
    with pytest.raises(ValueError, match="out"):
        openmla.indexer_topk(q, w, cache, bt, sl, qsl, 4, out=torch.zeros(3, 5, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="slot_mapping holds slot"):
        openmla.concat_and_cache_indexer_k(q[:, 0], cache, torch.tensor([0, 999, 1], device=device))
    with pytest.raises(ValueError, match="scale_fmt"):
        openmla.concat_and_cache_indexer_k(q[:, 0], f8, torch.tensor([0, 1, 2], device=device), cache_dtype="fp8",
                                           scale_fmt="e8m0")  # fmt: skip
    with pytest.raises(ValueError, match="width"):
        openmla.concat_and_cache_indexer_k(q[:, 0, :8], f8, torch.tensor([0, 1, 2], device=device), cache_dtype="fp8")
    with pytest.raises(ValueError, match="multiple of 4"):
        alloc_indexer_k_cache(2, 4, 6, cache_dtype="fp8")


@pytest.mark.gpu
def test_cuda_graph_topk(device):
    """Captured with validate=False into fixed buffers: replay gives the eager result."""
    lens, qlens, pad = SHAPES["decode"]
    args = _batch(lens, qlens, 64, 128, 64, "fp8", None, E4M3, device, pad_rows=4)
    topk = 2048
    out = torch.zeros(args[0].shape[0], topk, dtype=torch.int32, device=device)
    want = openmla.indexer_topk(*args, topk, cache_dtype="fp8")
    openmla.indexer_topk(*args, topk, cache_dtype="fp8", out=out, validate=False)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    out.zero_()
    with torch.cuda.graph(graph):
        openmla.indexer_topk(*args, topk, cache_dtype="fp8", out=out, validate=False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    logits = torch.empty(args[0].shape[0], args[3].shape[1] * 64, device=device)
    want_l = openmla.indexer_logits(*args, cache_dtype="fp8")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        openmla.indexer_logits(*args, cache_dtype="fp8", out=logits, validate=False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(logits, want_l)


def test_transformers_scores_with_folded_weights(device):
    """transformers' deepseek_v32 indexer (SPEC §13.1): relu(q . k * D^-0.5) weighted by weights_proj(x) * H^-0.5,
    summed over heads, causal. Folding both scales into ``weights`` gives the same scores and the same top-k."""
    lens, qlens = [13, 7], [13, 3]  # a whole prompt, and a chunk after context
    H, D = 4, 32
    q, _, cache, bt, sl, qsl = _batch(lens, qlens, H, D, 4, "auto", torch.float32, torch.float32, device)
    w_proj = torch.randn(q.shape[0], H, device=device)
    keys = dequantize_indexer_k_cache_ref(cache).reshape(-1, D)
    hf = torch.full((q.shape[0], bt.shape[1] * 4), float("-inf"), device=device)
    for b, (L, n) in enumerate(zip(lens, qlens)):
        pos = torch.arange(L, device=device)
        k = keys[bt[b, pos // 4].long() * 4 + pos % 4]
        rows = slice(int(qsl[b]), int(qsl[b + 1]))
        s = torch.relu(torch.einsum("thd,pd->thp", q[rows], k) * D**-0.5)
        s = torch.einsum("th,thp->tp", w_proj[rows] * H**-0.5, s)
        causal = pos[None, :] <= (L - n + torch.arange(n, device=device))[:, None]
        hf[rows, :L] = s.masked_fill(~causal, float("-inf"))
    ours = openmla.indexer_logits(q, w_proj * (D**-0.5 * H**-0.5), cache, bt, sl, qsl)
    _check_scores("vs transformers", hf, ours, torch.float32)
    _check_topk(openmla.indexer_topk(q, w_proj * (D**-0.5 * H**-0.5), cache, bt, sl, qsl, 5), hf, 5)


_SM90_SCRIPT = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import openmla.ops.indexer as I
from openmla.utils.sm90_report import resource_report

block_n, split, warps, stages = I._BLOCK_N, I._KEY_SPLIT, I._NUM_WARPS, I._NUM_STAGES
logits = dict(D=128, BLOCK_D=128, BLOCK_H=64, Q_PER=1, BLOCK_N=block_n, FP8=True, PAGE_ALIGNED=True, PRELOAD=True,
              MAX_PAGES=16, USE_TMA=False, FILL=False, COMPUTE=tl.float8e4nv, DOT_PRECISION=None, k_desc=None)
ptrs = dict(q="*fp8e4nv", weights="*fp32", k_cache="*u8", k_scale="*fp32", out="*fp32", logits="*fp32", thr="*fp32")
report = []
for name in json.loads(sys.argv[1]):
    if name == "logits":
        kern, const, opts = I._indexer_logits_fwd_kernel, logits, dict(num_warps=warps, num_stages=stages)
    else:
        kern, const = I._indexer_topk_fwd_kernel, dict(BLOCK=I._TOPK_BLOCK, HAS_LEN=True, RADIX=True)
        opts = dict(num_warps=I._TOPK_WARPS)
    sig = {n: "constexpr" if n in const else ptrs.get(n, "*i32" if n in ("block_table", "seq_lens",
           "query_start_loc", "row_len") else "i32") for n in kern.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names)
             if n not in const and (n.startswith("stride") or sig[n].startswith("*"))}
    c = triton.compile(ASTSource(kern, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=opts)
    report.append(dict(variant=name, **resource_report(c)))
print("REPORT" + json.dumps(report))
"""


@pytest.mark.skipif(on_gpu(), reason="the GPU runs compile the kernels for real")
def test_indexer_kernels_compile_for_sm90():
    """Offline sm90 compile (no GPU) of the decode configurations: the fp8 scores kernel runs e4m3 wgmma without
    spilling, and the radix top-k (one 16-warp program a row) fits the register file without spilling."""
    pytest.importorskip("triton.backends.nvidia")
    from openmla.utils.sm90_report import run_report_script

    for r in run_report_script(_SM90_SCRIPT, ["logits", "topk"]):
        assert r["stack"] == 0 and r["local"] == 0 and r["regs"] <= 255, r
        if r["variant"] == "logits":
            assert r["wgmma"] > 0, r
        else:
            assert r["regs"] * 32 * r["num_warps"] <= 65536, r


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_quantize_indexer_q(scale_fmt, device):
    """Per (token, head) e4m3 with the key writer's scale rule: the reference's bytes exactly; strided q; the scores
    of the fp8 q with its scales folded into the weights are those of the dequantised q."""
    T, H, D = pick(5, 300), pick(3, 64), pick(20, 128)
    q = (torch.randn(T, 2 * H, D, device=device) * 3)[:, ::2]
    q[1, 0] = 0  # the 1e-4 floor
    q_fp8, scale = openmla.ops.indexer.quantize_indexer_q(q, scale_fmt=scale_fmt)
    want_q, want_s = quantize_indexer_k_ref(q.reshape(T * H, D), scale_fmt)
    assert q_fp8.shape == (T, H, D) and scale.shape == (T, H)
    assert torch.equal(q_fp8.view(torch.uint8).reshape(T * H, D), want_q.view(torch.uint8))
    assert torch.equal(scale.reshape(-1), want_s)
    lens, qlens = [9, 4], [2, T - 2]
    lens[1] = max(lens[1], T - 2)
    _, w, cache, bt, sl, qsl = _batch(lens, qlens, H, 32, 4, "fp8", None, torch.float32, device)
    q2 = torch.randn(T, H, 32, device=device)
    q2_fp8, s2 = openmla.ops.indexer.quantize_indexer_q(q2, scale_fmt=scale_fmt)
    ref = indexer_logits_ref(q2_fp8.float() * s2[..., None], w, cache, bt, sl, qsl, cache_dtype="fp8")
    out = openmla.indexer_logits(q2_fp8, w * s2, cache, bt, sl, qsl, cache_dtype="fp8")
    _check_scores("fp8 q", ref, out, E4M3)
    with pytest.raises(TypeError, match="q"):
        openmla.ops.indexer.quantize_indexer_q(q_fp8)


def test_concat_strided_k_and_refusals(device):
    """Keys with a row stride (a slice of a wider projection) are written like contiguous ones; a key tensor that is
    not contiguous in its last dimension is refused, naming the argument."""
    T, D = 6, 16
    wide = torch.randn(T, 3 * D, device=device)
    cache = alloc_indexer_k_cache(4, 4, D, cache_dtype="fp8", device=device)
    slots = torch.tensor([0, 5, -1, 9, 15, 2], device=device)
    openmla.concat_and_cache_indexer_k(wide[:, D : 2 * D], cache, slots, cache_dtype="fp8")
    want = concat_and_cache_indexer_k_ref(wide[:, D : 2 * D].contiguous(), torch.zeros_like(cache), slots,
                                          cache_dtype="fp8")  # fmt: skip
    assert torch.equal(cache, want)
    with pytest.raises(ValueError, match="k must be contiguous in its last dimension"):
        openmla.concat_and_cache_indexer_k(wide[:, ::3], cache, slots, cache_dtype="fp8")
    with pytest.raises(ValueError, match="slot_mapping"):
        openmla.concat_and_cache_indexer_k(wide[:, :D], cache, slots[:4], cache_dtype="fp8")
