"""DCP over torch.distributed (gloo on CPU, NCCL on a GPU): decode, verify and chunked prefill with context
against single-rank results, one process per rank.

One spawn per world size W (process start-up dominates under the interpreter) runs every case at one
interleave and the verify and prefill cases at a second one, so that W = 2, 3, 4 and I = 1, 2, block size
each meet twice. Every rank builds the same global batch from a seed, keeps its shard
(``dcp_shard_cache_ref``) and checks its heads against the single-rank fp32 reference. On a CUDA machine
(``OPENMLA_TEST_DEVICE=cuda``) the same cases run with NCCL at W = 1, and at W = 2, 4, 8 where the machine has that
many GPUs (one a rank; the GPU cases include bf16 requests of 2-4k keys at 16 heads a rank).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from _dcp_harness import global_batch, gpus_for, run_ranks

from openmla.ops.cache import concat_and_cache_mla
from openmla.parallel import dcp_mla_decode, dcp_mla_prefill_with_context, dcp_slot_mapping
from openmla.reference import mla_decode_ref, mla_prefill_with_context_ref
from openmla.reference.dcp import dcp_shard_cache_ref
from openmla.utils.testing import TOLERANCES, assert_close, on_gpu, pick

BS = 4
_batch = partial(global_batch, block_size=BS)


# (seq_lens, qlens, causal, dtype, options): rows a rank owns nothing of, requests shorter than W,
# zero-length requests, qlen > seq_len (rows that see no key anywhere)
DECODE_CASES = [
    ([0, 1, 2, 9, 21], [1, 1, 1, 1, 1], True, torch.float32, {}),
    ([0, 1, 2, 9, 21], [1, 1, 1, 1, 1], True, torch.float32, {"merge": "all_to_all"}),
    ([1, 2, 6, 13, 21], [1, 2, 3, 4, 3], True, torch.float32, {"route": "segmented"}),
    ([1, 2, 6, 13, 21], [1, 2, 3, 4, 3], True, torch.float32, {"route": "masked", "merge": "all_to_all"}),
    ([2, 5, 13], [3, 2, 4], False, torch.float32, {}),
    ([3, 8, 17], [2, 1, 4], True, torch.float32, {"gather_heads": False}),
    ([3, 8, 17], [2, 1, 4], True, torch.bfloat16, {}),
    # host-known bounds and no checks (the form a CUDA graph captures): the local plans need no sync
    ([0, 1, 2, 9, 21], [1, 1, 1, 1, 1], True, torch.float32,
     {"max_query_len": 1, "max_seq_len": 24, "validate": False}),
    ([1, 2, 6, 13, 21], [1, 2, 3, 4, 3], True, torch.float32,
     {"route": "segmented", "max_query_len": 4, "max_seq_len": 21, "validate": False}),
] + pick([], [  # on a GPU also longer bf16 requests through both verify routes and a plain decode batch
    ([2048, 777, 1, 130], [4, 3, 2, 1], True, torch.bfloat16, {"route": "masked"}),
    ([2048, 777, 1, 130], [4, 3, 2, 1], True, torch.bfloat16, {"route": "segmented", "merge": "all_to_all"}),
    ([4096] * 8 + [5] * 8, [1] * 16, True, torch.bfloat16, {}),
])  # fmt: skip
H = pick(2, 16)  # heads per rank


def _decode_cases(rank, W, I, dev, cases):
    for i in cases:
        seq, qlens, causal, dtype, opts = DECODE_CASES[i]
        heads = H if opts.get("gather_heads", True) else H * W
        q, cache, bt, seq_t, qsl = _batch(seq, qlens, W * H if heads == H else heads, dtype, seed=i)
        sm = 0.13
        ref_o, ref_l = mla_decode_ref(q, cache, bt, seq_t, qsl, sm, causal=causal)
        lc, lbt = dcp_shard_cache_ref(cache, bt, seq_t, BS, W, rank, I)
        mine = slice(rank * H, (rank + 1) * H) if heads == H else slice(None)
        out, lse = dcp_mla_decode(
            q[:, mine].contiguous().to(dev), lc.to(dev), lbt.to(dev), seq_t.to(dev), qsl.to(dev), sm,
            interleave=I, causal=causal, return_lse=True, **opts,
        )  # fmt: skip
        name = f"W{W} I{I} rank {rank} decode case {i} {opts}"
        assert out.shape == (q.shape[0], heads, 512) and out.dtype == dtype, name
        assert_close(name + " out", ref_o[:, mine], out, *TOLERANCES[dtype])
        assert_close(name + " lse", ref_l[:, mine], lse, *TOLERANCES[dtype])


def _prefill_case(rank, W, I, dev, ctx, qlens, chunk_size, seed):
    """Chunked-context prefill over a sharded context; the new tokens written to their owners' caches."""
    g = torch.Generator().manual_seed(seed)
    Hp, d_nope, d_v = 2, 32, 32
    S = [c + n for c, n in zip(ctx, qlens)]
    _, cache, bt, seq_t, _ = _batch(S, [1] * len(S), 1, torch.float32, seed)
    qsl = torch.tensor([0] + torch.cumsum(torch.tensor(qlens), 0).tolist(), dtype=torch.int32)
    T = int(qsl[-1])
    q = torch.randn(T, Hp, d_nope + 64, generator=g) * 0.3
    k_nope = torch.randn(T, Hp, d_nope, generator=g) * 0.3
    v = torch.randn(T, Hp, d_v, generator=g)
    w = torch.randn(Hp * (d_nope + d_v), 512, generator=g) * 0.05
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    # the new tokens' cache rows, written through the slot mapping into a cache that holds the context only
    pos = torch.tensor([p for c, n in zip(ctx, qlens) for p in range(c, c + n)], dtype=torch.int64)
    req = torch.tensor([b for b, n in enumerate(qlens) for _ in range(n)], dtype=torch.int64)
    flat = cache.view(-1, 576)
    rows = torch.stack([flat[int(bt[b, p // BS]) * BS + p % BS] for b, p in zip(req.tolist(), pos.tolist())])
    k_pe = rows[:, 512:].contiguous()
    full, table = dcp_shard_cache_ref(cache, bt, seq_t, BS, W, rank, I)
    local, _ = dcp_shard_cache_ref(cache, bt, ctx_t, BS, W, rank, I, reserve_lens=seq_t)
    local, table = local.to(dev), table.to(dev)
    slots = dcp_slot_mapping(pos.to(dev), req.to(dev), table, BS, W, rank, I)
    concat_and_cache_mla(rows[:, :512].contiguous().to(dev), k_pe.to(dev), local, slots)
    torch.testing.assert_close(local.cpu(), full, rtol=0, atol=0, equal_nan=True)

    ref_o, ref_l = mla_prefill_with_context_ref(q, k_nope, k_pe, v, cache, bt, ctx_t, qsl, w, 0.2)
    out, lse = dcp_mla_prefill_with_context(
        q.to(dev), k_nope.to(dev), k_pe.to(dev), v.to(dev), local, table, ctx_t.to(dev), qsl.to(dev), w.to(dev),
        0.2, chunk_size=chunk_size, interleave=I, return_lse=True,
    )  # fmt: skip
    name = f"W{W} I{I} rank {rank} prefill ctx {ctx} chunk {chunk_size}"
    assert_close(name + " out", ref_o, out, *TOLERANCES[torch.float32])
    assert_close(name + " lse", ref_l, lse, *TOLERANCES[torch.float32])


def _errors(rank, W, dev):
    q, cache, bt, seq_t, qsl = _batch([3, 5], [1, 1], H, torch.float32, 0)
    args = (q.to(dev), cache.to(dev), bt.to(dev), seq_t.to(dev), qsl.to(dev), 0.1)
    try:  # ranks that disagree on T are refused on every rank, by name
        bad = args[0][: 2 if rank == 0 else 1]
        dcp_mla_decode(bad, *args[1:4], torch.tensor([0, 1, bad.shape[0]], dtype=torch.int32, device=dev), 0.1)
    except ValueError as err:
        assert "same" in str(err) or W == 1, err
    else:
        assert W == 1, "a T mismatch between ranks was not detected"
    for kwargs, exc, word in (({"interleave": 0}, ValueError, "interleave"), ({"merge": "ring"}, ValueError, "merge"),
                              ({"route": "plain"}, None, None)):  # fmt: skip
        try:
            dcp_mla_decode(*args, **kwargs)
        except ValueError as err:
            assert exc is ValueError and word in str(err), err
        else:
            assert exc is None, kwargs
    try:
        dcp_mla_decode(args[0].to(torch.int32), *args[1:])
    except TypeError as err:
        assert "q" in str(err)
    else:
        raise AssertionError("an int q was accepted")


def _worker(rank, W, dev):
    # every case at one interleave per W, the verify cases and a prefill at a second one: each W meets two
    # interleaves and each interleave two W (the single-process tests cover the sharding of the whole grid)
    main, other = {1: (1, BS), 2: (1, BS), 3: (2, 1), 4: (BS, 2), 8: (2, 1)}[W]
    _decode_cases(rank, W, main, dev, range(len(DECODE_CASES)))
    _prefill_case(rank, W, main, dev, [7, 3, 0], [1, 2, 2], chunk_size=64, seed=9)
    _prefill_case(rank, W, main, dev, [0, 5, 9], [2, 3, 1], chunk_size=4, seed=main)
    _decode_cases(rank, W, other, dev, [2, 3])
    _prefill_case(rank, W, other, dev, [0, 5, 9], [2, 3, 1], chunk_size=4, seed=other)
    _errors(rank, W, dev)


@pytest.mark.skipif(on_gpu(), reason="multi-process gloo on CPU; the GPU run is test_dcp_nccl_one_gpu")
@pytest.mark.parametrize("W", [2, 3, 4])
def test_dcp_gloo(W, tmp_path):
    run_ranks(_worker, W, tmp_path)


@pytest.mark.gpu
def test_dcp_nccl_one_gpu(tmp_path):
    run_ranks(_worker, 1, tmp_path, backend="nccl")


@pytest.mark.gpu
@pytest.mark.parametrize("W", [2, 4, 8])
def test_dcp_nccl(W, tmp_path):
    if not on_gpu() or not gpus_for(W):
        pytest.skip(f"NCCL over {W} GPUs (this machine has {torch.cuda.device_count()})")
    run_ranks(_worker, W, tmp_path, backend="nccl")
