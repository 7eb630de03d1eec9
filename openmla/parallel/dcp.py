"""DCP decode: paged MLA decode with the KV cache sharded over the ranks of a ``torch.distributed`` group.

Per call (SPEC §3.2, §5.5): the ranks all-gather their query heads (``[T, H, 576] -> [T, W*H, 576]``),
each rank attends every gathered head over its own shard with LSE (the route of
:func:`~openmla.parallel.verify.select_dcp_decode_route` gives causal verify rows their global window),
and the partials are merged exactly by LSE and scattered back by heads. The result equals single-rank
:func:`openmla.mla_decode` over the whole sequence (up to rounding); a rank that owns no key of a row
contributes nothing.
"""

from __future__ import annotations

import torch

from openmla.ops._validate import FLOAT16_DTYPES, capturing, check_index, check_tensor, describe
from openmla.ops.decode import mla_decode
from openmla.ops.plan import plan_decode
from openmla.parallel.comm import MERGES, _all_gather, all_gather_heads, group_info, merge_heads, merge_replicated
from openmla.parallel.sharding import _local, check_dcp_args, dcp_local_seq_lens, dcp_local_verify_row_lens
from openmla.parallel.verify import dcp_masked_decode, select_dcp_decode_route

__all__ = ["dcp_mla_decode", "dcp_local_decode"]


def dcp_local_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    sm_scale: float,
    *,
    world_size: int,
    rank: int,
    interleave: int = 1,
    causal: bool = True,
    kv_cache_dtype: str = "auto",
    kv_scale=None,
    route: str | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    d_v: int = 512,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, str]:
    r"""One rank's partial decode over its shard through a DCP route (no communication).

    Arguments as in :func:`dcp_mla_decode`, with the sharding given explicitly (``world_size``, ``rank``)
    and ``q`` holding every head this rank attends.

    Returns:
        (out `[T, h, d_v]` q.dtype, lse `[T, h]` fp32 natural log over this rank's visible keys, route).
    """
    W, rank, I = check_dcp_args(world_size, rank, interleave)
    T = q.shape[0]
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if query_start_loc.numel() > 1 else 0
    route = select_dcp_decode_route(causal, max_query_len, route)
    sync_ok = validate and not capturing()
    kw = dict(kv_cache_dtype=kv_cache_dtype, kv_scale=kv_scale, d_v=d_v)
    # a global length bound gives the local decode's plan without a host sync (so the call can be captured)
    local_max = None if max_seq_len is None else _local(max_seq_len, W, rank, I)

    def plan(lens, qsl, qlen):
        if local_max is None:
            return None
        return plan_decode(lens, qsl, q.shape[1], max_query_len=qlen, max_seq_len=local_max, d_v=d_v,
                           kv_cache_dtype=kv_cache_dtype, validate=sync_ok)  # fmt: skip

    if route == "masked":
        out, lse = dcp_masked_decode(
            q, kv_cache, block_table, seq_lens, query_start_loc, sm_scale, world_size=W, rank=rank, interleave=I,
            causal=causal, max_query_len=max_query_len, validate=validate, **kw,
        )  # fmt: skip
    elif route == "segmented":
        # one qlen-1 request per verify row, sharing its request's block table; the row's local length
        # carries the causal window (every local key when not causal)
        rows = torch.arange(T, device=q.device)
        req = torch.searchsorted(query_start_loc[1:].to(torch.int64), rows, right=True)
        req = req.clamp(max=max(block_table.shape[0] - 1, 0))
        if causal:
            row_lens = dcp_local_verify_row_lens(seq_lens, query_start_loc, W, rank, I, num_tokens=T)
        else:
            row_lens = dcp_local_seq_lens(seq_lens, W, rank, I, validate=sync_ok)[req]
        qsl_rows = torch.arange(T + 1, dtype=torch.int32, device=q.device)
        out, lse = mla_decode(q, kv_cache, block_table[req], row_lens, qsl_rows, sm_scale, causal=False,
                              plan=plan(row_lens, qsl_rows, 1), validate=sync_ok, **kw)  # fmt: skip
    else:
        local = dcp_local_seq_lens(seq_lens, W, rank, I, validate=sync_ok)
        # qlen 1 sees all its keys whether causal or not; a non-causal block sees every local key
        out, lse = mla_decode(q, kv_cache, block_table, local, query_start_loc, sm_scale, causal=False,
                              plan=plan(local, query_start_loc, max_query_len), validate=sync_ok, **kw)  # fmt: skip
    return out, lse, route


