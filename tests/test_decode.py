"""mla_decode (split-KV + reduce) against the fp32 reference: heads, page sizes, qlen, causal, dtypes."""

import dataclasses
import itertools

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

import openmla
from openmla.reference import mla_decode_ref
from openmla.utils.testing import TOLERANCES, assert_close, on_gpu, pick

SCALE = 576**-0.5
KV_SCALE = 0.05


def _batch(device, heads, qlens, lens, page, dtype, nan_pad=True):
    """A paged cache holding random rows for the requests, with NaN in every unused row."""
    B = len(lens)
    W = max(1, -(-max(lens) // page))
    num_blocks = B * W + 3
    rows = torch.randn(num_blocks, page, 576, device=device)
    if dtype == torch.float8_e4m3fn:
        cache = (rows / KV_SCALE / 4).to(dtype)  # values ~ N(0, 1) after dequantisation
    else:
        cache = rows.to(dtype)
    block_table = torch.randperm(num_blocks, device=device)[: B * W].view(B, W).int()
    if nan_pad:  # positions past each request's length must never be read
        flat = cache.view(-1, 576)
        used = torch.zeros(num_blocks * page, dtype=torch.bool, device=device)
        for b, n in enumerate(lens):
            pos = torch.arange(n, device=device)
            used[block_table[b, pos // page].long() * page + pos % page] = True
        if dtype == torch.float8_e4m3fn:
            flat.view(torch.uint8)[~used] = 0x7F  # e4m3fn NaN
        else:
            flat[~used] = float("nan")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    qsl = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32, device=device)
    q_dtype = torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype
    q = torch.randn(int(qsl[-1]), heads, 576, device=device).to(q_dtype)
    return q, cache, block_table, seq_lens, qsl


def _check(q, cache, bt, sl, qsl, causal, dtype, **kw):
    fp8 = dtype == torch.float8_e4m3fn
    kv = dict(kv_cache_dtype="fp8", kv_scale=KV_SCALE) if fp8 else {}
    out, lse = openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, causal=causal, **kv, **kw)
    ref_out, ref_lse = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, causal=causal,
                                      kv_scale=KV_SCALE if fp8 else None)  # fmt: skip
    atol, rtol, cos = TOLERANCES[torch.bfloat16 if fp8 else dtype]
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    # inputs are exact in the reference (same bf16/fp8 values), so only accumulation order and the
    # bf16 rounding of P before the PV product differ
    assert_close("out", ref_out, out, atol, rtol, cos)
    assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)
    return out, lse


HEADS = [1, 3, 12, 16, 24, 128]
PAGES = [1, 16, 64]
QLENS = ["1", "2", "4", "varlen"]
DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def _qlens(kind, B):
    if kind == "varlen":
        return [1 + (3 * b) % 5 for b in range(B)]
    return [int(kind)] * B


def _cases():
    full = list(itertools.product(HEADS, PAGES, QLENS, [True, False], DTYPES))
    if on_gpu():  # every heads x page x qlen in bf16 causal; the other axes at the shapes that matter
        keep = [c for c in full if c[3] and c[4] == torch.bfloat16]
        keep += [c for c in full if not c[3] and c[1] == 64 and c[4] == torch.bfloat16]
        keep += [c for c in full if c[0] in (16, 128) and c[1] == 64 and c[2] != "4" and c[4] != torch.bfloat16]
        return keep
    # CPU: every value of every axis, and every pair of (heads, qlen), (page, dtype), (qlen, causal)
    return [c for i, c in enumerate(full) if i % 11 == 0 or (c[0] in (3, 16) and c[1] == 16 and c[4] == torch.bfloat16)]


@pytest.mark.parametrize(
    "heads,page,qlen,causal,dtype", _cases(),
    ids=lambda v: str(v).replace("torch.", "") if not isinstance(v, bool) else ("causal" if v else "full"),
)  # fmt: skip
def test_mla_decode(heads, page, qlen, causal, dtype, device):
    lens = pick([37, 0, 5, 130], [4096, 0, 3, 8191, 1000, 33, 2048, 17])
    qlens = _qlens(qlen, len(lens))
    _check(*_batch(device, heads, qlens, lens, page, dtype), causal, dtype)


@pytest.mark.parametrize("page", pick([48, 64], [96, 160]))  # GPU splits are multiples of 256 here
def test_splits_not_on_page_boundaries(page, device):
    # several splits per request whose starts fall inside a page (equal splits of an odd length)
    lens = pick([1000, 601, 333], [30001, 9001, 12345])
    q, cache, bt, sl, qsl = _batch(device, 3, [1, 2, 1], lens, page, torch.float16)
    plan = openmla.plan_decode(sl, qsl, 3, num_sms=pick(2, 132))
    starts = [s * int(plan.split_len[b]) for b in range(3) for s in range(int(plan.num_splits[b]))]
    assert any(x % page for x in starts) and int(plan.num_splits.max()) > 1
    _check(q, cache, bt, sl, qsl, True, torch.float16, plan=plan)


