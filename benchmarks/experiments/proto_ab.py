"""The A/B of a prototype split kernel against ``seesaw-pair-el`` (``pair32.py``, ``pairw.py``; H200 experiment, not
part of openmla): both on ``plan_decode``'s regular plan, each run once on its own to compare the outputs (final
rows, LSE, and the partials of split requests), then timed alternating in one process (``AB_ROUNDS`` rounds). Also
what the two kernels share: their launcher and the test for a program with no rows."""

from __future__ import annotations

import os

from openmla.ops._gluon import GLUON_AVAILABLE, gl, gluon

ROUNDS = int(os.environ.get("AB_ROUNDS", "3"))

if GLUON_AVAILABLE:

    @gluon.jit
    def _program_has_rows(work_req, query_start_loc, Q_PER: gl.constexpr, N_HB: gl.constexpr, N_QB: gl.constexpr):
        """Whether this program (work item x head block x query block of the regular plan) has rows to compute:
        its work slot is used and its query block starts before the request's last query token."""
        pid = gl.program_id(0)
        i_b = gl.load(work_req + pid // (N_HB * N_QB))
        used = i_b >= 0
        i_b = gl.where(used, i_b, 0).to(gl.int64)
        qlen = gl.load(query_start_loc + i_b + 1) - gl.load(query_start_loc + i_b)
        return used & (((pid // N_HB) % N_QB) * Q_PER < qlen)


def ab_against_el(label: str, launch, shapes: list) -> int:
    """``launch(q, cache, block_table, seq_lens, qsl, plan, out, lse, scale_log2)`` runs the prototype; prints one
    line per shape (``AB_SHAPES`` overrides ``shapes``)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print(f"{label}: needs an sm90 GPU")
        return 0
    from problems import make_span_problem
    from common import ab_summary, alternate_us, env_line, shapes_from_env

    import openmla
    from openmla.ops import decode_gluon as dg

    scale_log2 = 576**-0.5 * 1.4426950408889634
    print(env_line(), f"| seesaw-pair-el vs {label} (split kernel, regular plan)")
    for h, b, s, qlen in shapes_from_env(shapes):
        q, cache, bt, sl, qsl, s_max = make_span_problem(h, b, s, qlen)
        flops = 2.0 * int(sl.sum()) * qlen * h * (576 + 512)
        plan = openmla.plan_decode(sl, qsl, h, max_query_len=qlen, max_seq_len=s_max)
        res = {n: (torch.zeros(q.shape[0], h, 512, dtype=torch.bfloat16, device="cuda"),
                   torch.zeros(q.shape[0], h, dtype=torch.float32, device="cuda"),
                   torch.zeros_like(plan.o_part), torch.zeros_like(plan.lse_part)) for n in ("el", label)}  # fmt: skip

        def el(r=res["el"]):
            dg.mla_decode_split_gluon(q, cache, bt, sl, qsl, plan, r[0], r[1], scale_log2, 1.0, True, 512,
                                      variant="seesaw-pair-el")  # fmt: skip

        def proto(r=res[label]):
            launch(q, cache, bt, sl, qsl, plan, r[0], r[1], scale_log2)

        for name, fn in (("el", el), (label, proto)):  # both write their partials into the plan's buffers
            fn()
            torch.cuda.synchronize()
            res[name][2].copy_(plan.o_part)
            res[name][3].copy_(plan.lse_part)
        diffs = [(res["el"][k].float() - res[label][k].float()).abs().nan_to_num(0.0).max().item() for k in range(4)]
        times = alternate_us({"el": el, label: proto}, ROUNDS)
        med, line = ab_summary(times, flops)
        print(f"## h{h} b{b} s{s} q{qlen} (max |diff| out {diffs[0]:.2e}, lse {diffs[1]:.2e}, partials {diffs[2]:.2e} "
              f"/ {diffs[3]:.2e}): {line} | speedup {label} {med['el'] / med[label]:.4f}x", flush=True)  # fmt: skip
        res = plan = None
        torch.cuda.empty_cache()
    return 0


def launch_proto(kernel, box: int, q, kv_cache, block_table, seq_lens, query_start_loc, plan, out, lse,
                 scale_log2: float, causal: bool = True, **constexprs) -> None:  # fmt: skip
    """Launch a prototype split kernel with ``_mla_decode_gluon_seesaw_kernel``'s arguments on the regular plan: TMA
    boxes of ``box`` rows (``[box, 256]`` latent halves, ``[box, 64]`` rope), one program per work item, head block
    and query block; ``constexprs``: the kernel's own (beyond PAGE, MAX_QLEN, BLOCK_H, Q_PER, CAUSAL, WG_REGS, N_HB,
    N_QB)."""
    import triton

    from openmla.ops import decode_gluon as dg
    from openmla.ops._gluon import TensorDescriptor

    num_blocks, page, _ = kv_cache.shape
    if page % box or plan.tiling.block_n % box:
        raise ValueError(f"{box}-row boxes need pages and split lengths that are multiples of {box}; got page {page}, "
                         f"block_n {plan.tiling.block_n}")  # fmt: skip
    H = q.shape[1]
    block_h, q_per = dg.gluon_decode_config(H, plan.max_query_len)
    kv2d = kv_cache.as_strided((num_blocks * page, 576), (kv_cache.stride(1), 1))
    shape, strides = [num_blocks * page, 576], [kv_cache.stride(1), 1]
    lat_desc = TensorDescriptor(kv2d, shape, strides, [box, 256], dg._kv_layout())
    rope_desc = TensorDescriptor(kv2d, shape, strides, [box, 64], dg._kv_layout(False, 64))
    n_hb, n_qb = triton.cdiv(H, block_h), triton.cdiv(plan.max_query_len, q_per)
    kernel[(plan.capacity * n_hb * n_qb,)](
        q, lat_desc, rope_desc, block_table, seq_lens, query_start_loc, plan.work_req, plan.work_split,
        plan.num_splits, plan.split_len, out, lse, plan.o_part, plan.lse_part, scale_log2, 1.0, q.stride(0),
        q.stride(1), block_table.stride(0), out.stride(0), out.stride(1), H, num_blocks, block_table.shape[1],
        PAGE=page, MAX_QLEN=plan.max_query_len, BLOCK_H=block_h, Q_PER=q_per, CAUSAL=causal,
        WG_REGS=dg.SEESAW_WG_REGS, N_HB=n_hb, N_QB=n_qb, num_warps=4, **constexprs)  # fmt: skip
