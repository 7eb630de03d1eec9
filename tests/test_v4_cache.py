"""The V4 fp8_v4 (FlashMLA MODEL1, 584 B) and auto caches: writer, readers, layout, E8M0 scales."""

import pytest
import torch

import openmla  # noqa: F401
from openmla.ops.cache_v4 import (
    allocate_v4_cache,
    concat_and_cache_v4,
    dequantize_and_gather_k_cache,
    gather_cache_v4,
    v4_block_stride,
)
from openmla.ops.e8m0 import e8m0_to_float, scale_to_e8m0
from openmla.reference.v4 import (
    concat_and_cache_v4_ref,
    dequantize_and_gather_k_cache_ref,
    dequantize_v4_cache_ref,
    gather_cache_v4_ref,
    v4_block_bytes,
)
from openmla.utils.testing import assert_close, pick

LAYOUTS = ["fp8_v4", "auto"]


def _rows(T, device, dtype=torch.bfloat16):
    x = torch.randn(T, 512, device=device) * torch.logspace(-6, 2, T, device=device)[:, None]
    x[0, :64] = 0  # an all-zero group: the 1e-4 floor
    x[-1, 64:128] = 1e4  # a large group
    return x[:, :448].to(dtype), x[:, 448:].to(dtype)


def test_layout_geometry(device):
    assert v4_block_stride(64) == 65 * 576 and v4_block_stride(64) % 576 == 0
    assert v4_block_stride(1) == 1152 and v4_block_stride(2) == 1728
    cache = allocate_v4_cache(3, 16, device=device)
    assert cache.shape == (3, 16, 584) and cache.dtype == torch.uint8
    assert cache.stride() == (v4_block_stride(16), 584, 1)
    fm = cache.view(torch.float8_e4m3fn).unsqueeze(2)  # FlashMLA's k_cache
    assert fm.shape == (3, 16, 1, 584) and fm.stride(0) == cache.stride(0)
    assert allocate_v4_cache(2, 4, kv_cache_dtype="auto", device=device).shape == (2, 4, 512)
    # the FlashMLA-typed view is accepted as the same cache
    kv_c, k_pe = _rows(5, device)
    slots = torch.tensor([0, 17, 18, 47, -1], device=device)
    concat_and_cache_v4(kv_c, k_pe, fm, slots)
    want = concat_and_cache_v4_ref(kv_c, k_pe, torch.zeros_like(cache), slots)
    other = allocate_v4_cache(3, 16, device=device)
    concat_and_cache_v4(kv_c, k_pe, other, slots)
    assert torch.equal(v4_block_bytes(cache).cpu(), v4_block_bytes(other).cpu())
    assert torch.equal(v4_block_bytes(cache).cpu(), want.cpu())
    one = torch.tensor([[1]], device=device)
    got = gather_cache_v4(fm, one, torch.tensor([3], device=device), out_dtype=torch.float32)
    assert torch.equal(got[1:].cpu(), dequantize_v4_cache_ref(cache)[17:19].cpu())


@pytest.mark.parametrize("block_size", [1, 5, 64])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_concat_and_cache_fp8_v4_bytes(block_size, in_dtype, device):
    T = pick(7, 300)
    nb = (2 * T) // block_size + 2
    cache = allocate_v4_cache(nb, block_size, device=device, fill=0xFF)  # NaN bytes everywhere unused
    kv_c, k_pe = _rows(T, device, in_dtype)
    slots = torch.randperm(nb * block_size, device=device)[:T]
    slots[1::3] = -1
    want = concat_and_cache_v4_ref(kv_c, k_pe, cache, slots)
    concat_and_cache_v4(kv_c, k_pe, cache, slots)
    got = v4_block_bytes(cache)
    # byte for byte (the interpreter rounds explicitly, the GPU converts with round-to-nearest-even)
    assert torch.equal(got.cpu(), want.cpu())
    # untouched slots keep their NaN bytes, including the padding between blocks
    raw = torch.empty(0, dtype=torch.uint8, device=device).set_(cache.untyped_storage()).view(nb, -1)
    assert raw.shape[1] == v4_block_stride(block_size) and bool((raw[:, block_size * 584 :] == 0xFF).all())
    # round trip within e4m3 precision per 64-group; rope exact in bf16
    flat = dequantize_v4_cache_ref(cache)
    keep = slots >= 0
    x = torch.cat([kv_c, k_pe], 1).float()[keep]
    y = flat[slots[keep].long()]
    g = x[:, :448].reshape(-1, 7, 64)
    err = (y[:, :448].reshape(-1, 7, 64) - g).abs()
    assert bool((err <= g.abs().amax(-1, keepdim=True).clamp_min(1e-4) * 2**-4 + 1e-30).all())
    assert torch.equal(y[:, 448:], k_pe.float()[keep].to(torch.bfloat16).float())


