"""How decode context parallelism (DCP) shards a sequence's KV cache over ranks (SPEC §5.1-5.2).

With ``W`` ranks and an interleave ``I >= 1``, the token at global position ``g`` lives on rank
``(g // I) % W``: runs of ``I`` consecutive tokens are dealt to the ranks in turn. On its owner the token
sits at local position ``l = (g // (I * W)) * I + g % I``; conversely local position ``l`` on rank ``r`` is
global ``g = ((l // I) * W + r) * I + l % I``. Owned positions increase with the local position, so the
keys a rank holds of any global prefix ``[0, n)`` are a local prefix, of length ``dcp_local_seq_lens(n)``.
"""

from __future__ import annotations

import numbers

import torch

from openmla.ops._validate import check_index, describe

__all__ = [
    "dcp_local_seq_lens",
    "dcp_local_verify_row_lens",
    "dcp_owner",
    "dcp_local_position",
    "dcp_global_position",
    "dcp_slot_mapping",
    "check_dcp_args",
]


def _positive_int(name: str, v) -> int:
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive int; got {v!r}")
    return int(v)


def check_dcp_args(world_size, rank, interleave) -> tuple[int, int | None, int]:
    """Validate ``(world_size, rank, interleave)``: W >= 1, ``0 <= rank < W`` (or None), I >= 1."""
    W = _positive_int("world_size", world_size)
    I = _positive_int("interleave", interleave)
    if rank is not None:
        if not isinstance(rank, numbers.Integral) or isinstance(rank, bool) or not 0 <= rank < W:
            raise ValueError(f"rank must be an int in [0, {W}); got {rank!r}")
        rank = int(rank)
    return W, rank, I


def _local(n: int, W: int, r: int, I: int) -> int:
    """Host form of :func:`_local_count`: tokens of the global prefix ``[0, n)`` owned by rank ``r``."""
    base = n // (I * W) * I
    return base + min(max(n - base * W - r * I, 0), I)


def _local_count(n: torch.Tensor, W: int, r, I: int) -> torch.Tensor:
    """Tokens of the global prefix ``[0, n)`` owned by rank ``r`` (``r`` an int or a broadcastable tensor)."""
    base = torch.div(n, I * W, rounding_mode="floor") * I
    rem = n - base * W
    return base + (rem - r * I).clamp(0, I)


def dcp_local_seq_lens(
    seq_lens: torch.Tensor, world_size: int, rank: int | None = None, interleave: int = 1, *, validate: bool = True
) -> torch.Tensor:
    r"""Local KV lengths of each rank under DCP sharding (vLLM's ``get_dcp_local_seq_lens``).

    Args:
        seq_lens (torch.Tensor): `[...]`, int32/int64; global lengths (tokens ``[0, S)`` per entry).
        world_size (int): DCP ranks ``W`` >= 1.
        rank (int | None): the rank; None returns every rank's length.
        interleave (int): ``I`` >= 1, consecutive tokens per rank before moving to the next.
        validate (bool): check that ``seq_lens`` is non-negative (a host sync).

    Returns:
        torch.Tensor: int32, `seq_lens.shape` (or `[..., W]` for ``rank=None``), on seq_lens' device:
        ``base + clamp(S - base * W - r * I, 0, I)`` with ``base = (S // (I * W)) * I``.

    Raises:
        TypeError, ValueError: a non-integer tensor, negative lengths, bad ``world_size``/``rank``/``interleave``.
    """
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.is_floating_point() or seq_lens.dtype == torch.bool:
        raise TypeError(f"seq_lens must be an int32/int64 tensor; got {seq_lens!r:.80}")
    W, rank, I = check_dcp_args(world_size, rank, interleave)
    s = seq_lens.to(torch.int64)
    if validate and s.numel() and int(s.min()) < 0:
        raise ValueError(f"seq_lens must be non-negative; got {describe(seq_lens)} with min {int(s.min())}")
    if rank is None:
        r = torch.arange(W, device=s.device)
        return _local_count(s[..., None], W, r, I).to(torch.int32)
    return _local_count(s, W, rank, I).to(torch.int32)