def _tma_available(device) -> bool:
    return device.type == "cpu" or torch.cuda.get_device_capability(device) >= (9, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,qlens", [(3, [1, 2, 3, 1]), (16, [4, 1, 2, 1])])
def test_tma_tiles(heads, qlens, causal, dtype, device):
    # full KV tiles through TMA descriptors, the causal diagonal and partial tiles through pointers;
    # NaN rows past each request (a TMA tile reads whole pages) and one invalid block number
    if not _tma_available(device):
        pytest.skip("TMA needs sm90+")
    lens = pick([70, 0, 133, 64], [3000, 0, 8191, 4096])
    q, cache, bt, sl, qsl = _batch(device, heads, qlens, lens, 64, dtype)
    kv_cache_dtype = "fp8" if dtype == torch.float8_e4m3fn else "auto"  # a plan is checked against its cache
    plan = openmla.plan_decode(sl, qsl, heads, num_sms=pick(2, 132), kv_cache_dtype=kv_cache_dtype)
    plan = dataclasses.replace(plan, tiling=dataclasses.replace(plan.tiling, tma=True))
    out, _ = _check(q, cache, bt, sl, qsl, causal, dtype, plan=plan)
    bad = bt.clone()
    bad[2, 1] = cache.shape[0] + 5  # keys 64..127 of request 2 name a block past the cache
    kv = {"kv_cache_dtype": "fp8", "kv_scale": KV_SCALE} if dtype == torch.float8_e4m3fn else {}
    out_bad, _ = openmla.mla_decode(q, cache, bad, sl, qsl, SCALE, causal=causal, plan=plan, validate=False, **kv)
    assert not torch.isnan(out_bad).any()
    rows = slice(int(qsl[2]), int(qsl[3]))
    assert torch.equal(out_bad[: rows.start], out[: rows.start])  # other requests are untouched


def test_plan_reuse_and_out_buffers(device):
    lens = pick([50, 3, 0, 9], [5000, 3, 0, 20000])
    qlens = [2, 1, 2, 2]
    q, cache, bt, sl, qsl = _batch(device, 16, qlens, lens, 16, torch.bfloat16)
    plan = openmla.plan_decode(sl, qsl, 16, max_query_len=2)
    out = torch.empty(q.shape[0], 16, 512, dtype=q.dtype, device=device)
    lse = torch.empty(q.shape[0], 16, device=device)
    for _ in range(2):  # two "layers" reuse one plan
        q = torch.randn_like(q)
        o, lse_o = _check(q, cache, bt, sl, qsl, True, torch.bfloat16, plan=plan, out=out, lse=lse)
        assert o.data_ptr() == out.data_ptr() and lse_o.data_ptr() == lse.data_ptr()
    # a plan rebuilt in place keeps its buffers (CUDA graphs)
    ptr = plan.work_req.data_ptr()
    again = openmla.plan_decode(sl, qsl, 16, max_query_len=2, out=plan)
    assert again is plan and plan.work_req.data_ptr() == ptr
    with pytest.raises(ValueError, match="plan was built for"):
        openmla.mla_decode(q[:, :8].contiguous(), cache, bt, sl, qsl, SCALE, plan=plan)


def test_plan_balances_ragged_batch(device):
    # one long request among many short ones: the long one is split, the short ones are not
    lens = [100000] + [64] * 31
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    qsl = torch.arange(33, dtype=torch.int32, device=device)
    plan = openmla.plan_decode(sl, qsl, 16, num_sms=132)
    splits = plan.num_splits.cpu()
    assert int(splits[0]) > 50 and bool((splits[1:] == 1).all())
    split_len = plan.split_len.cpu()
    assert int(split_len[0]) * int(splits[0]) >= lens[0] and bool((split_len % plan.tiling.block_n == 0).all())
    assert int(split_len[0]) * (int(splits[0]) - 1) < lens[0]  # no empty split
    assert int(plan.work_indptr[-1]) <= plan.capacity
    req = plan.work_req.cpu()
    assert bool((req[: int(plan.work_indptr[-1])] >= 0).all()) and bool((req[int(plan.work_indptr[-1]) :] == -1).all())


def test_plan_fills_whole_waves(device):
    # a uniform batch: the split count that runs in whole waves of the slots (programs that run at
    # once) wins over finer splits that leave a second, partial wave
    qsl = torch.arange(9, dtype=torch.int32, device=device)
    lens = torch.full((8,), 1000, dtype=torch.int32, device=device)
    per_sm = openmla.plan_decode(lens, qsl, 16, num_sms=1).tiling.programs_per_sm
    plan = openmla.plan_decode(lens, qsl, 16, num_sms=16 // per_sm)  # 16 slots: 2 x 500 beats 4 x 250 (2 waves)
    assert int(plan.work_indptr[-1]) == 16 and bool((plan.num_splits.cpu() == 2).all())  # 16 slots, 2 each
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        openmla.plan_decode(lens, qsl, 16, kv_cache_dtype="int8")


def test_fp8_query(device):
    lens = pick([40, 7], [4096, 100])
    q, cache, bt, sl, qsl = _batch(device, 16, [1, 1], lens, 16, torch.float8_e4m3fn)
    q_scale = 0.1
    q8 = (q.float() / q_scale).to(torch.float8_e4m3fn)
    out, lse = openmla.mla_decode(q8, cache, bt, sl, qsl, SCALE, kv_cache_dtype="fp8", kv_scale=KV_SCALE,
                                  q_scale=q_scale)  # fmt: skip
    ref_out, ref_lse = mla_decode_ref(q8, cache, bt, sl, qsl, SCALE, kv_scale=KV_SCALE, q_scale=q_scale)
    assert out.dtype == torch.bfloat16
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)


def test_no_lse_and_fp32(device):
    q, cache, bt, sl, qsl = _batch(device, 4, [1, 3], [20, 9], 4, torch.float32)
    out, lse = openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, return_lse=False)
    ref_out, _ = mla_decode_ref(q, cache, bt, sl, qsl, SCALE)
    assert lse is None
    assert_close("out", ref_out, out, 1e-4, 1e-4, 1e-6)


