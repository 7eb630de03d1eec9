"""Input validation of the DeepSeek V4 ops: the V4 cache, the compressor, the index sets, inverse RoPE and E8M0.

Each test below marked "defect" failed before its fix (a silent wrap, truncation or overlap, an out-of-bounds
read, or a crash deep inside Triton); the others pin refusals and strided inputs that were already right.
"""

from __future__ import annotations

import pytest
import torch

import openmla  # noqa: F401
from openmla.ops.cache_v4 import (
    allocate_v4_cache,
    concat_and_cache_v4,
    dequantize_and_gather_k_cache,
    gather_cache_v4,
)
from openmla.ops.compressor import allocate_compressor_state, compress_kv
from openmla.ops.e8m0 import scale_to_e8m0
from openmla.ops.rope import inverse_rope_rows, rope_rows_
from openmla.ops.v4_indices import combine_topk_swa_indices, csa_topk_indices, hca_indices, swa_indices
from openmla.reference.v4 import (
    combine_topk_swa_indices_ref,
    concat_and_cache_v4_ref,
    dequantize_and_gather_k_cache_ref,
    gather_cache_v4_ref,
    rope_cache_ref,
)


def _table(num_pos, device, rope_dim=64):
    inv_freq = 1.0 / 160000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    return rope_cache_ref(inv_freq, num_pos).to(device)


def _filled_cache(device, nb=4, bs=4):
    """An fp8_v4 cache with every slot written, a block table [2, 2] and seq_lens [5, 7]."""
    cache = allocate_v4_cache(nb, bs, device=device)
    rows = torch.randn(nb * bs, 512, device=device)
    concat_and_cache_v4(rows[:, :448], rows[:, 448:], cache, torch.arange(nb * bs, device=device))
    bt = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32, device=device)
    return cache, bt, torch.tensor([5, 7], dtype=torch.int32, device=device)


# ------------------------------------------------------------------ cache_v4
@pytest.mark.parametrize(
    "kw,match",
    [
        ({"num_blocks": True}, "num_blocks"),
        ({"block_size": True}, "block_size"),
        ({"fill": -1}, "fill"),  # defect: wrapped to 255
        ({"fill": 256}, "fill"),
        ({"fill": 1.5}, "fill"),  # defect: truncated to 1
    ],
    ids=lambda x: str(x),
)
def test_allocate_v4_cache_checks_args(kw, match, device):
    args = {"num_blocks": 2, "block_size": 4, **kw}
    with pytest.raises(ValueError, match=match):
        allocate_v4_cache(args.pop("num_blocks"), args.pop("block_size"), device=device, **args)


def test_concat_v4_checks_slots_of_an_empty_cache(device):
    """Defect: a cache of 0 slots returned before checking slot_mapping, dropping the rows silently."""
    cache = allocate_v4_cache(0, 4, device=device)
    kv, pe = torch.randn(2, 448, device=device), torch.randn(2, 64, device=device)
    with pytest.raises(ValueError, match="slot_mapping holds slot 1 but kv_cache has only 0 slots"):
        concat_and_cache_v4(kv, pe, cache, torch.tensor([-1, 1], device=device))
    concat_and_cache_v4(kv, pe, cache, torch.tensor([-1, -1], device=device))  # padding only: nothing to do


def test_concat_v4_auto_cache_views(device):
    """A permuted auto cache is written correctly; an expanded one (defect: rows aliased) is refused."""
    kv, pe = torch.randn(3, 448, device=device), torch.randn(3, 64, device=device)
    slots = torch.tensor([0, 5, 7], device=device)
    cache = torch.zeros(4, 2, 512, device=device).transpose(0, 1)
    ref = concat_and_cache_v4_ref(kv, pe, cache.contiguous(), slots, kv_cache_dtype="auto")
    concat_and_cache_v4(kv, pe, cache, slots, kv_cache_dtype="auto")
    assert torch.equal(cache, ref)
    with pytest.raises(ValueError, match="kv_cache must not overlap itself"):
        concat_and_cache_v4(kv, pe, torch.zeros(1, 1, 512, device=device).expand(2, 4, 512), slots,
                            kv_cache_dtype="auto")  # fmt: skip
    with pytest.raises(ValueError, match="kv_c must be contiguous in its last dimension"):
        concat_and_cache_v4(torch.randn(448, 3, device=device).t(), pe, cache, slots, kv_cache_dtype="auto")


