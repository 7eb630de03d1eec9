"""Paged MLA KV caches: writing tokens in (with fp8 quantisation) and gathering them out (dequantised).

Cache layouts (``kv_cache_dtype``):
    ``"auto"``: ``[num_blocks, block_size, d_c + d_rope]`` in bf16/fp16 (fp32 allowed for tests); each
        row is ``[kv_c | k_pe]``.
    ``"fp8"``: the same shape in ``float8_e4m3fn`` with one fp32 per-tensor scale; stored =
        ``sat(value / scale)`` (saturated to +-448), value ~= stored * scale.
    ``"fp8_ds_mla"``: uint8 ``[num_blocks, block_size, 656]``, DeepSeek V3.2's row: bytes ``[0, 512)``
        hold kv_c as e4m3 in 4 groups of 128, bytes ``[512, 528)`` the 4 fp32 group scales
        (``s = max(amax / 448, FLT_MIN)``, value ~= e4m3 * s), bytes ``[528, 656)`` k_pe as 64 bf16.
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
    check_tensor,
    describe,
    scalar_scale,
)

__all__ = ["concat_and_cache_mla", "gather_cache", "check_block_table", "KV_CACHE_DTYPES", "DS_MLA_ROW_BYTES"]

FP8_MAX = 448.0
DS_MLA_ROW_BYTES = 656  # 512 e4m3 + 4 fp32 scales + 64 bf16
DS_MLA_GROUP = 128
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_ds_mla")
_MODES = {"auto": 0, "fp8": 1, "fp8_ds_mla": 2}
_AUTO_DTYPES = FLOAT16_DTYPES + (torch.float32,)


@triton.jit
def _concat_and_cache_mla_fwd_kernel(
    kv_c,  # [T, D_C]
    k_pe,  # [T, D_R]
    cache,  # [num_blocks, block_size, entry] (uint8 for MODE 2)
    cache_f32,  # the same memory viewed as fp32 (MODE 2 only)
    cache_b16,  # the same memory viewed as bf16 (MODE 2 only)
    slot_mapping,  # [T]
    scale,  # [1] fp32 (MODE 1)
    stride_c_t,
    stride_r_t,
    stride_cache_b,
    stride_cache_o,
    num_slots,
    block_size,
    D_C: tl.constexpr,
    D_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    MODE: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + i_t).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    row = (slot // block_size) * stride_cache_b + (slot % block_size) * stride_cache_o

    o_c = tl.arange(0, BLOCK_C)
    m_c = (o_c < D_C) & valid
    o_r = tl.arange(0, BLOCK_R)
    m_r = (o_r < D_R) & valid
    b_c = tl.load(kv_c + i_t * stride_c_t + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_r = tl.load(k_pe + i_t * stride_r_t + o_r, mask=m_r, other=0.0).to(tl.float32)

    if MODE == 0:
        if cache.dtype.element_ty == tl.bfloat16:  # round to nearest even under the interpreter too
            tl.store(cache + row + o_c, to_bf16(b_c, EXACT_ROUND), mask=m_c)
            tl.store(cache + row + D_C + o_r, to_bf16(b_r, EXACT_ROUND), mask=m_r)
        else:
            tl.store(cache + row + o_c, b_c.to(cache.dtype.element_ty), mask=m_c)
            tl.store(cache + row + D_C + o_r, b_r.to(cache.dtype.element_ty), mask=m_r)
    elif MODE == 1:
        s = tl.load(scale)
        tl.store(cache + row + o_c, to_e4m3(b_c / s, EXACT_ROUND), mask=m_c)
        tl.store(cache + row + D_C + o_r, to_e4m3(b_r / s, EXACT_ROUND), mask=m_r)
    else:
        # 4 groups of 128, one fp32 scale each (D_C == BLOCK_C == 512 here)
        b_g = tl.reshape(b_c, (4, 128))
        b_s = tl.maximum(tl.max(tl.abs(b_g), axis=1) / 448.0, 1.1754943508222875e-38)  # [4]
        b_q = to_e4m3(b_g / b_s[:, None], EXACT_ROUND).to(tl.uint8, bitcast=True)
        o_g = tl.arange(0, 4)
        p_q = cache + row + o_g[:, None] * 128 + tl.arange(0, 128)[None, :]
        tl.store(p_q, b_q, mask=valid)
        tl.store(cache_f32 + row // 4 + 128 + o_g, b_s, mask=valid)
        tl.store(cache_b16 + row // 2 + 264 + o_r, to_bf16(b_r, EXACT_ROUND), mask=m_r)


@triton.jit
def _to_out(x, out, EXACT_ROUND: tl.constexpr):
    """fp32 ``x`` in ``out``'s dtype, bf16 rounded to nearest even under the interpreter too."""
    if out.dtype.element_ty == tl.bfloat16:
        return to_bf16(x, EXACT_ROUND)
    return x.to(out.dtype.element_ty)