def test_decode_errors(device):
    q, cache, bt, sl, qsl = _batch(device, 4, [1, 1], [5, 9], 4, torch.bfloat16, nan_pad=False)
    with pytest.raises(TypeError, match="query_start_loc"):
        openmla.mla_decode(q, cache, bt, sl, qsl.float(), SCALE)
    with pytest.raises(TypeError, match="kv_cache dtype"):
        openmla.mla_decode(q, cache.half(), bt, sl, qsl, SCALE)
    with pytest.raises(ValueError, match="kv_cache rows"):
        openmla.mla_decode(q, cache[..., :512].contiguous(), bt, sl, qsl, SCALE)
    with pytest.raises(ValueError, match="covers"):
        openmla.mla_decode(q, cache, bt, sl + 100, qsl, SCALE)
    with pytest.raises(ValueError, match="q_scale is required"):
        openmla.mla_decode(q.to(torch.float8_e4m3fn), cache.to(torch.float8_e4m3fn), bt, sl, qsl, SCALE,
                           kv_cache_dtype="fp8", kv_scale=1.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"query_start_loc\[-1\]"):
        openmla.mla_decode(q[:1], cache, bt, sl, qsl, SCALE)
    with pytest.raises(ValueError, match="max_query_len"):
        openmla.plan_decode(sl, torch.tensor([0, 1, 4], dtype=torch.int32, device=device), 4, max_query_len=2)
    with pytest.raises(ValueError, match="_gluon_kernel"):  # the benchmark's private kernel pick
        openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, _gluon_kernel="fast")


@settings(max_examples=pick(8, 25), deadline=None)
@given(
    heads=st.sampled_from([1, 2, 5, 16]),
    page=st.sampled_from([1, 3, 16]),
    reqs=st.lists(st.tuples(st.integers(0, 70), st.integers(1, 4)), min_size=1, max_size=4),
    causal=st.booleans(),
)
def test_decode_fuzz(heads, page, reqs, causal):
    from openmla.utils.testing import suite_device

    lens = [n for n, _ in reqs]
    qlens = [m for _, m in reqs]
    _check(*_batch(suite_device(), heads, qlens, lens, page, torch.float16), causal, torch.float16)


