"""DCP sharding and one rank's decode routes, single process (no communication): lengths against a brute-force
count of owned tokens, slot mappings, and every rank's partial (plain, segmented, masked) against the fp32
reference, merged by LSE into single-rank attention over the whole sequence."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from _dcp_harness import global_batch

from openmla.ops.cache import concat_and_cache_mla
from openmla.parallel import (
    dcp_global_position,
    dcp_local_position,
    dcp_local_seq_lens,
    dcp_local_verify_row_lens,
    dcp_masked_decode,
    dcp_owner,
    dcp_slot_mapping,
    select_dcp_decode_route,
)
from openmla.parallel.dcp import dcp_local_decode
from openmla.reference import mla_decode_ref
from openmla.reference.dcp import dcp_local_decode_ref, dcp_local_seq_lens_ref, dcp_merge_ref, dcp_shard_cache_ref
from openmla.utils.testing import TOLERANCES, assert_close

BS = 4
_global_batch = partial(global_batch, block_size=BS)
GRID = [(W, I) for W in (2, 3, 4) for I in (1, 2, BS)]


@pytest.mark.parametrize("W,I", GRID, ids=[f"W{w}-I{i}" for w, i in GRID])
def test_local_seq_lens_brute_force(W, I):
    seq = torch.arange(0, 3 * W * I + 5, dtype=torch.int32)
    every = dcp_local_seq_lens(seq, W, None, I)
    assert every.shape == (seq.numel(), W) and every.dtype == torch.int32
    for r in range(W):
        ref = dcp_local_seq_lens_ref(seq, W, r, I)
        assert torch.equal(dcp_local_seq_lens(seq, W, r, I), ref)
        assert torch.equal(every[:, r], ref)
    assert torch.equal(every.sum(1), seq)  # every token on exactly one rank
    # the largest local length is ceil(S / (W * I)) * I (SPEC 5.1)
    assert int(every.max()) == -(-int(seq.max()) // (W * I)) * I


@pytest.mark.parametrize("W,I", GRID, ids=[f"W{w}-I{i}" for w, i in GRID])
def test_position_maps_round_trip(W, I):
    g = torch.arange(0, 4 * W * I + 3)
    owner, loc = dcp_owner(g, W, I), dcp_local_position(g, W, I)
    for r in range(W):
        mine = g[owner == r]
        assert torch.equal(loc[owner == r], torch.arange(mine.numel()))  # owned tokens fill a local prefix
        assert torch.equal(dcp_global_position(torch.arange(mine.numel()), W, r, I), mine)


@pytest.mark.parametrize("W,I", [(2, 1), (3, 2), (4, BS)])
def test_verify_row_lens_brute_force(W, I):
    seq = torch.tensor([0, 1, 2, 7, 3 * W * I + 1], dtype=torch.int32)
    qlens = [1, 3, 2, 4, 3]  # qlen > seq_len gives rows that see nothing
    qsl = torch.tensor([0] + torch.cumsum(torch.tensor(qlens), 0).tolist(), dtype=torch.int32)
    for r in range(W):
        got = dcp_local_verify_row_lens(seq, qsl, W, r, I)
        want = []
        for b, n in enumerate(qlens):
            S = int(seq[b])
            want += [sum(1 for g in range(S - n + t + 1) if (g // I) % W == r) for t in range(n)]
        assert got.tolist() == want


@pytest.mark.parametrize("W,I", [(2, 1), (3, 2), (4, BS)])
def test_slot_mapping_owner_only(W, I):
    # two requests writing positions 3..9 and 0..2; each token lands on its owner's local slot only
    pos = torch.tensor([3, 4, 5, 6, 7, 8, 9, 0, 1, 2, -1])
    req = torch.tensor([0] * 7 + [1] * 3 + [0])
    seen = 0
    for r in range(W):
        nloc = int(dcp_local_seq_lens(torch.tensor([10]), W, r, I)[0])
        blocks = -(-nloc // BS)
        table = torch.arange(2 * max(blocks, 1), dtype=torch.int32).view(2, -1).flip(1) + 5
        slots = dcp_slot_mapping(pos, req, table, BS, W, r, I)
        for i, (g, b) in enumerate(zip(pos.tolist(), req.tolist())):
            if g < 0 or (g // I) % W != r:
                assert slots[i] == -1
            else:
                lp = (g // (I * W)) * I + g % I
                assert slots[i] == int(table[b, lp // BS]) * BS + lp % BS
                seen += 1
    assert seen == 10
    with pytest.raises(ValueError, match="block_table"):
        dcp_slot_mapping(pos, req, torch.zeros(2, 0, dtype=torch.int32), BS, 1, 0, 1)


def test_sharding_argument_errors():
    s = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="world_size"):
        dcp_local_seq_lens(s, 0)
    with pytest.raises(ValueError, match="rank"):
        dcp_local_seq_lens(s, 2, 2)
    with pytest.raises(ValueError, match="interleave"):
        dcp_local_seq_lens(s, 2, 0, 0)
    with pytest.raises(TypeError, match="seq_lens"):
        dcp_local_seq_lens(s.float(), 2, 0)
    with pytest.raises(ValueError, match="non-negative"):
        dcp_local_seq_lens(torch.tensor([-1]), 2, 0)
    with pytest.raises(ValueError, match="plain"):
        select_dcp_decode_route(True, 2, "plain")
    with pytest.raises(ValueError, match="route"):
        select_dcp_decode_route(True, 2, "cprr")
    assert select_dcp_decode_route(True, 1) == "plain"
    assert select_dcp_decode_route(False, 4) == "plain"
    assert select_dcp_decode_route(True, 2) == "segmented"
    assert select_dcp_decode_route(True, 4) == "segmented"  # masked only when forced (slower on the H200)
    assert select_dcp_decode_route(True, 4, "masked") == "masked"


def _to(device, *ts):
    return [t.to(device) for t in ts]


CASES = [
    # (seq_lens, qlens, causal): rows a rank owns nothing of, requests shorter than W, qlen > seq_len
    ([0, 1, 2, 9, 21], [1, 1, 1, 1, 1], True),
    ([1, 2, 6, 13, 21], [1, 2, 3, 4, 3], True),
    ([2, 5, 13], [3, 2, 4], False),
]


@pytest.mark.parametrize("W,I", [(2, 1), (3, 2), (4, BS)], ids=lambda x: str(x))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_local_routes_merge_to_single_rank(W, I, case, device):
    seq, qlens, causal = CASES[case]
    q, cache, bt, seq_t, qsl = _global_batch(seq, qlens, 3, torch.float32, seed=case)
    sm = 0.11
    ref_o, ref_l = mla_decode_ref(q, cache, bt, seq_t, qsl, sm, causal=causal)
    # qlen 1: the segmented route is the plain one row by row
    routes = ["plain", "masked"] if causal and max(qlens) == 1 else ["segmented", "masked"]
    for route in routes:
        outs, lses = [], []
        for r in range(W):
            lc, lbt = dcp_shard_cache_ref(cache, bt, seq_t, BS, W, r, I)
            o, lse, used = dcp_local_decode(*_to(device, q, lc, lbt, seq_t, qsl), sm, world_size=W, rank=r,
                                            interleave=I, causal=causal, route=route)  # fmt: skip
            assert used == route
            ro, rl = dcp_local_decode_ref(q, lc, lbt, seq_t, qsl, sm, world_size=W, rank=r, interleave=I, causal=causal)
            tol = TOLERANCES[torch.float32]
            assert_close(f"{route} r{r} out", ro, o, *tol)
            assert_close(f"{route} r{r} lse", rl, lse, *tol)
            outs.append(o)
            lses.append(lse)
        mo, ml = dcp_merge_ref(outs, lses)
        assert_close(f"{route} merged out", ref_o, mo, *TOLERANCES[torch.float32])
        assert_close(f"{route} merged lse", ref_l, ml, *TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_masked_kernel_low_precision(dtype, device):
    W, I = 3, 2
    q, cache, bt, seq_t, qsl = _global_batch([3, 14, 19], [2, 4, 3], 4, torch.float32, seed=7)
    kv_scale = 0.5 if dtype == torch.float8_e4m3fn else None
    if dtype == torch.float8_e4m3fn:
        cache = (cache / kv_scale).to(dtype)
        qd, kvd = torch.bfloat16, "fp8"
    else:
        cache, qd, kvd = cache.to(dtype), dtype, "auto"
    q = q.to(qd)
    for r in range(W):
        lc, lbt = dcp_shard_cache_ref(cache, bt, seq_t, BS, W, r, I)
        o, lse = dcp_masked_decode(*_to(device, q, lc, lbt, seq_t, qsl), 0.2, world_size=W, rank=r, interleave=I,
                                   kv_cache_dtype=kvd, kv_scale=kv_scale)  # fmt: skip
        ro, rl = dcp_local_decode_ref(q, lc, lbt, seq_t, qsl, 0.2, world_size=W, rank=r, interleave=I,
                                      kv_cache_dtype=kvd, kv_scale=kv_scale)  # fmt: skip
        assert o.dtype == qd
        assert_close(f"r{r} out", ro, o, *TOLERANCES[dtype])
        assert_close(f"r{r} lse", rl, lse, *TOLERANCES[dtype])


@pytest.mark.parametrize("route", ["segmented", "masked"])
def test_routes_fp8_cache(route, device):
    """An fp8 cache (per-tensor scale) through both verify routes of one rank."""
    W, I, scale = 2, BS, 0.25
    q, cache, bt, seq_t, qsl = _global_batch([6, 11], [3, 2], 2, torch.float32, seed=5)
    cache = (cache / scale).to(torch.float8_e4m3fn)
    q = q.to(torch.bfloat16)
    lc, lbt = dcp_shard_cache_ref(cache, bt, seq_t, BS, W, 1, I)
    o, lse, _ = dcp_local_decode(*_to(device, q, lc, lbt, seq_t, qsl), 0.2, world_size=W, rank=1, interleave=I,
                                 route=route, kv_cache_dtype="fp8", kv_scale=scale)  # fmt: skip
    ro, rl = dcp_local_decode_ref(q, lc, lbt, seq_t, qsl, 0.2, world_size=W, rank=1, interleave=I,
                                  kv_cache_dtype="fp8", kv_scale=scale)  # fmt: skip
    assert_close("out", ro, o, *TOLERANCES[torch.float8_e4m3fn])
    assert_close("lse", rl, lse, *TOLERANCES[torch.float8_e4m3fn])


@pytest.mark.parametrize("num_splits", [2, 5])
def test_masked_kernel_key_splits(num_splits, device):
    """Key splits (some of them empty) merged by LSE give the one-split result."""
    W, I = 2, 1
    q, cache, bt, seq_t, qsl = _global_batch([0, 3, 30, 41], [1, 2, 4, 3], 2, torch.float32, seed=11)
    for r in range(W):
        lc, lbt = dcp_shard_cache_ref(cache, bt, seq_t, BS, W, r, I)
        o, lse = dcp_masked_decode(*_to(device, q, lc, lbt, seq_t, qsl), 0.2, world_size=W, rank=r, interleave=I,
                                   num_splits=num_splits)  # fmt: skip
        ro, rl = dcp_local_decode_ref(q, lc, lbt, seq_t, qsl, 0.2, world_size=W, rank=r, interleave=I)
        assert_close(f"r{r} out", ro, o, *TOLERANCES[torch.float32])
        assert_close(f"r{r} lse", rl, lse, *TOLERANCES[torch.float32])


def test_masked_kernel_errors(device):
    q, cache, bt, seq_t, qsl = _to(device, *_global_batch([3, 5], [1, 2], 2, torch.float32))
    kw = dict(world_size=2, rank=0)
    with pytest.raises(TypeError, match="kv_cache"):
        dcp_masked_decode(q, cache.half(), bt, seq_t, qsl, 0.1, **kw)
    with pytest.raises(ValueError, match="seq_lens"):
        dcp_masked_decode(q, cache, bt, seq_t[:1], qsl, 0.1, **kw)
    with pytest.raises(ValueError, match="query_start_loc"):
        dcp_masked_decode(q, cache, bt, seq_t, qsl + 1, 0.1, **kw)
    with pytest.raises(ValueError, match="block_table"):
        dcp_masked_decode(q, cache, bt[:, :0], seq_t, qsl, 0.1, **kw)
    with pytest.raises(ValueError, match="rank"):
        dcp_masked_decode(q, cache, bt, seq_t, qsl, 0.1, world_size=2, rank=3)
    with pytest.raises(ValueError, match="kv_scale"):
        dcp_masked_decode(q, cache, bt, seq_t, qsl, 0.1, kv_scale=1.0, **kw)
    with pytest.raises(ValueError, match="num_splits"):
        dcp_masked_decode(q, cache, bt, seq_t, qsl, 0.1, num_splits=0, **kw)


def test_new_tokens_written_to_owner_only(device):
    """concat_and_cache_mla through dcp_slot_mapping fills exactly the owner's local rows."""
    W, I = 3, 2
    ctx, qlens = [5, 0, 11], [3, 2, 1]
    S = [c + n for c, n in zip(ctx, qlens)]
    _, cache, bt, seq_t, _ = _global_batch(S, [1, 1, 1], 1, torch.float32, seed=3)
    pos = torch.tensor([p for c, n in zip(ctx, qlens) for p in range(c, c + n)])
    req = torch.tensor([b for b, n in enumerate(qlens) for _ in range(n)])
    flat = cache.view(-1, 576)
    rows = torch.stack([flat[int(bt[b, p // BS]) * BS + p % BS] for b, p in zip(req.tolist(), pos.tolist())])
    for r in range(W):
        full, table = dcp_shard_cache_ref(cache, bt, seq_t, BS, W, r, I)
        part, table2 = dcp_shard_cache_ref(cache, bt, torch.tensor(ctx), BS, W, r, I, reserve_lens=seq_t)
        assert torch.equal(table, table2)
        part = part.to(device)
        slots = dcp_slot_mapping(*_to(device, pos, req, table2), BS, W, r, I)
        concat_and_cache_mla(*_to(device, rows[:, :512].contiguous(), rows[:, 512:].contiguous()), part, slots)
        torch.testing.assert_close(part.cpu(), full, rtol=0, atol=0, equal_nan=True)
