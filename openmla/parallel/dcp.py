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
from openmla.ops.cache import check_block_table
from openmla.ops.decode import _host_scale, mla_decode
from openmla.ops.plan import plan_decode
from openmla.parallel.comm import (
    FALLBACKS,
    MERGES,
    _all_gather,
    all_gather_heads,
    group_info,
    merge_heads,
    merge_replicated,
)
from openmla.parallel.sharding import _local, check_dcp_args, dcp_local_seq_lens, dcp_local_verify_row_lens
from openmla.parallel.verify import (
    _check_query_rows,
    check_decode_batch,
    dcp_masked_decode,
    select_dcp_decode_route,
)

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
    sync_ok = validate and not capturing()
    if sync_ok:  # rows of no request, or a max_query_len below a request's rows (the route would drop its window)
        top = _check_query_rows(T, block_table.shape[0], query_start_loc, max_query_len)
        max_query_len = top if max_query_len is None else max_query_len
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if query_start_loc.numel() > 1 else 0
    route = select_dcp_decode_route(causal, max_query_len, route)
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


_DTYPE_CODES = FLOAT16_DTYPES + (torch.float32,)  # q's dtypes, by index in the ranks' shared check


def _check_local_inputs(q, kv_cache, block_table, seq_lens, query_start_loc, sm_scale, *, world_size, rank,
                        interleave, causal, kv_cache_dtype, kv_scale, route, max_query_len, max_seq_len,
                        d_v):  # fmt: skip
    """Every check of one rank's :func:`dcp_mla_decode` inputs that needs no communication (host syncs).

    Run before the first collective so that a rank's bad input fails every rank at the same point (see
    :func:`dcp_mla_decode`). Returns the batch's longest query (``max_query_len`` when given).
    """
    if not isinstance(d_v, int) or isinstance(d_v, bool) or d_v < 1:
        raise ValueError(f"d_v must be a positive int; got {d_v!r}")
    T, _, _, B = check_decode_batch(q, kv_cache, block_table, seq_lens, query_start_loc, sm_scale, kv_cache_dtype,
                                    d_v)  # fmt: skip
    if kv_cache_dtype == "fp8":
        _host_scale("kv_scale", kv_scale, q.device)
    top = _check_query_rows(T, B, query_start_loc, max_query_len)
    max_query_len = top if max_query_len is None else max_query_len
    picked = select_dcp_decode_route(causal, max_query_len, route)
    if picked == "masked" and top > 16:
        raise ValueError(f"query lengths must be at most 16 for route 'masked'; got {top}")
    local = dcp_local_seq_lens(seq_lens, world_size, rank, interleave)  # checks seq_lens >= 0
    if B:
        top_s = int(seq_lens.max())
        if max_seq_len is not None and top_s > max_seq_len:
            raise ValueError(f"seq_lens reaches {top_s} but max_seq_len is {max_seq_len}")
        # this rank's keys of every request are covered by its block table, through blocks the cache has
        check_block_table(block_table, local, None, kv_cache.shape[1], kv_cache.shape[0])
    return max_query_len


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
        validate (bool): host-synchronising checks, all before the first collective: this rank's inputs (dtypes,
            shapes, ``query_start_loc`` rising from 0 to ``T``, the ``max_query_len`` / ``max_seq_len`` hints, its
            local lengths covered by ``block_table`` through blocks the cache has), then one small all-gather of
            each rank's verdict, shapes, arguments and a fingerprint of ``seq_lens`` / ``query_start_loc``, so
            that every rank raises (a ValueError) when any rank's input is bad or the ranks disagree. Pass False
            on the hot path.

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
    if validate and not capturing():
        # this rank's own checks first, their verdict shared with the shapes: a rank's bad input fails every
        # rank here (each with a ValueError) instead of leaving the others in a collective it never joins
        err = None
        try:
            max_query_len = _check_local_inputs(
                q, kv_cache, block_table, seq_lens, query_start_loc, sm_scale, world_size=W, rank=rank,
                interleave=interleave, causal=causal, kv_cache_dtype=kv_cache_dtype, kv_scale=kv_scale, route=route,
                max_query_len=max_query_len, max_seq_len=max_seq_len, d_v=d_v,
            )  # fmt: skip
        except (TypeError, ValueError) as e:
            err = e
        row_len = 14  # verdict, T, H, d_qk, B, I, causal, gather_heads, merge, dtype, d_v, 3 length fingerprints
        try:  # every rank must send a row of row_len values, whatever its inputs (else the others hang)
            if err is not None:
                raise err
            B = block_table.shape[0]
            idx = torch.arange(1, B + 2, dtype=torch.int64)
            s, qsl = seq_lens.to(torch.int64).cpu(), query_start_loc.to(torch.int64).cpu()
            # a fingerprint of seq_lens and query_start_loc (exact for any single differing entry)
            lens = [int(s.sum()), int((s * idx[:-1]).sum()), int((qsl * idx).sum())]
            # the merge each rank will run ("auto" resolved): ranks running different collectives would crash or hang
            ran = FALLBACKS.get(backend, "reduce_scatter") if merge == "auto" else merge
            merge_code = MERGES.index(ran) if gather_heads else -1
            mine = [0, *q.shape, B, interleave, int(bool(causal)), int(bool(gather_heads)), merge_code,
                    _DTYPE_CODES.index(q.dtype), d_v, *lens]  # fmt: skip
        except (TypeError, ValueError) as e:
            err = err or e
            mine = [1] + [-1] * (row_len - 1)
        mine = torch.tensor(mine, dtype=torch.int64)
        comm_dev = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        everyone = torch.empty(W * mine.numel(), dtype=torch.int64, device=comm_dev)
        _all_gather(everyone, mine.to(comm_dev), group=group)
        everyone = everyone.view(W, -1).cpu()
        if err is not None:
            raise err
        failed = everyone[:, 0].nonzero().flatten().tolist()
        if failed:
            raise ValueError(
                f"DCP rank(s) {failed} of {W} rejected their inputs (see their errors); rank {rank} stops too"
            )
        if not bool((everyone[:, :-3] == everyone[0, :-3]).all()):
            raise ValueError(
                "every DCP rank must pass the same [T, H, d_qk], batch size, interleave, causal, gather_heads, "
                "merge, q dtype and d_v; got (T, H, d_qk, B, I, causal, gather_heads, merge, dtype, d_v) per rank "
                f"{everyone[:, 1:-3].tolist()} (q {describe(q)})"
            )
        if not bool((everyone[:, -3:] == everyone[0, -3:]).all()):
            raise ValueError(
                "every DCP rank must pass the same global seq_lens and query_start_loc (the global lengths, not a "
                f"rank's local ones); rank {rank} has seq_lens {seq_lens[:8].tolist()}{'...' if B > 8 else ''}, "
                "and the ranks' fingerprints (seq_lens sum, weighted sum, query_start_loc weighted sum) differ: "
                f"{everyone[:, -3:].tolist()}"
            )
    else:
        check_tensor("q", q, dtypes=_DTYPE_CODES, ndim=3)
        check_index("block_table", block_table, ndim=2, device=q.device)
        B = block_table.shape[0]
        check_index("seq_lens", seq_lens, ndim=1, device=q.device, length=B)
        check_index("query_start_loc", query_start_loc, ndim=1, device=q.device, length=B + 1)
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
