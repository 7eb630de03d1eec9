"""concat_and_cache_mla and gather_cache against the fp32 references, all three cache layouts."""

import pytest
import torch

import openmla
from openmla.reference import concat_and_cache_mla_ref, dequantize_rows_ref, gather_cache_ref
from openmla.utils.testing import assert_close, pick

LAYOUTS = [("auto", torch.bfloat16), ("auto", torch.float16), ("fp8", torch.float8_e4m3fn), ("fp8_ds_mla", torch.uint8)]
SCALE = 0.02


def _empty_cache(num_blocks, block_size, layout, dtype, device):
    width = 656 if layout == "fp8_ds_mla" else 576
    if dtype == torch.uint8:
        return torch.zeros(num_blocks, block_size, width, dtype=dtype, device=device)
    return torch.zeros(num_blocks, block_size, width, dtype=torch.float32, device=device).to(dtype)


def _decoded(cache, layout):
    return dequantize_rows_ref(cache.view(-1, cache.shape[-1]), layout, SCALE)


def _tol(layout, dtype):
    # the interpreter rounds fp32->bf16/fp16/fp8 by truncation, the GPU to nearest: one ulp apart
    if layout == "auto":
        return (0, 2**-7 if dtype == torch.bfloat16 else 2**-10)
    return (SCALE * 2**-3, 2**-3)  # e4m3: 3 mantissa bits; ds_mla scales are per group


@pytest.mark.parametrize("layout,dtype", LAYOUTS, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_concat_and_cache(layout, dtype, block_size, slot_dtype, device):
    T = pick(9, 300)
    num_blocks = (2 * T) // block_size + 2
    kv_c = torch.randn(T, 512, device=device, dtype=torch.bfloat16)
    k_pe = torch.randn(T, 64, device=device, dtype=torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, device=device)[:T].to(slot_dtype)
    slots[::4] = -1  # padding tokens are skipped
    cache = _empty_cache(num_blocks, block_size, layout, dtype, device)
    cache.view(torch.uint8)[..., :] = 7  # untouched rows must stay as they were
    ref = concat_and_cache_mla_ref(kv_c, k_pe, cache, slots, kv_cache_dtype=layout, scale=SCALE)
    openmla.concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_cache_dtype=layout, scale=SCALE)
    written = torch.zeros(cache.shape[0] * cache.shape[1], dtype=torch.bool, device=device)
    written[slots[slots >= 0].long()] = True
    untouched = cache.view(-1, cache.shape[-1])[~written].view(torch.uint8)
    assert bool((untouched == 7).all()), "a row outside slot_mapping was written"
    atol, rtol = _tol(layout, dtype)
    assert_close("cache", _decoded(ref, layout)[written], _decoded(cache, layout)[written], atol, rtol, 1e-4)
    # round trip: the dequantised cache is close to the input
    want = torch.cat([kv_c, k_pe], 1).float()[slots >= 0]
    got = _decoded(cache, layout)[slots[slots >= 0].long()]
    if layout == "fp8_ds_mla":  # per-group scale: error bounded by 2^-4 of the group's max
        amax = want[:, :512].reshape(-1, 4, 128).abs().amax(-1, keepdim=True)
        err = (got[:, :512] - want[:, :512]).reshape(-1, 4, 128).abs()
        assert bool((err <= amax * 2**-4 + 1e-6).all())
        assert torch.equal(got[:, 512:], want[:, 512:])  # rope is kept in bf16, unquantised
    elif layout == "fp8":
        assert bool(((got - want).abs() <= want.abs() * 2**-4 + SCALE * 2**-9).all())
    else:
        assert torch.equal(got, want)


def test_fp8_saturates(device):
    kv_c = torch.full((1, 512), 1e4, device=device)
    k_pe = torch.full((1, 64), -1e4, device=device)
    cache = _empty_cache(2, 4, "fp8", torch.float8_e4m3fn, device)
    openmla.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([5], device=device), kv_cache_dtype="fp8", scale=1.0)
    row = cache.view(-1, 576)[5].float()
    assert bool((row[:512] == 448).all()) and bool((row[512:] == -448).all())


