"""Plain fp32 PyTorch references of the cache ops (the test oracle)."""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def quantize_fp8_ref(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``sat(x / scale)`` as float8_e4m3fn."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(())
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def ds_mla_row_ref(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Encode tokens as 656-byte fp8_ds_mla rows: ``[T, 512] + [T, 64] -> uint8 [T, 656]``."""
    T = kv_c.shape[0]
    g = kv_c.float().reshape(T, 4, 128)
    amax = g.abs().amax(-1)
    s = torch.clamp(amax / torch.full_like(amax, FP8_MAX), min=torch.finfo(torch.float32).tiny)  # [T, 4], IEEE
    q = (g / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(T, 512)
    return torch.cat(
        [q.view(torch.uint8), s.contiguous().view(torch.uint8).reshape(T, 16),
         k_pe.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(T, 128)], dim=1,
    )  # fmt: skip


def dequantize_rows_ref(rows: torch.Tensor, kv_cache_dtype: str, scale=None) -> torch.Tensor:
    """Cache rows ``[N, entry]`` -> fp32 ``[N, d_c + d_rope]``."""
    if kv_cache_dtype == "auto":
        return rows.float()
    if kv_cache_dtype == "fp8":
        return rows.float() * torch.as_tensor(scale, dtype=torch.float32, device=rows.device).reshape(())
    if kv_cache_dtype == "fp8_ds_mla":
        N = rows.shape[0]
        rows = rows.contiguous()
        q = rows[:, :512].view(torch.float8_e4m3fn).float().reshape(N, 4, 128)
        s = rows[:, 512:528].contiguous().view(torch.float32).reshape(N, 4)
        pe = rows[:, 528:656].contiguous().view(torch.bfloat16).float()
        return torch.cat([(q * s[..., None]).reshape(N, 512), pe], dim=1)
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")


def concat_and_cache_mla_ref(kv_c, k_pe, kv_cache, slot_mapping, *, kv_cache_dtype="auto", scale=None):
    """Return a copy of ``kv_cache`` with the tokens written (negative slots skipped)."""
    cache = kv_cache.clone()
    flat = cache.view(-1, cache.shape[-1])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    c, r = kv_c[keep], k_pe[keep]
    if kv_cache_dtype == "auto":
        flat[slots] = torch.cat([c, r], dim=1).float().to(cache.dtype)
    elif kv_cache_dtype == "fp8":
        flat[slots] = quantize_fp8_ref(torch.cat([c, r], dim=1), scale)
    elif kv_cache_dtype == "fp8_ds_mla":
        flat[slots] = ds_mla_row_ref(c, r)
    else:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")
    return cache


def request_slots_ref(block_table, seq_len: int, block_size: int, start: int = 0) -> torch.Tensor:
    """Flat slots of positions ``[start, start + seq_len)`` of one request (int64)."""
    pos = torch.arange(start, start + seq_len, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def gather_cache_ref(kv_cache, block_table, seq_lens, *, seq_starts=None, kv_cache_dtype="auto", scale=None):
    """fp32 ``[sum(seq_lens), 576]`` of the requests' dequantised rows, request after request."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    parts = []
    for b in range(block_table.shape[0]):
        start = 0 if seq_starts is None else int(seq_starts[b])
        slots = request_slots_ref(block_table[b], int(seq_lens[b]), kv_cache.shape[1], start)
        parts.append(dequantize_rows_ref(flat[slots], kv_cache_dtype, scale))
    width = 576 if kv_cache_dtype == "fp8_ds_mla" else kv_cache.shape[-1]
    return torch.cat(parts) if parts else torch.zeros(0, width)


def expand_page_indices_ref(block_table, seq_lens, block_size):
    """``(kv_indptr [B+1] int32, kv_indices [sum] int32)``."""
    indptr = torch.zeros(block_table.shape[0] + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(seq_lens.long().cpu(), 0)
    parts = [request_slots_ref(block_table[b].cpu(), int(seq_lens[b]), block_size) for b in range(len(seq_lens))]
    idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return indptr.int(), idx.int()
