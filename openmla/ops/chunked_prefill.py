"""MLA prefill with a paged context, in bounded chunks (vLLM's ``forward_mha`` + ``_compute_prefill_context``).

The new tokens of request ``b`` attend causally to themselves and fully to the request's
``context_lens[b]`` earlier tokens, which live only in the paged latent cache (rows ``kv_c | k_pe``).
Computed as (SPEC §3.3-3.5):

1. suffix: ``flash_attn_varlen`` of the new tokens over their own keys
   ``k = [k_nope | k_pe]``, ``v``, causal, giving ``(out, lse)``;
2. for each context chunk: gather the chunk's cache rows (``gather_cache``, dequantised), up-project the
   latents with ``kv_b_proj`` to per-head ``k_nope`` and ``v``, append the shared ``k_pe``, attend the
   queries of the chunk's requests to it non-causally, and fold the result into ``(out, lse)`` in place
   with ``merge_attn_states`` (the running output of those rows is kept in fp32: one rounding at the
   end instead of one per merge).

Chunking: the context tokens of all requests (that have new tokens) are laid end to end, request after
request, and cut into consecutive chunks of ``chunk_size`` tokens, so a chunk may span several requests
and a long context several chunks. The number of chunks is ``ceil(total_context / chunk_size)`` and each
chunk only touches the query rows of the requests it covers. The workspace (gathered rows, up-projected
keys and values) is bounded by ``chunk_size`` tokens, whatever the context lengths. The plan is made on
the host from CPU copies of ``context_lens`` and ``query_start_loc`` (pass them to avoid the one
device-to-host copy); the per-chunk metadata goes to the device in one transfer.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from openmla.ops._validate import (
    FLOAT16_DTYPES,
    capturing,
    check_index,
    check_no_overlap,
    check_tensor,
    describe,
    scalar_scale,
)
from openmla.ops.cache import check_block_table, gather_cache
from openmla.ops.merge import merge_attn_states
from openmla.ops.prefill import flash_attn_varlen

__all__ = ["mla_prefill_with_context"]


@dataclass(frozen=True)
class _ContextChunk:
    """One chunk of the packed context: requests ``[b0, b1)`` and their query rows ``[r0, r1)``.

    ``starts``/``lens`` (``[b1 - b0]``) are each request's context positions in this chunk,
    ``cu_k``/``cu_q`` (``[b1 - b0 + 1]``) the chunk-local cumulative key and query rows. Host int32
    tensors from the planner; device views after ``_to_device``.
    """

    b0: int
    b1: int
    r0: int
    r1: int
    num_tokens: int
    max_q: int
    max_k: int
    starts: torch.Tensor
    lens: torch.Tensor
    cu_k: torch.Tensor
    cu_q: torch.Tensor


def _plan_context_chunks(context_lens: torch.Tensor, query_start_loc: torch.Tensor, chunk_size: int
                         ) -> list[_ContextChunk]:  # fmt: skip
    """Cut the packed context of all requests into chunks of at most ``chunk_size`` tokens (host only).

    Args:
        context_lens (torch.Tensor): `[B]`, CPU integer tensor.
        query_start_loc (torch.Tensor): `[B + 1]`, CPU integer tensor.
        chunk_size (int): tokens per chunk, over all requests.

    Returns:
        list[_ContextChunk]: in order; requests without new tokens contribute no context.
    """
    ctx = context_lens.to(torch.int64)
    qsl = query_start_loc.to(torch.int64)
    qlen = qsl[1:] - qsl[:-1]
    ctx = torch.where(qlen > 0, ctx, 0)
    ends = torch.cumsum(ctx, 0)
    offs = ends - ctx
    total = int(ends[-1]) if ctx.numel() else 0
    chunks = []
    for lo in range(0, total, chunk_size):
        hi = min(total, lo + chunk_size)
        hit = ((ends > lo) & (offs < hi) & (ctx > 0)).nonzero().flatten()
        b0, b1 = int(hit[0]), int(hit[-1]) + 1
        o, c = offs[b0:b1], ctx[b0:b1]
        starts = (lo - o).clamp(min=0).minimum(c)
        lens = ((hi - o).clamp(min=0).minimum(c) - starts).clamp(min=0)
        cu_k = torch.zeros(b1 - b0 + 1, dtype=torch.int64)
        cu_k[1:] = torch.cumsum(lens, 0)
        cu_q = qsl[b0 : b1 + 1] - qsl[b0]
        chunks.append(
            _ContextChunk(
                b0=b0,
                b1=b1,
                r0=int(qsl[b0]),
                r1=int(qsl[b1]),
                num_tokens=int(cu_k[-1]),
                max_q=int(qlen[b0:b1].max()),
                max_k=int(lens.max()),
                starts=starts.int(),
                lens=lens.int(),
                cu_k=cu_k.int(),
                cu_q=cu_q.int(),
            )  # fmt: skip
        )
    return chunks


def _to_device(chunks: list[_ContextChunk], device: torch.device) -> list[_ContextChunk]:
    """Move every chunk's metadata to ``device`` in a single (pinned, asynchronous) copy."""
    if not chunks or device.type == "cpu":
        return chunks
    flat = torch.cat([torch.cat([c.starts, c.lens, c.cu_k, c.cu_q]) for c in chunks])
    flat = flat.pin_memory().to(device, non_blocking=True)
    out, i = [], 0
    for c in chunks:
        n = c.b1 - c.b0
        views = []
        for size in (n, n, n + 1, n + 1):
            views.append(flat[i : i + size])
            i += size
        out.append(_ContextChunk(c.b0, c.b1, c.r0, c.r1, c.num_tokens, c.max_q, c.max_k, *views))
    return out