def test_gather_cache_v4_checks_out_dtype(device):
    """Defect: an integer or fp8 out_dtype was allocated and the rows converted into it."""
    cache, bt, sl = _filled_cache(device)
    for dtype in (torch.int32, torch.uint8, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match="out_dtype"):
            gather_cache_v4(cache, bt, sl, out_dtype=dtype)


def test_v4_gathers_out_views(device):
    """Row-strided outputs are filled correctly; expanded ones (defect: rows written over each other) refused."""
    cache, bt, sl = _filled_cache(device)
    out = torch.zeros(12, 1024, device=device)[:, :512]
    gather_cache_v4(cache, bt, sl, out=out)
    assert torch.equal(out, gather_cache_v4_ref(cache, bt, sl))
    with pytest.raises(ValueError, match="out must not overlap itself"):
        gather_cache_v4(cache, bt, sl, out=torch.zeros(1, 512, device=device).expand(12, 512))
    ws = torch.full((9, 2, 512), 7.0, device=device).transpose(0, 1)
    ref = dequantize_and_gather_k_cache_ref(ws, cache, sl, bt, offset=2)
    dequantize_and_gather_k_cache(ws, cache, sl, bt, offset=2)
    assert torch.equal(ws, ref)
    with pytest.raises(ValueError, match="out must not overlap itself"):
        dequantize_and_gather_k_cache(torch.zeros(1, 9, 512, device=device).expand(2, 9, 512), cache, sl, bt)
    with pytest.raises(ValueError, match="out must be contiguous in its last dimension"):
        dequantize_and_gather_k_cache(torch.zeros(2, 9, 1024, device=device)[..., ::2], cache, sl, bt)


def test_dequantize_and_gather_checks_offset_and_seq_lens(device):
    """Defect: offset=True crashed inside Triton ("int1"); a negative seq_len was blamed on gather_lens."""
    cache, bt, sl = _filled_cache(device)
    ws = torch.zeros(2, 9, 512, device=device)
    with pytest.raises(ValueError, match="offset must be an int"):
        dequantize_and_gather_k_cache(ws, cache, sl, bt, offset=True)
    with pytest.raises(ValueError, match="seq_lens must be non-negative"):
        dequantize_and_gather_k_cache(ws, cache, torch.tensor([-1, 7], device=device), bt)


# ------------------------------------------------------------------ compressor
def _compressor_args(device, d=64, ratio=4):
    """A batch of two requests (8 and 4 tokens, overlap windows) into an auto cache of block size 4."""
    kv, sc = torch.randn(12, 2 * d, device=device), torch.randn(12, 2 * d, device=device)
    state = allocate_compressor_state(3, ratio, d, overlap=True, device=device)
    slots = torch.tensor([0, 2], dtype=torch.int32, device=device)
    qsl, seq = torch.tensor([0, 8, 12], device=device), torch.tensor([8, 4], device=device)
    cache = torch.zeros(4, 4, d, device=device)
    bt = torch.tensor([[1], [3]], dtype=torch.int32, device=device)
    args = [kv, sc, state, slots, qsl, seq, torch.ones(d, device=device), _table(16, device), cache, bt]
    return args, {"ratio": ratio, "kv_cache_dtype": "auto"}


@pytest.mark.parametrize(
    "kw,match",
    [({"num_slots": -1}, "num_slots"), ({"num_slots": True}, "num_slots"), ({"ratio": 0}, "ratio"),
     ({"head_dim": 0}, "head_dim"), ({"ratio": 4.0}, "ratio")],
    ids=lambda x: str(x),
)  # fmt: skip
def test_allocate_compressor_state_checks_args(kw, match, device):
    """Defect: no checks (a RuntimeError from torch.zeros, or a state no compress_kv call accepts)."""
    args = {"num_slots": 2, "ratio": 4, "head_dim": 64, **kw}
    with pytest.raises(ValueError, match=match):
        allocate_compressor_state(**args, overlap=True, device=device)