def dcp_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    sm_scale: float,
    *,
    group=None,
    interleave: int = 1,
    causal: bool = True,
    kv_cache_dtype: str = "auto",
    kv_scale: torch.Tensor | float | None = None,
    return_lse: bool = False,
    route: str | None = None,
    merge: str = "auto",
    gather_heads: bool = True,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    d_v: int = 512,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Paged MLA decode / verify under decode context parallelism (every rank of ``group`` calls it).

    Args:
        q (torch.Tensor): `[T, H, d_qk]` (576 = 512 latent + 64 rope), bf16/fp16 (fp32 for tests); this
            rank's ``H`` heads (every rank the same ``T`` and ``H``); request b owns rows
            ``query_start_loc[b]:query_start_loc[b+1]``.
        kv_cache (torch.Tensor): `[num_blocks, page_size, d_qk]`, q's dtype ("auto") or float8_e4m3fn ("fp8");
            this rank's shard: global position ``g`` of a request sits on rank ``(g // I) % W`` at local
            position ``(g // (I * W)) * I + g % I`` (``openmla.parallel.sharding``).
        block_table (torch.Tensor): `[B, max_blocks]`, int32; this rank's local blocks per request.
        seq_lens (torch.Tensor): `[B]`, int32; **global** lengths (context + new tokens); 0 gives out 0.
        query_start_loc (torch.Tensor): `[B + 1]`, int32; query lengths 1 (decode) to 16 (verify).
        sm_scale (float): softmax scale (model specific).
        group: the DCP process group (None: the default group), any world size ``W`` >= 1.
        interleave (int): ``I`` >= 1, tokens per rank before the next rank (``cp_kv_cache_interleave_size``).
        causal (bool): row ``t`` of a request sees global positions ``[0, S - qlen + t]``; else all ``S``.
        kv_cache_dtype (str), kv_scale: "auto", or "fp8" with its per-tensor scale (value = stored * scale).
        return_lse (bool): also return the merged LSE.
        route (str | None): "auto", "plain", "segmented" or "masked" (see ``openmla.parallel.verify``).
        merge (str): "auto", "reduce_scatter" or "all_to_all" (see ``openmla.parallel.comm``).
        gather_heads (bool): True (default): ``q`` holds this rank's heads, gathered over the group and
            scattered back. False: every rank passes the *same* heads (a model without tensor
            parallelism), no gather, and the merge is an all-reduce that gives every rank all of them.
        max_query_len (int | None): the batch's longest query, when known on the host (saves a sync).
        max_seq_len (int | None): an upper bound of ``seq_lens`` (global), when known on the host: the local
            decode is then planned without a host sync, so that a call with ``max_query_len``, this and
            ``validate=False`` can be captured in a CUDA graph.
        d_v (int): latent width (512).
        validate (bool): host-synchronising checks, including that every rank passes the same ``T``,
            ``H`` and batch size (one small all-gather); pass False on the hot path.

    Returns:
        out: `[T, H, d_v]`, q.dtype; this rank's heads attended over every rank's keys.
        lse: `[T, H]`, fp32, natural-log LSE over all keys (-inf where no key), or None.

    Raises:
        TypeError, ValueError: bad arguments (named in the message), or ranks that disagree on shapes.
        RuntimeError: torch.distributed is not initialised.
    """
    W, rank, backend = group_info(group)
    check_dcp_args(W, rank, interleave)
    if merge not in MERGES:  # checked before any collective, so every rank fails at the same point
        raise ValueError(f"merge must be one of {MERGES}; got {merge!r}")
    check_tensor("q", q, dtypes=FLOAT16_DTYPES + (torch.float32,), ndim=3)
    T, H, d_qk = q.shape
    check_index("block_table", block_table, ndim=2, device=q.device)
    B = block_table.shape[0]
    check_index("seq_lens", seq_lens, ndim=1, device=q.device, length=B)
    check_index("query_start_loc", query_start_loc, ndim=1, device=q.device, length=B + 1)
    if validate and not capturing():
        mine = torch.tensor([T, H, d_qk, B, interleave, int(causal), int(gather_heads)], dtype=torch.int64)
        comm_dev = q.device if "nccl" in backend else torch.device("cpu")
        everyone = torch.empty(W * mine.numel(), dtype=torch.int64, device=comm_dev)
        _all_gather(everyone, mine.to(comm_dev), group=group)
        everyone = everyone.view(W, -1).cpu()
        if not bool((everyone == everyone[0]).all()):
            raise ValueError(
                "every DCP rank must pass the same [T, H, d_qk], batch size, interleave, causal and gather_heads; "
                f"got (T, H, d_qk, B, I, causal, gather_heads) per rank {everyone.tolist()} (q {describe(q)})"
            )
        if B:
            qsl = query_start_loc.cpu()
            if int(qsl[0]) != 0 or int(qsl[-1]) != T or bool((qsl[1:] < qsl[:-1]).any()):
                raise ValueError(f"query_start_loc must rise from 0 to q.shape[0] ({T}); got {qsl.tolist()}")
    q_all = all_gather_heads(q, group) if gather_heads else q
    out, lse, _ = dcp_local_decode(
        q_all, kv_cache, block_table, seq_lens, query_start_loc, sm_scale, world_size=W, rank=rank,
        interleave=interleave, causal=causal, kv_cache_dtype=kv_cache_dtype, kv_scale=kv_scale, route=route,
        max_query_len=max_query_len, max_seq_len=max_seq_len, d_v=d_v, validate=validate,
    )  # fmt: skip
    if gather_heads:
        out, lse = merge_heads(out, lse, group, merge=merge)
    else:
        out, lse = merge_replicated(out, lse, group)
    return out, (lse if return_lse else None)
