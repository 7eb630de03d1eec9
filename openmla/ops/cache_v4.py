"""DeepSeek V4 paged KV caches: the 584-byte ``fp8_v4`` layout (FlashMLA MODEL1), writer and readers.

Layouts (``kv_cache_dtype``):
    ``"fp8_v4"``: uint8 ``[num_blocks, block_size, 584]`` viewed onto blocks of ``cache.stride(0)`` bytes
        (``allocate_v4_cache`` pads it to a multiple of 576). Within block ``b`` of ``BS`` tokens, token ``p``:
        bytes ``[p*576, p*576 + 448)``: dims 0..447 as e4m3 (OCP), 7 groups of 64;
        bytes ``[p*576 + 448, p*576 + 576)``: dims 448..511 as 64 bf16 (the rope part, not quantised);
        bytes ``[BS*576 + p*8, BS*576 + p*8 + 7)``: one UE8M0 exponent per nope group, then 1 pad byte (0).
        This is FlashMLA's MODEL1_FP8Sparse cache byte for byte: ``cache.view(torch.float8_e4m3fn)
        .unsqueeze(2)`` is the ``[num_blocks, block_size, 1, 584]`` tensor its sparse decode takes. (The
        584-wide row view is only a shape: a token's scales are not bytes 576..583 of its row.)
        Quantiser (SPEC §2.4): per group ``e = ceil(log2(max(amax, 1e-4) / 448))``,
        ``q = sat_e4m3(x / 2^e)``, byte ``e + 127``; a reader computes ``x = e4m3 * 2^(byte - 127)``.
    ``"auto"``: ``[num_blocks, block_size, 512]`` bf16 (fp16/fp32 allowed), row ``[kv_c (448) | k_pe (64)]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openmla.device import INTERPRET
from openmla.ops._bf16 import to_bf16
from openmla.ops._fp8 import to_e4m3
from openmla.ops._validate import (
    FLOAT16_DTYPES,
    capturing,
    check_index,
    check_no_overlap,
    check_positive_ints,
    check_tensor,
    describe,
)
from openmla.ops.cache import _check_gather_index, _gather_rows_out, check_block_table, check_slot_mapping

__all__ = [
    "V4_KV_CACHE_DTYPES",
    "V4_TOKEN_BYTES",
    "allocate_v4_cache",
    "concat_and_cache_v4",
    "dequantize_and_gather_k_cache",
    "gather_cache_v4",
    "store_v4_row",
    "v4_block_stride",
]

V4_D = 512  # K = V row width
V4_NOPE = 448  # e4m3 dims
V4_ROPE = 64  # bf16 dims
V4_GROUP = 64  # nope dims per UE8M0 exponent
V4_DATA_BYTES = 576  # 448 e4m3 + 64 bf16 per token
V4_SCALE_BYTES = 8  # 7 exponents + 1 pad per token
V4_TOKEN_BYTES = V4_DATA_BYTES + V4_SCALE_BYTES  # 584
V4_BLOCK_ALIGN = 576  # block stride granule (FlashMLA pads blocks to it)
V4_KV_CACHE_DTYPES = ("auto", "fp8_v4")
_AUTO_DTYPES = FLOAT16_DTYPES + (torch.float32,)
GATHER_BLOCK_T = 16  # rows per program of the readers


def v4_block_stride(block_size: int) -> int:
    """Bytes per block of an fp8_v4 cache: ``block_size * 584`` rounded up to a multiple of 576."""
    return triton.cdiv(block_size * V4_TOKEN_BYTES, V4_BLOCK_ALIGN) * V4_BLOCK_ALIGN


def allocate_v4_cache(
    num_blocks: int,
    block_size: int,
    *,
    kv_cache_dtype: str = "fp8_v4",
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    fill: int = 0,
) -> torch.Tensor:
    r"""Allocate a V4 cache for ``(num_blocks, block_size)``.

    Args:
        num_blocks (int), block_size (int): the cache geometry (any block size >= 1).
        kv_cache_dtype (str): "fp8_v4": uint8 ``[num_blocks, block_size, 584]`` with block stride
            ``v4_block_stride(block_size)`` bytes (see the module docstring); "auto": ``dtype``
            ``[num_blocks, block_size, 512]``.
        device: where to allocate (default: ``openmla.device.default_device()``).
        dtype (torch.dtype): element type of an "auto" cache (bf16, fp16 or fp32).
        fill (int): the byte every fp8_v4 byte starts as (0; tests pass 0xFF to poison unused pages).
    """
    from openmla.device import default_device

    check_positive_ints(("block_size", block_size))
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
        raise ValueError(f"num_blocks must be an int >= 0; got {num_blocks!r}")
    if not isinstance(fill, int) or isinstance(fill, bool) or not 0 <= fill <= 255:  # torch.full would wrap it
        raise ValueError(f"fill must be a byte value, an int in [0, 255]; got {fill!r}")
    device = default_device() if device is None else torch.device(device)
    if kv_cache_dtype == "auto":
        if dtype not in _AUTO_DTYPES:
            raise TypeError(f"an auto V4 cache holds bf16/fp16/fp32; got dtype {dtype}")
        return torch.zeros(num_blocks, block_size, V4_D, dtype=dtype, device=device)
    if kv_cache_dtype != "fp8_v4":
        raise ValueError(f"kv_cache_dtype must be one of {V4_KV_CACHE_DTYPES}; got {kv_cache_dtype!r}")
    stride = v4_block_stride(block_size)
    buf = torch.full((num_blocks, stride), fill, dtype=torch.uint8, device=device)
    return buf[:, : block_size * V4_TOKEN_BYTES].view(num_blocks, block_size, V4_TOKEN_BYTES)


def _check_v4_cache(kv_cache, kv_cache_dtype: str, auto_width: int = V4_D) -> tuple[torch.Tensor, int]:
    """Validate a V4 cache; return it as 3-D (uint8 for fp8_v4) and the mode (0 auto, 1 fp8_v4).
    An auto cache has rows of ``auto_width`` (512; the indexer's compressed keys 128)."""
    if kv_cache_dtype not in V4_KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {V4_KV_CACHE_DTYPES}; got {kv_cache_dtype!r}")
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 4 and kv_cache.shape[2] == 1:
        kv_cache = kv_cache.squeeze(2)  # FlashMLA's [num_blocks, block_size, 1, 584]
    if kv_cache_dtype == "auto":
        check_tensor("kv_cache", kv_cache, dtypes=_AUTO_DTYPES, ndim=3)
        if kv_cache.shape[-1] != auto_width:
            raise ValueError(f'an "auto" V4 kv_cache has rows of {auto_width}; got {describe(kv_cache)}')
        return kv_cache, 0
    check_tensor("kv_cache", kv_cache, dtypes=(torch.uint8, torch.float8_e4m3fn), ndim=3)
    nb, bs, width = kv_cache.shape
    if width != V4_TOKEN_BYTES:
        raise ValueError(f"an fp8_v4 kv_cache is [num_blocks, block_size, 584]; got {describe(kv_cache)}")
    if bs > 1 and kv_cache.stride(1) != V4_TOKEN_BYTES:
        raise ValueError(f"fp8_v4 kv_cache must have row stride 584 (FlashMLA MODEL1); got strides {kv_cache.stride()}")
    if nb > 1 and (kv_cache.stride(0) < bs * V4_TOKEN_BYTES or kv_cache.stride(0) % 2):
        raise ValueError(
            f"fp8_v4 kv_cache blocks must be an even number >= {bs * V4_TOKEN_BYTES} of bytes apart "
            f"(allocate_v4_cache pads to a multiple of 576); got strides {kv_cache.stride()}"
        )
    if kv_cache.storage_offset() % 2:
        raise ValueError("fp8_v4 kv_cache must start at an even byte (its rope part is bf16)")
    return kv_cache.view(torch.uint8), 1


def _block_stride(kv_cache: torch.Tensor) -> int:
    # a single block's stride may be reported as anything; only its own bytes are addressed then
    return kv_cache.stride(0) if kv_cache.shape[0] > 1 else v4_block_stride(kv_cache.shape[1])


@triton.jit
def store_v4_row(
    cache,  # uint8 fp8_v4 cache
    cache_b16,  # the same memory viewed as bf16
    base,  # byte offset of the token's block (int64, even)
    p,  # token offset within the block
    block_size,
    b_n,  # [8, 64] fp32: nope dims 0..447 as 7 groups of 64 (row 7 ignored)
    b_r,  # [64] fp32: rope dims 448..511
    valid,  # scalar: write at all
    EXACT_ROUND: tl.constexpr,
):
    """Quantise one 512-d row into the fp8_v4 layout (UE8M0 per 64 nope dims) and store it."""
    o_g = tl.arange(0, 8)
    o_c = tl.arange(0, 64)
    m_g = o_g < 7
    amax = tl.max(tl.abs(tl.where(m_g[:, None], b_n, 0.0)), axis=1)  # [8]
    y = tl.math.div_rn(tl.maximum(amax, 1e-4), tl.full((8,), 448.0, tl.float32))  # IEEE, as torch divides
    bits = y.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # exact ceil(log2(y))
    inv_scale = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact (-22 <= e <= 120)
    b_q = to_e4m3(b_n * inv_scale[:, None], EXACT_ROUND).to(tl.uint8, bitcast=True)
    row = base + p * 576
    tl.store(cache + row + o_g[:, None] * 64 + o_c[None, :], b_q, mask=m_g[:, None] & valid)
    tl.store(cache_b16 + (row + 448) // 2 + o_c, to_bf16(b_r, EXACT_ROUND), mask=valid)
    b_e = tl.where(m_g, tl.minimum(tl.maximum(e + 127, 0), 255), 0).to(tl.uint8)
    tl.store(cache + base + block_size * 576 + p * 8 + o_g, b_e, mask=valid)


@triton.jit
def _concat_and_cache_v4_fwd_kernel(
    kv_c,  # [T, 448]
    k_pe,  # [T, 64]
    cache,  # fp8_v4: uint8; auto: [num_blocks, block_size, 512]
    cache_b16,  # fp8_v4: bf16 view of cache
    slot_mapping,  # [T]
    stride_c_t,
    stride_r_t,
    stride_cache_b,
    stride_cache_o,
    num_slots,
    block_size,
    MODE: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + i_t).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    blk = slot // block_size
    p = slot % block_size
    o_g = tl.arange(0, 8)
    o_c = tl.arange(0, 64)
    m_n = (o_g[:, None] < 7) & valid
    b_n = tl.load(kv_c + i_t * stride_c_t + o_g[:, None] * 64 + o_c[None, :], mask=m_n, other=0.0).to(tl.float32)
    b_r = tl.load(k_pe + i_t * stride_r_t + o_c, mask=valid, other=0.0).to(tl.float32)
    if MODE == 1:
        store_v4_row(cache, cache_b16, blk * stride_cache_b, p, block_size, b_n, b_r, valid, EXACT_ROUND)
    else:
        row = blk * stride_cache_b + p * stride_cache_o
        if cache.dtype.element_ty == tl.bfloat16:
            b_n = to_bf16(b_n, EXACT_ROUND)
            b_r = to_bf16(b_r, EXACT_ROUND)
        tl.store(cache + row + o_g[:, None] * 64 + o_c[None, :], b_n.to(cache.dtype.element_ty), mask=m_n)
        tl.store(cache + row + 448 + o_c, b_r.to(cache.dtype.element_ty), mask=valid)


def concat_and_cache_v4(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_cache_dtype: str = "fp8_v4",
    validate: bool = True,
) -> None:
    r"""Write each token's V4 KV row (``[kv_c | k_pe]``, 512 dims) into a paged V4 cache, in place.

    Args:
        kv_c (torch.Tensor): `[T, 448]`, bf16/fp16/fp32; dims 0..447 of the normed KV row.
        k_pe (torch.Tensor): `[T, 64]`, bf16/fp16/fp32; dims 448..511, already RoPE'd.
        kv_cache (torch.Tensor): an "fp8_v4" or "auto" V4 cache (module docstring; ``allocate_v4_cache``).
        slot_mapping (torch.Tensor): `[T]`, int32/int64; slot = block * block_size + offset; negative
            slots (padding) are skipped.
        kv_cache_dtype (str): "fp8_v4" or "auto".
        validate (bool): check that every slot lies inside the cache (a host synchronisation). Unchecked,
            slots beyond the cache are skipped, never written.
    """
    check_tensor("kv_c", kv_c, dtypes=_AUTO_DTYPES, ndim=2)
    dev = kv_c.device
    T = kv_c.shape[0]
    if kv_c.shape[1] != V4_NOPE:
        raise ValueError(f"kv_c must be [T, {V4_NOPE}]; got {describe(kv_c)}")
    check_tensor("k_pe", k_pe, dtypes=_AUTO_DTYPES, shape=(T, V4_ROPE), device=dev)
    check_index("slot_mapping", slot_mapping, ndim=1, device=dev, length=T)
    slot_mapping = slot_mapping.contiguous()  # 1-D index tensors are read densely (a strided one is copied)
    cache, mode = _check_v4_cache(kv_cache, kv_cache_dtype)
    if cache.device != dev:
        raise ValueError(f"kv_cache must be on {dev} like kv_c; got {describe(cache)}")
    if mode == 0:
        check_no_overlap("kv_cache", cache)  # (an fp8_v4 cache's strides are checked above)
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    num_slots = num_blocks * block_size
    if validate and not capturing() and T > 0:  # also for an empty cache: its slots are never silently dropped
        check_slot_mapping(slot_mapping, num_slots)
    if T == 0 or num_slots == 0:
        return
    c16 = cache.view(torch.bfloat16) if mode == 1 else cache
    stride_b = _block_stride(cache) if mode == 1 else cache.stride(0)
    _concat_and_cache_v4_fwd_kernel[(T,)](
        kv_c, k_pe, cache, c16, slot_mapping, kv_c.stride(0), k_pe.stride(0), stride_b, cache.stride(1),
        num_slots, block_size, MODE=mode, EXACT_ROUND=INTERPRET,
    )  # fmt: skip


@triton.jit
def _gather_v4_fwd_kernel(
    cache,  # fp8_v4: uint8; auto: [num_blocks, block_size, 512]
    cache_b16,  # fp8_v4: bf16 view
    block_table,  # [B, W]
    starts,  # [B] first position to read
    lens,  # [B] rows to read
    cu_out,  # [B + 1] output row offsets (OUT_CU)
    out,  # OUT_CU: [rows, 512]; else [B, M, 512]
    stride_cache_b,
    stride_cache_o,
    stride_bt_b,
    stride_bt_w,
    stride_out_b,
    stride_out_t,
    out_offset,
    out_rows,  # rows writable per request (OUT_CU: in total)
    num_blocks,
    block_size,
    max_blocks,
    MODE: tl.constexpr,
    OUT_CU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    n = tl.load(lens + i_b)
    if i_c * BLOCK_T >= n:
        return
    start = tl.load(starts + i_b).to(tl.int64)
    o_t = i_c * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    if OUT_CU:
        o_row = tl.load(cu_out + i_b).to(tl.int64) + o_t
        m_t = (o_t < n) & (o_row < out_rows)
        p_out = out + o_row[:, None] * stride_out_t
    else:
        m_t = (o_t < n) & (out_offset + o_t < out_rows)
        p_out = out + i_b * stride_out_b + (out_offset + o_t)[:, None] * stride_out_t
    pos = start + o_t
    i_blk = pos // block_size
    m_r = m_t & (pos >= 0) & (i_blk < max_blocks)
    blk = tl.load(block_table + i_b * stride_bt_b + i_blk * stride_bt_w, mask=m_r, other=-1).to(tl.int64)
    m_r = m_r & (blk >= 0) & (blk < num_blocks)
    blk = tl.where(m_r, blk, 0)
    p = pos % block_size
    o_c = tl.arange(0, 64)
    for g in tl.static_range(8):  # 7 nope groups, then the rope part
        if MODE == 1:
            if g < 7:
                row = blk * stride_cache_b + p * 576
                b_q = tl.load(cache + row[:, None] + g * 64 + o_c[None, :], mask=m_r[:, None], other=0)
                b_e = tl.load(cache + blk * stride_cache_b + block_size * 576 + p * 8 + g, mask=m_r, other=127)
                b_e = b_e.to(tl.int32)
                b_s = tl.where(
                    b_e == 255, float("nan"),
                    tl.where(b_e == 0, 5.877471754111438e-39, (b_e << 23).to(tl.float32, bitcast=True)),
                )  # fmt: skip
                b_v = b_q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * b_s[:, None]
            else:
                row = (blk * stride_cache_b + p * 576 + 448) // 2
                b_v = tl.load(cache_b16 + row[:, None] + o_c[None, :], mask=m_r[:, None], other=0.0).to(tl.float32)
        else:
            row = blk * stride_cache_b + p * stride_cache_o
            b_v = tl.load(cache + row[:, None] + g * 64 + o_c[None, :], mask=m_r[:, None], other=0.0).to(tl.float32)
        if out.dtype.element_ty == tl.bfloat16:
            b_v = to_bf16(b_v, EXACT_ROUND)
        tl.store(p_out + g * 64 + o_c[None, :], b_v.to(out.dtype.element_ty), mask=m_t[:, None])


def _launch_gather(cache, mode, block_table, starts, lens, out, *, cu=None, offset=0, out_rows, grid_rows):
    B = block_table.shape[0]
    c16 = cache.view(torch.bfloat16) if mode == 1 else cache
    stride_b = _block_stride(cache) if mode == 1 else cache.stride(0)
    out_cu = cu is not None
    grid = (B, triton.cdiv(grid_rows, GATHER_BLOCK_T))
    _gather_v4_fwd_kernel[grid](
        cache, c16, block_table, starts, lens, cu if out_cu else lens, out,
        stride_b, cache.stride(1), block_table.stride(0), block_table.stride(1),
        0 if out_cu else out.stride(0), out.stride(-2), offset, out_rows,
        cache.shape[0], cache.shape[1], block_table.shape[1],
        MODE=mode, OUT_CU=out_cu, BLOCK_T=GATHER_BLOCK_T, EXACT_ROUND=INTERPRET,
    )  # fmt: skip


def gather_cache_v4(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    seq_starts: torch.Tensor | None = None,
    kv_cache_dtype: str = "fp8_v4",
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    validate: bool = True,
) -> torch.Tensor:
    r"""Gather and dequantise each request's V4 cache rows into one contiguous ``[rows, 512]`` tensor.

    Request ``b`` contributes positions ``[seq_starts[b], seq_starts[b] + seq_lens[b])`` (start 0 by
    default), request after request.

    Args:
        kv_cache (torch.Tensor): an "fp8_v4" or "auto" V4 cache.
        block_table (torch.Tensor): `[B, max_blocks]`, int32/int64, any strides.
        seq_lens (torch.Tensor): `[B]`, int32/int64; rows per request.
        seq_starts (torch.Tensor | None): `[B]`, int32/int64; first position per request.
        kv_cache_dtype (str): "fp8_v4" or "auto".
        out (torch.Tensor | None): `[>= sum(seq_lens), 512]` bf16/fp16/fp32 to write into (no host sync
            to size it); rows past it are never written.
        out_dtype (torch.dtype): dtype of a newly allocated output.
        validate (bool): check the block table against the cache (host sync). Unchecked, rows through
            a block the cache lacks read as zeros.

    Returns:
        torch.Tensor: `[sum(seq_lens), 512]` (or ``out``), rows ``[kv_c | k_pe]`` dequantised.
    """
    cache, mode = _check_v4_cache(kv_cache, kv_cache_dtype)
    dev = cache.device
    if out is None and out_dtype not in _AUTO_DTYPES:  # (an integer or fp8 output would truncate the rows)
        raise TypeError(f"out_dtype must be one of bf16, fp16, fp32; got {out_dtype}")
    B, seq_lens, seq_starts = _check_gather_index(block_table, seq_lens, seq_starts, dev)
    if validate and not capturing() and B > 0:
        check_block_table(block_table, seq_lens, seq_starts, cache.shape[1], cache.shape[0])
    cu, out = _gather_rows_out(seq_lens, out, V4_D, out_dtype, validate)
    if B == 0 or out.shape[0] == 0 or cache.shape[0] == 0:
        return out
    starts = seq_starts if seq_starts is not None else torch.zeros_like(seq_lens)
    _launch_gather(cache, mode, block_table, starts, seq_lens, out, cu=cu, out_rows=out.shape[0],
                   grid_rows=block_table.shape[1] * cache.shape[1])  # fmt: skip
    return out


def dequantize_and_gather_k_cache(
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    gather_lens: torch.Tensor | None = None,
    offset: int = 0,
    kv_cache_dtype: str = "fp8_v4",
    validate: bool = True,
) -> torch.Tensor:
    r"""Dequantise the last ``gather_lens[r]`` tokens of each request into a per-request workspace (SPEC §2.4).

    For request r with ``g = gather_lens[r]`` (``seq_lens[r]`` when None) and ``start = seq_lens[r] - g``:
    ``out[r, offset + i] = row(position start + i)`` for ``i < g``. Other rows of ``out`` are untouched.
    For a compressed cache pass ``seq_lens // ratio`` and that cache's block table (its block size is
    ``kv_cache.shape[1]``).

    Args:
        out (torch.Tensor): `[R, M, 512]`, bf16/fp16/fp32, written in place (any row strides).
        kv_cache (torch.Tensor): an "fp8_v4" or "auto" V4 cache.
        seq_lens (torch.Tensor): `[R]`, int32/int64; tokens (or entries) per request.
        block_table (torch.Tensor): `[R, max_blocks]`, int32/int64.
        gather_lens (torch.Tensor | None): `[R]`, int32/int64; trailing rows to gather (<= seq_lens).
        offset (int): first workspace row to write.
        kv_cache_dtype (str): "fp8_v4" or "auto".
        validate (bool): check ``0 <= gather_lens <= seq_lens``, ``offset + gather_lens <= M`` and the
            block table (host sync). Unchecked, rows past ``M`` are never written and rows through a
            block the cache lacks read as zeros.

    Returns:
        torch.Tensor: ``out``.
    """
    cache, mode = _check_v4_cache(kv_cache, kv_cache_dtype)
    dev = cache.device
    check_tensor("out", out, dtypes=_AUTO_DTYPES, ndim=3, device=dev)
    R, M = out.shape[0], out.shape[1]
    if out.shape[2] != V4_D:
        raise ValueError(f"out must be [R, M, {V4_D}]; got {describe(out)}")
    check_no_overlap("out", out)
    check_index("seq_lens", seq_lens, ndim=1, device=dev, length=R)
    check_index("block_table", block_table, ndim=2, device=dev)
    if block_table.shape[0] != R:
        raise ValueError(f"block_table must have {R} rows like out; got {describe(block_table)}")
    if gather_lens is not None:
        check_index("gather_lens", gather_lens, ndim=1, device=dev, length=R)
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset <= M:
        raise ValueError(f"offset must be an int in [0, {M}] (out is [R, M, 512]); got {offset!r}")
    g = (seq_lens if gather_lens is None else gather_lens).contiguous()
    starts = seq_lens - g
    if validate and not capturing() and R > 0:
        if int(seq_lens.min()) < 0:
            raise ValueError("seq_lens must be non-negative")
        if int(g.min()) < 0 or int(starts.min()) < 0:
            raise ValueError("gather_lens must lie in [0, seq_lens]")
        if offset + int(g.max()) > M:
            raise ValueError(f"offset {offset} + gather_lens up to {int(g.max())} exceeds out's {M} rows")
        check_block_table(block_table, g, starts, cache.shape[1], cache.shape[0])
    if R == 0 or M == offset or cache.shape[0] == 0:
        return out
    _launch_gather(cache, mode, block_table, starts, g, out, offset=offset, out_rows=M, grid_rows=M - offset)
    return out