def test_pad_and_scale_bytes(device):
    cache = allocate_v4_cache(2, 4, device=device, fill=0xAB)
    x = torch.zeros(1, 448, device=device)
    x[0, 64:128] = 448.0  # amax 448 -> e = 0 -> byte 127
    x[0, 128:192] = 449.0  # just above -> e = 1 -> byte 128
    concat_and_cache_v4(x, torch.ones(1, 64, device=device), cache, torch.tensor([6], device=device))
    blk = v4_block_bytes(cache)[1].cpu()
    exps = blk[4 * 576 + 2 * 8 : 4 * 576 + 3 * 8]
    assert exps.tolist() == [127 - 22, 127, 128, 105, 105, 105, 105, 0]  # zeros: 1e-4/448 -> 2^-22; pad 0
    assert bool((blk[: 2 * 576] == 0xAB).all())  # the other tokens of the block untouched


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("with_starts", [False, True])
def test_gather_cache_v4(layout, block_size, with_starts, device):
    lens = pick([7, 0, 1, 12], [1000, 0, 1, 4097, 63])
    B, W = len(lens), (max(lens) + 3 + block_size - 1) // block_size
    nb = B * W + 3
    cache = allocate_v4_cache(nb, block_size, kv_cache_dtype=layout, device=device, fill=0xFF)
    used = torch.randperm(nb, device=device)[: B * W]
    T = nb * block_size
    kv_c, k_pe = _rows(T, device)
    slots = torch.arange(T, device=device)
    concat_and_cache_v4(kv_c, k_pe, cache, slots, kv_cache_dtype=layout)
    table = used.view(W, B).t().int()  # non-contiguous
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    starts = torch.tensor([min(3, n) for n in lens], dtype=torch.int32, device=device) if with_starts else None
    ref = gather_cache_v4_ref(cache, table, seq_lens, seq_starts=starts, kv_cache_dtype=layout)
    out = gather_cache_v4(cache, table, seq_lens, seq_starts=starts, kv_cache_dtype=layout)
    assert out.shape == (sum(lens), 512) and out.dtype == torch.bfloat16
    assert_close("gather bf16", ref, out, 0, 2**-8, 1e-5)
    out32 = gather_cache_v4(cache, table, seq_lens, seq_starts=starts, kv_cache_dtype=layout,
                            out=torch.empty(sum(lens) + 2, 512, device=device))  # fmt: skip
    assert_close("gather fp32", ref, out32[: sum(lens)], 0, 0, 0)
    assert bool(out32[sum(lens) :].isnan().all())  # rows past the requests untouched


def test_nan_pages_not_read(device):
    bs = 4
    cache = allocate_v4_cache(6, bs, device=device, fill=0xFF)
    kv_c, k_pe = _rows(8, device)
    slots = torch.tensor([8, 9, 10, 11, 16, 17, 18, 19], device=device)  # blocks 2 and 4
    concat_and_cache_v4(kv_c, k_pe, cache, slots)
    table = torch.tensor([[2, 4, 0]], dtype=torch.int32, device=device)  # block 0 holds NaN bytes
    out = gather_cache_v4(cache, table, torch.tensor([7], device=device), out_dtype=torch.float32)
    assert bool(out.isfinite().all())
    # reading a NaN page gives NaN (e4m3 0xFF, exponent 255): the bytes are honoured, not hidden
    bad = gather_cache_v4(cache, torch.tensor([[0]], dtype=torch.int32, device=device),
                          torch.tensor([1], device=device), out_dtype=torch.float32)  # fmt: skip
    assert bool(bad.isnan().any())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("use_gather_lens", [False, True])
