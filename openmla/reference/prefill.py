"""Plain fp32 PyTorch references of the prefill ops (the test oracle): varlen attention, LSE merge and
MLA prefill over new tokens plus a paged context, computed directly (no chunks)."""

from __future__ import annotations

import torch

from openmla.reference.cache import dequantize_rows_ref, request_slots_ref


def _descale(t) -> float:
    return 1.0 if t is None else float(t.reshape(()).item())


def flash_attn_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, sm_scale, *, causal=True, q_descale=None,
                          k_descale=None, v_descale=None):  # fmt: skip
    """fp32 ``(out [Tq, H, d_v], lse [Tq, H])`` of ``flash_attn_varlen`` (natural-log LSE, bottom-right
    causal, GQA); rows that see no key give out 0 and lse -inf; rows past ``cu_seqlens_q[-1]`` too."""
    Tq, H, _ = q.shape
    H_KV, d_v = k.shape[1], v.shape[2]
    qf = q.float() * _descale(q_descale)
    kf = k.float() * _descale(k_descale)
    vf = v.float() * _descale(v_descale)
    out = torch.zeros(Tq, H, d_v, dtype=torch.float32, device=q.device)
    lse = torch.full((Tq, H), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        n, m = q1 - q0, k1 - k0
        if n == 0:
            continue
        kb = kf[k0:k1].repeat_interleave(H // H_KV, dim=1)  # [m, H, d_qk]
        vb = vf[k0:k1].repeat_interleave(H // H_KV, dim=1)
        s = torch.einsum("thd,khd->thk", qf[q0:q1], kb) * sm_scale  # [n, H, m]
        if causal:
            keep = torch.arange(m, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None] + (m - n)
            s = s.masked_fill(~keep[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(s, -1) if m else torch.full((n, H), float("-inf"), device=q.device)
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)
        out[q0:q1] = torch.einsum("thk,khd->thd", p, vb)
        lse[q0:q1] = row_lse
    return out, lse


def merge_attn_states_ref(out_a, lse_a, out_b, lse_b):
    """fp32 exact merge of two normalised partials by their natural-log LSEs; +inf/NaN count as -inf,
    a -inf part contributes nothing, and two -inf parts give out 0, lse -inf."""
    L = torch.stack([lse_a.float(), lse_b.float()])  # [2, T, H]
    L = torch.where(torch.isnan(L) | torch.isposinf(L), float("-inf"), L)
    M = L.amax(0)
    Ms = torch.where(torch.isneginf(M), 0.0, M)
    w = torch.exp(L - Ms)  # [2, T, H]
    den = w.sum(0)
    safe = torch.where(den > 0, den, 1.0)
    oa = torch.where(w[0, ..., None] > 0, out_a.float(), 0.0)
    ob = torch.where(w[1, ..., None] > 0, out_b.float(), 0.0)
    out = (oa * w[0, ..., None] + ob * w[1, ..., None]) / safe[..., None]
    lse = torch.where(den > 0, Ms + torch.log(safe), float("-inf"))
    return out, lse


def mla_prefill_with_context_ref(q, k_nope, k_pe, v, kv_cache, block_table, context_lens, query_start_loc,
                                 kv_b_proj_weight, sm_scale, *, kv_cache_dtype="auto", kv_scale=None):  # fmt: skip
    """fp32 ``(out [T, H, d_v], lse [T, H])`` of ``mla_prefill_with_context``, unchunked: request b's
    keys are its ``context_lens[b]`` cached tokens (dequantised, up-projected with ``kv_b_proj_weight``)
    followed by its new tokens, and new token t sees the whole context and new tokens ``<= t``. The
    gathered cache rows and the up-projected context keys/values are rounded to q.dtype (they are
    activations of that dtype in the op and in vLLM); everything else is fp32."""
    T, H, _ = q.shape
    d_nope, d_v = k_nope.shape[-1], v.shape[-1]
    d_rope = k_pe.shape[-1]
    k_pe = k_pe.reshape(T, d_rope)
    d_c = kv_cache.shape[-1] - d_rope if kv_cache_dtype != "fp8_ds_mla" else 512
    W = kv_b_proj_weight.float()  # [H * (d_nope + d_v), d_c]
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    block_size = kv_cache.shape[1]
    qsl = query_start_loc.tolist()
    ks, vs, cu_k = [], [], [0]
    for b in range(len(qsl) - 1):
        ctx = int(context_lens[b])
        rows = dequantize_rows_ref(flat[request_slots_ref(block_table[b], ctx, block_size)], kv_cache_dtype, kv_scale)
        rows = rows.to(q.dtype).float()  # gathered rows are q.dtype activations too
        # the up-projected keys/values are activations of q's dtype (as kv_b_proj's output is)
        kv = (rows[:, :d_c] @ W.t()).to(q.dtype).float().view(ctx, H, d_nope + d_v)
        k_ctx = torch.cat([kv[..., :d_nope], rows[:, None, d_c:].expand(ctx, H, d_rope)], dim=-1)
        s0, s1 = qsl[b], qsl[b + 1]
        k_new = torch.cat([k_nope[s0:s1].float(), k_pe[s0:s1, None, :].float().expand(s1 - s0, H, d_rope)], dim=-1)
        ks += [k_ctx, k_new]
        vs += [kv[..., d_nope:], v[s0:s1].float()]
        cu_k.append(cu_k[-1] + ctx + s1 - s0)
    k_all = torch.cat(ks) if ks else torch.zeros(0, H, d_nope + d_rope)
    v_all = torch.cat(vs) if vs else torch.zeros(0, H, d_v)
    cu_k = torch.tensor(cu_k, dtype=torch.int32)
    return flash_attn_varlen_ref(q.float(), k_all, v_all, query_start_loc.cpu(), cu_k, sm_scale, causal=True)