@pytest.mark.parametrize(
    "kw,match",
    [({"ratio": True}, "ratio must be a positive int"), ({"eps": -1.0}, "eps"), ({"eps": float("nan")}, "eps")],
    ids=lambda x: str(x),
)
def test_compress_kv_checks_scalars(kw, match, device):
    """Defect: ratio=True was taken as 1 (an error about the state's shape); a negative or NaN eps ran."""
    args, kws = _compressor_args(device)
    with pytest.raises(ValueError, match=match):
        compress_kv(*args, **{**kws, **kw})


def test_compress_kv_refuses_negative_query_start(device):
    """Defect: query_start_loc[0] < 0 passed validation and the kernel pooled rows before kv's first one."""
    args, kws = _compressor_args(device)
    args[4] = torch.tensor([-2, 8, 12], device=device)
    args[5] = torch.tensor([10, 4], device=device)
    with pytest.raises(ValueError, match="query_start_loc must start at >= 0"):
        compress_kv(*args, **kws)


@pytest.mark.parametrize("which", ["state", "kv_cache", "entry_rows"])
def test_compress_kv_refuses_overlapping_outputs(which, device):
    """Defect: expanded outputs were accepted, their rows written over each other."""
    args, kws = _compressor_args(device)
    if which == "state":
        args[2] = args[2][:1].expand(3, -1, -1, -1)
    elif which == "kv_cache":
        args[8] = torch.zeros(1, 4, 64, device=device).expand(4, 4, 64)
    else:
        kws["entry_rows"] = torch.zeros(1, 64, device=device).expand(12, 64)
    with pytest.raises(ValueError, match=f"{which} must not overlap itself"):
        compress_kv(*args, **kws)


def test_compress_kv_entry_slots_fit_int32(device):
    """Defect: without a cache, block ids whose slots exceed int32 were wrapped into entry_slots silently."""
    args, kws = _compressor_args(device)
    args[8] = None
    args[9] = torch.full((2, 1), 2**29, dtype=torch.int64, device=device)
    slots = torch.zeros(12, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"block_table refers to a block outside \[0, 134217728\)"):
        compress_kv(*args, ratio=4, block_size=16, entry_slots=slots)


# ------------------------------------------------------------------ index sets
def _batch(device):
    """Three requests (qlens 1, 3, 2 after 5, 2, 0 tokens of context), 8 token rows, a block table [3, 3]."""
    qsl = torch.tensor([0, 1, 4, 6], dtype=torch.int32, device=device)
    seq = torch.tensor([6, 5, 2], dtype=torch.int32, device=device)
    table = torch.tensor([[4, 1, 7], [0, 8, 2], [5, 3, 6]], dtype=torch.int32, device=device)
    return qsl, seq, table, 8


def test_index_sets_check_int_arguments(device):
    """Defect: True passed as an int (a crash inside Triton or torch, or a misleading message)."""
    qsl, seq, table, T = _batch(device)
    with pytest.raises(ValueError, match="num_tokens"):
        swa_indices(qsl, seq, table, block_size=4, window=4, num_tokens=True)
    with pytest.raises(ValueError, match="window"):
        swa_indices(qsl, seq, table, block_size=4, window=True, num_tokens=T)
    with pytest.raises(ValueError, match="ratio"):
        hca_indices(qsl, seq, table, block_size=4, ratio=True, width=8, num_tokens=T)
    with pytest.raises(ValueError, match="topk"):
        combine_topk_swa_indices(torch.zeros(T, 4, dtype=torch.int32, device=device), qsl, seq, seq, window=4,
                                 ratio=2, topk=True, M=12, N=3)  # fmt: skip


def test_index_sets_check_out_buffers(device):
    """Defect: a non-tensor buffer raised AttributeError; an expanded out_indices had its rows written over
    each other. A wider, row-strided buffer is fine."""
    qsl, seq, table, T = _batch(device)
    kw = {"block_size": 4, "window": 4, "num_tokens": T}
    with pytest.raises(TypeError, match="out_indices must be a torch.Tensor"):
        swa_indices(qsl, seq, table, out_indices=[[0] * 4] * T, **kw)
    with pytest.raises(TypeError, match="out_lens must be a torch.Tensor"):
        swa_indices(qsl, seq, table, out_lens=[0] * T, **kw)
    with pytest.raises(ValueError, match="out_indices must be int32 .* apart"):
        swa_indices(qsl, seq, table, out_indices=torch.zeros(1, 4, dtype=torch.int32, device=device).expand(T, 4),
                    **kw)  # fmt: skip
    ref = swa_indices(qsl, seq, table, **kw)
    buf = torch.full((T, 16), 99, dtype=torch.int32, device=device)[:, :6]
    idx, lens = swa_indices(qsl, seq, table, out_indices=buf, **kw)
    assert torch.equal(idx[:, :4], ref[0]) and bool((idx[:, 4:] == -1).all()) and torch.equal(lens, ref[1])