def _check_prefill_with_context_args(q, k_nope, k_pe, v, kv_cache, block_table, context_lens, query_start_loc,
                                     kv_b_proj_weight, chunk_size, kv_cache_dtype):  # fmt: skip
    """The tensor and chunk-size checks shared with the DCP variant; returns ``(T, H, d_nope, d_rope, d_v, d_c, B)``."""
    check_tensor("q", q, dtypes=FLOAT16_DTYPES + (torch.float32,), ndim=3)
    dev, dtype = q.device, q.dtype
    T, H, d_qk = q.shape
    check_tensor("k_nope", k_nope, dtypes=(dtype,), shape=(T, H, None), device=dev)
    d_nope = k_nope.shape[2]
    d_rope = d_qk - d_nope
    if d_rope <= 0:
        raise ValueError(f"q's head dim must exceed k_nope's; got q {describe(q)}, k_nope {describe(k_nope)}")
    if not isinstance(k_pe, torch.Tensor) or k_pe.dim() not in (2, 3):
        raise ValueError(f"k_pe must be a [T, {d_rope}] or [T, 1, {d_rope}] tensor; got {k_pe!r:.80}")
    shape_pe = (T, d_rope) if k_pe.dim() == 2 else (T, 1, d_rope)
    check_tensor("k_pe", k_pe, dtypes=(dtype,), shape=shape_pe, device=dev)
    check_tensor("v", v, dtypes=(dtype,), shape=(T, H, None), device=dev)
    d_v = v.shape[2]
    check_tensor("kv_cache", kv_cache, ndim=3, device=dev)
    entry = 576 if kv_cache_dtype == "fp8_ds_mla" else kv_cache.shape[2]
    d_c = entry - d_rope
    check_tensor("kv_b_proj_weight", kv_b_proj_weight, dtypes=(dtype,), shape=(H * (d_nope + d_v), d_c), device=dev,
                 last_dim_contiguous=False)  # fmt: skip
    check_index("block_table", block_table, ndim=2, device=dev)
    B = block_table.shape[0]
    check_index("context_lens", context_lens, ndim=1, device=dev, length=B)
    check_index("query_start_loc", query_start_loc, ndim=1, device=dev, length=B + 1)
    if not isinstance(chunk_size, numbers.Integral) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    return T, H, d_nope, d_rope, d_v, d_c, B


