"""Offline sm90 compile check of the kernels ``mla_decode`` and ``flash_attn_varlen`` run (no GPU needed).

``python -m openmla.utils.sm90_check [out.json]`` compiles each kernel configuration of ``CASES`` for sm90
(``triton.compile`` with ``GPUTarget("cuda", 90, 32)`` in a subprocess with ``TRITON_INTERPRET=0``) and prints
one JSON line per case: registers, spills, shared memory, wgmma / TMA counts and the SASS instruction count
(:func:`openmla.utils.sm90_report.resource_report`). Two runs (before / after an edit) compare with
``diff``. It takes minutes on a small CPU, so it is a tool, not a test.
"""

from __future__ import annotations

import json
import sys

from openmla.utils.sm90_report import run_report_script

# (kernel, name, constexprs, descriptor blocks): the Gluon decode kernels, the portable decode split and
# reduce kernels, the portable and the Gluon prefill kernels, in the configurations the dispatchers pick
_WS = [(64, 2, True, 64, False), (64, 2, False, 16, False), (64, 2, True, 64, True), (64, 2, False, 16, True)]
CASES: list[dict] = []
for bn, st, causal, bh, fp8 in _WS:
    CASES.append(
        dict(
            kernel="ws",
            name=f"ws bn{bn} st{st} causal{int(causal)} bh{bh} fp8{int(fp8)}",
            cons=dict(
                PAGE=64,
                MAX_QLEN=4,
                BLOCK_H=bh,
                Q_PER=64 // bh,
                BLOCK_N=bn,
                STAGES=st,
                CAUSAL=causal,
                FP8=fp8,
                N_HB=2,
                N_QB=1,
                PRODUCER_REGS=32,
                num_warps=8,
            ),
            box=32,
            fp8=fp8,
        )
    )
# seesaw (PAIR=False); the pair kernel alone, and on the spanning schedule with the merge by TMA, final rows by
# TMA or staged (OUT_TMA False: rows that are not evenly strided); 32- and 64-row boxes
for name, pair, spans, out_tma, bh, causal, box in [
    ("seesaw", False, False, False, 16, True, 32),
    ("seesaw", False, False, False, 64, False, 64),
    ("seesaw", False, False, False, 32, True, 64),
    ("pair", True, False, False, 64, False, 64),
    ("pair", True, False, False, 16, True, 32),
    ("pair+spans", True, True, True, 64, True, 64),
    ("pair+spans", True, True, True, 32, True, 64),
    ("pair+spans", True, True, False, 64, False, 64),
    ("pair+spans", True, True, True, 64, True, 32),
]:
    CASES.append(
        dict(
            kernel="seesaw",
            name=f"{name} out_tma{int(out_tma)} bh{bh} causal{int(causal)} box{box}",
            cons=dict(
                PAGE=64,
                MAX_QLEN=4,
                BLOCK_H=bh,
                Q_PER=64 // bh,
                CAUSAL=causal,
                WG_REGS=240,
                N_HB=2,
                N_QB=1,
                PAIR=pair,
                SPANS=spans,
                OUT_TMA=out_tma,
                MERGE_TMA=spans,
                num_warps=4,
                # the flags of the variants deleted since (their defaults)
                NAMED=False,
                R_FIRST=False,
                OPAQUE=True,
                TRACE=False,
                trace=None,
                EARLY=3 if pair else 0,
            ),
            box=box,
            fp8=False,
        )
    )
for bh, qp, bn, w, st, tma_, fp8 in [
    (16, 1, 64, 4, 3, False, False),
    (32, 1, 64, 4, 3, False, False),
    (16, 1, 32, 4, 2, True, True),
    (16, 1, 64, 8, 2, True, True),
    (64, 1, 64, 8, 2, False, False),
]:
    CASES.append(
        dict(
            kernel="decode",
            name=f"decode bh{bh} bn{bn} w{w} st{st} tma{int(tma_)} fp8{int(fp8)}",
            cons=dict(
                PAGE=64,
                MAX_QLEN=1,
                D_V=512,
                D_R=64,
                BLOCK_H=bh,
                Q_PER=qp,
                BLOCK_N=bn,
                PAGE_ALIGNED=True,
                USE_TMA=tma_,
                MAX_PAGES=128,
                CAUSAL=True,
                DC=128,
                D_RP=64,
                COMPUTE="fp16" if fp8 else "bf16",
                DOT_PRECISION="tf32",
                PDL=False,
            ),
            warps=w,
            stages=st,
            fp8=fp8,
        )
    )