@pytest.mark.parametrize("layout,dtype", LAYOUTS, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("block_size", [1, 5, 64])
@pytest.mark.parametrize("with_starts", [False, True])
def test_gather_cache(layout, dtype, block_size, with_starts, device):
    lens = pick([7, 0, 1, 12], [1000, 0, 1, 4097, 63])
    B = len(lens)
    max_len = max(lens) + 3
    W = (max_len + block_size - 1) // block_size
    num_blocks = B * W + 3
    cache = _empty_cache(num_blocks, block_size, layout, dtype, device)
    T = num_blocks * block_size
    openmla.concat_and_cache_mla(
        torch.randn(T, 512, device=device), torch.randn(T, 64, device=device), cache,
        torch.arange(T, device=device), kv_cache_dtype=layout, scale=SCALE,
    )  # fmt: skip
    block_table = torch.randperm(num_blocks, device=device)[: B * W].view(W, B).t().int()  # non-contiguous
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    starts = torch.tensor([min(3, n) for n in lens], dtype=torch.int32, device=device) if with_starts else None
    out = openmla.gather_cache(cache, block_table, seq_lens, seq_starts=starts, kv_cache_dtype=layout, scale=SCALE)
    ref = gather_cache_ref(cache, block_table, seq_lens, seq_starts=starts, kv_cache_dtype=layout, scale=SCALE)
    assert out.dtype == torch.bfloat16 and out.shape == (sum(lens), 576)
    assert_close("gather", ref, out, 0, 2**-7, 1e-5)
    buf = torch.empty(sum(lens), 576, dtype=torch.float32, device=device)
    out32 = openmla.gather_cache(cache, block_table, seq_lens, seq_starts=starts, kv_cache_dtype=layout,
                                 scale=SCALE, out=buf)  # fmt: skip
    assert out32.data_ptr() == buf.data_ptr()
    assert_close("gather fp32", ref, out32, 1e-6, 1e-6, 1e-7)


def test_cache_errors(device):
    cache = torch.zeros(2, 4, 576, dtype=torch.bfloat16, device=device)
    kv, pe = torch.randn(3, 512, device=device), torch.randn(3, 64, device=device)
    ok = torch.tensor([0, 1, 2], device=device)
    with pytest.raises(TypeError, match="slot_mapping"):
        openmla.concat_and_cache_mla(kv, pe, cache, ok.float())
    with pytest.raises(ValueError, match="slot_mapping holds slot 8"):
        openmla.concat_and_cache_mla(kv, pe, cache, torch.tensor([0, 8, 1], device=device))
    # unchecked, an out-of-range slot is skipped by the kernel, never written
    before = cache.clone()
    openmla.concat_and_cache_mla(kv, pe, cache, torch.tensor([-1, 8, 100], device=device), validate=False)
    assert torch.equal(cache, before)
    with pytest.raises(ValueError, match="k_pe"):
        openmla.concat_and_cache_mla(kv, pe[:2], cache, ok)
    with pytest.raises(ValueError, match="kv_cache rows must be"):
        openmla.concat_and_cache_mla(kv, pe[:, :32], cache, ok)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        openmla.concat_and_cache_mla(kv, pe, cache, ok, kv_cache_dtype="fp8", scale=1.0)
    with pytest.raises(ValueError, match="scale is required"):
        openmla.concat_and_cache_mla(kv, pe, cache.to(torch.float8_e4m3fn), ok, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        openmla.concat_and_cache_mla(kv, pe, cache, ok, kv_cache_dtype="int4")
    bt = torch.tensor([[0, 5]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="block_table refers to block 5"):
        openmla.gather_cache(cache, bt, torch.tensor([6], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="covers only 8 tokens"):
        openmla.gather_cache(cache, bt, torch.tensor([9], dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="seq_lens"):
        openmla.gather_cache(cache, bt, torch.tensor([1.0], device=device))
    # a short request never touches the out-of-range block
    assert openmla.gather_cache(cache, bt, torch.tensor([4], dtype=torch.int32, device=device)).shape == (4, 576)