def _mla_prefill_with_context_fwd(q, k_nope, k_pe, v, kv_cache, block_table, chunks, query_start_loc, max_q, W,
                                  sm_scale, chunk_size, kv_cache_dtype, kv_scale, return_lse, out):  # fmt: skip
    """Suffix attention, then the context chunks folded in place (see the module docstring)."""
    T, H, d_qk = q.shape
    d_nope, d_v = k_nope.shape[-1], v.shape[-1]
    d_rope = d_qk - d_nope
    d_c = W.shape[1]
    dev, dtype = q.device, q.dtype

    k_new = torch.empty(T, H, d_qk, dtype=dtype, device=dev)
    k_new[..., :d_nope] = k_nope
    k_new[..., d_nope:] = k_pe.reshape(T, 1, d_rope)
    out, lse = flash_attn_varlen(
        q, k_new, v, query_start_loc, query_start_loc, max_q, max_q, sm_scale,
        causal=True, return_lse=return_lse or bool(chunks), out=out,
    )  # fmt: skip
    del k_new
    if not chunks:
        return out, lse

    n_ws = min(chunk_size, max(c.num_tokens for c in chunks))
    ws = torch.empty(n_ws, d_c + d_rope, dtype=dtype, device=dev)  # gathered [kv_c | k_pe] rows
    kv = torch.empty(n_ws, H * (d_nope + d_v), dtype=dtype, device=dev)  # up-projected [k_nope | v] per head
    k_ctx = torch.empty(n_ws, H, d_qk, dtype=dtype, device=dev)
    rows = max(c.r1 - c.r0 for c in chunks)
    o_ctx = torch.empty(rows, H, d_v, dtype=dtype, device=dev)
    # the running output of the rows that see context is kept in fp32 (one rounding at the end, not one
    # per merge); its LSE is already fp32, merged in place in ``lse``
    R0, R1 = chunks[0].r0, chunks[-1].r1
    acc = out[R0:R1].float()
    w_t = W.t()
    for c in chunks:
        n, nr = c.num_tokens, c.r1 - c.r0
        gather_cache(
            kv_cache, block_table[c.b0 : c.b1], c.lens, seq_starts=c.starts, kv_cache_dtype=kv_cache_dtype,
            scale=kv_scale, out=ws[:n], validate=False,
        )  # fmt: skip
        torch.mm(ws[:n, :d_c], w_t, out=kv[:n])
        kv_h = kv[:n].view(n, H, d_nope + d_v)
        k_ctx[:n, :, :d_nope] = kv_h[..., :d_nope]
        k_ctx[:n, :, d_nope:] = ws[:n, None, d_c:]
        o_c, lse_c = flash_attn_varlen(
            q[c.r0 : c.r1], k_ctx[:n], kv_h[..., d_nope:], c.cu_q, c.cu_k, c.max_q, c.max_k, sm_scale,
            causal=False, return_lse=True, out=o_ctx[:nr], validate=False,
        )  # fmt: skip
        o_rows, lse_rows = acc[c.r0 - R0 : c.r1 - R0], lse[c.r0 : c.r1]
        merge_attn_states(o_rows, lse_rows, o_c, lse_c, out=o_rows, out_lse=lse_rows)
    out[R0:R1] = acc
    return out, (lse if return_lse else None)


