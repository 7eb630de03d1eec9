"""The DCP collectives on plain ``torch.distributed``: the head all-gather and the exact cross-rank LSE merge.

Layouts (SPEC §5.5): rank ``r`` brings ``H`` query heads; the all-gather stacks them rank-major, so gathered
head ``w * H + h`` is rank ``w``'s head ``h``. After the local attention every rank holds a partial
``(out, lse)`` over its own keys for all ``W * H`` heads, and the merge hands rank ``r`` its heads
``[r * H, (r + 1) * H)`` attended over every rank's keys:

* ``"reduce_scatter"`` (vLLM's ``cp_lse_ag_out_rs``): all-gather the LSEs ``[W, T, W*H]``, scale the local
  output by ``exp(lse_r - lse*)`` (0 for a rank that saw no key), then reduce-scatter (sum) by heads in the
  output's dtype;
* ``"all_to_all"`` (``dcp_a2a_lse_reduce``): send every rank its heads' partial output and LSE
  (``all_to_all_single``) and merge the ``W`` partials locally in fp32 with ``merge_attn_states``.

Backends: NCCL and gloo (torch >= 2.6) run every collective used here. Where a backend lacks
``reduce_scatter_tensor`` (older gloo), "reduce_scatter" falls back to "all_to_all" (the same output bytes),
once per backend, and says so in :data:`FALLBACKS`. ``all_gather_single`` / ``reduce_scatter_single`` are used
where torch has them (the ``*_tensor`` names are deprecated there), else the ``*_tensor`` ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from openmla.ops.merge import merge_attn_states

__all__ = ["group_info", "all_gather_heads", "merge_heads", "merge_replicated", "MERGES", "FALLBACKS"]

MERGES = ("auto", "reduce_scatter", "all_to_all")
#: backend name -> the merge it fell back to (filled when a backend refused a collective)
FALLBACKS: dict[str, str] = {}
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_info(group) -> tuple[int, int, str]:
    """``(world_size, rank, backend)`` of ``group`` (None: the default group).

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("DCP needs torch.distributed initialised (dist.init_process_group with gloo or nccl)")
    return dist.get_world_size(group), dist.get_rank(group), str(dist.get_backend(group))


def all_gather_heads(q: torch.Tensor, group=None) -> torch.Tensor:
    """`[T, H, D]` on every rank -> `[T, W * H, D]`, rank-major heads (gathered head ``w * H + h``)."""
    W = dist.get_world_size(group)
    T, H, D = q.shape
    buf = torch.empty(W * T, H, D, dtype=q.dtype, device=q.device)
    _all_gather(buf, q.contiguous(), group=group)
    return buf.view(W, T, H, D).transpose(0, 1).reshape(T, W * H, D)


def _clean_lse(lse: torch.Tensor) -> torch.Tensor:
    """NaN and +inf count as an empty part (-inf), as in every openmla merge."""
    return torch.where(torch.isnan(lse) | torch.isposinf(lse), float("-inf"), lse)


def _global_lse(lses: torch.Tensor) -> torch.Tensor:
    """`[W, ...]` natural-log LSEs -> the LSE of their union (-inf where every part is empty)."""
    M = lses.amax(0)
    Ms = torch.where(torch.isneginf(M), 0.0, M)
    den = torch.exp(lses - Ms).sum(0)
    return torch.where(den > 0, Ms + torch.log(torch.where(den > 0, den, 1.0)), float("-inf"))


def _corrected(out: torch.Tensor, lse: torch.Tensor, lse_all: torch.Tensor) -> torch.Tensor:
    """``out * exp(lse - lse_all)`` with rows of weight 0 set to 0 (their ``out`` is never read)."""
    f = torch.exp(lse - torch.where(torch.isneginf(lse_all), 0.0, lse_all))
    f = torch.where(torch.isneginf(lse) | torch.isneginf(lse_all), 0.0, f)
    return torch.where(f[..., None] > 0, out.float() * f[..., None], 0.0).to(out.dtype)