for hb, bd, bs in [(1, 128, 64), (4, 512, 2)]:
    CASES.append(
        dict(
            kernel="reduce",
            name=f"reduce hb{hb} bd{bd} bs{bs}",
            cons=dict(MAX_QLEN=1, D_V=512, BLOCK_S=bs, BLOCK_HB=hb, BLOCK_D=bd, PDL=False),
            warps=4,
            stages=3,
        )
    )
for causal, dt, bm, bn, w, st in [
    (True, "bf16", 128, 64, 8, 2),
    (False, "bf16", 128, 128, 8, 2),
    (True, "fp8e4nv", 128, 64, 8, 3),
    (True, "bf16", 64, 32, 4, 2),
]:
    fp8 = dt == "fp8e4nv"
    CASES.append(
        dict(
            kernel="prefill",
            name=f"prefill causal{int(causal)} {dt} bm{bm} bn{bn} w{w} st{st}",
            cons=dict(
                GROUP=1,
                D1=128,
                BLOCK_D1=128,
                D2=64,
                BLOCK_D2=64,
                HAS_D2=True,
                D_V=128,
                BLOCK_DV=128,
                CAUSAL=causal,
                STORE_LSE=True,
                HAS_DESCALE=fp8,
                QK_DTYPE=dt,
                PV_DTYPE="bf16",
                DOT_PRECISION="tf32",
                SCALE_POS=True,
                BLOCK_M=bm,
                BLOCK_N=bn,
                KV_TMA=False,
                PIPE_QK=False,
            ),
            warps=w,
            stages=st,
            dtype="fp8e4nv" if fp8 else "bf16",
        )
    )
for bn, st, causal, pp, group, hb in [
    (128, 2, True, True, 1, 1),
    (128, 2, False, True, 1, 1),
    (64, 3, True, False, 8, 1),
]:
    name = f"prefill_gluon bn{bn} st{st} causal{int(causal)} pp{int(pp)} g{group}"
    CASES.append(
        dict(
            kernel="prefill_gluon",
            name=name,
            cons=dict(
                GROUP=group,
                BLOCK_N=bn,
                STAGES=st,
                CAUSAL=causal,
                SCALE_POS=True,
                PINGPONG=pp,
                HEAD_BLOCK=hb,
                STORE_LSE=True,
                PRODUCER_REGS=24,
                CONSUMER_REGS=240,
                FP8=False,
                num_warps=4,
            ),
        )
    )

