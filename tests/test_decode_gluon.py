"""The Hopper (Gluon) decode tier: an offline sm90 compile report on the CPU, and the kernel against the
fp32 reference and the portable kernel on an sm90 GPU (``hopper`` marker)."""

import importlib.util
import itertools
import math

import pytest
import torch

import openmla
from openmla.ops.gluon import decode as dg
from openmla.reference import mla_decode_ref
from openmla.utils.sm90_report import run_report_script
from openmla.utils.testing import TOLERANCES, assert_close

SCALE = 576**-0.5
LOG2E = 1.4426950408889634
KV_SCALE = 0.05  # fp8 caches: value = stored e4m3 * KV_SCALE

# (BLOCK_N, STAGES, CAUSAL, BLOCK_H, FP8): the warp-specialised kernel (1-warp TMA producer + two
# consumer warpgroups) with 64- and 32-key tiles, both causal flags and a few row foldings (BLOCK_H 64 =
# h128/h64, 16 = h16 x 4 query rows, 32), and its fp8-cache path
COMPILE_VARIANTS = [
    (64, 2, True, 64, False),
    (64, 2, False, 16, False),
    (32, 3, True, 32, False),
    (64, 2, True, 64, True),
    (64, 2, False, 16, True),
    (64, 2, True, 32, True),
]

_COMPILE_SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from openmla.utils.sm90_report import resource_report
from openmla.ops.gluon import decode as g
from openmla.ops.gluon import decode_narrow as gn
from openmla.ops.gluon import decode_seesaw as gs

def nvmma(swizzle, bits):
    return (f"NVMMASharedLayout(swizzle_byte_width={swizzle}, element_bitwidth={bits}, rank=2, transposed=False, "
            "fp4_padded=False, cga_layout=[])")
ptr = {"q": "*bf16", "block_table": "*i32", "seq_lens": "*i32", "query_start_loc": "*i32", "work_req": "*i32",
       "work_split": "*i32", "num_splits": "*i32", "split_len": "*i32", "out": "*bf16", "lse": "*fp32",
       "o_part": "*fp32", "lse_part": "*fp32", "group_indptr": "*i32", "span_indptr": "*i32", "span_flags": "*i32"}