def _merge_reduce_scatter(out, lse, group, W, rank):
    T, HW, D = out.shape
    H = HW // W
    lses = torch.empty(W * T, HW, dtype=torch.float32, device=lse.device)
    _all_gather(lses, lse.contiguous(), group=group)
    lses = _clean_lse(lses.view(W, T, HW))
    lse_all = _global_lse(lses)  # [T, W*H]
    send = _corrected(out, lses[rank], lse_all).view(T, W, H, D).transpose(0, 1).reshape(W * T, H, D)
    recv = torch.empty(T, H, D, dtype=out.dtype, device=out.device)
    _reduce_scatter(recv, send, group=group)
    return recv, lse_all[:, rank * H : (rank + 1) * H].contiguous()


def _merge_all_to_all(out, lse, group, W, rank):
    T, HW, D = out.shape
    H = HW // W
    send_o = out.view(T, W, H, D).transpose(0, 1).contiguous()  # [W (destination), T, H, D]
    send_l = lse.view(T, W, H).transpose(0, 1).contiguous()
    recv_o = torch.empty_like(send_o)  # [W (source), T, H, D]
    recv_l = torch.empty_like(send_l)
    dist.all_to_all_single(recv_o, send_o, group=group)
    dist.all_to_all_single(recv_l, send_l, group=group)
    acc = recv_o[0].float()
    acc_l = recv_l[0].clone()
    for w in range(1, W):  # exact pairwise folds in fp32; a part with weight 0 is not read
        merge_attn_states(acc, acc_l, recv_o[w], recv_l[w], out=acc, out_lse=acc_l)
    acc = torch.where(torch.isneginf(acc_l)[..., None], 0.0, acc)  # a row no rank saw: 0 (not the part's bytes)
    return acc.to(out.dtype), acc_l


def merge_heads(out: torch.Tensor, lse: torch.Tensor, group=None, *, merge: str = "auto"):
    r"""Merge per-rank partials over gathered heads and scatter them back by heads (SPEC §5.5).

    Args:
        out (torch.Tensor): `[T, W * H, D]`; this rank's normalised partial over its own keys.
        lse (torch.Tensor): `[T, W * H]`, fp32 natural log; -inf (or NaN, +inf) where the rank saw no key.
        group: the DCP process group (None: the default group).
        merge (str): "auto" (= "reduce_scatter"), "reduce_scatter" or "all_to_all" (see the module docstring).

    Returns:
        (out `[T, H, D]` of out's dtype, lse `[T, H]` fp32 natural log): heads ``[r * H, (r + 1) * H)``
        attended over every rank's keys (0 and -inf where no rank saw a key).
    """
    W, rank, backend = group_info(group)
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}; got {merge!r}")
    if out.shape[1] % W:
        raise ValueError(f"out has {out.shape[1]} heads, not a multiple of the group's {W} ranks")
    merge = FALLBACKS.get(backend, "reduce_scatter") if merge == "auto" else merge
    if merge == "reduce_scatter":
        try:
            return _merge_reduce_scatter(out, lse, group, W, rank)
        except (RuntimeError, NotImplementedError) as err:  # a backend without reduce_scatter (older gloo)
            if "support" not in str(err).lower() and not isinstance(err, NotImplementedError):
                raise
            FALLBACKS[backend] = "all_to_all"
    return _merge_all_to_all(out, lse, group, W, rank)


def merge_replicated(out: torch.Tensor, lse: torch.Tensor, group=None):
    r"""Merge per-rank partials of the *same* heads on every rank (vLLM's ``cp_lse_ag_out_ar``).

    Args:
        out (torch.Tensor): `[T, H, D]`; this rank's partial over its keys. lse: `[T, H]` fp32 natural log.
        group: the DCP process group.

    Returns:
        (out `[T, H, D]`, lse `[T, H]`): the same on every rank, over all ranks' keys (all-gather of the
        LSEs, then an all-reduce of the scaled outputs in the output's dtype).
    """
    W, rank, _ = group_info(group)
    T, H, D = out.shape
    lses = torch.empty(W * T, H, dtype=torch.float32, device=lse.device)
    _all_gather(lses, lse.contiguous(), group=group)
    lses = _clean_lse(lses.view(W, T, H))
    lse_all = _global_lse(lses)
    acc = _corrected(out, lses[rank], lse_all).contiguous()
    dist.all_reduce(acc, group=group)
    return acc, lse_all