_SCRIPT = r"""
import importlib, json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from openmla.utils.sm90_report import resource_report

def mod(*names):
    for n in names:
        try:
            return importlib.import_module(n)
        except ImportError:
            pass
    raise ImportError(names)

dg = mod("openmla.ops.gluon.decode", "openmla.ops.decode_gluon")
gs = mod("openmla.ops.gluon.decode_seesaw", "openmla.ops.decode_gluon_seesaw")
pg = mod("openmla.ops.gluon.prefill", "openmla.ops.prefill_gluon")
from openmla.ops import decode as dp, prefill as pp

def nvmma(swizzle, bits):
    return (f"NVMMASharedLayout(swizzle_byte_width={swizzle}, element_bitwidth={bits}, rank=2, transposed=False, "
            "fp4_padded=False, cga_layout=[])")
DT = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp8e4nv": tl.float8e4nv}
ptr = {"q": "*bf16", "block_table": "*i32", "seq_lens": "*i32", "query_start_loc": "*i32", "work_req": "*i32",
       "work_split": "*i32", "num_splits": "*i32", "split_len": "*i32", "out": "*bf16", "lse": "*fp32",
       "o_part": "*fp32", "lse_part": "*fp32", "group_indptr": "*i32", "span_indptr": "*i32", "span_flags": "*i32",
       "work_indptr": "*i32", "merge_info": "*i32", "num_merge": "*i32", "o": "*bf16", "cu_seqlens_q": "*i32",
       "cu_seqlens_k": "*i32", "q_descale": "*fp32", "k_descale": "*fp32", "v_descale": "*fp32", "q_ds": "*fp32",
       "k_ds": "*fp32", "v_ds": "*fp32"}
report = []
for case in json.loads(sys.argv[1]):
    kind = case["kernel"]
    fn = {"ws": getattr(dg, "_mla_decode_gluon_ws_kernel", None), "seesaw": gs._mla_decode_gluon_seesaw_kernel,
          "decode": dp._mla_decode_fwd_kernel, "reduce": dp._mla_decode_reduce_kernel,
          "prefill": pp._flash_attn_varlen_fwd_kernel, "prefill_gluon": pg._flash_attn_varlen_gluon_kernel}[kind]
    cons = {k: v for k, v in case["cons"].items() if k in fn.arg_names or k == "num_warps"}
    for k in ("COMPUTE", "QK_DTYPE", "PV_DTYPE"):
        if k in cons:
            cons[k] = DT[cons[k]]
    if kind == "seesaw":
        for desc, flag in (("out_desc", "OUT_TMA"), ("part_desc", "MERGE_TMA")):
            if not case["cons"][flag]:
                cons[desc] = None
    if kind == "decode" and not case["cons"]["USE_TMA"]:
        cons["kc_desc"] = cons["kr_desc"] = None
    if kind == "prefill":
        ptr["q"] = ptr["k"] = ptr["v"] = "*" + case["dtype"]
        for d in ("desc_k1", "desc_k2", "desc_v"):  # (pointer stand-ins of the dropped KV_TMA path)
            ptr[d] = "*" + case["dtype"]
    else:
        ptr["q"] = "*bf16"
    box, fp8 = case.get("box", 32), case.get("fp8", False)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in cons:
            sig[name] = "constexpr"
        elif kind in ("ws", "seesaw") and name == "lat_desc":
            width = 256 if kind == "seesaw" else 512
            sig[name] = f"tensordesc<fp8e4nv[32, 512],{nvmma(128, 8)}>" if fp8 else \
                f"tensordesc<bf16[{box}, {width}],{nvmma(128, 16)}>"
        elif kind in ("ws", "seesaw") and name == "rope_desc":
            sig[name] = f"tensordesc<fp8e4nv[32, 64],{nvmma(64, 8)}>" if fp8 else \
                f"tensordesc<bf16[{box}, 64],{nvmma(128, 16)}>"
        elif name == "out_desc":
            sig[name] = f"tensordesc<bf16[{case['cons']['BLOCK_H']}, 256],{nvmma(128, 16)}>"
        elif name == "part_desc":
            sig[name] = f"tensordesc<fp32[{case['cons']['BLOCK_H']}, 256],{nvmma(128, 32)}>"
        elif name in ("kc_desc", "kr_desc"):
            bn = case["cons"]["BLOCK_N"]
            sig[name] = f"tensordesc<fp8e4nv[{bn}, {128 if name == 'kc_desc' else 64}]>"
        elif kind == "prefill_gluon" and name.endswith("_desc"):
            bn = case["cons"]["BLOCK_N"]
            blk = {"q_desc": [64, 64], "q2_desc": [64, 64], "k1_desc": [bn, 128], "k2_desc": [bn, 64],
                   "v_desc": [bn, 128]}[name]  # (q2_desc: the fp8 path's second q box; bf16 passes q_desc)
            sig[name] = f"tensordesc<bf16{blk},{nvmma(128, 16)}>"
        elif name == "kv_cache":
            sig[name] = "*fp8e4nv" if fp8 else "*bf16"
        elif name in ptr:
            sig[name] = ptr[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("scale_log2", "v_scale", "sm_scale", "qk_scale"):
            sig[name] = "fp32"
        elif name.startswith("stride_"):
            sig[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
    warps = cons.pop("num_warps", case.get("warps", 4))
    if kind in ("ws", "seesaw", "prefill_gluon"):
        cons["num_warps"] = warps
        src = GluonASTSource(fn, sig, constexprs=cons, attrs=attrs)
        opts = dict(num_warps=warps)
    else:
        src = ASTSource(fn, sig, constexprs=cons, attrs=attrs)
        opts = dict(num_warps=warps, num_stages=case.get("stages", 3))
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    report.append(dict(name=case["name"], **resource_report(k)))
print("REPORT" + json.dumps(report))
"""


def main(argv: list[str]) -> None:
    names = argv[1:2] or [None]
    cases = [c for c in CASES if not argv[2:] or any(s in c["name"] for s in argv[2:])]
    reports = run_report_script(_SCRIPT, cases)
    lines = [json.dumps(r, sort_keys=True) for r in reports]
    if names[0]:
        with open(names[0], "w") as f:
            f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv)