report = []
for block_n, stages, causal, block_h, fp8 in json.loads(sys.argv[1]):
    box = 32
    seesaw = str(block_n).split("+")[0] in ("seesaw", "pair")
    if block_n == "narrow":  # the narrow fp8 kernel: BLOCK_H block_h, Q_PER in the stages field
        fn = gn._mla_decode_gluon_narrow_kernel
        cons = dict(PAGE=64, MAX_QLEN=4, BLOCK_H=block_h, Q_PER=stages, CAUSAL=causal,
                    RAW=gn.raw_stages(block_h * stages), WIDEN_REGS=gn.WIDEN_REGS, TMA_REGS=gn.TMA_REGS, N_QB=2,
                    num_warps=gn.NUM_WARPS)
    elif seesaw:  # "seesaw|pair[+box64][+spans[+staged]]"
        fn = gs._mla_decode_gluon_seesaw_kernel
        name, *opts = block_n.split("+")
        box = 64 if "box64" in opts else 32
        spans = "spans" in opts
        cons = dict(PAGE=64, MAX_QLEN=4, BLOCK_H=block_h, Q_PER=64 // block_h, CAUSAL=causal,
                    WG_REGS=g.SEESAW_WG_REGS, N_HB=2, N_QB=1, PAIR=name == "pair", SPANS=spans,
                    OUT_TMA=spans and "staged" not in opts, MERGE_TMA=spans, num_warps=4)
        for desc, flag in (("out_desc", "OUT_TMA"), ("part_desc", "MERGE_TMA")):
            if not cons[flag]:
                cons[desc] = None
    else:
        fn = g._mla_decode_gluon_ws_kernel
        cons = dict(PAGE=64, MAX_QLEN=4, BLOCK_H=block_h, Q_PER=64 // block_h, BLOCK_N=block_n, STAGES=stages,
                    CAUSAL=causal, PRODUCER_REGS=g.WS_PRODUCER_REGS, FP8=fp8, N_HB=2, N_QB=1, num_warps=8)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in cons:
            sig[name] = "constexpr"
        elif name == "lat_desc":  # the seesaw kernels copy half a latent row per box
            width = 256 if seesaw else 512
            bf16 = f"tensordesc<bf16[{box}, {width}],{nvmma(128, 16)}>"
            sig[name] = f"tensordesc<fp8e4nv[32, 512],{nvmma(128, 8)}>" if fp8 else bf16
        elif name == "rope_desc":
            bf16 = f"tensordesc<bf16[{box}, 64],{nvmma(128, 16)}>"
            sig[name] = f"tensordesc<fp8e4nv[32, 64],{nvmma(64, 8)}>" if fp8 else bf16
        elif name == "out_desc":  # the pair kernel's final rows on the spanning schedule
            sig[name] = f"tensordesc<bf16[{block_h}, 256],{nvmma(128, 16)}>"
        elif name == "part_desc":  # the partials it merges
            sig[name] = f"tensordesc<fp32[{block_h}, 256],{nvmma(128, 32)}>"
        elif name in ptr:
            sig[name] = ptr[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("scale_log2", "v_scale"):
            sig[name] = "fp32"
        elif name.startswith("stride_"):  # as the JIT specialises a multiple of 16 (q: 576-element rows)
            sig[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
    k = triton.compile(GluonASTSource(fn, sig, constexprs=cons, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cons["num_warps"]))
    r = resource_report(k)
    r["shapes"] = sorted(set(re.findall(r"wgmma.mma_async.sync.aligned.(m\d+n\d+k\d+)", k.asm["ptx"])))
    report.append(dict(variant=[block_n, stages, causal, block_h, fp8], **r))
print("REPORT" + json.dumps(report))
"""


def _compile_report(variants):
    return run_report_script(_COMPILE_SCRIPT, variants)


@pytest.mark.skipif(not dg.GLUON_AVAILABLE, reason="triton.experimental.gluon is not installed")
def test_gluon_decode_compiles_for_sm90():
    # offline sm90 compile (no GPU needed): wgmma + TMA in the PTX, no spill, fits the shared memory
    for r in _compile_report(COMPILE_VARIANTS):
        name = "BLOCK_N={} STAGES={} CAUSAL={} BLOCK_H={} FP8={}".format(*r["variant"])
        assert r["wgmma"] > 0 and r["tma"] > 0, f"{name}: {r}"
        assert r["regs"] <= 255 and r["stack"] == 0 and r["local"] == 0, f"{name}: spills or too many registers {r}"
        assert r["shared"] + r["static_shared"] <= dg.SMEM_LIMIT, f"{name}: shared memory {r}"
        # 8 consumer warps + the producer warp's warpgroup, registers moved by setmaxnreg
        assert r["num_warps"] == 12 and r["setmaxnreg"], f"{name}: {r}"


@pytest.mark.skipif(not dg.GLUON_AVAILABLE, reason="triton.experimental.gluon is not installed")
def test_gluon_narrow_compiles_for_sm90():
    # the narrow fp8 kernel at HB 8 / 16 / 32 rows (BLOCK_H x Q_PER): no spill, fits the shared memory, 12 warps (the
    # consumer and widening warpgroups, the TMA warp's warpgroup) with setmaxnreg; every MMA m64n<HB>k16 (S^T 9 chunks
    # x 4 k-steps, O^T 8 M-repeats x 4); five TMA messages a 32-key box pair (four 128-byte latent ones, the rope)
    from openmla.ops.gluon import decode_narrow as gn

    for r in _compile_report([["narrow", 1, True, 16, True], ["narrow", 2, False, 16, True],
                              ["narrow", 1, True, 8, True], ["narrow", 4, True, 8, True],
                              ["narrow", 1, False, 32, True]]):  # fmt: skip
        _, q_per, _, block_h, _ = r["variant"]
        hb = block_h * q_per
        assert r["regs"] <= 255 and r["stack"] == 0 and r["local"] == 0, f"{r['variant']}: spills {r}"
        smem = hb * 576 * 2 + 2 * 64 * 576 * 2 + gn.raw_stages(hb) * 32 * 576 + hb * 64 * 2 + gn._SCRATCH
        assert r["shared"] + r["static_shared"] <= min(dg.SMEM_LIMIT, smem), f"{r['variant']}: {r}"
        assert r["num_warps"] == 12 and r["setmaxnreg"], f"{r['variant']}: {r}"
        assert r["shapes"] == [f"m64n{hb}k16"] and r["wgmma"] == 9 * 4 + 32 and r["tma"] == 5, f"{r['variant']}: {r}"


@pytest.mark.skipif(not dg.GLUON_AVAILABLE, reason="triton.experimental.gluon is not installed")
def test_gluon_seesaw_compiles_for_sm90():
    # the seesaw and pair kernels compile with wgmma + TMA, two 4-warp partitions, fit the shared memory and do
    # not spill: their stage and Q-chunk indices are a runtime 0 per iteration. "+box64": one 64-row TMA box per
    # tile (box_rows=64). "+spans": the request-spanning schedule, final rows by TMA ("+staged": through pointer
    # stores, for rows that are not evenly strided), cut requests merged from partials copied by TMA.
    reports = _compile_report([["seesaw", "", True, 16, False], ["seesaw", "", False, 64, False],
                               ["seesaw+box64", "", False, 64, False], ["pair", "", True, 16, False],
                               ["pair+box64", "", False, 64, False],
                               ["pair+box64+spans", "", True, 64, False],
                               ["pair+box64+spans+staged", "", True, 64, False]])  # fmt: skip
    for r in reports:
        assert r["wgmma"] > 0 and r["tma"] > 0 and r["regs"] <= 255, r
        assert r["shared"] + r["static_shared"] <= dg.SMEM_LIMIT, r
        assert r["num_warps"] == 8 and r["setmaxnreg"], r
    assert all(r["stack"] == 0 and r["local"] == 0 for r in reports[:-2]), reports[:-2]
    # the request-spanning loop keeps a few item values in local memory between items (64 B a thread in Triton
    # 3.6; the SASS of the pair loop has no local access, checked offline)
    assert all(r["stack"] <= 128 for r in reports[-2:]), reports[-2:]
    # final rows by TMA: two [32, 256] output boxes a warpgroup (4 TMA stores each in the PTX, one a warp)
    assert reports[-2]["tma"] > reports[-1]["tma"], reports[-2:]
    # 64-row boxes: half the TMA copies of 32-row boxes (seesaw: 30 -> 15 in the PTX)
    assert reports[2]["tma"] * 2 == reports[1]["tma"] and reports[4]["tma"] * 2 == reports[3]["tma"], reports


def test_gluon_decode_unsupported_on_cpu():
    q = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    cache = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    assert not dg.gluon_decode_supported(q, cache, None)  # a CPU tensor is refused before the plan is read
    assert dg.gluon_decode_config(128, 1) == (64, 1)
    assert dg.gluon_decode_config(16, 4) == (16, 4)
    assert dg.gluon_decode_config(24, 2) == (32, 2)
    cache8 = cache.to(torch.float8_e4m3fn)
    assert not dg.gluon_decode_supported(q, cache8, None, "fp8")
    assert not dg.gluon_decode_supported(q, cache8, None, "int8")
    # the fp8 path takes 64-key tiles only (refused before any launch)
    with pytest.raises(ValueError, match="fp8 cache"):
        dg.mla_decode_split_gluon(q, cache8, None, None, None, None, None, None, 1.0, 1.0, True, 512, block_n=32)
    with pytest.raises(ValueError, match="variant must be"):
        dg.mla_decode_split_gluon(q, cache, None, None, None, None, None, None, 1.0, 1.0, True, 512, variant="x")
    with pytest.raises(ValueError, match="seesaw"):  # bf16 caches and 64-key tiles only
        dg.mla_decode_split_gluon(q, cache8, None, None, None, None, None, None, 1.0, 1.0, True, 512, variant="seesaw")
    with pytest.raises(ValueError, match="seesaw"):
        dg.mla_decode_split_gluon(
            q, cache, None, None, None, None, None, None, 1.0, 1.0, True, 512, block_n=32, variant="seesaw"
        )
    with pytest.raises(ValueError, match="box_rows"):  # 64-row boxes: seesaw kernels, 64-token pages
        dg.mla_decode_split_gluon(q, cache, None, None, None, None, None, None, 1.0, 1.0, True, 512, box_rows=64)
    with pytest.raises(ValueError, match="multiple of 64"):
        dg.mla_decode_split_gluon(
            q, cache[:, :32], None, None, None, None, None, None, 1.0, 1.0, True, 512, variant="seesaw", box_rows=64
        )
    with pytest.raises(ValueError, match="16 bytes at a time"):  # q's rows are copied 16 bytes a thread
        q_odd = torch.zeros(1, 16, 584, dtype=torch.bfloat16)[..., :576]
        dg.mla_decode_split_gluon(q_odd, cache, None, None, None, None, None, None, 1.0, 1.0, True, 512, variant="pair")
    with pytest.raises(ValueError, match="spans needs"):  # the request-spanning schedule: the pair kernel only
        dg.mla_decode_split_gluon(
            q, cache, None, None, None, None, None, None, 1.0, 1.0, True, 512, variant="seesaw", spans=object()
        )


def test_gluon_narrow_rules():
    # which fp8 calls take the narrow kernel (heads x max query length <= 32), its row foldings and raw stages, and
    # the refusals of variant="narrow" before any launch
    from types import SimpleNamespace

    from openmla.ops import decode as dec
    from openmla.ops.gluon import decode_narrow as gn

    assert [dec._gluon_variant("fp8", h, ql, 128, 132) for h, ql in ((16, 1), (16, 2), (32, 1), (33, 1), (16, 3))] == [
        "narrow", "narrow", "narrow", "ws", "ws"]  # fmt: skip
    assert dec._gluon_variant("auto", 16, 1, 128, 132) == "seesaw"
    assert [gn.narrow_config(h, ql) for h, ql in ((1, 1), (6, 5), (8, 4), (16, 1), (16, 2), (20, 1), (32, 1))] == [
        (1, 8), (8, 4), (8, 4), (16, 1), (16, 2), (32, 1), (32, 1)]  # fmt: skip
    assert [gn.raw_stages(hb) for hb in (8, 16, 32)] == [3, 3, 2]
    q = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    cache8 = torch.zeros(2, 64, 576, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    args = (None, None, None, SimpleNamespace(max_query_len=4), None, None, 1.0, 1.0, True, 512)
    with pytest.raises(ValueError, match="narrow"):  # 16 heads x 4 rows
        dg.mla_decode_split_gluon(q, cache8, *args, variant="narrow")
    with pytest.raises(ValueError, match="narrow"):  # a bf16 cache
        dg.mla_decode_split_gluon(q[:, :4], cache8.to(torch.bfloat16), *args, variant="narrow")


def test_gluon_q_copyable():
    # the seesaw kernels copy q's rows 16 bytes a thread (cp.async): last dim contiguous, token and head strides in
    # multiples of 16 elements, a 16-byte-aligned base; gluon_decode_supported sends any other q to the portable tier
    q = torch.zeros(3, 16, 576, dtype=torch.bfloat16)
    assert dg._q_copyable(q)
    assert dg._q_copyable(torch.zeros(3, 16, 1024, dtype=torch.bfloat16)[..., :576])  # a wider row, 1024 apart
    assert not dg._q_copyable(torch.zeros(3, 16, 584, dtype=torch.bfloat16)[..., :576])  # rows 584 apart
    assert not dg._q_copyable(torch.zeros(3, 576, 16, dtype=torch.bfloat16).transpose(1, 2))  # last dim strided
    assert not dg._q_copyable(torch.zeros(3 * 16 * 576 + 1, dtype=torch.bfloat16)[1:].view(3, 16, 576))  # 2 B off


# ---------------------------------------------------------------------------------------------------
# GPU (sm90) tests

# A barrier-phase bug in a kernel hangs rather than fails, and a hung CUDA call cannot be interrupted by a
# signal: where pytest-timeout is installed, every GPU test gets a limit with the "thread" method (the plugin
# dumps the stacks, naming the hung test, and ends the session instead of hanging it). The limit covers the
# test's compiles (a few seconds per kernel specialisation).
GPU_TEST_TIMEOUT_S = 90


def _gpu_test(fn):
    fn = pytest.mark.hopper(fn)
    if importlib.util.find_spec("pytest_timeout") is not None:
        fn = pytest.mark.timeout(GPU_TEST_TIMEOUT_S, method="thread")(fn)
    return fn


VARIANTS = [
    {"block_n": 64, "stages": 2},  # warp-specialised (TMA producer warp): fp8 caches
    {"block_n": 32, "stages": 3},
    # two warpgroup partitions: alternate 64-key tiles ("seesaw"), or pairs of tiles in FlashMLA's order ("pair")
    {"variant": "seesaw"},
    {"variant": "pair"},
    # (these pick one 64-row TMA box per 64-key tile where pages and splits are multiples of 64, as every plan
    # here at page 64; two 32-row boxes at page 32 or on forced 32-token tilings); two 32-row boxes forced:
    {"variant": "seesaw", "box_rows": 32},
    {"variant": "pair", "box_rows": 32},
]
KERNEL_KW = {
    "ws": {},
    "ws-n32": {"block_n": 32, "stages": 3},
    "fp8": {},
    "fp8-narrow": {"variant": "narrow"},
    "seesaw": {"variant": "seesaw"},
    "pair": {"variant": "pair"},
    "seesaw+box32": {"variant": "seesaw", "box_rows": 32},
    "pair+box32": {"variant": "pair", "box_rows": 32},
}
SEESAW_KERNELS = ["seesaw", "pair", "seesaw+box32", "pair+box32"]


def _variant_id(i):
    v = VARIANTS[i]
    if "variant" not in v:
        return "n{}s{}".format(v["block_n"], v["stages"])
    return v["variant"] + ("+box32" if v.get("box_rows") == 32 else "")


def _batch(device, heads, qlens, lens, page, bad_tail=False, fp8=False):
    """A paged bf16 (or e4m3, ``fp8``) cache with random rows for the requests and NaN in every unused row."""
    B = len(lens)
    W = max(1, -(-max(lens) // page)) + 1  # one spare column: entries past a request's pages
    num_blocks = B * W + 3
    rows = torch.randn(num_blocks, page, 576, device=device)
    # fp8: values ~ N(0, 1) after dequantisation (stored * KV_SCALE)
    cache = (rows / KV_SCALE / 4).to(torch.float8_e4m3fn) if fp8 else rows.to(torch.bfloat16)
    block_table = torch.randperm(num_blocks, device=device)[: B * W].view(B, W).int()
    flat = cache.view(-1, 576)
    used = torch.zeros(num_blocks * page, dtype=torch.bool, device=device)
    for b, n in enumerate(lens):
        pos = torch.arange(n, device=device)
        used[block_table[b, pos // page].long() * page + pos % page] = True
        if bad_tail:  # block ids past the sequence: -1 and out of range (must never be read)
            first = -(-n // page)
            block_table[b, first:] = torch.where(torch.arange(W - first, device=device) % 2 == 0, -1, num_blocks + 7)
    if fp8:
        flat.view(torch.uint8)[~used] = 0x7F  # e4m3fn NaN
    else:
        flat[~used] = float("nan")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    qsl = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32, device=device)
    q = torch.randn(int(qsl[-1]), heads, 576, device=device).to(torch.bfloat16)
    return q, cache, block_table, seq_lens, qsl


def _qlens(kind, B):
    if kind == "varlen":
        return [1 + (3 * b) % 5 for b in range(B)]
    return [int(kind)] * B


def _gluon_decode(q, cache, bt, sl, qsl, causal, num_sms=None, spans=None, **kw):
    """The Gluon split kernel and the reduce; ``spans`` ("cut", "snap" or "auto"): the request-spanning schedule
    over ``num_sms`` in that mode (the kernel merges its pieces: no reduce)."""
    from openmla.ops.decode import _mla_decode_reduce
    from openmla.ops.plan_spans import plan_spans

    T, H, _ = q.shape
    fp8 = cache.dtype == torch.float8_e4m3fn
    kv_dtype = "fp8" if fp8 else "auto"
    kv_s = KV_SCALE if fp8 else 1.0
    plan = openmla.plan_decode(sl, qsl, H, num_sms=num_sms, kv_cache_dtype=kv_dtype)
    assert dg.gluon_decode_supported(q, cache, plan, kv_dtype)
    sp = None
    if spans:
        block_h, q_per = dg.gluon_decode_config(H, plan.max_query_len)
        readers = -(-H // block_h) * -(-plan.max_query_len // q_per)
        sp = plan_spans(sl, qsl, max(1, plan.num_sms // readers), readers, plan.capacity, mode=spans)
    out = torch.empty(T, H, 512, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    dg.mla_decode_split_gluon(q, cache, bt, sl, qsl, plan, out, lse, SCALE * kv_s * LOG2E, kv_s, causal, 512,
                              spans=sp, **kw)  # fmt: skip
    if sp is None:  # (the spanning kernel merges its pieces itself)
        _mla_decode_reduce(qsl, plan, out, lse, 512)
    return out, lse, (plan if sp is None else sp)


def _check(q, cache, bt, sl, qsl, causal, num_sms=None, **kw):
    out, lse, plan = _gluon_decode(q, cache, bt, sl, qsl, causal, num_sms, **kw)
    kv_scale = KV_SCALE if cache.dtype == torch.float8_e4m3fn else None
    ref_out, ref_lse = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, causal=causal, kv_scale=kv_scale)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)
    return out, lse, plan


@_gpu_test
@pytest.mark.parametrize("variant", range(len(VARIANTS)), ids=_variant_id)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("qlen", ["1", "2", "4", "varlen"])
@pytest.mark.parametrize("heads", [16, 32, 64, 128])
def test_gluon_decode(heads, qlen, causal, variant, device):
    lens = [4096, 0, 3, 8191, 1000, 33, 2048, 17]  # ragged, one empty request, tails inside pages
    q, cache, bt, sl, qsl = _batch(device, heads, _qlens(qlen, len(lens)), lens, 64)
    _check(q, cache, bt, sl, qsl, causal, **VARIANTS[variant])


@_gpu_test
@pytest.mark.parametrize("num_sms", [4, 132])
@pytest.mark.parametrize("variant", range(len(VARIANTS)), ids=_variant_id)
def test_gluon_decode_splits(num_sms, variant, device):
    # many splits (long requests, few or many SMs to balance over), block ids past the sequence invalid
    lens = [30001, 9001, 12345, 64, 0]
    q, cache, bt, sl, qsl = _batch(device, 128, [1, 2, 1, 3, 1], lens, 64, bad_tail=True)
    _, _, plan = _check(q, cache, bt, sl, qsl, True, num_sms=num_sms, **VARIANTS[variant])
    assert int(plan.num_splits.max()) > 1


@_gpu_test
@pytest.mark.parametrize("kernel", ["ws", "ws-n32", "seesaw", "pair", "fp8", "fp8-narrow"])  # (32-row boxes: 32-token
# splits)
def test_gluon_decode_split_starts_inside_pages(kernel, device, monkeypatch):
    # splits of 32-token granularity start at multiples of 32 that are not multiples of the 64-token page:
    # a 64-key tile is then two boxes on two pages, and a split's last tile can be half empty. The GPU
    # planner's own tiles are 64 tokens for bf16 at these rows (32 for fp8), so the tiling is forced.
    import dataclasses

    from openmla.ops import plan as plan_mod

    tiling = plan_mod.choose_tiling
    monkeypatch.setattr(plan_mod, "choose_tiling", lambda *a, **kw: dataclasses.replace(
        tiling(*a, **kw), block_n=32, num_warps=4, num_stages=2, tma=False))  # fmt: skip
    fp8 = kernel.startswith("fp8")
    kv_dtype = "fp8" if fp8 else "auto"
    lens = [30001, 9001, 12345]
    q, cache, bt, sl, qsl = _batch(device, 16, [1, 2, 1], lens, 64, bad_tail=True, fp8=fp8)
    for num_sms in (132, 100, 66, 33, 8):
        plan = openmla.plan_decode(sl, qsl, 16, num_sms=num_sms, kv_cache_dtype=kv_dtype)
        starts = [s * int(plan.split_len[b]) for b in range(3) for s in range(int(plan.num_splits[b]))]
        if any(x % 64 for x in starts):
            break
    else:
        pytest.fail("no planner setting gave split starts inside pages")
    _check(q, cache, bt, sl, qsl, True, num_sms=num_sms, **KERNEL_KW[kernel])


@_gpu_test
@pytest.mark.parametrize("kernel", ["ws", *SEESAW_KERNELS, "fp8"])
@pytest.mark.parametrize("page", [32, 64])
@pytest.mark.parametrize("heads,qlen", [(128, 1), (16, 4)])
def test_gluon_decode_tile_counts(heads, qlen, page, kernel, device):
    # 0 to 5 tiles per work item (short requests are not split): a single tile, none; page 32: the two
    # boxes of a 64-key tile on two pages, block ids past the sequence invalid; the sequence end at every
    # offset of a tile
    lens = [0, 1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 191, 192, 193, 256, 257, 320]
    q, cache, bt, sl, qsl = _batch(device, heads, [qlen] * len(lens), lens, page, bad_tail=True, fp8=kernel == "fp8")
    for causal in (True, False):
        _, _, plan = _check(q, cache, bt, sl, qsl, causal, **KERNEL_KW[kernel])
    assert int(plan.num_splits.max()) == 1, "the planner split a short request: tile counts not as listed"


@_gpu_test
@pytest.mark.parametrize("heads,qlen", [(16, 1), (32, 1), (128, 1), (128, 2), (16, 4)])
def test_gluon_matches_portable(heads, qlen, device):
    lens = [4096, 77, 2048, 1, 5000]
    q, cache, bt, sl, qsl = _batch(device, heads, [qlen] * len(lens), lens, 64)
    out, lse, _ = _gluon_decode(q, cache, bt, sl, qsl, True)
    ref_out, ref_lse = openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, causal=True, backend="triton")
    # both round P to bf16 before P V; they differ only in accumulation order
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)


@_gpu_test
@pytest.mark.parametrize("kernel", ["ws", *SEESAW_KERNELS, "fp8"])
def test_gluon_decode_empty_rows(kernel, device):
    # causal rows that see no key (seq_len < qlen) give out 0 and lse -inf, never NaN
    lens = [2, 0, 40]
    fp8 = kernel == "fp8"
    q, cache, bt, sl, qsl = _batch(device, 32, [4, 3, 1], lens, 64, fp8=fp8)
    out, lse, _ = _gluon_decode(q, cache, bt, sl, qsl, True, **KERNEL_KW[kernel])
    ref_out, ref_lse = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, causal=True, kv_scale=KV_SCALE if fp8 else None)
    assert bool(torch.isneginf(lse[:2]).all()) and float(out[:2].abs().max()) == 0.0
    assert math.isinf(float(lse[4, 0])) and not torch.isnan(out).any()
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)


@_gpu_test
@pytest.mark.parametrize("kernel,heads", [("ws", 32), ("fp8", 32), ("fp8-narrow", 16), ("seesaw", 32), ("pair", 32),
                                          ("pair", 128)])  # fmt: skip
def test_gluon_decode_rows_outside(kernel, heads, device):
    # unchecked (validate=False), a query_start_loc that starts below 0 and ends past T (its last request then has 3
    # rows where the plan allows 2): the Gluon kernels touch no row of the request starting below 0 and none past T,
    # and the other rows come out as for the checked batch. Every request split (num_sms 8), so the reduce runs too;
    # at h128 the pair kernel runs the request-spanning schedule and merges the pieces itself
    fp8 = kernel.startswith("fp8")
    lens = [3000, 8191, 77, 5000]
    q, cache, bt, sl, qsl = _batch(device, heads, [1, 2, 2, 1], lens, 64, fp8=fp8)
    T = q.shape[0]
    bad = qsl.clone()
    bad[0], bad[-1] = -1, T + 2
    kv_dtype = "fp8" if fp8 else "auto"
    plan = openmla.plan_decode(sl, qsl, heads, num_sms=8, kv_cache_dtype=kv_dtype)
    assert (plan.spans is not None) == (heads == 128), "the spanning schedule not as the test assumes"
    assert int((plan.num_splits if plan.spans is None else plan.spans.num_splits).max()) > 1, "no request split"
    out = torch.full((T, heads, 512), 7.0, dtype=q.dtype, device=device)
    lse = torch.full((T, heads), 7.0, device=device)
    kv = {"kv_cache_dtype": "fp8", "kv_scale": KV_SCALE} if fp8 else {}
    openmla.mla_decode(q, cache, bt, sl, bad, SCALE, plan=plan, out=out, lse=lse, backend="gluon", validate=False,
                       _gluon_kernel={"fp8": "ws", "fp8-narrow": "narrow"}.get(kernel, kernel), **kv)  # fmt: skip
    torch.cuda.synchronize()
    assert bool((out[0] == 7.0).all()) and bool((lse[0] == 7.0).all()), "a request starting below 0 wrote row 0"
    ref_out, ref_lse = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, causal=True, kv_scale=KV_SCALE if fp8 else None)
    assert_close("out", ref_out[1:], out[1:], *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse[1:], lse[1:], 1e-3, 1e-3, 1e-6)


@_gpu_test
@pytest.mark.parametrize("variant", ["pair", "seesaw"])
@pytest.mark.parametrize("q_gain", [1.0, 40.0, 0.01])
def test_gluon_pair_score_jumps(variant, q_gain, device):
    # large scores (q x 40: the row max jumps by tens of units in log2 from tile to tile), ordinary ones and tiny ones
    # (q x 0.01: the pair kernel's lazy reference max never moves after the first tile, so no warp rescales),
    # causal and not, a split request, an empty one
    lens = [8191, 3000, 0, 129, 12345]
    q, cache, bt, sl, qsl = _batch(device, 128, [1, 2, 1, 1, 1], lens, 64)
    q = (q.float() * q_gain).to(torch.bfloat16)
    for causal in (True, False):
        _check(q, cache, bt, sl, qsl, causal, variant=variant)


@_gpu_test
@pytest.mark.parametrize("mode", ["cut", "snap"])
@pytest.mark.parametrize("num_sms", [8, 30, 132])
@pytest.mark.parametrize(
    "heads,qlen", [(128, "1"), (128, "2"), (64, "varlen"), (16, "4"), (16, "1"), (32, "1"), (8, "varlen")]
)
def test_gluon_decode_spans(heads, qlen, num_sms, mode, device):
    # the request-spanning schedule: each program loops over its group's items, last to first (the mbarrier phases
    # run on across them); "cut": requests cut into pieces (up to 27 here), which the kernel merges through
    # partials and flags; "snap": whole requests. A request without keys, tails inside pages, block ids past the
    # sequence invalid
    lens = [4096, 0, 3, 8191, 1000, 33, 2048, 17, 129, 12345]
    q, cache, bt, sl, qsl = _batch(device, heads, _qlens(qlen, len(lens)), lens, 64, bad_tail=True)
    for causal in (True, False):
        _, _, spans = _check(q, cache, bt, sl, qsl, causal, num_sms=num_sms, spans=mode, variant="pair")
        assert int(spans.flags.abs().sum()) == 0, "a flag was not reset"
    if mode == "snap":
        assert int(spans.num_splits.max()) == 1
    else:  # (every case has a program with several items or a request in several pieces; most have both)
        assert int(spans.group_indptr.diff().max()) > 1 or int(spans.num_splits.max()) > 1


@_gpu_test
@pytest.mark.parametrize("mode", ["snap", "cut"])
@pytest.mark.parametrize("view", ["padded", "token_major"])
def test_gluon_pair_out_views(view, mode, device):
    # the pair kernel on the spanning schedule stores final rows by TMA where the rows of ``out`` are evenly strided
    # (here padded to 1024 elements) and falls back to the staged stores elsewhere (here heads strided apart from
    # tokens); q-lengths 1-5. In cut mode: the same two ways out after the merge of a cut request's pieces
    from openmla.ops.plan_spans import plan_spans

    lens = [4096, 0, 3, 8191, 1000, 33, 2048, 17]
    q, cache, bt, sl, qsl = _batch(device, 128, _qlens("varlen", len(lens)), lens, 64)
    T, H = q.shape[:2]
    if view == "padded":
        out = torch.full((T, H, 1024), 7.0, dtype=torch.bfloat16, device=device)[..., :512]
    else:
        out = torch.full((H, T, 512), 7.0, dtype=torch.bfloat16, device=device).transpose(0, 1)
    plan = openmla.plan_decode(sl, qsl, H, num_sms=40)  # (4 groups of 10 readers)
    block_h, q_per = dg.gluon_decode_config(H, plan.max_query_len)
    assert (dg._out_desc(out, block_h) is not None) == (view == "padded")
    readers = -(-H // block_h) * -(-plan.max_query_len // q_per)
    sp = plan_spans(sl, qsl, max(1, plan.num_sms // readers), readers, plan.capacity, mode=mode)
    assert (int(sp.num_splits.max()) > 1) == (mode == "cut")
    lse = torch.empty(T, H, dtype=torch.float32, device=device)
    dg.mla_decode_split_gluon(q, cache, bt, sl, qsl, plan, out, lse, SCALE * LOG2E, 1.0, True, 512, spans=sp,
                              variant="pair")  # fmt: skip
    assert int(sp.flags.abs().sum()) == 0, "a flag was not reset"
    ref_out, ref_lse = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, causal=True)
    assert_close("out", ref_out, out.float(), *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)
    if view == "padded":  # nothing past each row's 512 elements
        assert bool((out.as_strided((T, H, 1024), out.stride())[..., 512:] == 7.0).all())


@_gpu_test
def test_mla_decode_spans(device):
    # mla_decode's default at h128 when the batch fills the SMs: the plan carries the request-spanning schedule
    # (num_sms=8 here, so that a small batch fills them; a ragged batch, so requests are cut), the pair kernel runs it
    # and merges the cut requests; twice with the same plan (the flags reset themselves)
    lens = [3000, 0, 64, 8191, 5000, 77]
    q, cache, bt, sl, qsl = _batch(device, 128, [1, 1, 2, 1, 2, 1], lens, 64)
    plan = openmla.plan_decode(sl, qsl, 128, num_sms=8)
    assert plan.spans is not None and int(plan.spans.num_splits.max()) > 1
    ref_out, ref_lse = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, causal=True)
    for _ in range(2):
        out, lse = openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, causal=True, plan=plan)
        assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
        assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)


@_gpu_test
@pytest.mark.parametrize("backend", ["gluon", "auto"])
def test_mla_decode_backend(backend, device):
    # the public entry point with the Gluon tier selected (forced, or by "auto" at 64 rows)
    lens = [3000, 0, 64, 8191]
    q, cache, bt, sl, qsl = _batch(device, 128, [1, 1, 2, 1], lens, 64)
    out, lse = openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, causal=True, backend=backend)
    ref_out, ref_lse = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, causal=True)
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)


# fp8 (e4m3) cache: TMA'd as fp8, widened to fp16 in shared memory by the consumers
@_gpu_test
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("qlen", ["1", "2", "varlen"])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_gluon_decode_fp8(heads, qlen, causal, device):
    lens = [4096, 0, 3, 8191, 1000, 33, 2048, 17]  # NaN bytes (0x7F) in every row past a request
    q, cache, bt, sl, qsl = _batch(device, heads, _qlens(qlen, len(lens)), lens, 64, fp8=True)
    _check(q, cache, bt, sl, qsl, causal)


@_gpu_test
@pytest.mark.parametrize("num_sms", [4, 132])
def test_gluon_decode_fp8_splits(num_sms, device):
    lens = [30001, 9001, 12345, 64, 0]
    q, cache, bt, sl, qsl = _batch(device, 128, [1, 2, 1, 3, 1], lens, 64, bad_tail=True, fp8=True)
    _, _, plan = _check(q, cache, bt, sl, qsl, True, num_sms=num_sms)
    assert int(plan.num_splits.max()) > 1


# the narrow fp8 kernel (heads x query rows <= 32): N = HB = BLOCK_H x Q_PER of 8, 16 or 32 rows
NARROW_CASES = [(1, "1"), (6, "varlen"), (8, "4"), (16, "1"), (16, "2"), (20, "1"), (32, "1"), (3, "varlen")]


@_gpu_test
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads,qlen", NARROW_CASES)
def test_gluon_decode_narrow(heads, qlen, causal, device):
    # ragged lengths, an empty request, tails inside pages, NaN bytes in every unused row; h6 x 5 rows: 2 query
    # blocks of 4 tokens (N_QB 2); against the reference and against the ws kernel on the same inputs (both fp16)
    from openmla.ops.gluon import decode_narrow as gn

    lens = [4096, 0, 3, 8191, 1000, 33, 2048, 17]
    q, cache, bt, sl, qsl = _batch(device, heads, _qlens(qlen, len(lens)), lens, 64, fp8=True)
    block_h, q_per = gn.narrow_config(heads, int((qsl[1:] - qsl[:-1]).max()))
    assert block_h * q_per in (8, 16, 32)
    out, lse, _ = _check(q, cache, bt, sl, qsl, causal, variant="narrow")
    ws_out, ws_lse, _ = _gluon_decode(q, cache, bt, sl, qsl, causal, variant="ws")
    assert_close("out", ws_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ws_lse, lse, 1e-4, 1e-4, 1e-6)


@_gpu_test
@pytest.mark.parametrize("page", [32, 64, 256])
@pytest.mark.parametrize("heads,qlen", [(16, 1), (8, 4)])
def test_gluon_decode_narrow_tile_counts(heads, qlen, page, device):
    # 0 to 5 tiles per work item: one box pair per 64-key tile through a 2- or 3-stage raw ring (every lap of its
    # parities), page 32: a tile's two boxes on two pages, block ids past the sequence invalid, the sequence end at
    # every offset of a tile
    lens = [0, 1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 191, 192, 193, 256, 257, 320]
    q, cache, bt, sl, qsl = _batch(device, heads, [qlen] * len(lens), lens, page, bad_tail=True, fp8=True)
    for causal in (True, False):
        _, _, plan = _check(q, cache, bt, sl, qsl, causal, variant="narrow")
    # (the fp8 plan cuts the two longest into 2 splits of 3 and 2 tiles)
    assert int(plan.num_splits.max()) <= 2, "the planner split a short request further: tile counts not as listed"


@_gpu_test
@pytest.mark.parametrize("num_sms", [4, 132])
def test_gluon_decode_narrow_splits(num_sms, device):
    # many splits (partials + the reduce), block ids past the sequence invalid, up to 3 query rows (h8: 24 rows)
    lens = [30001, 9001, 12345, 64, 0]
    q, cache, bt, sl, qsl = _batch(device, 8, [1, 2, 1, 3, 1], lens, 64, bad_tail=True, fp8=True)
    _, _, plan = _check(q, cache, bt, sl, qsl, True, num_sms=num_sms, variant="narrow")
    assert int(plan.num_splits.max()) > 1


@_gpu_test
def test_gluon_decode_narrow_empty_rows(device):
    # causal rows that see no key (seq_len < qlen) give out 0 and lse -inf, never NaN
    lens = [2, 0, 40]
    q, cache, bt, sl, qsl = _batch(device, 8, [4, 3, 1], lens, 64, fp8=True)
    out, lse, _ = _gluon_decode(q, cache, bt, sl, qsl, True, variant="narrow")
    ref_out, ref_lse = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, causal=True, kv_scale=KV_SCALE)
    assert bool(torch.isneginf(lse[:2]).all()) and float(out[:2].abs().max()) == 0.0
    assert math.isinf(float(lse[4, 0])) and not torch.isnan(out).any()
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)


@_gpu_test
@pytest.mark.parametrize("backend", ["gluon", "auto"])
@pytest.mark.parametrize("heads,qlen", [(128, 1), (16, 4), (16, 1), (16, 2)])
def test_mla_decode_fp8_backend(heads, qlen, backend, device):
    # the public entry point with an fp8 cache ("auto" runs it on the Gluon tier on sm90), and the portable
    # kernel forced on the same plan (on sm90 its tiles are the ones sized for the Gluon tier)
    lens = [3000, 0, 64, 8191, 77]
    q, cache, bt, sl, qsl = _batch(device, heads, [qlen] * len(lens), lens, 64, fp8=True)
    kv = {"kv_cache_dtype": "fp8", "kv_scale": KV_SCALE}
    out, lse = openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, causal=True, backend=backend, **kv)
    ref_out, ref_lse = mla_decode_ref(q, cache, bt, sl, qsl, SCALE, causal=True, kv_scale=KV_SCALE)
    assert not torch.isnan(out).any()
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)
    port_out, port_lse = openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, causal=True, backend="triton", **kv)
    assert_close("out", port_out, out, *TOLERANCES[torch.bfloat16])  # both compute in fp16
    assert_close("lse", port_lse, lse, 1e-3, 1e-3, 1e-6)


def test_backend_errors(device):
    q = torch.randn(1, 16, 576, device=device).to(torch.float16)
    cache = torch.randn(4, 64, 576, device=device).to(torch.float16)
    bt = torch.arange(4, dtype=torch.int32, device=device).view(1, 4)
    sl = torch.tensor([100], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="backend='gluon' needs"):  # fp16 is not handled by the Gluon tier
        openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, backend="gluon")
    with pytest.raises(ValueError, match="backend must be"):
        openmla.mla_decode(q, cache, bt, sl, qsl, SCALE, backend="cuda")
