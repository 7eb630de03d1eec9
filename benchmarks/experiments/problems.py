"""Decode problems the experiments share (moved here from ``benchmarks/bench_decode_gluon.py``, now gone)."""

from __future__ import annotations

import torch

PAGE = 64
KV_SCALE = 0.05


def make_problem(h, b, s, qlen, pool_gib, fp8=False):
    """q, a cache of 64-token pages scattered over a pool of ``pool_gib`` GiB, block table, lengths and
    query_start_loc for ``b`` requests of ``s`` keys and ``qlen`` queries (fp8: e4m3 values of scale KV_SCALE)."""
    pages_needed = b * (-(-s // PAGE))
    pool_pages = max(pages_needed, int(pool_gib * 2**30 / (PAGE * 576 * (1 if fp8 else 2))))
    if fp8:
        cache = torch.empty(pool_pages, PAGE, 576, device="cuda", dtype=torch.float8_e4m3fn)
        for i in range(0, pool_pages, 4096):  # in slices: no fp32 copy of the whole pool
            cache[i : i + 4096] = (torch.randn(min(4096, pool_pages - i), PAGE, 576, device="cuda") / KV_SCALE / 4).to(
                torch.float8_e4m3fn)  # fmt: skip
    else:
        cache = torch.randn(pool_pages, PAGE, 576, device="cuda", dtype=torch.bfloat16)
    block_table = torch.randperm(pool_pages, device="cuda")[:pages_needed].view(b, -1).int()
    seq_lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda") * qlen
    q = torch.randn(b * qlen, h, 576, device="cuda", dtype=torch.bfloat16)
    return q, cache, block_table, seq_lens, qsl


def make_span_problem(h, b, s, qlen):
    """``make_problem`` over a 2 GiB pool for the spanning-schedule experiments; ``s == "ragged"``: 512 .. 16384
    keys a request, a fixed draw. Returns ``(q, cache, block_table, seq_lens, qsl, s_max)``."""
    s_max = 16384 if s == "ragged" else s
    q, cache, bt, sl, qsl = make_problem(h, b, s_max, qlen, 2.0)
    if s == "ragged":
        gen = torch.Generator(device="cpu").manual_seed(0)
        sl.copy_(torch.randint(512, 16385, (b,), generator=gen, dtype=torch.int32))
    return q, cache, bt, sl, qsl, s_max
