"""MLA prefill with a chunked context under DCP: the context of each chunk gathered from every rank's shard.

The new tokens' own attention (causal, MHA form) needs no cache and runs as in
:func:`openmla.mla_prefill_with_context`. The context lives sharded (``openmla.parallel.sharding``), so
for each chunk of the packed context (the same plan on every rank, from the global context lengths):

1. each rank gathers the keys it owns of the chunk's global range ``[start, start + len)`` of each
   request: a contiguous local range ``[local(start), local(start + len))``, dequantised (``gather_cache``);
2. the ranks all-gather these pieces, padded to the largest rank's piece (every rank computes every
   rank's counts from the global lengths, so no sizes are exchanged);
3. the rows are reordered request by request (rank 0's keys of a request, then rank 1's, ...: attention
   over a key set does not depend on its order, SPEC §5.7) and the chunk proceeds as usual: up-project
   with ``kv_b_proj``, attend the chunk's queries non-causally, fold into the running output by LSE.

New tokens are written only to their owner's cache (``dcp_slot_mapping`` + ``concat_and_cache_mla``),
by the caller, before or after this call (the new tokens' keys come from ``k_nope``/``k_pe`` here).
"""

from __future__ import annotations

import torch

from openmla.ops._validate import capturing, scalar_scale
from openmla.ops.cache import check_block_table, gather_cache
from openmla.ops.chunked_prefill import _check_prefill_with_context_args, _plan_context_chunks, _to_device
from openmla.ops.merge import merge_attn_states
from openmla.ops.prefill import flash_attn_varlen
from openmla.parallel.comm import _all_gather, group_info
from openmla.parallel.sharding import _local_count, check_dcp_args

__all__ = ["dcp_mla_prefill_with_context"]


