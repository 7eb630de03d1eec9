"""Plain fp32 reference of paged MLA decode (absorbed MQA form)."""

from __future__ import annotations

import torch

from openmla.reference.cache import dequantize_rows_ref, request_slots_ref


def mla_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    sm_scale: float,
    *,
    causal: bool = True,
    kv_scale=None,
    q_scale=None,
    kv_cache_dtype: str | None = None,
    d_v: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Naive paged MLA decode in fp32.

    Args:
        q: `[T, H, d_qk]` (bf16/fp16/fp32, or fp8 with ``q_scale``); request b owns rows
            ``query_start_loc[b]:query_start_loc[b+1]``.
        kv_cache: `[num_blocks, block_size, d_qk]` (or an fp8 / fp8_ds_mla cache); K = row, V = row[:d_v].
        block_table: `[B, W]` int. seq_lens: `[B]` int (keys per request, new tokens included).
        query_start_loc: `[B + 1]` int. sm_scale: softmax scale.
        causal: query t of a request with qlen L sees keys ``[0, seq_len - L + t]``; else all keys.
        kv_scale: per-tensor scale of an fp8 cache. kv_cache_dtype: inferred from the cache dtype
            when None ("fp8" for float8_e4m3fn, "fp8_ds_mla" for uint8).

    Returns:
        out `[T, H, d_v]` fp32 (0 for rows with no visible key), lse `[T, H]` fp32 natural log (-inf there).
    """
    if kv_cache_dtype is None:
        kv_cache_dtype = {torch.float8_e4m3fn: "fp8", torch.uint8: "fp8_ds_mla"}.get(kv_cache.dtype, "auto")
    qf = q.float()
    if q_scale is not None:
        qf = qf * torch.as_tensor(q_scale, dtype=torch.float32, device=q.device).reshape(())
    T, H, _ = q.shape
    out = torch.zeros(T, H, d_v, dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    qsl = query_start_loc.long().cpu()
    for b in range(block_table.shape[0]):
        r0, r1 = int(qsl[b]), int(qsl[b + 1])
        n, L = r1 - r0, int(seq_lens[b])
        if n == 0 or L == 0:
            continue
        slots = request_slots_ref(block_table[b], L, kv_cache.shape[1])
        K = dequantize_rows_ref(flat[slots], kv_cache_dtype, kv_scale)  # [L, d_qk]
        V = K[:, :d_v]
        s = torch.einsum("thd,kd->thk", qf[r0:r1], K) * sm_scale  # [n, H, L]
        if causal:
            qi = torch.arange(n, device=q.device)[:, None]
            kj = torch.arange(L, device=q.device)[None, :]
            s = s.masked_fill(~(kj <= qi + (L - n))[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)
        out[r0:r1] = p @ V
        lse[r0:r1] = row_lse
    return out, lse
