"""The Hopper (Gluon) prefill kernel: an offline sm90 compile report on the CPU, and the kernel against the
fp32 reference and the Triton ``flash_attn_varlen`` on an sm90 GPU (``hopper`` marker)."""

import faulthandler
import itertools
import os

import pytest
import torch

import openmla
from openmla.ops.gluon import prefill as pg
from openmla.reference.prefill import flash_attn_varlen_ref
from openmla.utils.sm90_report import run_report_script
from openmla.utils.testing import TOLERANCES, assert_close

SCALE = 192**-0.5

# (BLOCK_N, STAGES, CAUSAL, PINGPONG, GROUP, SCALE_POS)
COMPILE_VARIANTS = [
    (128, 2, True, True, 1, True),  # the default
    (128, 2, False, True, 1, True),
    (128, 2, True, False, 1, True),
    (128, 2, True, True, 8, False),
    (64, 3, True, True, 1, True),
    (64, 4, False, False, 16, True),
    (128, 2, True, True, 1, True, True),  # fp8 q / k (7th field: FP8)
    (128, 3, True, True, 1, True, True),
    (128, 2, False, True, 8, False, True),
]

# bytes of stack allowed: the bf16 128-key builds keep 5 words there (the first item's id, values the epilogue
# reads), stored once before the partitions start and reloaded once an item, outside the key loop
SPILL_BOUND = 24

_COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from openmla.utils.sm90_report import resource_report
from openmla.ops.gluon import prefill as g

NVMMA = ("NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, transposed=False, "
         "fp4_padded=False, cga_layout=[])")
