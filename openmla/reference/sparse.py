"""Plain fp32 PyTorch references of sparse MLA and its index ops (the test oracle; naive, not fast)."""

from __future__ import annotations

import torch

from openmla.reference.cache import dequantize_rows_ref
from openmla.reference.v4 import dequantize_v4_cache_ref, inverse_rope_rows_ref


def convert_req_index_to_global_index_ref(req_id, block_table, token_indices, block_size, topk_length=None):
    """``[T, K]`` int32 global slots of request-local positions; -1 where invalid (see the op's docstring)."""
    R, W = block_table.shape
    tok = token_indices.long().cpu()
    req = req_id.long().cpu()
    bt = block_table.long().cpu()
    T, K = tok.shape
    n = torch.full((T,), K) if topk_length is None else topk_length.long().cpu()
    blk = torch.div(tok, block_size, rounding_mode="floor")
    ok = (tok >= 0) & (blk < W) & (torch.arange(K)[None, :] < n[:, None]) & ((req >= 0) & (req < R))[:, None]
    b = bt[req.clamp(0, max(R - 1, 0))[:, None], blk.clamp(0, max(W - 1, 0))] if R and W else torch.zeros_like(tok)
    ok &= b >= 0
    return torch.where(ok, b * block_size + tok % block_size, -1).int()


def sparse_seq_lens_ref(query_start_loc, seq_lens, topk, num_tokens=None):
    """``[num_tokens]`` int32: ``min(pos + 1, topk)`` per token; 0 for tokens no request covers."""
    qsl = query_start_loc.long().cpu().tolist()
    sl = seq_lens.long().cpu().tolist()
    T = qsl[-1] if num_tokens is None else num_tokens
    out = torch.zeros(T, dtype=torch.int64)
    for b in range(len(sl)):
        qlen = qsl[b + 1] - qsl[b]
        for i in range(qlen):
            t = qsl[b] + i
            if t < T and sl[b] > 0:
                out[t] = min(max(sl[b] - qlen + i + 1, 0), topk)
    return out.int()


def build_ragged_indices_from_dense_ref(indices, lengths, num_rows=-1):
    """``(indptr [R + 1], flat [sum(lengths)])`` int32 (only the defined part of ``flat``)."""
    idx = indices.long().cpu()
    lens = lengths.long().cpu().clamp(0, idx.shape[1])
    indptr = torch.zeros(idx.shape[0] + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(lens, 0)
    parts = [idx[r, : int(lens[r])] for r in range(idx.shape[0])]
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    if num_rows >= 0:
        flat = torch.where((flat >= 0) & (flat < num_rows), flat, -1)
    return indptr.int(), flat.int()


def _dense_rows(indices, topk_length, T):
    """Dense ``[T, K]`` int64 index rows and a ``[T, K]`` mask of the entries that count (ragged or not)."""
    if isinstance(indices, (tuple, list)):
        indptr, flat = (x.long().cpu() for x in indices)
        lens = (indptr[1:] - indptr[:-1]).tolist()
        K = max(lens + [1])
        rows = torch.full((T, K), -1, dtype=torch.int64)
        for t in range(T):
            rows[t, : lens[t]] = flat[int(indptr[t]) : int(indptr[t + 1])]
        counted = torch.arange(K)[None, :] < torch.tensor(lens, dtype=torch.int64)[:, None]
        return rows, counted
    rows = indices.long().cpu()
    K = rows.shape[1]
    if topk_length is None:
        counted = torch.ones(T, K, dtype=torch.bool)
    else:
        counted = torch.arange(K)[None, :] < topk_length.long().cpu()[:, None]
    return rows, counted


def _keys(kv_cache, kv_cache_dtype, indices, topk_length, T):
    """Gathered fp32 keys ``[T, K, D]`` and their validity ``[T, K]`` for one source."""
    if kv_cache_dtype == "fp8_v4":  # block-split rows: every slot dequantised first (SPEC §2.4)
        if kv_cache.dim() == 4:
            kv_cache = kv_cache.squeeze(2)  # FlashMLA's [num_blocks, block_size, 1, 584]
        flat = dequantize_v4_cache_ref(kv_cache.view(torch.uint8))
    else:
        flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    num_slots = flat.shape[0]
    rows, counted = (x.to(flat.device) for x in _dense_rows(indices, topk_length, T))
    valid = counted & (rows >= 0) & (rows < num_slots)
    sel = torch.where(valid, rows, 0)
    if kv_cache_dtype == "fp8_v4":
        keys = flat[sel.reshape(-1)].reshape(T, rows.shape[1], -1)
    else:
        keys = dequantize_rows_ref(flat[sel.reshape(-1)], kv_cache_dtype).reshape(T, rows.shape[1], -1)
    if kv_cache_dtype != "auto":  # a NaN from dequantising a selected fp8 row counts as 0 (the V4 seed's rule)
        keys = torch.where(torch.isnan(keys), 0.0, keys)
    keys = torch.where(valid[..., None], keys, 0.0)  # never-selected rows never matter
    return keys, valid


def sparse_mla_ref(
    q,
    kv_cache,
    indices,
    sm_scale,
    *,
    kv_cache_dtype="auto",
    topk_length=None,
    attn_sink=None,
    d_v=512,
    extra_kv_cache=None,
    extra_indices=None,
    extra_topk_length=None,
    inv_rope_positions=None,
    cos_sin_cache=None,
):
    """fp32 sparse MLA: ``(out [T, H, d_v] fp32, lse [T, H] fp32)``, the sink-free natural-log LSE.

    Keys of token t: the counted, in-range entries of its index row(s) in both sources (duplicates count
    twice); K = the dequantised row, V = its first ``d_v`` values. The sink multiplies out by
    ``sigmoid(lse - sink)``. A row with no valid key gives out 0 and lse -inf. With ``inv_rope_positions`` and
    ``cos_sin_cache`` the finished output's last R dims are rotated by minus the token's angle (V4, SPEC §7.8).
    ``kv_cache_dtype`` "fp8_v4" reads the block-split V4 layout (SPEC §2.4). Computed on the cache's device.
    """
    T = q.shape[0]
    qf = q.float().to(kv_cache.device)
    keys, valid = _keys(kv_cache, kv_cache_dtype, indices, topk_length, T)
    if extra_kv_cache is not None:
        k2, v2 = _keys(extra_kv_cache, kv_cache_dtype, extra_indices, extra_topk_length, T)
        keys, valid = torch.cat([keys, k2], 1), torch.cat([valid, v2], 1)
    s = torch.einsum("thd,tkd->thk", qf, keys) * sm_scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)  # -inf for empty rows
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("thk,tkd->thd", p, keys[..., :d_v])
    if attn_sink is not None:
        f = torch.sigmoid(lse - attn_sink.float().to(lse.device)[None, :])
        out = out * torch.where(torch.isneginf(lse), 0.0, f)[..., None]
    if inv_rope_positions is not None:
        out = inverse_rope_rows_ref(out, inv_rope_positions.to(out.device), cos_sin_cache.to(out.device))
    return out, lse


def apply_attn_sink_ref(out, lse, attn_sink):
    """``out * sigmoid(lse - sink)`` in fp32 (0 where lse is -inf)."""
    lse = lse.float()
    f = torch.sigmoid(lse - attn_sink.float().to(lse.device)[None, :])
    return out.float().to(lse.device) * torch.where(torch.isneginf(lse), 0.0, f)[..., None]
