"""Plain fp32 PyTorch references of the DCP ops: sharding a paged cache, one rank's partial, the exact merge."""

from __future__ import annotations

import torch

from openmla.reference.cache import dequantize_rows_ref, request_slots_ref


def dcp_local_seq_lens_ref(seq_lens, world_size: int, rank: int, interleave: int = 1) -> torch.Tensor:
    """Brute force: count the positions ``g < S`` with ``(g // I) % W == rank``, one request at a time."""
    out = [sum(1 for g in range(int(s)) if (g // interleave) % world_size == rank) for s in seq_lens.tolist()]
    return torch.tensor(out, dtype=torch.int32)


def dcp_shard_cache_ref(kv_cache, block_table, seq_lens, block_size: int, world_size: int, rank: int,
                        interleave: int = 1, *, spare_blocks: int = 1, reserve_lens=None):  # fmt: skip
    """Copy the tokens ``rank`` owns out of a single-rank paged cache into a fresh local one.

    Args:
        kv_cache: `[num_blocks, bs, D]`; block_table: `[B, max_blocks]`; seq_lens: `[B]` global lengths.
        block_size: the local cache's block size. spare_blocks: extra (NaN-filled, never owned) blocks.
        reserve_lens: `[B]` global lengths to allocate local blocks for (default ``seq_lens``); only the
            first ``seq_lens`` tokens are copied, the rest of the reserved rows hold NaN.

    Returns:
        (local_cache `[n, block_size, D]`, local_block_table `[B, max_local_blocks]` int32). Local blocks
        are handed out in reverse order (so block ids differ from positions) and unused rows hold NaN
        (fp caches) so that a kernel that reads a key it does not own shows up.
    """
    W, I = world_size, interleave
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    B = block_table.shape[0]
    per_req, nblk = [], []
    for b in range(B):
        cap = int(seq_lens[b]) if reserve_lens is None else max(int(seq_lens[b]), int(reserve_lens[b]))
        nblk.append(-(-sum(1 for g in range(cap) if (g // I) % W == rank) // block_size))
        S = int(seq_lens[b])
        slots = request_slots_ref(block_table[b], S, kv_cache.shape[1])
        mine = [g for g in range(S) if (g // I) % W == rank]
        per_req.append(slots[mine] if mine else slots[:0])
    total = sum(nblk) + spare_blocks
    width = max([1] + nblk)
    local = torch.empty(total, block_size, kv_cache.shape[-1], dtype=kv_cache.dtype, device=kv_cache.device)
    if local.is_floating_point() and local.dtype.itemsize > 1:
        local.fill_(float("nan"))
    else:
        local.view(torch.uint8).fill_(0x7F)  # fp8 e4m3 NaN bytes
    table = torch.full((B, width), -1, dtype=torch.int32, device=kv_cache.device)
    free = list(range(total - 1, -1, -1))
    for b, slots in enumerate(per_req):
        for j in range(nblk[b]):
            blk = free.pop(0)
            table[b, j] = blk
            rows = slots[j * block_size : (j + 1) * block_size]
            if rows.numel():
                local[blk, : rows.numel()] = flat[rows]
    table[table < 0] = 0  # columns past a request's blocks are never read; keep them valid block ids
    return local, table


def dcp_local_decode_ref(q, kv_cache, block_table, seq_lens, query_start_loc, sm_scale, *, world_size: int,
                         rank: int, interleave: int = 1, causal: bool = True, kv_cache_dtype=None, kv_scale=None,
                         d_v: int = 512):  # fmt: skip
    """fp32 ``(out [T, H, d_v], lse [T, H])`` of one rank's partial over its local shard.

    Local position ``l`` holds global ``((l // I) * W + rank) * I + l % I``; row t of a request with
    qlen n and global length S sees the local keys whose global position is ``<= S - n + t`` (all local
    keys when not causal). Rows that see no key: out 0, lse -inf.
    """
    W, I = world_size, interleave
    if kv_cache_dtype is None:
        kv_cache_dtype = {torch.float8_e4m3fn: "fp8"}.get(kv_cache.dtype, "auto")
    T, H, _ = q.shape
    qf = q.float()
    out = torch.zeros(T, H, d_v)
    lse = torch.full((T, H), float("-inf"))
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    qsl = query_start_loc.tolist()
    for b in range(block_table.shape[0]):
        r0, r1 = qsl[b], qsl[b + 1]
        n, S = r1 - r0, int(seq_lens[b])
        L = int(dcp_local_seq_lens_ref(seq_lens[b : b + 1], W, rank, I)[0])
        if n == 0 or L == 0:
            continue
        slots = request_slots_ref(block_table[b], L, kv_cache.shape[1])
        K = dequantize_rows_ref(flat[slots], kv_cache_dtype, kv_scale).float().cpu()
        loc = torch.arange(L)
        g = ((loc // I) * W + rank) * I + loc % I
        s = torch.einsum("thd,kd->thk", qf[r0:r1].cpu(), K) * sm_scale
        if causal:
            keep = g[None, :] <= (S - n + torch.arange(n))[:, None]  # [n, L]
            s = s.masked_fill(~keep[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(s, -1)
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)
        out[r0:r1] = p @ K[:, :d_v]
        lse[r0:r1] = row_lse
    return out, lse


def dcp_merge_ref(outs, lses):
    """Exact merge of per-rank partials over disjoint key sets (natural-log LSEs; +inf/NaN count as -inf).

    Args:
        outs: list of `[T, H, D]`; lses: list of `[T, H]`.

    Returns:
        (out `[T, H, D]` fp32, lse `[T, H]` fp32): 0 / -inf where every part is empty.
    """
    L = torch.stack([x.float().cpu() for x in lses])
    L = torch.where(torch.isnan(L) | torch.isposinf(L), float("-inf"), L)
    M = L.amax(0)
    Ms = torch.where(torch.isneginf(M), 0.0, M)
    w = torch.exp(L - Ms)
    den = w.sum(0)
    safe = torch.where(den > 0, den, 1.0)
    o = sum(torch.where(wi[..., None] > 0, oi.float().cpu() * wi[..., None], 0.0) for wi, oi in zip(w, outs))
    return o / safe[..., None], torch.where(den > 0, Ms + torch.log(safe), float("-inf"))
