"""Hardening of decode context parallelism (openmla.parallel): bad input gets a clear error on every rank, strided
index tensors are handled, and the validation still accepts the edge cases (ranks that hold no key of a request,
seq_len 0, qlen > seq_len, empty query blocks) at W = 2 and W = 3 (not a power of two) with I = 1 and I = block size.

Single-process checks of one rank's routes (``dcp_masked_decode``, ``dcp_local_decode``), then one gloo spawn per
world size (one process per rank, as tests/test_parallel_dcp.py) for ``dcp_mla_decode`` and
``dcp_mla_prefill_with_context``.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from _dcp_harness import global_batch, run_ranks

from openmla.parallel import dcp_masked_decode, dcp_mla_decode, dcp_mla_prefill_with_context
from openmla.parallel.dcp import dcp_local_decode
from openmla.reference import mla_decode_ref
from openmla.reference.dcp import dcp_local_decode_ref, dcp_shard_cache_ref
from openmla.utils.testing import TOLERANCES, assert_close, on_gpu

BS = 4
H = 2  # heads per rank
_batch = partial(global_batch, block_size=BS)
_TOL = TOLERANCES[torch.float32]


def _shard(W, rank, I, seq=(5, 9, 13), qlens=(2, 3, 1), heads=H, seed=0):
    q, cache, bt, seq_t, qsl = _batch(list(seq), list(qlens), heads, torch.float32, seed)
    lc, lbt = dcp_shard_cache_ref(cache, bt, seq_t, BS, W, rank, I)
    return q, cache, bt, seq_t, qsl, lc, lbt


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view whose last dimension has stride 2."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


# --- one rank's routes, single process ------------------------------------------------------------------------


def test_masked_strided_index_tensors(device):
    """The masked kernel read block_table rows, seq_lens and query_start_loc as dense arrays: a strided view was
    read wrongly (NaN from keys the rank does not own). They are made dense first."""
    W, rank, I = 2, 0, 1
    q, _, _, seq_t, qsl, lc, lbt = _shard(W, rank, I)
    ref_o, ref_l = dcp_local_decode_ref(q, lc, lbt, seq_t, qsl, 0.1, world_size=W, rank=rank, interleave=I)
    kw = dict(world_size=W, rank=rank, interleave=I)
    q, lc, lbt, seq_t, qsl = (t.to(device) for t in (q, lc, lbt, seq_t, qsl))
    for name, args in (
        ("block_table", (lbt if lbt.shape[1] == 1 else _strided(lbt), seq_t, qsl)),
        ("seq_lens", (lbt, _strided(seq_t[None])[0], qsl)),
        ("query_start_loc", (lbt, seq_t, _strided(qsl[None])[0])),
    ):
        out, lse = dcp_masked_decode(q, lc, args[0], args[1], args[2], 0.1, **kw)
        assert_close(f"strided {name} out", ref_o, out, *_TOL)
        assert_close(f"strided {name} lse", ref_l, lse, *_TOL)


def test_masked_rejects_bad_scalars_and_blocks(device):
    """sm_scale, an fp8 kv_scale and block ids outside the cache were accepted (NaN/inf out, a negative or zero
    scale, keys silently dropped); now a ValueError/TypeError naming the argument."""
    W, rank = 2, 0
    q, _, _, seq_t, qsl, lc, lbt = (t.to(device) for t in _shard(W, rank, 1))
    kw = dict(world_size=W, rank=rank)
    for bad in (float("nan"), float("inf"), "0.1"):
        with pytest.raises(ValueError, match="sm_scale"):
            dcp_masked_decode(q, lc, lbt, seq_t, qsl, bad, **kw)
    q16, lc8 = q.to(torch.bfloat16), lc.nan_to_num(0.0).to(torch.float8_e4m3fn)
    for bad in (-1.0, 0.0, float("nan"), float("inf"), torch.tensor([-2.0], device=device)):
        with pytest.raises(ValueError, match="kv_scale"):
            dcp_masked_decode(q16, lc8, lbt, seq_t, qsl, 0.1, kv_cache_dtype="fp8", kv_scale=bad, **kw)
    with pytest.raises(TypeError, match="kv_scale"):
        dcp_masked_decode(q16, lc8, lbt, seq_t, qsl, 0.1, kv_cache_dtype="fp8", kv_scale=True, **kw)
    out, _ = dcp_masked_decode(q16, lc8, lbt, seq_t, qsl, 0.1, kv_cache_dtype="fp8", kv_scale=0.5, **kw)
    assert torch.isfinite(out.float()).all()
    for blk in (lc.shape[0], -3):
        bad_bt = lbt.clone()
        bad_bt[1, 0] = blk
        with pytest.raises(ValueError, match="block_table refers to block"):
            dcp_masked_decode(q, lc, bad_bt, seq_t, qsl, 0.1, **kw)


@pytest.mark.parametrize("route", ["plain", "masked", None])
def test_routes_reject_short_max_query_len_and_rows_without_request(route, device):
    """A max_query_len below a request's rows made dcp_local_decode pick the plain route for a causal verify block
    (rows saw future keys) and left the masked kernel's later rows unwritten; q rows with an empty batch (B = 0)
    came back as uninitialised memory. Both are refused now."""
    W, rank = 2, 1
    q, _, _, seq_t, qsl, lc, lbt = (t.to(device) for t in _shard(W, rank, 1))
    kw = dict(world_size=W, rank=rank)
    empty_bt, empty_s = lbt[:0], seq_t[:0]
    empty_qsl = torch.zeros(1, dtype=torch.int32, device=device)
    if route == "masked":
        with pytest.raises(ValueError, match="max_query_len"):
            dcp_masked_decode(q, lc, lbt, seq_t, qsl, 0.1, max_query_len=2, **kw)
        with pytest.raises(ValueError, match="no request"):
            dcp_masked_decode(q, lc, empty_bt, empty_s, empty_qsl, 0.1, **kw)
        out, lse = dcp_masked_decode(q[:0], lc, empty_bt, empty_s, empty_qsl, 0.1, **kw)
        assert out.shape == (0, H, 512) and lse.shape == (0, H)
        return
    opts = {"route": route} if route else {}
    with pytest.raises(ValueError, match="max_query_len"):
        dcp_local_decode(q, lc, lbt, seq_t, qsl, 0.1, max_query_len=1, **opts, **kw)
    with pytest.raises(ValueError, match="no request"):
        dcp_local_decode(q, lc, empty_bt, empty_s, empty_qsl, 0.1, **kw)
    # a hint that bounds every query is still taken
    ref_o, ref_l = dcp_local_decode_ref(q.cpu(), lc.cpu(), lbt.cpu(), seq_t.cpu(), qsl.cpu(), 0.1, **kw)
    out, lse, used = dcp_local_decode(q, lc, lbt, seq_t, qsl, 0.1, max_query_len=3, **kw)
    assert used == "segmented"
    assert_close("hinted out", ref_o, out, *_TOL)
    assert_close("hinted lse", ref_l, lse, *_TOL)


# --- every rank, gloo -----------------------------------------------------------------------------------------


def _poison_empty():
    """torch.empty that fills floating tensors with NaN (conftest's fixture does not reach spawned ranks)."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.is_floating_point() and t.numel():
            t.fill_(float("nan"))
        return t

    torch.empty = poisoned


# (seq_lens, qlens, causal): requests shorter than W * I (ranks that hold no key: LSE -inf, merged exactly),
# seq_len 0 rows, qlen > seq_len (rows that see no key anywhere), an empty query block
EDGE_CASES = [
    ([0, 1, 2, 3, 5], [1, 1, 1, 1, 1], True),
    ([0, 1, 2, 3, 11], [1, 2, 0, 3, 4], True),
    ([0, 2, 9], [2, 1, 3], False),
]


def _edge_cases(rank, W, I, dev):
    """The validation accepts the edge cases, and every route and merge equals single-rank attention there."""
    for i, (seq, qlens, causal) in enumerate(EDGE_CASES):
        q, cache, bt, seq_t, qsl = _batch(seq, qlens, W * H, torch.float32, seed=10 + i)
        ref_o, ref_l = mla_decode_ref(q, cache, bt, seq_t, qsl, 0.13, causal=causal)
        lc, lbt = dcp_shard_cache_ref(cache, bt, seq_t, BS, W, rank, I)
        mine = slice(rank * H, (rank + 1) * H)
        for opts in ({}, {"route": "masked", "merge": "all_to_all"}, {"route": "segmented", "gather_heads": False}):
            heads = slice(None) if opts.get("gather_heads") is False else mine
            out, lse = dcp_mla_decode(
                q[:, heads].contiguous().to(dev), lc.to(dev), lbt.to(dev), seq_t.to(dev), qsl.to(dev), 0.13,
                interleave=I, causal=causal, return_lse=True, **opts,
            )  # fmt: skip
            name = f"W{W} I{I} rank {rank} edge case {i} {opts}"
            assert_close(name + " out", ref_o[:, heads], out, *_TOL)
            assert_close(name + " lse", ref_l[:, heads], lse, *_TOL)


def _decode_errors(rank, W, I, dev):
    """Bad input fails every rank with a ValueError/TypeError at the same point (no rank left in a collective)."""
    q, cache, bt, seq_t, qsl = _batch([5, 9, 3], [2, 3, 1], W * H, torch.float32, seed=3)
    lc, lbt = dcp_shard_cache_ref(cache, bt, seq_t, BS, W, rank, I)
    q = q[:, rank * H : (rank + 1) * H].contiguous()
    q, lc, lbt, seq_t, qsl = (t.to(dev) for t in (q, lc, lbt, seq_t, qsl))
    args = (q, lc, lbt, seq_t, qsl, 0.13)
    kw = dict(interleave=I)

    # a max_query_len hint below the longest query: the plain route served a causal verify block (wrong output)
    with pytest.raises(ValueError, match="max_query_len"):
        dcp_mla_decode(*args, max_query_len=1, **kw)
    # q rows but no request: uninitialised output before
    empty_qsl = torch.zeros(1, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="no request"):
        dcp_mla_decode(q, lc, lbt[:0], seq_t[:0], empty_qsl, 0.13, **kw)
    # one rank's bad input (its block table too narrow for its keys, or a NaN sm_scale): that rank raised after
    # the head all-gather and the others crashed in the merge; now each rank raises here
    if rank == 0:
        with pytest.raises(ValueError, match="block_table"):
            dcp_mla_decode(q, lc, lbt[:, :0], seq_t, qsl, 0.13, **kw)
    else:
        with pytest.raises(ValueError, match=r"rank\(s\) \[0\]"):
            dcp_mla_decode(*args, **kw)
    with pytest.raises(ValueError, match="sm_scale" if rank == W - 1 else rf"rank\(s\) \[{W - 1}\]"):
        dcp_mla_decode(*args[:5], float("nan") if rank == W - 1 else 0.13, **kw)
    # a non-int d_v on one rank: its row of the check's all-gather still has every rank's length (no hang)
    with pytest.raises(ValueError, match="d_v" if rank == 0 else r"rank\(s\) \[0\]"):
        dcp_mla_decode(*args, d_v=None if rank == 0 else 512, **kw)
    # ranks on different merges or q dtypes ran different collectives (gloo aborted the process)
    with pytest.raises(ValueError, match="merge"):
        dcp_mla_decode(*args, merge="all_to_all" if rank == 0 else "reduce_scatter", **kw)
    with pytest.raises(ValueError, match="dtype"):
        x = (q, lc) if rank else (q.to(torch.bfloat16), lc.to(torch.bfloat16))
        dcp_mla_decode(*x, *args[2:], **kw)
    # local lengths passed as seq_lens (they differ per rank): silently wrong output before
    local = torch.tensor([len([g for g in range(int(s)) if (g // I) % W == rank]) for s in seq_t.tolist()])
    with pytest.raises(ValueError, match="global seq_lens"):
        dcp_mla_decode(q, lc, lbt, local.to(seq_t), qsl, 0.13, **kw)
    # a max_seq_len bound below a request's length
    with pytest.raises(ValueError, match="max_seq_len"):
        dcp_mla_decode(*args, max_query_len=3, max_seq_len=8, **kw)
    # the masked route through a strided block table now reads it right
    ref_o, _ = mla_decode_ref(*_batch([5, 9, 3], [2, 3, 1], W * H, torch.float32, seed=3), 0.13)
    out, _ = dcp_mla_decode(q, lc, _strided(lbt), seq_t, qsl, 0.13, route="masked", **kw)
    assert_close(f"rank {rank} strided masked", ref_o[:, rank * H : (rank + 1) * H], out, *_TOL)


def _prefill_errors(rank, W, I, dev):
    """dcp_mla_prefill_with_context: rows past query_start_loc[-1] came back unwritten, wrong-shaped CPU copies
    raised IndexError/RuntimeError and a non-positive fp8 tensor kv_scale was used; now a ValueError (before any
    collective, on every rank)."""
    g = torch.Generator().manual_seed(5)
    ctx, qlens = [5, 3], [2, 1]
    _, cache, bt, seq_t, _ = _batch([c + n for c, n in zip(ctx, qlens)], [1, 1], 1, torch.float32, seed=5)
    lc, lbt = dcp_shard_cache_ref(cache, bt, seq_t, BS, W, rank, I)
    T, Hp, d_nope, d_v = 3, 2, 32, 32
    q = torch.randn(T, Hp, d_nope + 64, generator=g)
    k_nope, v = torch.randn(T, Hp, d_nope, generator=g), torch.randn(T, Hp, d_v, generator=g)
    k_pe, w = torch.randn(T, 64, generator=g), torch.randn(Hp * (d_nope + d_v), 512, generator=g) * 0.05
    ctx_t, qsl = torch.tensor(ctx, dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32)

    def call(**kw):
        a = dict(q=q, k_nope=k_nope, k_pe=k_pe, v=v, kv_cache=lc, block_table=lbt, context_lens=ctx_t,
                 query_start_loc=qsl, kv_b_proj_weight=w, sm_scale=0.2, chunk_size=4, interleave=I)  # fmt: skip
        a.update(kw)
        on_dev = {k: x.to(dev) if isinstance(x, torch.Tensor) and not k.endswith("_cpu") else x for k, x in a.items()}
        return dcp_mla_prefill_with_context(**on_dev)

    with pytest.raises(ValueError, match=r"query_start_loc\[-1\]"):
        call(query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"query_start_loc\[-1\]"):
        call(block_table=lbt[:0], context_lens=ctx_t[:0], query_start_loc=qsl[:1])
    with pytest.raises(ValueError, match="context_lens_cpu"):
        call(context_lens_cpu=torch.tensor([5, 3, 7]))
    with pytest.raises(ValueError, match="query_start_loc_cpu"):
        call(query_start_loc_cpu=torch.tensor([0, 2]))
    lc8 = lc.nan_to_num(0.0).to(torch.float8_e4m3fn)
    for validate in (True, False):
        with pytest.raises(ValueError, match="kv_scale"):
            call(kv_cache=lc8, kv_cache_dtype="fp8", kv_scale=torch.tensor([-1.0]), validate=validate)
    out, _ = call()  # the valid call still runs
    assert torch.isfinite(out).all()


def _worker(rank, W, dev, I):
    _poison_empty()
    _edge_cases(rank, W, I, dev)
    _decode_errors(rank, W, I, dev)
    _prefill_errors(rank, W, I, dev)


@pytest.mark.skipif(on_gpu(), reason="multi-process gloo on CPU")
@pytest.mark.parametrize("W,I", [(2, 1), (3, BS)], ids=["W2-I1", "W3-Ibs"])
def test_dcp_hardening_gloo(W, I, tmp_path):
    run_ranks(_worker, W, tmp_path, I)