def dcp_local_verify_row_lens(
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    world_size: int,
    rank: int,
    interleave: int = 1,
    *,
    num_tokens: int | None = None,
) -> torch.Tensor:
    r"""Per-row local lengths of a causal verify block under DCP (SPEC §5.2).

    Row ``t`` of request ``b`` (query length ``q_b``, global length ``S_b``) sees global positions
    ``[0, S_b - q_b + t]``; its local length is the sharded count of that prefix. The bound is taken in
    global coordinates before sharding (sharding ``S_b`` and then subtracting is wrong for ``W > 1``).

    Args:
        seq_lens (torch.Tensor): `[B]`, int32/int64; global lengths (context + new tokens).
        query_start_loc (torch.Tensor): `[B + 1]`, int32/int64; any query lengths (ragged allowed).
        world_size (int), rank (int), interleave (int): the sharding (see :func:`dcp_local_seq_lens`).
        num_tokens (int | None): ``query_start_loc[-1]`` when known (avoids a host sync).

    Returns:
        torch.Tensor: `[num_tokens]`, int32; row-major (request, then row) like the query rows.
    """
    W, rank, I = check_dcp_args(world_size, rank, interleave)
    check_index("seq_lens", seq_lens, ndim=1, kernel=False)
    B = seq_lens.shape[0]
    check_index("query_start_loc", query_start_loc, ndim=1, device=seq_lens.device, length=B + 1, kernel=False)
    qsl = query_start_loc.to(torch.int64)
    T = int(qsl[-1]) if num_tokens is None else int(num_tokens)
    rows = torch.arange(T, device=qsl.device)
    req = torch.searchsorted(qsl[1:], rows, right=True).clamp(max=max(B - 1, 0))
    if B == 0:
        return torch.zeros(0, dtype=torch.int32, device=qsl.device)
    q_end = qsl[1:][req]
    visible = seq_lens.to(torch.int64)[req] - (q_end - rows) + 1  # S - q + t + 1 with t = row - q_start
    return _local_count(visible.clamp(min=0), W, rank, I).to(torch.int32)


def dcp_owner(positions: torch.Tensor, world_size: int, interleave: int = 1) -> torch.Tensor:
    """The rank that stores each global position: ``(g // I) % W`` (same dtype and shape)."""
    W, _, I = check_dcp_args(world_size, None, interleave)
    return torch.div(positions, I, rounding_mode="floor") % W


def dcp_local_position(positions: torch.Tensor, world_size: int, interleave: int = 1) -> torch.Tensor:
    """Each global position's local position on its owner: ``(g // (I * W)) * I + g % I``."""
    W, _, I = check_dcp_args(world_size, None, interleave)
    return torch.div(positions, I * W, rounding_mode="floor") * I + positions % I


def dcp_global_position(local_positions: torch.Tensor, world_size: int, rank: int, interleave: int = 1):
    """The global position of local position ``l`` on ``rank``: ``((l // I) * W + rank) * I + l % I``."""
    W, rank, I = check_dcp_args(world_size, rank, interleave)
    return (torch.div(local_positions, I, rounding_mode="floor") * W + rank) * I + local_positions % I


def dcp_slot_mapping(
    positions: torch.Tensor,
    req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    world_size: int,
    rank: int,
    interleave: int = 1,
    *,
    validate: bool = True,
) -> torch.Tensor:
    r"""Cache slots of new tokens on one rank: the owner's local slot, -1 where ``rank`` does not own the token.

    Args:
        positions (torch.Tensor): `[T]`, int32/int64; each token's global position (-1 or less: padding).
        req_indices (torch.Tensor): `[T]`, int32/int64; each token's row of ``block_table``.
        block_table (torch.Tensor): `[B, max_blocks]`, int32/int64; this rank's local block table.
        block_size (int): tokens per cache block.
        world_size (int), rank (int), interleave (int): the sharding.
        validate (bool): check that every owned token's local block lies inside ``block_table``
            and is non-negative (a host sync).

    Returns:
        torch.Tensor: `[T]`, int64; ``block_table[b, l // bs] * bs + l % bs`` for owned tokens (``l`` the
        local position), -1 elsewhere.

    Raises:
        ValueError: mismatched shapes, or (``validate``) an owned token outside its block table.
    """
    W, rank, I = check_dcp_args(world_size, rank, interleave)
    bs = _positive_int("block_size", block_size)
    check_index("positions", positions, ndim=1, kernel=False)
    dev = positions.device
    T = positions.shape[0]
    check_index("req_indices", req_indices, ndim=1, device=dev, length=T, kernel=False)
    check_index("block_table", block_table, ndim=2, device=dev, kernel=False)
    g = positions.to(torch.int64)
    owned = (g >= 0) & (dcp_owner(g.clamp(min=0), W, I) == rank)
    loc = dcp_local_position(g.clamp(min=0), W, I)
    col = torch.div(loc, bs, rounding_mode="floor")
    req = req_indices.to(torch.int64)
    B, nb = block_table.shape
    if validate and T:
        bad = owned & ((req < 0) | (req >= B) | (col >= nb))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"token {i} (position {int(g[i])}, request row {int(req[i])}) needs local block {int(col[i])} "
                f"but block_table is {tuple(block_table.shape)}"
            )
    safe = owned & (req >= 0) & (req < B) & (col < nb)
    blk = block_table[req.clamp(0, max(B - 1, 0)), col.clamp(0, max(nb - 1, 0))].to(torch.int64) if B and nb else g
    if validate and T and bool((safe & (blk < 0)).any()):
        raise ValueError("block_table holds a negative block for an owned token")
    return torch.where(safe, blk * bs + loc % bs, torch.full_like(g, -1))
