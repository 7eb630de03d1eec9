"""Plain fp32 PyTorch references of the lightning-indexer ops (the test oracle); layouts in docs/indexer.md."""

from __future__ import annotations

import torch

FP8_MAX = 448.0
SCALE_FLOOR = 1e-4  # amax floor of the per-token scale (SPEC §2.5)


def quantize_indexer_k_ref(k: torch.Tensor, scale_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 quantisation: ``[T, D] -> (e4m3 [T, D], fp32 scale [T])``, ``k ~= k_fp8 * scale``.

    ``scale = max(amax, 1e-4) / 448``, rounded up to a power of two when ``scale_fmt == "ue8m0"``.
    """
    x = k.float()
    amax = x.abs().amax(-1).clamp(min=SCALE_FLOOR)
    s = amax / torch.full_like(amax, FP8_MAX)  # a tensor divisor: CUDA divides by a Python scalar as x * (1/448)
    if scale_fmt == "ue8m0":  # round up to a power of two (exactly: on the bits)
        bits = s.contiguous().view(torch.int32)
        bits = torch.where((bits & 0x7FFFFF) != 0, (bits & 0x7F800000) + 0x800000, bits)
        s = bits.view(torch.float32)
    q = (x / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s


def split_fp8_indexer_cache_ref(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block-split fp8 cache (uint8 ``[NB, BS, D + 4]``) as ``(e4m3 [NB, BS, D], fp32 [NB, BS])`` copies."""
    NB, BS, W = cache.shape
    D = W - 4
    blocks = cache.reshape(NB, BS * W)
    keys = blocks[:, : BS * D].reshape(NB, BS, D).contiguous().view(torch.float8_e4m3fn)
    scales = blocks[:, BS * D :].contiguous().view(torch.float32).reshape(NB, BS)
    return keys, scales


def dequantize_indexer_k_cache_ref(cache: torch.Tensor, cache_dtype: str = "auto") -> torch.Tensor:
    """The whole indexer key cache as fp32 ``[NB, BS, D]`` (keys times their scales for "fp8")."""
    if cache_dtype == "auto":
        return cache.float()
    if cache_dtype == "fp8":
        keys, scales = split_fp8_indexer_cache_ref(cache)
        return keys.float() * scales[..., None]
    raise ValueError(f"unknown cache_dtype {cache_dtype!r}")


def concat_and_cache_indexer_k_ref(k, cache, slot_mapping, *, cache_dtype="auto", scale_fmt=None):
    """Return a copy of ``cache`` with the keys written at their slots (negative slots skipped)."""
    cache = cache.clone()
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    x = k[keep]
    NB, BS = cache.shape[:2]
    if cache_dtype == "auto":
        cache.view(NB * BS, -1)[slots] = x.float().to(cache.dtype)
        return cache
    if cache_dtype != "fp8":
        raise ValueError(f"unknown cache_dtype {cache_dtype!r}")
    D = cache.shape[-1] - 4
    q, s = quantize_indexer_k_ref(x, scale_fmt)
    blocks = cache.view(NB, -1)
    blk, off = slots // BS, slots % BS
    cols = off[:, None] * D + torch.arange(D, device=cache.device)[None, :]
    blocks[blk[:, None], cols] = q.view(torch.uint8)
    cols = BS * D + off[:, None] * 4 + torch.arange(4, device=cache.device)[None, :]
    blocks[blk[:, None], cols] = s.contiguous().view(torch.uint8).reshape(-1, 4)
    return cache


def gather_indexer_k_ref(cache, block_table, seq_lens, *, cache_dtype="auto") -> torch.Tensor:
    """fp32 ``[sum(seq_lens), D]``: each request's keys at positions ``0 .. seq_len - 1``, request after request."""
    keys = dequantize_indexer_k_cache_ref(cache, cache_dtype)
    BS = cache.shape[1]
    flat = keys.reshape(-1, keys.shape[-1])
    parts = []
    for b in range(block_table.shape[0]):
        pos = torch.arange(int(seq_lens[b]), device=cache.device)
        parts.append(flat[block_table[b, pos // BS].long() * BS + pos % BS])
    return torch.cat(parts) if parts else keys.new_zeros(0, keys.shape[-1])


def indexer_logits_ref(
    q, weights, k_cache, block_table, seq_lens, query_start_loc, *, cache_dtype="auto", max_seq_len=None
) -> torch.Tensor:
    """fp32 ``[T, max_seq_len]``: ``sum_h relu(q[t, h] . k[p]) * weights[t, h]`` for ``p <= pos_t``, else -inf.

    Rows outside every request are all -inf. ``max_seq_len`` defaults to the block table's span.
    """
    T = q.shape[0]
    S = block_table.shape[1] * k_cache.shape[1] if max_seq_len is None else max_seq_len
    out = torch.full((T, S), float("-inf"), dtype=torch.float32, device=q.device)
    keys = gather_indexer_k_ref(k_cache, block_table, seq_lens, cache_dtype=cache_dtype)
    k0 = 0
    for b in range(block_table.shape[0]):
        L = int(seq_lens[b])
        lo, hi = int(query_start_loc[b]), int(query_start_loc[b + 1])
        kb = keys[k0 : k0 + L]
        k0 += L
        for j, t in enumerate(range(lo, hi)):
            n = min(L - (hi - lo) + j + 1, S)
            if n <= 0:
                continue
            s = torch.relu(q[t].float() @ kb[:n].T)  # [H, n]
            out[t, :n] = (s * weights[t].float()[:, None]).sum(0)
    return out


def topk_from_logits_ref(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 ``[T, topk]``: per row the positions of the ``topk`` largest finite scores (ties: lower
    position first), in increasing position order, then -1."""
    T, S = logits.shape
    out = torch.full((T, topk), -1, dtype=torch.int32, device=logits.device)
    pos = torch.arange(S, device=logits.device)
    for t in range(T):
        row = logits[t].float()
        cand = pos[row > float("-inf")]  # NaN compares false: never selected
        if cand.numel() == 0:
            continue
        # stable sort by score descending keeps lower positions first among equal scores
        order = torch.sort(row[cand] + 0.0, descending=True, stable=True).indices
        chosen = torch.sort(cand[order[:topk]]).values
        out[t, : chosen.numel()] = chosen.int()
    return out


def indexer_topk_ref(
    q, weights, k_cache, block_table, seq_lens, query_start_loc, topk, *, cache_dtype="auto", max_seq_len=None
) -> torch.Tensor:
    """``topk_from_logits_ref`` of ``indexer_logits_ref``: int32 ``[T, topk]``, -1 padded."""
    logits = indexer_logits_ref(
        q, weights, k_cache, block_table, seq_lens, query_start_loc, cache_dtype=cache_dtype, max_seq_len=max_seq_len
    )
    return topk_from_logits_ref(logits, topk)
