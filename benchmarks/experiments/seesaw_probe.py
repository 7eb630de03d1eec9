"""Which wrong schedule explains the seesaw kernel's warpgroup-0 error? (H200 probe; not part of openmla)

Run 19 (``seesaw_debug.py``) showed: with a separate P buffer (``SEPARATE_P``) the seesaw kernel is right for
one 64-key tile, but for requests with several tiles the output columns of warpgroup 0 (0-255) are wrong while
warpgroup 1's columns and the LSE are right, identically with every other knob. This probe runs one request
of ``H`` = 64 heads (64 valid rows) in one split (``plan_decode(..., num_sms=1)``) for several lengths, and
compares each column half of the kernel's output with a PyTorch simulation of the seesaw schedule, exact and
with one injected fault in warpgroup 0 at a time (stale P, stale row max, skipped tile, no rescale, the other
stage's V, ...). The fault whose simulation matches (error ~1e-3) names the defect.

    PYTHONPATH=$PWD python3 benchmarks/experiments/seesaw_probe.py [--knobs sep,arrive,fence,regs=232]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))

import torch

import seesaw_debug as sd

LOG2E = 1.4426950408889634


def simulate(q, keys, scale_log2, fault: str):
    """The seesaw schedule in fp32 (P rounded to bf16 as in the kernel): returns (out [M, 512], lse [M]).
    Tile j (64 keys) belongs to warpgroup j % 2; ``fault`` perturbs warpgroup 0 only."""
    M = q.shape[0]
    L = keys.shape[0]
    n_tiles = math.ceil(L / 64)
    m_prev = [torch.full((M,), -math.inf, device=q.device) for _ in range(2)]
    acc = [torch.zeros(M, 256, device=q.device) for _ in range(2)]
    l_own = [torch.zeros(M, device=q.device) for _ in range(2)]
    m_hist: list[torch.Tensor] = []
    p_hist: list[torch.Tensor] = []
    for j in range(n_tiles):
        k = keys[j * 64 : (j + 1) * 64]
        s = (q @ k.T) * scale_log2
        own = j % 2
        m_new = torch.maximum(m_prev[own], s.max(1).values)
        m_use = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
        p = torch.exp2(s - m_use[:, None]).to(torch.bfloat16).float()
        m_hist.append(m_new)
        p_hist.append(p)
        for wg in (0, 1):
            mj, pj, vj = m_new, p, k[:, wg * 256 : (wg + 1) * 256]
            reader = wg != own
            if wg == 0 and reader:
                if fault == "r_skip":
                    continue
                if fault == "r_stale_p" and p_hist[j - 1].shape == p.shape:
                    pj = p_hist[j - 1]
                if fault == "r_stale_m":
                    mj = m_hist[j - 2] if j >= 2 else torch.zeros_like(m_new)
                if fault == "r_v_prev" and vj.shape[0] == 64:
                    vj = keys[(j - 1) * 64 : j * 64, :256]
            mu = torch.where(mj == -math.inf, torch.zeros_like(mj), mj)
            alpha = torch.exp2(m_prev[wg] - mu)
            if wg == 0 and ((reader and fault == "r_no_rescale") or (not reader and fault == "o_no_rescale")):
                alpha = torch.ones_like(alpha)
            if wg == 0 and fault == "alpha_late" and j >= 1:  # rescale applied one tile late
                alpha = torch.exp2(m_hist[j - 2] - m_hist[j - 1]) if j >= 2 else torch.ones_like(alpha)
            if wg == 0 and fault == "pv_dropped_own" and not reader:
                pj = torch.zeros_like(pj)
            acc[wg] = acc[wg] * alpha[:, None] + pj @ vj
            l_own[wg] = l_own[wg] * alpha
            if not reader:
                l_own[wg] = l_own[wg] + p.sum(1)
            m_prev[wg] = mj
    # as the kernel: each warpgroup divides its half by the sum of both warpgroups' row sums
    l_tot = l_own[0] + l_own[1]
    out = torch.cat([acc[0], acc[1]], 1) / l_tot[:, None]
    return out, (m_prev[1] + torch.log2(l_tot)) / LOG2E


FAULTS = ["exact", "r_skip", "r_stale_p", "r_stale_m", "r_v_prev", "r_no_rescale", "o_no_rescale", "alpha_late",
          "pv_dropped_own"]  # fmt: skip


def main() -> int:
    import openmla

    ap = argparse.ArgumentParser()
    ap.add_argument("--knobs", default="sep", help="knob sets separated by ';' (seesaw_debug.py --knobs syntax)")
    ap.add_argument("--lens", default="64,65,128,129,192,256,320,512,1024")
    args = ap.parse_args()
    dev = torch.device("cuda")
    H = 64
    save = os.environ.get("OUT")
    for spec in args.knobs.split(";"):
        k = sd.parse_knobs(spec)
        print(f"# knobs {k.label()}; one request, H {H}, qlen 1, one split; rel err = max|a-b| / max|b| per half")
        for L in [int(x) for x in args.lens.split(",")]:
            q, cache, bt, sl, qsl = sd.make_batch(dev, H, [1], [L], fill=float("nan"), seed=L)
            plan = openmla.plan_decode(sl, qsl, H, num_sms=1)
            splits = int(plan.num_splits[0])
            out, lse, _ = sd.run_decode(k, q, cache, bt, sl, qsl, True, plan)
            torch.cuda.synchronize()
            page = cache.shape[1]
            pos = torch.arange(L, device=dev)
            keys = cache[bt[0, pos // page].long(), pos % page].float()
            qq = q[0].float()
            o = out[0].float()
            row = []
            for f in FAULTS:
                so, slse = simulate(qq, keys, sd.SCALE * LOG2E, f)
                e0 = float((o[:, :256] - so[:, :256]).abs().max() / so[:, :256].abs().max())
                e1 = float((o[:, 256:] - so[:, 256:]).abs().max() / so[:, 256:].abs().max())
                el = float((lse[0] - slse).abs().max())
                row.append(f"{f} {e0:.1e}/{e1:.1e}/lse {el:.1e}")
            nan = int(torch.isnan(o).sum())
            print(f"L {L:5d} tiles {math.ceil(L / 64):3d} splits {splits} nan {nan} | " + " | ".join(row), flush=True)
            if save:
                tag = spec.replace(",", "_").replace("=", "")
                torch.save({"q": qq.cpu(), "keys": keys.cpu(), "out": o.cpu(), "lse": lse[0].cpu(), "knobs": spec},
                           os.path.join(save, f"probe_{tag}_L{L}.pt"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