def test_dequantize_and_gather_k_cache(layout, use_gather_lens, device):
    bs = pick(4, 64)
    lens = pick([9, 0, 3, 5], [700, 0, 129, 64])
    R = len(lens)
    W = max(lens) // bs + 1
    nb = R * W + 1
    cache = allocate_v4_cache(nb, bs, kv_cache_dtype=layout, device=device)
    kv_c, k_pe = _rows(nb * bs, device)
    concat_and_cache_v4(kv_c, k_pe, cache, torch.arange(nb * bs, device=device), kv_cache_dtype=layout)
    table = torch.randperm(nb, device=device)[: R * W].view(R, W).int()
    seq_lens = torch.tensor(lens, device=device)
    gl = torch.tensor([min(n, 4) for n in lens], device=device) if use_gather_lens else None
    offset = 3
    M = offset + max(lens) + 2
    out = torch.empty(R, M, 512, device=device)
    ref = dequantize_and_gather_k_cache_ref(out, cache, seq_lens, table, gather_lens=gl, offset=offset,
                                            kv_cache_dtype=layout)  # fmt: skip
    dequantize_and_gather_k_cache(out, cache, seq_lens, table, gather_lens=gl, offset=offset, kv_cache_dtype=layout)
    assert_close("workspace", ref, out, 0, 0, 0)  # NaN rows (untouched) sit at the same places
    with pytest.raises(ValueError, match="exceeds out"):
        dequantize_and_gather_k_cache(out[:, : offset + 2], cache, seq_lens, table, offset=offset,
                                      kv_cache_dtype=layout)  # fmt: skip
    # unchecked, the rows past M are never written
    small = torch.zeros(R, offset + 2, 512, device=device)
    dequantize_and_gather_k_cache(
        small, cache, seq_lens, table, gather_lens=gl, offset=offset, kv_cache_dtype=layout, validate=False
    )
    assert_close("truncated", ref[:, : offset + 2].nan_to_num(0.0), small, 0, 0, 0)