fn = g._flash_attn_varlen_gluon_kernel
report = []
for v in json.loads(sys.argv[1]):
    block_n, stages, causal, pingpong, group, scale_pos = v[:6]
    fp8 = len(v) > 6 and v[6]
    q_bufs = 2 if g._smem_bytes(block_n, stages, fp8, 2) <= g.SMEM_LIMIT else 1  # the launcher's default
    cons = dict(GROUP=group, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal, SCALE_POS=scale_pos, PINGPONG=pingpong,
                HEAD_BLOCK=1, STORE_LSE=True, PRODUCER_REGS=g.PRODUCER_REGS, CONSUMER_REGS=g.CONSUMER_REGS, num_warps=4,
                FP8=fp8, Q_BUFS=q_bufs)
    blocks = {"q_desc": [64, 128] if fp8 else [64, 64], "q2_desc": [64, 64], "k1_desc": [block_n, 128],
              "k2_desc": [block_n, 64], "v_desc": [block_n, 128]}
    ptr = {"o": "*bf16", "lse": "*fp32", "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32", "counter": "*i32",
           "q_ds": "*fp32", "k_ds": "*fp32", "v_ds": "*fp32"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in cons:
            sig[name] = "constexpr"
        elif name in blocks:
            if fp8 and name != "v_desc":
                lay = (f"NVMMASharedLayout(swizzle_byte_width={min(128, blocks[name][1])}, element_bitwidth=8, "
                       "rank=2, transposed=False, fp4_padded=False, cga_layout=[])")
                sig[name] = f"tensordesc<fp8e4nv{blocks[name]},{lay}>"
            else:
                sig[name] = f"tensordesc<bf16{blocks[name]},{NVMMA}>"
        elif name in ptr:
            sig[name] = ptr[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "qk_scale":
            sig[name] = "fp32"
        elif name.startswith("stride_"):  # multiples of 16, as the JIT specialises the contiguous case
            sig[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
    k = triton.compile(GluonASTSource(fn, sig, constexprs=cons, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4))
    report.append(dict(variant=v, **resource_report(k)))
print("REPORT" + json.dumps(report))
"""


def _compile_report(variants):
    return run_report_script(_COMPILE_SCRIPT, variants)


@pytest.mark.skipif(not pg.GLUON_AVAILABLE, reason="triton.experimental.gluon is not installed")
def test_gluon_prefill_compiles_for_sm90():
    # offline sm90 compile (no GPU needed): wgmma + TMA in the PTX, no spill, fits the shared memory,
    # 4 + 4 consumer warps + the producer's warpgroup, registers moved by setmaxnreg
    for r in _compile_report(COMPILE_VARIANTS):
        name = "BLOCK_N={} STAGES={} CAUSAL={} PINGPONG={} GROUP={} SCALE_POS={}".format(*r["variant"][:6])
        name += " FP8" if len(r["variant"]) > 6 else ""
        assert r["wgmma"] > 0 and r["tma"] > 0, f"{name}: {r}"
        assert r["regs"] <= 255 and r["stack"] <= SPILL_BOUND and r["local"] == 0, f"{name}: spills {r}"
        assert r["shared"] + r["static_shared"] <= pg.SMEM_LIMIT, f"{name}: shared memory {r}"
        assert r["num_warps"] == 12 and str(pg.CONSUMER_REGS) in r["setmaxnreg"], f"{name}: {r}"
        assert r["cta_barrier"] == 0, f"{name}: a CTA-wide barrier in the kernel {r}"
        # the output rows leave by 16-byte stores (stores.row_store_layout): 8 a thread and warpgroup
        assert r["st_v4"] >= 8, f"{name}: output stores {r}"


def test_gluon_prefill_unsupported_on_cpu():
    q = torch.zeros(4, 16, 192, dtype=torch.bfloat16)
    k = torch.zeros(4, 16, 192, dtype=torch.bfloat16)
    v = torch.zeros(4, 16, 128, dtype=torch.bfloat16)
    assert not pg.gluon_prefill_supported(q, k, v)
    with pytest.raises(ValueError, match="flash_attn_varlen_gluon needs"):
        cu = torch.tensor([0, 4], dtype=torch.int32)
        pg.flash_attn_varlen_gluon(q, k, v, cu, cu, 4, 4, SCALE)
    assert pg._smem_bytes(128, 2) <= pg.SMEM_LIMIT and pg._smem_bytes(64, 4) <= pg.SMEM_LIMIT
    assert pg._smem_bytes(128, 3) > pg.SMEM_LIMIT
    assert pg._smem_bytes(128, 3, fp8=True) <= pg.SMEM_LIMIT < pg._smem_bytes(128, 4, fp8=True)
    assert pg._smem_bytes(128, 2, True, 2) <= pg.SMEM_LIMIT < pg._smem_bytes(128, 2, False, 2)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    assert not pg.gluon_prefill_supported(q8, k8, v8, fp8=True) and not pg.gluon_prefill_supported(q8, k8, v8)


@pytest.mark.parametrize("rows", [0, 1, 65, 300])
def test_widen_e4m3(rows, device):
    # the fp8 path's V widening (a Triton kernel; torch's cast ran at ~1 TB/s on the H200): every e4m3 byte, from
    # a head-strided view, equal to torch's cast bit for bit; NaN stays NaN on the GPU (the interpreter's cast
    # makes it 480, so the CPU run leaves the two NaN bytes out)
    codes = torch.arange(256, dtype=torch.int32)
    if torch.device(device).type == "cpu":
        codes = codes[(codes & 0x7F) != 0x7F]
    wide = codes[torch.arange(rows * 3 * 96) % codes.numel()].to(torch.uint8).view(torch.float8_e4m3fn)
    wide = wide.reshape(rows, 3, 96).to(device)
    v = torch.cat([wide, wide[..., :32]], dim=-1)[:, :2, 16:80]  # [rows, 2, 64], head stride 128, row stride 384
    got = pg._widen_e4m3(v)
    assert got.is_contiguous() and got.shape == v.shape and got.dtype == torch.bfloat16
    want = v.to(torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num().view(torch.int16), want.nan_to_num().view(torch.int16))


# ---------------------------------------------------------------------------------------------------
# GPU (sm90) tests


# An mbarrier phase bug hangs the GPU instead of failing, and pytest-timeout is not installed: a watchdog thread
# dumps every thread's traceback (the hung test's frame included) to the real stderr (not pytest's capture) and
# ends the process (exit 1) once a test has run this many seconds.
GPU_TEST_TIMEOUT_S = 120.0
_REAL_STDERR = []


def _real_stderr(config):
    if not _REAL_STDERR:
        capman = config.pluginmanager.getplugin("capturemanager")
        if capman is None:
            _REAL_STDERR.append(os.fdopen(os.dup(2), "w"))
        else:
            with capman.global_and_fixture_disabled():  # fd 2 is the terminal / log again in here
                _REAL_STDERR.append(os.fdopen(os.dup(2), "w"))
    return _REAL_STDERR[0]


@pytest.fixture(autouse=True)
def _hang_watchdog(request):
    if request.node.get_closest_marker("hopper") is None or GPU_TEST_TIMEOUT_S <= 0:
        yield
        return
    faulthandler.dump_traceback_later(GPU_TEST_TIMEOUT_S, exit=True, file=_real_stderr(request.config))
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _cu(lens, device):
    return torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=device)


def _problem(device, heads, qlens, klens, h_kv=None, pad_rows=0, v_strided=False):
    """bf16 q/k/v for a ragged batch; ``pad_rows`` extra rows past the last request hold NaN (never read
    as data: the kernel must not let them reach the output)."""
    h_kv = h_kv or heads
    Tq, Tk = sum(qlens) + pad_rows, sum(klens) + pad_rows
    q = torch.randn(Tq, heads, 192, device=device).to(torch.bfloat16)
    k = torch.randn(Tk, h_kv, 192, device=device).to(torch.bfloat16)
    if v_strided:  # v as the second half of a [Tk, h_kv, 256] tensor (head stride 256)
        kv = torch.randn(Tk, h_kv, 256, device=device).to(torch.bfloat16)
        v = kv[..., 128:]
    else:
        v = torch.randn(Tk, h_kv, 128, device=device).to(torch.bfloat16)
    if pad_rows:
        q[sum(qlens) :] = float("nan")
        k[sum(klens) :] = float("nan")
        v[sum(klens) :] = float("nan")
    return q, k, v, _cu(qlens, device), _cu(klens, device)


def _check(q, k, v, cu_q, cu_k, qlens, klens, causal, against_triton=True, sm_scale=SCALE, **kw):
    nq = int(cu_q[-1])
    out, lse = pg.flash_attn_varlen_gluon(q, k, v, cu_q, cu_k, max(qlens), max(klens), sm_scale, causal=causal, **kw)
    torch.cuda.synchronize()  # a hang shows up here, inside this test (the watchdog names it)
    ref_out, ref_lse = flash_attn_varlen_ref(q[:nq], k, v, cu_q, cu_k, sm_scale, causal=causal)
    out, lse = out[:nq], lse[:nq]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)
    if against_triton:
        t_out, t_lse = openmla.flash_attn_varlen(q[:nq], k, v, cu_q, cu_k, max(qlens), max(klens), sm_scale,
                                                 causal=causal, backend="triton")  # fmt: skip
        # both round P to bf16 before P V; they differ in tiling and accumulation order
        assert_close("out vs triton", t_out, out, *TOLERANCES[torch.bfloat16])
        assert_close("lse vs triton", t_lse, lse, 1e-3, 1e-3, 1e-6)
    return out, lse


# The GPU tests run from the simplest mechanism up (with -x the first failure says the most): no key tile at all,
# one tile (scores, softmax, last P V: no loop), two and more tiles (the ring's loop), then the batches below.
@pytest.mark.hopper
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gluon_prefill_no_keys_at_all(causal, device):
    # Tk = 0 (the launcher's 1-row dummy descriptors; n_tiles = 0 everywhere: no ring, no turns) -> out 0, lse -inf
    qlens, klens = [5, 130], [0, 0]
    q, k, v, cu_q, cu_k = _problem(device, 16, qlens, klens)
    assert k.shape[0] == 0
    out, lse = _check(q, k, v, cu_q, cu_k, qlens, klens, causal, against_triton=False)
    assert bool(torch.isneginf(lse).all()) and float(out.abs().max()) == 0.0


@pytest.mark.hopper
@pytest.mark.parametrize("lens", [(1, 1), (64, 64), (128, 128), (129, 300), (300, 700)], ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gluon_prefill_smoke(lens, causal, device):
    # one request, 2 heads: n_tiles 1 (tile 0 + last P V only), then 2-6 tiles (ring laps), against the reference only
    qlens, klens = [lens[0]], [lens[1]]
    q, k, v, cu_q, cu_k = _problem(device, 2, qlens, klens)
    _check(q, k, v, cu_q, cu_k, qlens, klens, causal, against_triton=False)


# (query lengths, key lengths): ragged, length-1 and empty requests, Lk > Lq (a cached prefix), Lk < Lq
# (causal rows that see no key), tile-boundary lengths
BATCHES = {
    "ragged": ([700, 1, 0, 129, 64, 333, 128, 255], [700, 1, 0, 129, 64, 333, 128, 255]),
    "prefix": ([300, 5, 128, 1, 77], [1000, 200, 128, 513, 77]),
    "short_k": ([200, 64, 9], [100, 1, 0]),
}


@pytest.mark.hopper
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", [16, 128])
def test_gluon_prefill(heads, causal, batch, device):
    qlens, klens = BATCHES[batch]
    q, k, v, cu_q, cu_k = _problem(device, heads, qlens, klens)
    _check(q, k, v, cu_q, cu_k, qlens, klens, causal)


@pytest.mark.hopper
@pytest.mark.parametrize("block_n,stages,pingpong", [(128, 2, True), (128, 2, False), (64, 3, True), (64, 4, False)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gluon_prefill_tilings(block_n, stages, pingpong, causal, device):
    qlens, klens = [1500, 3, 640, 0, 191], [2100, 3, 640, 5, 191]
    q, k, v, cu_q, cu_k = _problem(device, 16, qlens, klens)
    _check(q, k, v, cu_q, cu_k, qlens, klens, causal, block_n=block_n, stages=stages, pingpong=pingpong)


@pytest.mark.hopper
@pytest.mark.parametrize("head_block", [2, 4, 12, 1 << 16])  # 12 -> gcd 4 with 16 heads; 1 << 16 -> every head
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gluon_prefill_launch_orders(head_block, causal, device):
    qlens, klens = [700, 3, 0, 300], [900, 3, 5, 300]
    q, k, v, cu_q, cu_k = _problem(device, 16, qlens, klens)
    _check(q, k, v, cu_q, cu_k, qlens, klens, causal, head_block=head_block)


@pytest.mark.hopper
@pytest.mark.parametrize("block_n", [128, 64])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gluon_prefill_nan_tails_and_strides(causal, block_n, device):
    # NaN rows past the last request (a TMA box of the last tile reaches them: the V tail is zeroed by both
    # warpgroups, the K tail masked) and v with head stride 256
    qlens, klens = [333, 70, 1], [400, 70, 2]
    q, k, v, cu_q, cu_k = _problem(device, 16, qlens, klens, pad_rows=300, v_strided=True)
    assert pg.gluon_prefill_supported(q, k, v)
    _check(q, k, v, cu_q, cu_k, qlens, klens, causal, block_n=block_n)


@pytest.mark.hopper
@pytest.mark.parametrize("sm_scale", [-0.05, 0.0])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gluon_prefill_nonpositive_scale(sm_scale, causal, device):
    # SCALE_POS=False: the scores are scaled before the mask and the row max (-inf * 0 would be NaN); NaN rows past
    # the last request reach the last tile's TMA boxes
    qlens, klens = [200, 3, 70], [260, 3, 70]
    q, k, v, cu_q, cu_k = _problem(device, 16, qlens, klens, pad_rows=64)
    _check(q, k, v, cu_q, cu_k, qlens, klens, causal, against_triton=False, sm_scale=sm_scale)


@pytest.mark.hopper
@pytest.mark.parametrize("h_kv", [1, 4])
def test_gluon_prefill_gqa(h_kv, device):
    qlens, klens = [300, 1, 129], [500, 1, 129]
    q, k, v, cu_q, cu_k = _problem(device, 16, qlens, klens, h_kv=h_kv)
    _check(q, k, v, cu_q, cu_k, qlens, klens, True)


@pytest.mark.hopper
def test_gluon_prefill_empty_rows(device):
    # causal, Lk < Lq: the first Lq - Lk rows of a request see no key -> out 0, lse -inf, never NaN
    qlens, klens = [130, 4, 3], [2, 0, 3]
    q, k, v, cu_q, cu_k = _problem(device, 16, qlens, klens)
    out, lse = _check(q, k, v, cu_q, cu_k, qlens, klens, True)
    assert bool(torch.isneginf(lse[:128]).all()) and float(out[:128].abs().max()) == 0.0
    assert bool(torch.isneginf(lse[130:134]).all()) and float(out[130:134].abs().max()) == 0.0
    assert bool(torch.isfinite(lse[128:130]).all())


@pytest.mark.hopper
def test_gluon_prefill_given_outputs_and_untouched_rows(device):
    # out / lse buffers given (out strided), rows past cu_seqlens_q[-1] left as they were
    qlens = [200, 37]
    q, k, v, cu_q, cu_k = _problem(device, 16, qlens, qlens, pad_rows=10)
    q = q.nan_to_num(0.0)
    big = torch.full((q.shape[0], 16, 256), 7.0, dtype=torch.bfloat16, device=device)
    out = big[..., :128]
    lse = torch.full((q.shape[0], 16), 3.0, dtype=torch.float32, device=device)
    o2, l2 = pg.flash_attn_varlen_gluon(q, k, v, cu_q, cu_k, 200, 200, SCALE, causal=True, out=out, lse=lse)
    assert o2 is out and l2 is lse
    ref_out, ref_lse = flash_attn_varlen_ref(q[:237], k, v, cu_q, cu_k, SCALE, causal=True)
    assert_close("out", ref_out, out[:237], *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse[:237], 1e-3, 1e-3, 1e-6)
    assert bool((out[237:] == 7.0).all()) and bool((lse[237:] == 3.0).all()) and bool((big[..., 128:] == 7.0).all())


@pytest.mark.hopper
def test_gluon_prefill_long_matches_triton(device):
    # a long causal request (many ring laps, all four tile kinds) against the Triton kernel only
    qlens = [4096, 1000]
    q, k, v, cu_q, cu_k = _problem(device, 128, qlens, qlens)
    out, lse = pg.flash_attn_varlen_gluon(q, k, v, cu_q, cu_k, 4096, 4096, SCALE, causal=True)
    t_out, t_lse = openmla.flash_attn_varlen(q, k, v, cu_q, cu_k, 4096, 4096, SCALE, causal=True, backend="triton")
    assert not torch.isnan(out).any()
    assert_close("out vs triton", t_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse vs triton", t_lse, lse, 1e-3, 1e-3, 1e-6)


def _fp8_problem(device, heads, qlens, klens, h_kv=None):
    """e4m3 q / k / v scaled into range, their descales, and the cu_seqlens."""
    q, k, v, cu_q, cu_k = _problem(device, heads, qlens, klens, h_kv=h_kv)
    ds = [torch.tensor([s], device=device) for s in (0.02, 0.05, 0.01)]
    q8, k8, v8 = ((x.float() / d).clamp(-448, 448).to(torch.float8_e4m3fn) for x, d in zip((q, k, v), ds))
    return q8, k8, v8, ds, cu_q, cu_k


@pytest.mark.hopper
@pytest.mark.parametrize("block_n,stages", [(128, 2), (128, 3), (64, 4)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gluon_prefill_fp8(causal, block_n, stages, device):
    # fp8 q / k / v (the default on sm90): scores on fp8 tensor cores, V widened to bf16, descales; a
    # ragged batch with an empty request, a request without keys and Lk != Lq, GQA, against the fp32 reference
    # on the same fp8 values and against the portable kernel's fp8 path
    qlens, klens = [300, 0, 1, 129, 40], [700, 17, 0, 129, 20]
    q8, k8, v8, ds, cu_q, cu_k = _fp8_problem(device, 16, qlens, klens, h_kv=4)
    kw = dict(causal=causal, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    out, lse = pg.flash_attn_varlen_gluon(q8, k8, v8, cu_q, cu_k, max(qlens), max(klens), SCALE, causal=causal,
                                          block_n=block_n, stages=stages, descales=tuple(ds))  # fmt: skip
    torch.cuda.synchronize()
    ref_out, ref_lse = flash_attn_varlen_ref(q8, k8, v8, cu_q, cu_k, SCALE, **kw)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)
    t_out, t_lse = openmla.flash_attn_varlen(q8, k8, v8, cu_q, cu_k, max(qlens), max(klens), SCALE,
                                             backend="triton", **kw)  # fmt: skip
    assert_close("out vs triton", t_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse vs triton", t_lse, lse, 1e-3, 1e-3, 1e-6)
    # through flash_attn_varlen: "auto" routes fp8 to this kernel; without descales they default to 1
    g_out, g_lse = openmla.flash_attn_varlen(q8, k8, v8, cu_q, cu_k, max(qlens), max(klens), SCALE, **kw)
    if block_n == pg.BLOCK_N_DEFAULT and stages == pg.STAGES_DEFAULT:
        torch.testing.assert_close(g_out, out, atol=0, rtol=0)
    o1, _ = openmla.flash_attn_varlen(q8, k8, v8, cu_q, cu_k, max(qlens), max(klens), SCALE, causal=causal,
                                      backend="gluon")  # fmt: skip
    # raw e4m3 values give logits ~1e3 here, where the fp8 MMA's accumulation rounding decides the softmax:
    # the default is checked against explicit unit descales on the same kernel, bit for bit
    ones = (torch.ones(1, dtype=torch.float32, device=device),) * 3
    r1, _ = pg.flash_attn_varlen_gluon(q8, k8, v8, cu_q, cu_k, max(qlens), max(klens), SCALE, causal=causal,
                                       descales=ones)  # fmt: skip
    torch.testing.assert_close(o1, r1, atol=0, rtol=0)


@pytest.mark.hopper
@pytest.mark.parametrize("block_n", [128, 64])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gluon_prefill_fp8_nan_tails(causal, block_n, device):
    # e4m3 NaN bytes (0x7F) in the rows past the last request of k and of a head-strided v: the last tile's TMA box
    # reaches them; the K tail is masked and the V rows zeroed in shared memory (0 * NaN would reach the output)
    qlens, klens = [333, 70, 1], [400, 70, 2]
    q8, k8, v8, ds, cu_q, cu_k = _fp8_problem(device, 16, qlens, klens)
    nk, pad = k8.shape[0], 300
    kv = torch.full((nk + pad, 16, 256), 0x7F, dtype=torch.uint8, device=device)
    kv[:nk, :, 128:] = v8.view(torch.uint8)
    v_pad = kv.view(torch.float8_e4m3fn)[..., 128:]  # head stride 256, NaN rows past the keys
    k_pad = torch.full((nk + pad, 16, 192), 0x7F, dtype=torch.uint8, device=device)
    k_pad[:nk] = k8.view(torch.uint8)
    k_pad = k_pad.view(torch.float8_e4m3fn)
    assert bool(v_pad[nk:].float().isnan().all())
    args = (q8, k_pad, v_pad, cu_q, cu_k, max(qlens), max(klens), SCALE)
    out, lse = pg.flash_attn_varlen_gluon(*args, causal=causal, block_n=block_n, descales=tuple(ds))
    torch.cuda.synchronize()
    ref_out, ref_lse = flash_attn_varlen_ref(q8, k8, v8, cu_q, cu_k, SCALE, causal=causal, q_descale=ds[0],
                                             k_descale=ds[1], v_descale=ds[2])  # fmt: skip
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)


# (query lengths, key lengths) for the persistent walk: row blocks past a short request (skipped items), a request
# without keys (items without tiles), Lk != Lq, ring positions that are no multiple of the depth
WALK = ([300, 5, 0, 129, 200, 1], [300, 200, 5, 129, 100, 0])


@pytest.mark.hopper
@pytest.mark.parametrize("programs", [1, 3, 7])
@pytest.mark.parametrize("block_n,stages", [(128, 2), (64, 3)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gluon_prefill_persistent_walk(programs, block_n, stages, causal, device):
    # few persistent programs walk every item (Q, the K / V ring, the wgmma turns and the item ids run on across
    # items): against the reference, and bit for bit equal to one program an SM (each item computes the same
    # whichever program takes it)
    qlens, klens = WALK
    q, k, v, cu_q, cu_k = _problem(device, 4, qlens, klens)
    out, lse = _check(q, k, v, cu_q, cu_k, qlens, klens, causal, against_triton=False, block_n=block_n,
                      stages=stages, programs=programs)  # fmt: skip
    o1, l1 = pg.flash_attn_varlen_gluon(q, k, v, cu_q, cu_k, max(qlens), max(klens), SCALE, causal=causal,
                                        block_n=block_n, stages=stages)  # fmt: skip
    torch.testing.assert_close(o1, out, atol=0, rtol=0)
    torch.testing.assert_close(l1, lse, atol=0, rtol=0)


@pytest.mark.hopper
@pytest.mark.parametrize("programs", [1, 5])
@pytest.mark.parametrize("q_bufs", [1, 2])
def test_gluon_prefill_persistent_walk_fp8(programs, q_bufs, device):
    # fp8 (two Q buffers by default: an item's Q lands while the item before runs; one as in bf16): the same bits
    qlens, klens = WALK
    q8, k8, v8, ds, cu_q, cu_k = _fp8_problem(device, 4, qlens, klens, h_kv=2)
    args = (q8, k8, v8, cu_q, cu_k, max(qlens), max(klens), SCALE)
    out, lse = pg.flash_attn_varlen_gluon(*args, causal=True, descales=tuple(ds), programs=programs, q_bufs=q_bufs)
    o1, l1 = pg.flash_attn_varlen_gluon(*args, causal=True, descales=tuple(ds))
    torch.cuda.synchronize()
    ref_out, ref_lse = flash_attn_varlen_ref(q8, k8, v8, cu_q, cu_k, SCALE, causal=True, q_descale=ds[0],
                                             k_descale=ds[1], v_descale=ds[2])  # fmt: skip
    assert_close("out", ref_out, out, *TOLERANCES[torch.bfloat16])
    assert_close("lse", ref_lse, lse, 1e-3, 1e-3, 1e-6)
    torch.testing.assert_close(o1, out, atol=0, rtol=0)
    torch.testing.assert_close(l1, lse, atol=0, rtol=0)


@pytest.mark.hopper
def test_gluon_prefill_cuda_graph(device):
    # the work counter is a fresh zero inside the captured graph: every replay hands out every item again
    qlens = [700, 129, 40]
    q, k, v, cu_q, cu_k = _problem(device, 16, qlens, qlens)
    want, want_lse = pg.flash_attn_varlen_gluon(q, k, v, cu_q, cu_k, 700, 700, SCALE, causal=True)
    out = torch.empty_like(want)
    lse = torch.empty_like(want_lse)

    def fn():
        pg.flash_attn_varlen_gluon(q, k, v, cu_q, cu_k, 700, 700, SCALE, causal=True, out=out, lse=lse, programs=9)

    fn()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        out.fill_(7.0)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    with pytest.raises(ValueError, match="programs must be a positive int"):
        pg.flash_attn_varlen_gluon(q, k, v, cu_q, cu_k, 700, 700, SCALE, programs=0)
    with pytest.raises(ValueError, match="q_bufs must be 1 or 2"):  # two bf16 Q buffers and the 128-key ring
        pg.flash_attn_varlen_gluon(q, k, v, cu_q, cu_k, 700, 700, SCALE, q_bufs=2)
