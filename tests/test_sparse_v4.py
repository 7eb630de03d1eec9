"""sparse_mla for DeepSeek V4 against the fp32 reference: D = d_v = 512, the SWA cache as the main source and
the compressed cache as the extra one (fp8_v4 or bf16, own block sizes), windows and top-k longer and shorter
than the context, all-invalid rows, sinks, NaN bytes in unused pages, the fused inverse RoPE (also through the
split merge) against a torch rotation, any head count, prefill paged or over a gathered bf16 workspace, errors."""

import pytest
import torch

import openmla
from openmla.reference import sparse_mla_ref
from openmla.reference.v4 import (
    combine_topk_swa_indices_ref,
    csa_topk_global_ref,
    hca_indices_ref,
    rope_cache_ref,
    rope_rows_ref,
    swa_indices_ref,
    v4_block_bytes,
)
from openmla.utils.testing import TOLERANCES, assert_close, on_gpu, pick, random_v4_cache

SCALE = 512**-0.5
INF = float("inf")
# LSE tolerances (atol, rtol, cos) by cache dtype. fp8_v4 rows (e4m3 x a power of two, bf16 rope) are exact in bf16,
# so unlike fp8_ds_mla the GPU kernel's bf16 operands change no score: a torch emulation of the GPU kernel (bf16
# rows and P, 132-SM split plan) measures lse cosine <= 1.4e-15 on the random configs at the GPU shapes.
_LSE_TOL = {"auto": (1e-3, 1e-3, 1e-6), "fp8_v4": (1e-2, 1e-3, 1e-6)}


def _rope_table(num_pos=64):
    """V4's [cos | sin] table for 64 rope dims (fp32, transformers' angles)."""
    return rope_cache_ref(1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)), num_pos)