def test_index_slots_fit_int32(device):
    """Defect: a block id whose slots exceed int32 was wrapped (here to slot 0) instead of refused."""
    qsl, seq, table, T = _batch(device)
    big = torch.full_like(table, 2**29, dtype=torch.int64)
    match = r"block_table refers to a block outside \[0, 134217728\)"
    with pytest.raises(ValueError, match=match):
        swa_indices(qsl, seq, big, block_size=16, window=4, num_tokens=T)
    with pytest.raises(ValueError, match=match):
        csa_topk_indices(torch.zeros(T, 2, dtype=torch.int32, device=device), qsl, seq, big, block_size=16, ratio=2)
    with pytest.raises(ValueError, match=match):
        hca_indices(qsl, seq, big, block_size=16, ratio=2, width=4, num_tokens=T)
    with pytest.raises(ValueError, match=r"block_table refers to a block outside \[0, 536870912\)"):
        swa_indices(qsl, seq, torch.full_like(table, -1), block_size=4, window=4, num_tokens=T)


def test_combine_workspace_fits_int32(device):
    """Defect: R * M > 2^31 wrapped the workspace rows r*M + i to negative int32 values (with validate too)."""
    qsl, seq, _, T = _batch(device)
    tk = torch.zeros(T, 4, dtype=torch.int32, device=device)
    for validate in (True, False):
        with pytest.raises(ValueError, match=r"R \* M = 3 \* 2147483648 rows exceed"):
            combine_topk_swa_indices(tk, qsl, seq, seq, window=4, ratio=2, topk=3, M=2**31, N=3, validate=validate)


def test_combine_expanded_topk_rows(device):
    """Defect: a row stride of 0 (an expanded topk_indices) was read as 1, shifting every row's ids."""
    qsl, seq, _, T = _batch(device)
    tk = torch.tensor([[2, -1, 0, 1, 5]], device=device).expand(T, 5)
    idx, lens = combine_topk_swa_indices(tk, qsl, seq, seq, window=4, ratio=2, topk=3, M=12, N=3)
    ref_i, ref_l = combine_topk_swa_indices_ref(tk, qsl, seq, seq, 4, 2, 3, 12, 3, idx.shape[1])
    assert torch.equal(idx.cpu(), ref_i) and torch.equal(lens.cpu(), ref_l)


# ------------------------------------------------------------------ rope, e8m0
@pytest.mark.parametrize("fn", [inverse_rope_rows, rope_rows_], ids=["inverse", "forward"])
def test_rope_rows_refuse_overlapping_rows(fn, device):
    """Defect: an expanded o was rotated in place once per alias (twice or more where programs interleave)."""
    table = _table(16, device)
    pos = torch.tensor([0, 5, 9], device=device)
    with pytest.raises(ValueError, match="must not overlap itself"):
        fn(torch.randn(1, 2, 512, device=device).expand(3, 2, 512), pos, table)
    with pytest.raises(ValueError, match="must not overlap itself"):
        fn(torch.randn(3, 1, 512, device=device).expand(3, 2, 512), pos, table)
    with pytest.raises(ValueError, match="positions span"):
        fn(torch.randn(3, 2, 512, device=device), torch.tensor([0, 5, 16], device=device), table)


def test_scale_to_e8m0_keeps_fp64():
    """Defect: fp64 scales were rounded to fp32 first, so 1 + 2^-40 encoded as 2^0 and 2^128 read as inf."""
    with pytest.raises(ValueError, match="exact power of two"):
        scale_to_e8m0(torch.tensor([1.0 + 2**-40], dtype=torch.float64))
    with pytest.raises(ValueError, match="E8M0 range"):
        scale_to_e8m0(torch.tensor([2.0**128], dtype=torch.float64))
    got = scale_to_e8m0(torch.tensor([2.0**-127, 0.5, 2.0**127], dtype=torch.float64))
    assert got.tolist() == [0, 126, 254]