def _chunk_pieces(starts: torch.Tensor, lens: torch.Tensor, W: int, I: int):
    """Per rank: local starts and counts `[W, n]` of a chunk's global ranges, and the reorder index.

    The index maps request-major rows (request j: rank 0's keys, then rank 1's, ...) to rows of the
    all-gathered `[W * n_max]` workspace; returns ``(lstart [W, n], cnt [W, n], n_max, index)``.
    """
    r = torch.arange(W, dtype=torch.int64)[:, None]
    s, e = starts.to(torch.int64)[None, :], (starts + lens).to(torch.int64)[None, :]
    lstart = _local_count(s, W, r, I)
    cnt = _local_count(e, W, r, I) - lstart  # [W, n]
    n_max = int(cnt.sum(1).max())
    offs = torch.cumsum(cnt, 1) - cnt  # each request's first row within its rank's piece
    parts = [torch.arange(int(cnt[w, j])) + w * n_max + int(offs[w, j]) for j in range(cnt.shape[1]) for w in range(W)]
    return lstart, cnt, n_max, torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def dcp_mla_prefill_with_context(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    sm_scale: float,
    *,
    chunk_size: int,
    group=None,
    interleave: int = 1,
    kv_cache_dtype: str = "auto",
    kv_scale: torch.Tensor | float | None = None,
    context_lens_cpu: torch.Tensor | None = None,
    query_start_loc_cpu: torch.Tensor | None = None,
    return_lse: bool = False,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""MLA prefill of new tokens over themselves (causal) and a context sharded over the DCP group.

    Every rank of ``group`` calls it with the same new tokens' rows (its own heads: ``q``, ``k_nope``,
    ``v`` and ``kv_b_proj_weight`` may hold a head subset) and its own cache shard.

    Args:
        q (torch.Tensor): `[T, h, d_nope + d_rope]` (192), bf16/fp16 (fp32 for tests).
        k_nope (torch.Tensor): `[T, h, d_nope]`; k_pe: `[T, d_rope]` or `[T, 1, d_rope]`; v: `[T, h, d_v]`;
            the new tokens' keys and values, q.dtype.
        kv_cache (torch.Tensor): `[num_blocks, block_size, d_c + d_rope]` of ``kv_cache_dtype``; this rank's shard.
        block_table (torch.Tensor): `[B, max_blocks]`, int32/int64; local blocks.
        context_lens (torch.Tensor): `[B]`, int32/int64; **global** cached tokens before the new ones.
        query_start_loc (torch.Tensor): `[B + 1]`, int32/int64; new-token rows per request.
        kv_b_proj_weight (torch.Tensor): `[h * (d_nope + d_v), d_c]`, q.dtype (HF layout, this rank's heads).
        sm_scale (float): softmax scale.
        chunk_size (int): global context tokens per chunk over all requests; bounds the workspace: a rank's
            piece of a chunk is about ``chunk_size / W`` rows (up to ``I`` more per request), the all-gathered
            buffer ``W`` times the largest piece, then the usual per-chunk up-projected keys and values.
        group: the DCP process group (None: the default group). interleave (int): ``I`` >= 1.
        kv_cache_dtype (str), kv_scale: "auto", "fp8" (per-tensor scale) or "fp8_ds_mla".
        context_lens_cpu, query_start_loc_cpu (torch.Tensor | None): CPU copies (save a device sync).
        return_lse (bool): also return the LSE.
        validate (bool): check the local block table against the cache (a host sync).

    Returns:
        out: `[T, h, d_v]`, q.dtype. lse: `[T, h]` fp32 natural log over all attended keys, or None.

    Raises:
        TypeError, ValueError: bad dtypes, shapes or arguments (named in the message).
        RuntimeError: torch.distributed is not initialised.
    """
    W, rank, _ = group_info(group)
    _, _, I = check_dcp_args(W, rank, interleave)
    T, H, d_nope, d_rope, d_v, d_c, B = _check_prefill_with_context_args(
        q, k_nope, k_pe, v, kv_cache, block_table, context_lens, query_start_loc, kv_b_proj_weight, chunk_size,
        kv_cache_dtype,
    )  # fmt: skip
    dev, dtype = q.device, q.dtype
    entry = 576 if kv_cache_dtype == "fp8_ds_mla" else kv_cache.shape[2]
    if kv_cache_dtype == "fp8":  # positive and finite, checked here (a rank's chunk gathers then trust it)
        kv_scale = scalar_scale("kv_scale", kv_scale, dev)
    for name, t, n in (("context_lens_cpu", context_lens_cpu, B), ("query_start_loc_cpu", query_start_loc_cpu, B + 1)):
        if t is not None and (
            not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.shape != (n,) or t.is_floating_point()
        ):
            raise ValueError(f"{name} must be an integer CPU tensor of shape [{n}]; got {t!r:.80}")
    ctx_cpu = context_lens.cpu() if context_lens_cpu is None else context_lens_cpu
    qsl = (query_start_loc.cpu() if query_start_loc_cpu is None else query_start_loc_cpu).to(torch.int64)
    if B and (int(qsl[0]) != 0 or bool((qsl[1:] < qsl[:-1]).any())):
        raise ValueError(f"query_start_loc must start at 0 and not decrease; got {qsl.tolist()}")
    if (int(qsl[-1]) if B else 0) != T:  # every row of q belongs to a request (else out rows stay unwritten)
        raise ValueError(f"query_start_loc[-1] ({int(qsl[-1]) if B else 0}) must equal q.shape[0] ({T})")
    if B and int(ctx_cpu.min()) < 0:
        raise ValueError(f"context_lens must be non-negative; got {ctx_cpu.tolist()}")
    max_q = int((qsl[1:] - qsl[:-1]).max()) if B else 0
    if validate and B and int(ctx_cpu.max()) > 0 and not capturing():
        local = _local_count(context_lens.to(torch.int64), W, rank, I)
        check_block_table(block_table, local, None, kv_cache.shape[1], kv_cache.shape[0])

    # the new tokens among themselves (causal), then every context chunk folded in
    k_new = torch.cat([k_nope, k_pe.reshape(T, 1, d_rope).expand(T, H, d_rope)], dim=-1)
    chunks = _plan_context_chunks(ctx_cpu, qsl, chunk_size)
    out, lse = flash_attn_varlen(q, k_new, v, query_start_loc, query_start_loc, max_q, max_q, sm_scale,
                                 causal=True, return_lse=return_lse or bool(chunks))  # fmt: skip
    del k_new
    if not chunks:
        return out, (lse if return_lse else None)
    pieces = [_chunk_pieces(c.starts, c.lens, W, I) for c in chunks]
    n_ws = max(p[2] for p in pieces)
    ws_local = torch.empty(n_ws, entry if kv_cache_dtype != "fp8_ds_mla" else 576, dtype=dtype, device=dev)
    ws_all = torch.empty(W * n_ws, ws_local.shape[1], dtype=dtype, device=dev)
    R0, R1 = chunks[0].r0, chunks[-1].r1
    acc = out[R0:R1].float()
    w_t = kv_b_proj_weight.t()
    for c, dc, (lstart, cnt, n_max, index) in zip(_to_device(chunks, dev), chunks, pieces):
        n = dc.num_tokens
        mine = int(cnt[rank].sum())
        if mine:
            gather_cache(
                kv_cache, block_table[c.b0 : c.b1], cnt[rank].to(dev), seq_starts=lstart[rank].to(dev),
                kv_cache_dtype=kv_cache_dtype, scale=kv_scale, out=ws_local[:mine], validate=False,
            )  # fmt: skip
        _all_gather(ws_all[: W * n_max], ws_local[:n_max], group=group)
        ws = ws_all[index.to(dev)]  # [n, d_c + d_rope], request-major
        kv_h = torch.mm(ws[:, :d_c], w_t).view(n, H, d_nope + d_v)
        k_ctx = torch.cat([kv_h[..., :d_nope], ws[:, None, d_c:].expand(n, H, d_rope)], dim=-1)
        o_c, lse_c = flash_attn_varlen(
            q[c.r0 : c.r1], k_ctx, kv_h[..., d_nope:], c.cu_q, c.cu_k, c.max_q, c.max_k, sm_scale,
            causal=False, return_lse=True, validate=False,
        )  # fmt: skip
        o_rows, lse_rows = acc[c.r0 - R0 : c.r1 - R0], lse[c.r0 : c.r1]
        merge_attn_states(o_rows, lse_rows, o_c, lse_c, out=o_rows, out_lse=lse_rows)
    out[R0:R1] = acc
    return out, (lse if return_lse else None)