def mla_prefill_with_context(
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
    kv_cache_dtype: str = "auto",
    kv_scale: torch.Tensor | float | None = None,
    context_lens_cpu: torch.Tensor | None = None,
    query_start_loc_cpu: torch.Tensor | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""MLA prefill ("MHA" form) of new tokens over themselves (causal) and their cached context.

    Request ``b`` has new tokens at rows ``query_start_loc[b]:query_start_loc[b+1]`` and
    ``context_lens[b]`` earlier tokens at positions ``[0, context_lens[b])`` of the paged cache
    (``block_table[b]``). New token ``t`` attends to the whole context and to new tokens ``<= t``:
    bottom-right causal attention over ``context + new`` keys. The context is processed in chunks of at
    most ``chunk_size`` tokens over all requests (see the module docstring); the result does not depend
    on ``chunk_size`` beyond rounding.

    Args:
        q (torch.Tensor): `[T, h, d_nope + d_rope]` (192 = 128 + 64), bf16/fp16 (fp32 for tests);
            ``q_pe`` RoPE'd, last.
        k_nope (torch.Tensor): `[T, h, d_nope]`, q.dtype; the new tokens' up-projected key part.
        k_pe (torch.Tensor): `[T, d_rope]` or `[T, 1, d_rope]`, q.dtype; the new tokens' RoPE'd key,
            shared by all heads.
        v (torch.Tensor): `[T, h, d_v]` (128), q.dtype; the new tokens' values.
        kv_cache (torch.Tensor): `[num_blocks, block_size, d_c + d_rope]` (576 = 512 + 64) rows
            ``kv_c | k_pe`` in a layout of ``kv_cache_dtype`` (see ``openmla.ops.cache``: bf16/fp16 for
            "auto", float8_e4m3fn for "fp8", uint8 `[.., 656]` for "fp8_ds_mla").
        block_table (torch.Tensor): `[B, max_blocks]`, int32/int64.
        context_lens (torch.Tensor): `[B]`, int32/int64; cached tokens before the new ones (0 allowed).
        query_start_loc (torch.Tensor): `[B + 1]`, int32/int64; new-token rows per request.
        kv_b_proj_weight (torch.Tensor): `[h * (d_nope + d_v), d_c]`, q.dtype; ``kv_b_proj.weight`` in HF
            layout (per head: d_nope key rows, then d_v value rows), dequantised.
        sm_scale (float): softmax scale (required; SPEC §0, e.g. ``192**-0.5 * mscale**2``).
        chunk_size (int): context tokens gathered per chunk, over all requests; bounds the workspace at
            ``chunk_size * (d_c + d_rope + h * (2 * d_nope + d_rope + d_v))`` elements of q.dtype, plus
            per-chunk query-row buffers and an fp32 copy `[rows, h, d_v]` of the output rows that see
            context (their running output).
        kv_cache_dtype (str): "auto", "fp8" or "fp8_ds_mla".
        kv_scale (torch.Tensor | float | None): per-tensor fp32 dequantisation scale of an "fp8" cache.
        context_lens_cpu (torch.Tensor | None): CPU copy of ``context_lens`` (saves a device sync).
        query_start_loc_cpu (torch.Tensor | None): CPU copy of ``query_start_loc`` (saves a device sync).
        return_lse (bool): also return the LSE.
        out (torch.Tensor | None): `[T, h, d_v]` q.dtype buffer to write into.

    Returns:
        out: `[T, h, d_v]`, q.dtype.
        lse: `[T, h]`, fp32, natural-log LSE of ``sm_scale * q . k`` over all attended keys; or None.

    Raises:
        TypeError, ValueError: on wrong dtypes, shapes, devices or arguments (the message names them).
    """
    T, H, _, _, d_v, _, B = _check_prefill_with_context_args(
        q, k_nope, k_pe, v, kv_cache, block_table, context_lens, query_start_loc, kv_b_proj_weight, chunk_size,
        kv_cache_dtype,
    )  # fmt: skip
    dev, dtype = q.device, q.dtype
    if out is not None:
        check_tensor("out", out, dtypes=(dtype,), shape=(T, H, d_v), device=dev)
        check_no_overlap("out", out)
    if kv_cache_dtype == "fp8":  # positive and finite (read once here; the chunks' gathers then trust it)
        kv_scale = scalar_scale("kv_scale", kv_scale, dev)
    for name, t, n in (("context_lens_cpu", context_lens_cpu, B), ("query_start_loc_cpu", query_start_loc_cpu, B + 1)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.shape != (n,)):
            raise ValueError(f"{name} must be a CPU tensor of shape [{n}]; got {t!r:.80}")

    if context_lens_cpu is None or query_start_loc_cpu is None:  # one device-to-host copy for both
        both = torch.cat([context_lens.to(torch.int64), query_start_loc.to(torch.int64)]).cpu()
        context_lens_cpu = both[:B] if context_lens_cpu is None else context_lens_cpu
        query_start_loc_cpu = both[B:] if query_start_loc_cpu is None else query_start_loc_cpu
    qsl = query_start_loc_cpu.to(torch.int64)
    if B and (int(qsl[0]) != 0 or bool((qsl[1:] < qsl[:-1]).any())):
        raise ValueError(f"query_start_loc must start at 0 and not decrease; got {qsl.tolist()}")
    if (int(qsl[-1]) if B else 0) != T:  # every row of q belongs to a request (else out rows stay unwritten)
        raise ValueError(f"query_start_loc[-1] ({int(qsl[-1]) if B else 0}) must equal q.shape[0] ({T})")
    if B and int(context_lens_cpu.min()) < 0:
        raise ValueError(f"context_lens must be non-negative; got {context_lens_cpu.tolist()}")
    max_q = int((qsl[1:] - qsl[:-1]).max()) if B else 0

    if B and int(context_lens_cpu.max()) > 0 and not capturing():  # every chunk's blocks, checked once
        check_block_table(block_table, context_lens, None, kv_cache.shape[1], kv_cache.shape[0])
    chunks = _to_device(_plan_context_chunks(context_lens_cpu, qsl, chunk_size), dev)
    return _mla_prefill_with_context_fwd(
        q, k_nope, k_pe, v, kv_cache, block_table, chunks, query_start_loc, max_q, kv_b_proj_weight, sm_scale,
        chunk_size, kv_cache_dtype, kv_scale, return_lse, out,
    )  # fmt: skip