@pytest.mark.parametrize("programs_per_sm,heads", [(1, 12), (1, 3), (8, 12)])
def test_reduce_task_sizes(programs_per_sm, heads, device, monkeypatch):
    # few reduce programs: whole-row tasks, several heads a task where the rows are many against the programs (the
    # CPU's 12 heads: 2), and each program loops over several tasks; a mix of merged and single-split requests
    import openmla.ops.decode as decode_mod
    import openmla.ops.plan as plan_mod

    monkeypatch.setattr(decode_mod, "_REDUCE_PROGRAMS_PER_SM", programs_per_sm)
    if not on_gpu():  # tiny CPU requests still split
        monkeypatch.setattr(plan_mod, "_MIN_SPLIT", 64)
        monkeypatch.setattr(plan_mod, "_MIN_SPLIT_64_ROWS", 64)
    lens = pick([300, 5, 260, 0, 140], [20000, 70, 9000, 0, 33000])
    q, cache, bt, sl, qsl = _batch(device, heads, [1, 2, 3, 1, 2], lens, 64, torch.bfloat16)
    plan = openmla.plan_decode(sl, qsl, heads, num_sms=pick(8, 16))
    n = plan.num_splits.cpu().tolist()
    assert n[0] > 1 and n[1] == 1 and n[2] > 1, n
    progs, block_hb, block_d, _ = decode_mod._reduce_tiling(plan, heads, 512)
    rows, programs = 5 * 3 * heads, programs_per_sm * plan.num_sms
    assert block_d == 512 and (block_hb > 1) == (rows // 2 >= 8 * programs), (block_hb, rows, programs)
    if programs_per_sm == 1:
        assert progs < int(plan.num_merge) * 3 * -(-heads // block_hb)
    _check(q, cache, bt, sl, qsl, True, torch.bfloat16, plan=plan)


def test_reduce_wide_steps(device, monkeypatch):
    # one-head reduce tasks take up to 64 splits per step of the split loop (one step for all the splits of a
    # request), masked past each request's split count, narrower than a row when the batch has few rows; head-block
    # tasks stay at 2048 elements per step
    import openmla.ops.decode as decode_mod
    import openmla.ops.plan as plan_mod

    if not on_gpu():
        monkeypatch.setattr(plan_mod, "_MIN_SPLIT", 64)
        monkeypatch.setattr(plan_mod, "_MIN_SPLIT_64_ROWS", 64)
    lens = pick([700, 5, 260], [30000, 70, 9000])
    q, cache, bt, sl, qsl = _batch(device, 4, [1, 2, 1], lens, 64, torch.bfloat16)
    plan = openmla.plan_decode(sl, qsl, 4, num_sms=pick(16, 132))
    n_max = int(plan.num_splits.max())
    assert n_max > 2
    _, block_hb, block_d, block_s = decode_mod._reduce_tiling(plan, 4, 512)
    # as many splits per step as a request's share of the work items (the longest request takes several steps)
    share = triton.next_power_of_2(-(-plan.capacity // 3))
    assert block_hb == 1 and block_d < 512 and block_s == max(2, min(64, 16384 // block_d, share)), (
        block_d, block_s, n_max, plan.capacity)  # fmt: skip
    # (CPU: one step, 16 >= 11 splits; GPU: 94 splits in the longest request, two steps of 64)
    _check(q, cache, bt, sl, qsl, True, torch.bfloat16, plan=plan)
    monkeypatch.setattr(decode_mod, "_REDUCE_PROGRAMS_PER_SM", 1)  # few programs, many heads: head-block tasks
    plan = openmla.plan_decode(sl, qsl, 64, num_sms=16)
    _, block_hb, block_d, block_s = decode_mod._reduce_tiling(plan, 64, 512)
    assert block_hb > 1 and block_s == max(2, 2048 // (block_hb * block_d)), (block_hb, block_d, block_s)


def test_gluon_auto_rule():
    from openmla.ops.decode import _gluon_auto

    # (kv dtype, rows a tile, batch): bf16 from 32 rows, 16-row tiles from batch 64; fp8 always
    assert _gluon_auto("auto", 64, 1) and _gluon_auto("auto", 32, 1)
    assert _gluon_auto("auto", 16, 64) and _gluon_auto("auto", 16, 128)
    assert not _gluon_auto("auto", 16, 32) and not _gluon_auto("auto", 16, 1)
    assert _gluon_auto("fp8", 16, 1)


def test_gluon_variant():
    from openmla.ops.decode import _gluon_variant

    # (kv dtype, heads, max query len, batch, SMs): the pair kernel from 64 heads once the batch's programs fill
    # 30% of the SMs (plan.pair_wanted)
    assert _gluon_variant("auto", 128, 1, 128, 132) == "pair"
    assert _gluon_variant("auto", 128, 2, 128, 132) == "pair"
    assert _gluon_variant("auto", 128, 1, 1, 132) == "seesaw"  # batch 1: short splits, seesaw measured faster
    assert _gluon_variant("auto", 128, 1, 16, 132) == "seesaw"  # 32 programs
    assert _gluon_variant("auto", 128, 1, 24, 132) == "pair"  # 48 programs
    assert _gluon_variant("auto", 128, 1, 32, 132) == "pair"  # 64 programs
    assert _gluon_variant("auto", 64, 1, 128, 132) == "pair"
    assert _gluon_variant("auto", 64, 1, 32, 132) == "seesaw"
    assert _gluon_variant("auto", 64, 2, 128, 132) == "pair"
    assert _gluon_variant("auto", 16, 4, 128, 132) == "seesaw"  # 16-head blocks
    assert _gluon_variant("auto", 32, 1, 128, 132) == "seesaw"
    assert _gluon_variant("fp8", 128, 2, 128, 132) == "ws"