def _block_table(seq_lens, block_size, gen, extra_blocks=2):
    """Distinct, shuffled blocks per request (a block past every request stays unused)."""
    need = [max(1, -(-int(s) // block_size)) for s in seq_lens]
    width = max(need)
    perm = torch.randperm(sum(need) + extra_blocks, generator=gen)
    bt = torch.full((len(need), width), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[at : at + n].int()
        at += n
    return bt, sum(need) + extra_blocks


def _scenario(seq_lens, qlens, window, ratio, topk, swa_bs, cmp_bs, kv_cache_dtype, device, seed=0, mode="csa",
              invalid=()):  # fmt: skip
    """A V4 batch: per-token SWA slot lists (main) and compressed slot lists (extra; CSA: a random top-k of the
    visible entries, HCA: all of them), caches holding only the rows some list names, tokens ``invalid`` with
    no key at all."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.zeros(len(qlens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
    T = int(qsl[-1])
    is_valid = torch.ones(T, dtype=torch.bool)
    for t in invalid:
        is_valid[t] = False
    bt, nb = _block_table(seq_lens, swa_bs, g)
    idx, lens = swa_indices_ref(qsl, seq_lens, bt, swa_bs, window, T, is_valid)
    ebt, enb = _block_table(seq_lens // ratio, cmp_bs, g)
    if mode == "csa":
        local = torch.stack([torch.randperm(max(int(seq_lens.max()) // ratio, topk), generator=g)[:topk]
                             for _ in range(T)]).int()  # fmt: skip
        eidx, elens = csa_topk_global_ref(local, qsl, seq_lens, ebt, cmp_bs, ratio, is_valid)
    else:
        eidx, elens = hca_indices_ref(qsl, seq_lens, ebt, cmp_bs, ratio, topk, T, is_valid)
    used = torch.unique(idx[idx >= 0]).long()
    e_used = torch.unique(eidx[eidx >= 0]).long()
    cache = random_v4_cache(nb, swa_bs, kv_cache_dtype, used, device, g)
    ecache = random_v4_cache(enb, cmp_bs, kv_cache_dtype, e_used, device, g)
    positions = torch.cat([torch.arange(int(s) - q, int(s)) for s, q in zip(seq_lens.tolist(), qlens)])
    d = {"idx": idx, "lens": lens, "eidx": eidx, "elens": elens}
    d = {k: v.to(device) for k, v in d.items()}
    return dict(d, T=T, cache=cache, ecache=ecache, positions=positions.to(device), qsl=qsl, seq_lens=seq_lens,
                bt=bt, ebt=ebt)  # fmt: skip


def _run(sc, q, kv_cache_dtype, *, sink=None, rope=True, **kw):
    cs = _rope_table(int(sc["seq_lens"].max()) + 1).to(q.device) if rope else None
    args = dict(kv_cache_dtype=kv_cache_dtype, topk_length=sc["lens"], attn_sink=sink, extra_kv_cache=sc["ecache"],
                extra_indices=sc["eidx"], extra_topk_length=sc["elens"],
                inv_rope_positions=sc["positions"] if rope else None, cos_sin_cache=cs)  # fmt: skip
    out, lse = openmla.sparse_mla(q, sc["cache"], sc["idx"], SCALE, **args, **kw)
    ref_out, ref_lse = sparse_mla_ref(q, sc["cache"], sc["idx"], SCALE, **args)
    assert out.shape == (q.shape[0], q.shape[1], 512) and out.dtype == q.dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close("out", ref_out, out, *TOLERANCES[q.dtype])
    assert_close("lse", ref_lse, lse, *_LSE_TOL[kv_cache_dtype])
    return out, lse, ref_out


def _q(T, H, device, seed=1):
    return torch.randn(T, H, 512, generator=torch.Generator().manual_seed(seed)).bfloat16().to(device)


# (seq_lens, qlens, window, ratio, top-k, swa block, compressed block, mode): decode / verify rows with windows
# and top-k longer and shorter than the context (a 3-token request sees no compressed entry at all)
CASES = [
    ([3, 40], [1, 2], 8, 4, 6, 16, 64, "csa"),
    ([70, 5], [2, 1], 16, 4, 32, 64, 2, "csa"),
    ([50], [3], 128, 16, 8, 1, 1, "hca"),
]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_v4", "auto"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_sparse_v4_decode(case, kv_cache_dtype, device):
    seq_lens, qlens, window, ratio, topk, swa_bs, cmp_bs, mode = CASES[case]
    sc = _scenario(seq_lens, qlens, window, ratio, topk, swa_bs, cmp_bs, kv_cache_dtype, device, seed=case,
                   mode=mode, invalid=(0,))  # fmt: skip
    H = pick(6, 64)
    sink = torch.randn(H, generator=torch.Generator().manual_seed(3)).to(device)
    sink[0] = -INF
    out, lse, _ = _run(sc, _q(sc["T"], H, device), kv_cache_dtype, sink=sink)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()  # the all-invalid row
    assert torch.isfinite(lse[1:]).all()


@pytest.mark.parametrize("heads", pick([1, 5, 16, 20, 64], [1, 5, 16, 20, 64, 100, 128]))
def test_sparse_v4_any_head_count(heads, device):
    sc = _scenario([9, 30], [1, 1], 8, 4, 4, 16, 2, "fp8_v4", device, seed=heads)
    sink = torch.linspace(-2.0, 2.0, heads).to(device)
    _run(sc, _q(sc["T"], heads, device, seed=heads), "fp8_v4", sink=sink)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_v4", "auto"])
def test_sparse_v4_splits_merge_rope_and_sink(kv_cache_dtype, device):
    """With several splits the inverse RoPE and the sink run in the merge kernel: the same result."""
    sc = _scenario([40, 3], [2, 1], 16, 4, 8, 16, 2, kv_cache_dtype, device, seed=5, invalid=(1,))
    q = _q(sc["T"], 6, device)
    sink = torch.tensor([0.5, -INF, INF, -1.0, 2.0, 0.0], device=device)
    one, _, _ = _run(sc, q, kv_cache_dtype, sink=sink, _num_splits_override=1)
    for n in (3, 17):  # 17: the merge's one-head programs over 32 split rows
        many, _, _ = _run(sc, q, kv_cache_dtype, sink=sink, _num_splits_override=n)
        assert_close(f"{n} splits", one.float(), many, *TOLERANCES[q.dtype])
    assert (one[:, 2] == 0).all()  # a +inf sink gives 0


@pytest.mark.parametrize("splits", [1, 2])
def test_sparse_v4_inverse_rope_against_torch_rotation(splits, device):
    """The fused epilogue equals the unrotated output rotated afterwards by a plain torch rotation and by the
    standalone inverse_rope_rows; dims 0..447 pass through untouched; the rotation undoes a forward one."""
    sc = _scenario([33, 12], [2, 1], 16, 4, 8, 16, 2, "fp8_v4", device, seed=11)
    q = _q(sc["T"], 6, device)
    cs = _rope_table(40).to(device)
    kw = dict(kv_cache_dtype="fp8_v4", topk_length=sc["lens"], extra_kv_cache=sc["ecache"], extra_indices=sc["eidx"],
              extra_topk_length=sc["elens"], _num_splits_override=splits)  # fmt: skip
    plain, lse0 = openmla.sparse_mla(q, sc["cache"], sc["idx"], SCALE, **kw)
    fused, lse1 = openmla.sparse_mla(q, sc["cache"], sc["idx"], SCALE, inv_rope_positions=sc["positions"],
                                     cos_sin_cache=cs, **kw)  # fmt: skip
    assert torch.equal(lse0, lse1) and torch.equal(fused[..., :448], plain[..., :448])
    # a torch rotation by minus the angle: (a, b) -> (a c + b s, b c - a s) on the interleaved pairs
    pos = sc["positions"].long().cpu()
    c, s = cs.cpu()[pos, :32][:, None, :], cs.cpu()[pos, 32:][:, None, :]
    a, b = plain.float().cpu()[..., 448::2], plain.float().cpu()[..., 449::2]
    want = plain.float().cpu().clone()
    want[..., 448::2], want[..., 449::2] = a * c + b * s, b * c - a * s
    assert_close("fused vs torch", want, fused.cpu(), *TOLERANCES[q.dtype])
    assert (fused[..., 448:].float() - plain[..., 448:].float()).abs().max() > 0.01  # it did rotate
    standalone = openmla.inverse_rope_rows(plain.clone(), sc["positions"], cs)
    assert_close("fused vs inverse_rope_rows", standalone.float(), fused, *TOLERANCES[q.dtype])
    back = rope_rows_ref(fused, pos.to(device), cs)  # the forward rotation undoes it
    assert_close("round trip", plain.float(), back, *TOLERANCES[q.dtype])


@pytest.mark.parametrize("seed", range(pick(10, 16)))
def test_sparse_v4_random_configs(seed, device):
    """Random mixes of heads, tokens, widths, block sizes, dtypes, sentinels (-1, out of range, duplicates), lengths,
    a dense or ragged extra source, sinks, splits and the inverse RoPE against the reference."""
    g = torch.Generator().manual_seed(300 + seed)

    def r(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    def source(T, K, bs):
        blocks = max(1, r(8, 96) // bs)
        n = blocks * bs
        idx = torch.randint(-2, n + 2, (T, K), generator=g, dtype=torch.int32)  # -1, -2 and past the cache
        if K >= 3:
            idx[:, 1] = idx[:, 2]  # a duplicate counts twice
        lens = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32)
        counted = torch.arange(K)[None, :] < lens[:, None]
        used = torch.unique(idx[counted & (idx >= 0) & (idx < n)]).long()
        return random_v4_cache(blocks, bs, kv_dtype, used, device, g), idx, lens

    kv_dtype = ["fp8_v4", "auto"][r(0, 1)]
    T, H = r(1, pick(5, 40)), r(1, pick(24, 128))
    cache, idx, lens = source(T, r(1, pick(48, 1024)), [1, 3, 16, 64, 256][r(0, 4)])
    kw = {"kv_cache_dtype": kv_dtype, "topk_length": lens.to(device)}
    if r(0, 1):
        kw["extra_kv_cache"], eidx, elens = source(T, r(1, pick(24, 512)), [1, 2, 64][r(0, 2)])
        if r(0, 1):
            # built on the device: on a GPU the op's kernel rejects CPU tensors
            kw["extra_indices"] = openmla.build_ragged_indices_from_dense(eidx.to(device), elens.to(device))
        else:
            kw["extra_indices"], kw["extra_topk_length"] = eidx.to(device), elens.to(device)
    if r(0, 1):
        kw["attn_sink"] = (torch.randn(H, generator=g) * 2).to(device)
    if r(0, 1):
        kw["inv_rope_positions"] = torch.randint(0, 50, (T,), generator=g).to(device)
        kw["cos_sin_cache"] = _rope_table(50).to(device)
    split = {"_num_splits_override": r(2, 5)} if r(0, 1) else {}
    q = _q(T, H, device, seed=seed)
    out, lse = openmla.sparse_mla(q, cache, idx.to(device), SCALE, **kw, **split)
    ref_out, ref_lse = sparse_mla_ref(q, cache, idx.to(device), SCALE, **kw)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close("out", ref_out, out, *TOLERANCES[q.dtype])
    assert_close("lse", ref_lse, lse, *_LSE_TOL[kv_dtype])


def test_sparse_v4_nan_exponent_in_a_selected_row(device):
    """A selected fp8_v4 row whose exponent byte is 255 (a NaN scale) counts as 0 in that group, like the
    reference (SPEC §6: a NaN from dequantising counts as 0); the other rows are unaffected."""
    sc = _scenario([20], [1], 16, 4, 4, 16, 2, "fp8_v4", device, seed=2)
    slot = int(sc["idx"][0, 0])
    bs = sc["cache"].shape[1]
    v4_block_bytes(sc["cache"])[slot // bs, bs * 576 + (slot % bs) * 8 + 3] = 255
    out, lse, _ = _run(sc, _q(1, 4, device), "fp8_v4")
    assert torch.isfinite(lse).all() and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_v4", "auto"])
def test_sparse_v4_prefill_paged_and_gathered_workspace(kv_cache_dtype, device):
    """Prefill through the same op, two ways: the paged caches as two sources, or both gathered into one bf16
    workspace (compressed entries then the window, SPEC §7.6) as a single source; the same result."""
    window, ratio, topk = 8, 4, 6
    seq_lens, qlens = [24, 13], [10, 13]
    sc = _scenario(seq_lens, qlens, window, ratio, topk, 16, 2, kv_cache_dtype, device, seed=9)
    T = sc["T"]
    q = _q(T, pick(4, 64), device)
    paged, lse_p, ref = _run(sc, q, kv_cache_dtype)
    # the workspace: per request N compressed entries at rows [0, N), then its last M - N tokens
    sl = sc["seq_lens"]
    N = int(sl.max()) // ratio
    gather = torch.minimum(sl, torch.tensor(max(qlens) + window - 1, dtype=torch.int32))
    M = N + int(gather.max())
    ws = torch.zeros(len(seq_lens), M, 512, dtype=torch.bfloat16, device=device)
    openmla.dequantize_and_gather_k_cache(ws, sc["ecache"], (sl // ratio).to(device), sc["ebt"].to(device),
                                          kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    openmla.dequantize_and_gather_k_cache(ws, sc["cache"], sl.to(device), sc["bt"].to(device),
                                          gather_lens=gather.to(device), offset=N,
                                          kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    # the top-k as request-local entry ids, read back from the global compressed slots
    ebt, cbs = sc["ebt"], sc["ecache"].shape[1]
    inv = {int(ebt[b, j]): (b, j) for b in range(ebt.shape[0]) for j in range(ebt.shape[1]) if ebt[b, j] >= 0}
    eidx = sc["eidx"].cpu()
    local = torch.full_like(eidx, -1)
    for t in range(T):
        for k in range(int(sc["elens"][t])):
            b, j = inv[int(eidx[t, k]) // cbs]
            local[t, k] = j * cbs + int(eidx[t, k]) % cbs
    widx, wlens = combine_topk_swa_indices_ref(local, sc["qsl"], sl, gather, window, ratio, topk, M, N,
                                               topk + window)  # fmt: skip
    cs = _rope_table(int(sl.max()) + 1).to(device)
    gathered, lse_g = openmla.sparse_mla(q, ws, widx.to(device), SCALE, topk_length=wlens.to(device),
                                         inv_rope_positions=sc["positions"], cos_sin_cache=cs)  # fmt: skip
    assert_close("workspace out", ref, gathered, *TOLERANCES[q.dtype])
    assert_close("workspace lse", lse_p, lse_g, 1e-3, 1e-3, 1e-6)


def test_sparse_v4_flashmla_views_and_buffers(device):
    """FlashMLA's [num_blocks, block_size, 1, 584] float8_e4m3fn view of the same cache, and out / lse buffers."""
    sc = _scenario([20, 9], [1, 1], 8, 4, 4, 16, 2, "fp8_v4", device, seed=4)
    q = _q(sc["T"], 3, device)
    out, lse, _ = _run(sc, q, "fp8_v4")
    view = sc["cache"].view(torch.float8_e4m3fn).unsqueeze(2)
    eview = sc["ecache"].view(torch.float8_e4m3fn).unsqueeze(2)
    o_buf = torch.empty_like(out)
    l_buf = torch.empty_like(lse)
    cs = _rope_table(21).to(device)
    o2, l2 = openmla.sparse_mla(q, view, sc["idx"], SCALE, kv_cache_dtype="fp8_v4", topk_length=sc["lens"],
                                extra_kv_cache=eview, extra_indices=sc["eidx"], extra_topk_length=sc["elens"],
                                inv_rope_positions=sc["positions"], cos_sin_cache=cs, out=o_buf, lse=l_buf)  # fmt: skip
    assert o2 is o_buf and l2 is l_buf and torch.equal(o2, out) and torch.equal(l2, lse)


def test_sparse_v4_errors(device):
    sc = _scenario([20], [2], 8, 4, 4, 16, 2, "fp8_v4", device, seed=6)
    q = _q(2, 2, device)
    cache, idx = sc["cache"], sc["idx"]
    cs = _rope_table(21).to(device)
    pos = sc["positions"]

    def call(q=q, cache=cache, **kw):
        return openmla.sparse_mla(q, cache, idx, SCALE, kv_cache_dtype="fp8_v4", **kw)

    with pytest.raises(ValueError, match="q must be \\[T, H, 512\\]"):
        call(q=torch.zeros(2, 2, 576, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="584"):
        call(cache=torch.zeros(2, 16, 656, dtype=torch.uint8, device=device))
    with pytest.raises(TypeError, match="kv_cache"):
        call(cache=torch.zeros(2, 16, 584, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="row stride 584"):
        call(cache=torch.zeros(2, 16, 600, dtype=torch.uint8, device=device)[..., :584])
    with pytest.raises(TypeError, match="extra_kv_cache"):
        call(extra_kv_cache=torch.zeros(2, 16, 512, dtype=torch.bfloat16, device=device), extra_indices=idx)
    with pytest.raises(ValueError, match="go together"):
        call(inv_rope_positions=pos)
    with pytest.raises(ValueError, match="go together"):
        call(cos_sin_cache=cs)
    with pytest.raises(ValueError, match="inv_rope_positions must have 2 entries"):
        call(inv_rope_positions=pos[:1], cos_sin_cache=cs)
    with pytest.raises(TypeError, match="inv_rope_positions"):
        call(inv_rope_positions=pos.float(), cos_sin_cache=cs)
    with pytest.raises(ValueError, match="span"):
        call(inv_rope_positions=pos + 100, cos_sin_cache=cs)
    with pytest.raises(ValueError, match="cos_sin_cache must be \\[P, R\\]"):
        call(inv_rope_positions=pos, cos_sin_cache=torch.zeros(21, 256, device=device))
    with pytest.raises(ValueError, match="cos_sin_cache must be \\[P, R\\]"):
        call(inv_rope_positions=pos, cos_sin_cache=torch.zeros(21, 48, device=device))
    with pytest.raises(TypeError, match="cos_sin_cache"):
        call(inv_rope_positions=pos, cos_sin_cache=torch.zeros(21, 64, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        openmla.sparse_mla(q, cache, idx, SCALE, kv_cache_dtype="fp8_v3")


def test_sparse_v4_unvalidated_positions_leave_rows_unrotated(device):
    """validate=False: a position outside the table leaves that row's rope dims as they are (nothing read
    outside the table)."""
    sc = _scenario([20], [2], 8, 4, 4, 16, 2, "fp8_v4", device, seed=8)
    q = _q(2, 2, device)
    cs = _rope_table(21).to(device)
    kw = dict(kv_cache_dtype="fp8_v4", topk_length=sc["lens"])
    plain, _ = openmla.sparse_mla(q, sc["cache"], sc["idx"], SCALE, **kw)
    pos = torch.tensor([-3, 500], dtype=torch.int64, device=device)
    out, _ = openmla.sparse_mla(q, sc["cache"], sc["idx"], SCALE, inv_rope_positions=pos, cos_sin_cache=cs,
                                validate=False, **kw)  # fmt: skip
    assert torch.equal(out, plain)


@pytest.mark.skipif(not on_gpu(), reason="CUDA graphs need a GPU")
def test_sparse_v4_in_a_cuda_graph(device):
    sc = _scenario([40, 30], [2, 2], 16, 4, 8, 64, 2, "fp8_v4", device, seed=12)
    q = _q(sc["T"], 64, device)
    cs = _rope_table(41).to(device)
    kw = dict(kv_cache_dtype="fp8_v4", topk_length=sc["lens"], extra_kv_cache=sc["ecache"], extra_indices=sc["eidx"],
              extra_topk_length=sc["elens"], inv_rope_positions=sc["positions"], cos_sin_cache=cs)  # fmt: skip
    want, _ = openmla.sparse_mla(q, sc["cache"], sc["idx"], SCALE, **kw)
    out = torch.empty_like(want)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        openmla.sparse_mla(q, sc["cache"], sc["idx"], SCALE, out=out, **kw)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


class _FakeFlashMLA:
    """FlashMLA's MODEL1 sparse decode and its sparse prefill as their docstrings state them (q `[b, s_q, h, 512]`,
    k_cache `[blocks, block_size, 1, 584]` fp8, indices `[b, s_q, topk]`, extra_topk_length `[b]`; prefill kv
    `[s, 1, 512]`, indices `[t, 1, k]`), through the fp32 reference: the bench must hand the peer the same problem."""

    @staticmethod
    def get_mla_metadata(*args, **kwargs):
        return object(), None

    @staticmethod
    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, softmax_scale=None,
                               causal=False, is_fp8_kvcache=False, indices=None, attn_sink=None, extra_k_cache=None,
                               extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None):  # fmt: skip
        assert is_fp8_kvcache and not causal and head_dim_v == 512 and k_cache.dim() == 4 and q.shape[2] in (64, 128)
        b, s_q, h, _ = q.shape
        rows = b * s_q
        el = None if extra_topk_length is None else extra_topk_length.repeat_interleave(s_q)
        out, lse = sparse_mla_ref(q.reshape(rows, h, 512), k_cache, indices.reshape(rows, -1), softmax_scale,
                                  kv_cache_dtype="fp8_v4", attn_sink=attn_sink, extra_kv_cache=extra_k_cache,
                                  extra_indices=extra_indices_in_kvcache.reshape(rows, -1),
                                  extra_topk_length=el)  # fmt: skip
        return out.to(q.dtype).view(b, s_q, h, 512), lse.view(b, s_q, h).transpose(1, 2)

    @staticmethod
    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        assert kv.dim() == 3 and kv.shape[1] == 1 and indices.dim() == 3 and indices.shape[1] == 1
        out, lse = sparse_mla_ref(q, kv, indices[:, 0], sm_scale, topk_length=topk_length, attn_sink=attn_sink)
        return out.to(q.dtype), lse, lse


@pytest.mark.parametrize("spec", ["v4decode h3 b2 q2 w4 k6 wb16 eb2 elen", "v4decode h64 b1 q1 w8 k4 wb4 eb4",
                                  "v4prefill h2 t5 k6 s40", "v4prefill h2 t6 k4 w4 paged",
                                  "v4prefill h2 t6 k4 w4 paged gather"])  # fmt: skip
def test_bench_sparse_v4_peer_side_by_side(monkeypatch, spec, device):
    """The sparse_v4 bench family with a stand-in FlashMLA: the peer's row, the ratio and the output check."""
    from openmla.bench import sparse_v4
    from openmla.bench.context import BenchContext
    from openmla.bench.timing import Timer

    dev = torch.device(device)
    ctx = BenchContext(dev, Timer(dev, rep=5, rounds=1), peers=True, quick=False, bw_gbs=1.0, peak_tflops=1.0,
                       env=dict(gpu="cpu", torch="t", triton="tr", git="x", label=""))  # fmt: skip
    ctx.family = "sparse_v4"
    monkeypatch.setattr(sparse_v4, "POOL_GIB", 2**-14)  # small caches on a GPU too (the stand-in reads them all)
    monkeypatch.setattr(ctx, "peer", lambda name: _FakeFlashMLA if name == "flash_mla" else None)
    monkeypatch.setattr(ctx, "time", lambda fns, graph=True: ctx.timer.alternate(fns, graph=False))
    notes = []
    monkeypatch.setattr(ctx, "note", notes.append)
    own, peer = sparse_v4.run(sparse_v4.parse(spec), ctx)
    assert not notes, notes
    assert (own["provider"], peer["provider"], own["peer"]) == ("openmla", "flashmla", "flashmla")
    assert own["check"] > 0.999, own["check"]
    assert own["ratio"] == peer["p50_us"] / own["p50_us"] and peer["flops"] == own["flops"] > 0