@triton.jit
def _gather_cache_fwd_kernel(
    cache,  # [num_blocks, block_size, entry]
    cache_f32,  # MODE 2: fp32 view
    cache_b16,  # MODE 2: bf16 view
    block_table,  # [B, W]
    seq_lens,  # [B]
    seq_starts,  # [B] (HAS_STARTS)
    cu_out,  # [B + 1] output row offsets
    out,  # [rows, D]
    scale,  # [1] fp32 (MODE 1)
    stride_cache_b,
    stride_cache_o,
    stride_bt_b,
    stride_bt_w,
    stride_out_t,
    num_blocks,
    block_size,
    max_blocks,
    out_rows,  # rows of out: nothing is written outside them, whatever unchecked seq_lens say
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    MODE: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    n = tl.load(seq_lens + i_b)
    if i_c * BLOCK_T >= n:
        return
    start = 0
    if HAS_STARTS:
        start = tl.load(seq_starts + i_b)
    out_start = tl.load(cu_out + i_b).to(tl.int64)

    o_t = i_c * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = (o_t < n) & (out_start + o_t >= 0) & (out_start + o_t < out_rows)  # rows written (zeros if unread)
    pos = (start + o_t).to(tl.int64)
    i_blk = pos // block_size
    m_in = m_t & (i_blk < max_blocks) & (pos >= 0)
    blk = tl.load(block_table + i_b * stride_bt_b + i_blk * stride_bt_w, mask=m_in, other=-1).to(tl.int64)
    m_ok = m_in & (blk >= 0) & (blk < num_blocks)
    row = tl.where(m_ok, blk * stride_cache_b + (pos % block_size) * stride_cache_o, 0)
    p_out = out + (out_start + o_t)[:, None] * stride_out_t

    if MODE == 2:
        o_q = tl.arange(0, 128)
        for g in tl.static_range(4):
            b_q = tl.load(cache + row[:, None] + g * 128 + o_q[None, :], mask=m_ok[:, None], other=0)
            b_s = tl.load(cache_f32 + row // 4 + 128 + g, mask=m_ok, other=0.0)
            b_v = b_q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * b_s[:, None]
            tl.store(p_out + g * 128 + o_q[None, :], _to_out(b_v, out, EXACT_ROUND), mask=m_t[:, None])
        o_r = tl.arange(0, 64)
        b_r = tl.load(cache_b16 + row[:, None] // 2 + 264 + o_r[None, :], mask=m_ok[:, None], other=0.0)
        tl.store(p_out + 512 + o_r[None, :], _to_out(b_r.to(tl.float32), out, EXACT_ROUND), mask=m_t[:, None])
    else:
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        b_v = tl.load(cache + row[:, None] + o_d[None, :], mask=m_ok[:, None] & m_d[None, :], other=0.0)
        b_v = b_v.to(tl.float32)
        if MODE == 1:
            b_v = b_v * tl.load(scale)
        tl.store(p_out + o_d[None, :], _to_out(b_v, out, EXACT_ROUND), mask=m_t[:, None] & m_d[None, :])


def _check_cache(kv_cache, kv_cache_dtype: str, entry: int | None = None) -> int:
    """Validate a cache for its declared layout; return the mode number."""
    if kv_cache_dtype not in _MODES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}; got {kv_cache_dtype!r}")
    check_tensor("kv_cache", kv_cache, ndim=3)
    mode = _MODES[kv_cache_dtype]
    if mode == 0 and kv_cache.dtype not in _AUTO_DTYPES:
        raise TypeError(f'kv_cache must be bf16/fp16/fp32 for kv_cache_dtype="auto"; got {describe(kv_cache)}')
    if mode == 1 and kv_cache.dtype != torch.float8_e4m3fn:
        raise TypeError(f'kv_cache must be float8_e4m3fn for kv_cache_dtype="fp8"; got {describe(kv_cache)}')
    if mode == 2:
        if kv_cache.dtype != torch.uint8 or kv_cache.shape[-1] != DS_MLA_ROW_BYTES:
            raise TypeError(f'kv_cache must be uint8 [*, *, 656] for "fp8_ds_mla"; got {describe(kv_cache)}')
        if kv_cache.stride(0) % 4 or kv_cache.stride(1) % 4 or kv_cache.storage_offset() % 4:
            raise ValueError(f"fp8_ds_mla kv_cache rows must be 4-byte aligned; got strides {kv_cache.stride()}")
    elif entry is not None and kv_cache.shape[-1] != entry:
        raise ValueError(f"kv_cache rows must be {entry} wide (kv_c + k_pe); got {describe(kv_cache)}")
    return mode


def _aliases(kv_cache, mode):
    """The fp32 and bf16 views of a uint8 fp8_ds_mla cache, same address (the cache itself otherwise)."""
    if mode != 2:
        return kv_cache, kv_cache
    return kv_cache.view(torch.float32), kv_cache.view(torch.bfloat16)


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_cache_dtype: str = "auto",
    scale: torch.Tensor | float | None = None,
    validate: bool = True,
) -> None:
    r"""Write each token's latent and rope parts into a paged MLA cache, in place.

    Args:
        kv_c (torch.Tensor): `[T, d_c]` (512 for DeepSeek), bf16/fp16/fp32; the normed latent.
        k_pe (torch.Tensor): `[T, d_rope]` (64), same dtype family; the RoPE'd key part.
        kv_cache (torch.Tensor): `[num_blocks, block_size, d_c + d_rope]` (bf16/fp16/fp32 for "auto",
            float8_e4m3fn for "fp8") or uint8 `[num_blocks, block_size, 656]` for "fp8_ds_mla"
            (d_c must be 512, d_rope 64); see the module docstring for the byte layout.
        slot_mapping (torch.Tensor): `[T]`, int32/int64; slot = block * block_size + offset;
            a negative slot marks a padding token, which is skipped.
        kv_cache_dtype (str): "auto", "fp8" or "fp8_ds_mla".
        scale (torch.Tensor | float): per-tensor fp32 dequantisation scale for "fp8"
            (stored = sat(value / scale)), positive and finite; ignored otherwise.
        validate (bool): check that every slot lies inside the cache and that a tensor ``scale`` is positive
            and finite (a host synchronisation). An engine whose allocator made the slots passes False on its
            per-layer hot path; slots beyond the cache are then skipped by the kernel, never written.

    Raises:
        ValueError/TypeError: on a wrong shape, dtype or device, or a slot beyond the cache
            (checked unless a CUDA graph is being captured; the kernel never writes out of bounds).
    """
    check_tensor("kv_c", kv_c, dtypes=_AUTO_DTYPES, ndim=2)
    dev = kv_c.device
    check_tensor("k_pe", k_pe, dtypes=_AUTO_DTYPES, ndim=2, shape=(kv_c.shape[0], None), device=dev)
    check_index("slot_mapping", slot_mapping, ndim=1, device=dev, length=kv_c.shape[0])
    slot_mapping = slot_mapping.contiguous()  # the kernel reads one slot per token from a dense array
    d_c, d_r = kv_c.shape[1], k_pe.shape[1]
    mode = _check_cache(kv_cache, kv_cache_dtype, entry=d_c + d_r)
    if kv_cache.device != dev:
        raise ValueError(f"kv_cache must be on {dev} like kv_c; got {describe(kv_cache)}")
    check_no_overlap("kv_cache", kv_cache)  # written in place
    if mode == 2 and (d_c != 512 or d_r != 64):
        raise ValueError(f"fp8_ds_mla stores kv_c [T, 512] and k_pe [T, 64]; got d_c {d_c}, d_rope {d_r}")
    scale_t = scalar_scale("scale", scale, dev, validate=validate) if mode == 1 else slot_mapping
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    num_slots = num_blocks * block_size
    T = kv_c.shape[0]
    if T == 0:
        return
    if validate and not capturing():
        check_slot_mapping(slot_mapping, num_slots)
    c32, c16 = _aliases(kv_cache, mode)
    _concat_and_cache_mla_fwd_kernel[(T,)](
        kv_c, k_pe, kv_cache, c32, c16, slot_mapping, scale_t,
        kv_c.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        num_slots, block_size,
        D_C=d_c, D_R=d_r, BLOCK_C=triton.next_power_of_2(d_c), BLOCK_R=triton.next_power_of_2(d_r), MODE=mode,
        EXACT_ROUND=INTERPRET,
    )  # fmt: skip


def check_slot_mapping(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Raise when a slot lies beyond a cache of ``num_slots`` slots (a host sync; negative slots are padding)."""
    top = int(slot_mapping.max())
    if top >= num_slots:
        raise ValueError(f"slot_mapping holds slot {top} but kv_cache has only {num_slots} slots")


def _check_gather_index(block_table, seq_lens, seq_starts, dev):
    """Check a gather's index tensors; returns ``(B, seq_lens, seq_starts)``, the 1-D ones made dense."""
    check_index("block_table", block_table, ndim=2, device=dev)
    B = block_table.shape[0]
    check_index("seq_lens", seq_lens, ndim=1, device=dev, length=B)
    if seq_starts is not None:
        check_index("seq_starts", seq_starts, ndim=1, device=dev, length=B)
        seq_starts = seq_starts.contiguous()  # the kernel reads dense arrays
    seq_lens = seq_lens.contiguous()
    return B, seq_lens, seq_starts


def _gather_rows_out(seq_lens, out, D: int, out_dtype: torch.dtype, validate: bool):
    """A gather's output row offsets ``cu`` `[B + 1]` int64 and its output: ``out`` checked, or a new tensor."""
    B = seq_lens.shape[0]
    dev = seq_lens.device
    cu = torch.zeros(B + 1, dtype=torch.int64, device=dev)
    torch.cumsum(seq_lens, 0, out=cu[1:])
    if out is None:
        out = torch.empty(int(cu[-1]) if B else 0, D, dtype=out_dtype, device=dev)
    else:
        check_tensor("out", out, dtypes=_AUTO_DTYPES, ndim=2, device=dev)
        check_no_overlap("out", out)
        if out.shape[1] != D:
            raise ValueError(f"out must have {D} columns; got {describe(out)}")
        if validate and not capturing() and B and out.shape[0] < int(cu[-1]):
            raise ValueError(f"out has {out.shape[0]} rows but sum(seq_lens) is {int(cu[-1])}")
    return cu, out


def check_block_table(block_table, seq_lens, seq_starts, block_size: int, num_blocks: int) -> None:
    """Raise when a request reads past its block table or through a block the cache lacks (host sync)."""
    dev = block_table.device
    B, max_blocks = block_table.shape
    ends = seq_lens.long() + (0 if seq_starts is None else seq_starts.long())
    if int(seq_lens.min()) < 0 or (seq_starts is not None and int(seq_starts.min()) < 0):
        raise ValueError("seq_lens and seq_starts must be non-negative")
    need = (ends + block_size - 1) // block_size  # blocks each request reads (a prefix bound)
    if int(need.max()) > max_blocks:
        raise ValueError(
            f"a request reads up to position {int(ends.max())} but block_table [{B}, {max_blocks}] "
            f"covers only {max_blocks * block_size} tokens at block_size {block_size}"
        )
    first = 0 if seq_starts is None else seq_starts.long() // block_size
    cols = torch.arange(max_blocks, device=dev)[None, :]
    used = (cols < need[:, None]) & (cols >= (first[:, None] if seq_starts is not None else 0))
    used &= (seq_lens > 0)[:, None]
    blocks = block_table[used]
    if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        raise ValueError(
            f"block_table refers to block {int(blocks.max()) if int(blocks.min()) >= 0 else int(blocks.min())} "
            f"but kv_cache has {num_blocks} blocks"
        )


def gather_cache(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    seq_starts: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
    scale: torch.Tensor | float | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    validate: bool = True,
) -> torch.Tensor:
    r"""Gather the cached rows of each request into one contiguous, dequantised tensor.

    Request ``b`` contributes the rows of positions ``[seq_starts[b], seq_starts[b] + seq_lens[b])``
    (``seq_starts`` defaults to 0), request after request.

    Args:
        kv_cache (torch.Tensor): a paged cache of ``kv_cache_dtype`` (see the module docstring).
        block_table (torch.Tensor): `[B, max_blocks]`, int32/int64; request b's logical block -> physical.
        seq_lens (torch.Tensor): `[B]`, int32/int64; rows to gather per request.
        seq_starts (torch.Tensor | None): `[B]`, int32/int64; first position per request (for chunks).
        kv_cache_dtype (str): "auto", "fp8" or "fp8_ds_mla".
        scale (torch.Tensor | float): per-tensor fp32 scale of an "fp8" cache.
        out (torch.Tensor | None): `[sum(seq_lens), D]` of ``out_dtype`` to write into (avoids the host
            synchronisation that sizing the output needs). D = kv_cache.shape[-1], or 576 for fp8_ds_mla.
        out_dtype (torch.dtype): dtype of a newly allocated output (bf16 by default).
        validate (bool): check the block table against the cache, a tensor ``scale`` (positive, finite) and
            the rows of a given ``out`` on the host (a sync); callers that checked the whole batch once (chunked
            prefill) pass False. Unchecked, bad blocks and positions past the block table read as zeros and
            rows past ``out`` are not written.

    Returns:
        torch.Tensor: `[sum(seq_lens), D]`, dequantised rows ``[kv_c | k_pe]``.
    """
    mode = _check_cache(kv_cache, kv_cache_dtype)
    dev = kv_cache.device
    B, seq_lens, seq_starts = _check_gather_index(block_table, seq_lens, seq_starts, dev)
    if out is None and out_dtype not in _AUTO_DTYPES:
        raise TypeError(f"out_dtype must be one of bf16, fp16, fp32; got {out_dtype}")
    D = 576 if mode == 2 else kv_cache.shape[-1]
    scale_t = scalar_scale("scale", scale, dev, validate=validate) if mode == 1 else seq_lens
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    max_blocks = block_table.shape[1]

    if validate and not capturing() and B > 0:
        check_block_table(block_table, seq_lens, seq_starts, block_size, num_blocks)

    cu, out = _gather_rows_out(seq_lens, out, D, out_dtype, validate)
    if B == 0 or out.shape[0] == 0:
        return out
    BLOCK_T = 16
    grid = (B, triton.cdiv(max_blocks * block_size, BLOCK_T))
    c32, c16 = _aliases(kv_cache, mode)
    _gather_cache_fwd_kernel[grid](
        kv_cache, c32, c16, block_table, seq_lens, seq_starts if seq_starts is not None else seq_lens, cu, out,
        scale_t, kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0), block_table.stride(1),
        out.stride(0), num_blocks, block_size, max_blocks, out.shape[0],
        D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_T=BLOCK_T, MODE=mode, HAS_STARTS=seq_starts is not None,
        EXACT_ROUND=INTERPRET,
    )  # fmt: skip
    return out