def test_v4_cache_errors(device):
    cache = allocate_v4_cache(2, 4, device=device)
    kv, pe = torch.randn(3, 448, device=device), torch.randn(3, 64, device=device)
    ok = torch.tensor([0, 1, 2], device=device)
    with pytest.raises(ValueError, match="kv_c must be"):
        concat_and_cache_v4(torch.randn(3, 512, device=device), pe, cache, ok)
    with pytest.raises(ValueError, match="k_pe"):
        concat_and_cache_v4(kv, pe[:2], cache, ok)
    with pytest.raises(ValueError, match="slot_mapping holds slot 8"):
        concat_and_cache_v4(kv, pe, cache, torch.tensor([0, 8, 1], device=device))
    before = v4_block_bytes(cache).clone()
    concat_and_cache_v4(kv, pe, cache, torch.tensor([-1, 8, 100], device=device), validate=False)
    assert torch.equal(v4_block_bytes(cache), before)
    with pytest.raises(ValueError, match="row stride 584"):
        concat_and_cache_v4(kv, pe, torch.zeros(2, 4, 584, dtype=torch.uint8, device=device)[:, ::2], ok)
    with pytest.raises(ValueError, match="584"):
        concat_and_cache_v4(kv, pe, torch.zeros(2, 4, 576, dtype=torch.uint8, device=device), ok)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        concat_and_cache_v4(kv, pe, cache, ok, kv_cache_dtype="fp8")
    with pytest.raises(TypeError, match="kv_cache"):
        concat_and_cache_v4(kv, pe, cache, ok, kv_cache_dtype="auto")
    bt = torch.tensor([[0, 5]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="block_table refers to block 5"):
        gather_cache_v4(cache, bt, torch.tensor([6], device=device))
    with pytest.raises(ValueError, match="gather_lens"):
        dequantize_and_gather_k_cache(torch.zeros(1, 8, 512, device=device), cache, torch.tensor([2], device=device),
                                      bt, gather_lens=torch.tensor([3], device=device))  # fmt: skip


def test_e8m0():
    s = torch.tensor([1.0, 0.5, 2.0**-127, 2.0**127, 0.125])
    b = scale_to_e8m0(s)
    assert b.dtype == torch.uint8 and b.tolist() == [127, 126, 0, 254, 124]
    assert torch.equal(e8m0_to_float(b), s)
    assert torch.equal(scale_to_e8m0(b), b)  # raw bytes pass through
    assert torch.equal(scale_to_e8m0(s.to(torch.float8_e8m0fnu)), b)
    assert torch.equal(scale_to_e8m0(s.to(torch.bfloat16)), b)
    for bad, what in ((torch.tensor([1.5]), "power of two"), (torch.tensor([0.0]), "positive"),
                      (torch.tensor([float("inf")]), "finite"), (torch.tensor([2.0**-130]), "range"),
                      (torch.tensor([3]), "dtype")):  # fmt: skip
        with pytest.raises((ValueError, TypeError), match=what):
            scale_to_e8m0(bad)
    with pytest.raises(ValueError, match="255"):
        scale_to_e8m0(torch.tensor([255], dtype=torch.uint8))


@pytest.mark.gpu
def test_flashmla_reads_fp8_v4(device):
    """FlashMLA's MODEL1 sparse decode reads a cache written by concat_and_cache_v4 (byte-for-byte layout check).

    Needs the peer extension (shared/peers/README.md: copy it to .peers and put .peers on PYTHONPATH)."""
    flash_mla = pytest.importorskip("flash_mla")
    bs, nb, b, h, topk = 64, 9, 2, 64, 128
    cache = allocate_v4_cache(nb, bs, device=device, fill=0xFF)  # unused pages hold NaN bytes
    T = (nb - 1) * bs
    kv_c, k_pe = _rows(T, device)
    concat_and_cache_v4(kv_c, k_pe, cache, torch.arange(T, device=device) + bs)  # block 0 stays NaN
    idx = torch.stack([torch.randperm(T, device=device)[:topk] + bs for _ in range(b)])
    idx[0, -5:] = -1
    q = torch.randn(b, 1, h, 512, device=device, dtype=torch.bfloat16)
    scale = 512**-0.5
    meta = flash_mla.get_mla_metadata()[0]
    out, _ = flash_mla.flash_mla_with_kvcache(q, cache.view(torch.float8_e4m3fn).unsqueeze(2), None, None, 512, meta,
                                              softmax_scale=scale, is_fp8_kvcache=True,
                                              indices=idx.int().view(b, 1, topk))  # fmt: skip
    flat = dequantize_v4_cache_ref(cache)
    for r in range(b):
        sel = idx[r][idx[r] >= 0].long()
        k = flat[sel]  # [n, 512]
        p = torch.softmax(q[r, 0].float() @ k.T * scale, dim=-1)
        ref = p @ k
        # FlashMLA rounds P to bf16 before P V: an error of ~2^-9 of the values' scale (|k| ~ 100 here; H200: 0.32 at
        # 5 of 32768 entries against atol 0.016), while a wrong byte layout misplaces whole values
        atol = 4e-3 * float(k.abs().max())
        assert_close(f"flashmla row {r}", ref, out[r, 0], atol, 1.6e-2, 1e-5)


def test_strided_index_inputs(device):
    cache = allocate_v4_cache(4, 4, device=device)
    kv_c, k_pe = _rows(6, device)
    slots = torch.stack([torch.arange(6, device=device) + 3, torch.zeros(6, dtype=torch.int64, device=device)], 1)
    concat_and_cache_v4(kv_c, k_pe, cache, slots[:, 0])
    ref = dequantize_v4_cache_ref(cache)[3:9]
    lens = torch.tensor([[5, 0], [1, 0]], device=device)[:, 0]
    starts = torch.tensor([[3, 9], [2, 9]], device=device)[:, 0]
    table = torch.tensor([[0, 1, 2], [2, 3, 0]], dtype=torch.int32, device=device)
    out = gather_cache_v4(cache, table, lens, seq_starts=starts, out_dtype=torch.float32)
    assert torch.equal(out[:5].cpu(), ref[:5].cpu())  # positions 3..7 of request 0 = slots 3..7
    assert torch.equal(out[5].cpu(), dequantize_v4_cache_ref(cache)[10].cpu())  # request 1, position 2 = slot 10
