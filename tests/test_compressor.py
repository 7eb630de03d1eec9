"""compress_kv against the stateless fp32 reference; the same entries for one prefill, chunks and decode steps."""

import pytest
import torch

import openmla  # noqa: F401
from openmla.ops.cache_v4 import allocate_v4_cache
from openmla.ops.compressor import allocate_compressor_state, compress_kv
from openmla.reference.v4 import compress_kv_ref, dequantize_v4_cache_ref, rope_cache_ref, v4_block_bytes
from openmla.utils.testing import assert_close, pick


def _table(num_pos, device):
    inv_freq = 1.0 / 160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    return rope_cache_ref(inv_freq, num_pos).to(device)


class _Setup:
    """Random per-token projections for B requests and a compressed cache with a shuffled block table."""

    def __init__(self, lens, ratio, d, overlap, layout, device, bs_c=4, cache_dtype=torch.float32):
        self.lens, self.ratio, self.d, self.layout, self.device = lens, ratio, d, layout, device
        coff = 2 if overlap else 1
        self.kv = [torch.randn(n, coff * d, device=device) for n in lens]
        ape = torch.randn(ratio, coff * d, device=device)
        self.score = [torch.randn(n, coff * d, device=device) * 2 + ape[torch.arange(n) % ratio] for n in lens]
        self.weight = torch.rand(d, device=device) + 0.5
        self.table = _table(max(lens) + 1, device)
        W = max(max(lens) // ratio // bs_c + 1, 1)
        nb = len(lens) * W + 2
        self.bs_c = bs_c
        self.cache = allocate_v4_cache(nb, bs_c, kv_cache_dtype=layout, device=device, dtype=cache_dtype)
        if layout == "auto":
            self.cache = torch.full((nb, bs_c, d), float("nan"), dtype=cache_dtype, device=device)
        else:
            self.cache.fill_(0xFF)
        self.block_table = torch.randperm(nb, device=device)[: len(lens) * W].view(len(lens), W).int()
        self.state = allocate_compressor_state(len(lens) + 2, ratio, d, overlap=overlap, device=device)
        self.state.fill_(float("nan"))  # stale rows of an earlier request must never be read
        self.slots = torch.tensor([len(lens) + 1 - b for b in range(len(lens))], dtype=torch.int32, device=device)

    def step(self, chunks):
        """One batched step: request b brings tokens [chunks[b][0], chunks[b][1])."""
        qsl, seq, kvs, scs = [0], [], [], []
        for b, (s, e) in enumerate(chunks):
            qsl.append(qsl[-1] + e - s)
            seq.append(e)
            kvs.append(self.kv[b][s:e])
            scs.append(self.score[b][s:e])
        dev = self.device
        compress_kv(
            torch.cat(kvs), torch.cat(scs), self.state, self.slots, torch.tensor(qsl, dtype=torch.int32, device=dev),
            torch.tensor(seq, dtype=torch.int32, device=dev), self.weight, self.table, self.cache, self.block_table,
            ratio=self.ratio, eps=1e-6, kv_cache_dtype=self.layout,
        )  # fmt: skip

    def entries(self, b):
        n = self.lens[b] // self.ratio
        flat = dequantize_v4_cache_ref(self.cache, self.layout)
        i = torch.arange(n, device=self.device)
        return flat[self.block_table[b, i // self.bs_c].long() * self.bs_c + i % self.bs_c]

    def ref(self, b):
        return compress_kv_ref(self.kv[b], self.score[b], self.weight, self.table, self.ratio, 1e-6)

    def raw(self):
        return v4_block_bytes(self.cache).clone() if self.layout == "fp8_v4" else self.cache.view(torch.uint8).clone()


CASES = [  # ratio, d, overlap, layout
    (4, 128, True, "auto"),
    (4, 512, True, "fp8_v4"),
    (pick(16, 128), 512, False, "fp8_v4"),
    (8, 128, False, "auto"),
]


@pytest.mark.parametrize("ratio,d,overlap,layout", CASES, ids=lambda x: str(x))
def test_compress_prefill(ratio, d, overlap, layout, device):
    lens = [3 * ratio + 1, ratio - 1, 2 * ratio, ratio]
    s = _Setup(lens, ratio, d, overlap, layout, device)
    s.step([(0, n) for n in lens])
    for b in range(len(lens)):
        ref = s.ref(b)
        got = s.entries(b)
        if layout == "auto":
            assert_close(f"entries {b}", ref, got, 2e-5, 2e-5, 1e-9)
        else:  # e4m3 per 64-group, bf16 rope
            assert_close(f"entries {b}", ref, got, 1e-3, 2**-4, 1e-3)


def _chunks(n, sizes):
    out, s, k = [], 0, 0
    while s < n:
        e = min(n, s + sizes[k % len(sizes)])
        out.append((s, e))
        s, k = e, k + 1
    return out


@pytest.mark.parametrize("ratio,d,overlap,layout", CASES[:3], ids=lambda x: str(x))
def test_compress_chunked_and_decode_identical(ratio, d, overlap, layout, device):
    """A request's cache bytes are identical for one prefill, chunked prefill, and one-by-one decode."""
    n = 2 * ratio + 3
    lens = [n, n]
    one = _Setup(lens, ratio, d, overlap, layout, device)
    torch.manual_seed(0)
    chunked = _Setup(lens, ratio, d, overlap, layout, device)
    chunked.kv, chunked.score, chunked.weight, chunked.block_table = one.kv, one.score, one.weight, one.block_table
    chunked.cache.copy_(one.cache)
    one.step([(0, n), (0, n)])
    # request 0 in ragged chunks (one closes two windows at once), request 1 one token per step
    c0 = _chunks(n, [ratio + 3, 1, 2 * ratio, 1])
    c1 = [(t, t + 1) for t in range(n)]
    for k in range(max(len(c0), len(c1))):
        reqs = []
        if k < len(c0):
            reqs.append(0)
        if k < len(c1):
            reqs.append(1)
        sub_slots = chunked.slots
        chunked.slots = sub_slots[reqs]
        kv_keep, sc_keep, bt_keep = chunked.kv, chunked.score, chunked.block_table
        chunked.kv = [kv_keep[b] for b in reqs]
        chunked.score = [sc_keep[b] for b in reqs]
        chunked.block_table = bt_keep[reqs]
        chunked.step([(c0 if b == 0 else c1)[k] for b in reqs])
        chunked.slots, chunked.kv, chunked.score, chunked.block_table = sub_slots, kv_keep, sc_keep, bt_keep
    assert torch.equal(one.raw().cpu(), chunked.raw().cpu())
    assert_close("vs ref", one.ref(0), chunked.entries(0), *((2e-5, 2e-5, 1e-9) if layout == "auto" else
                                                             (1e-3, 2**-4, 1e-3)))  # fmt: skip


def test_entry_mid_decode_step(device):
    """A verify step of 3 tokens whose middle token closes a window, beside a prefilling request."""
    ratio = 4
    s = _Setup([10, 7], ratio, 128, True, "auto", device)
    s.step([(0, 6), (0, 2)])
    s.step([(6, 9), (2, 7)])  # positions 6, 7, 8: entry 1 is emitted by position 7, in the middle
    s.step([(9, 10), (7, 7)])  # a request with no tokens this step
    for b in range(2):
        assert_close(f"entries {b}", s.ref(b), s.entries(b), 2e-5, 2e-5, 1e-9)
    # nothing was written beyond the emitted entries (the cache started as NaN)
    flat = s.cache.view(-1, 128)
    assert int((~flat.isnan().all(-1)).sum()) == 10 // 4 + 7 // 4


def test_padding_tokens_and_bf16_inputs(device):
    """Tokens past query_start_loc[B] are ignored; bf16 projections are read as fp32."""
    ratio, d = 4, 128
    s = _Setup([8], ratio, d, True, "auto", device)
    kv = torch.cat([s.kv[0], torch.randn(5, 2 * d, device=device)]).to(torch.bfloat16)
    sc = torch.cat([s.score[0], torch.randn(5, 2 * d, device=device)]).to(torch.bfloat16)
    compress_kv(kv, sc, s.state, s.slots[:1], torch.tensor([0, 8], device=device), torch.tensor([8], device=device),
                s.weight, s.table, s.cache, s.block_table, ratio=ratio, kv_cache_dtype="auto")  # fmt: skip
    ref = compress_kv_ref(kv[:8], sc[:8], s.weight, s.table, ratio)
    assert_close("bf16 in", ref, s.entries(0), 2e-5, 2e-5, 1e-9)


def test_compressor_errors(device):
    ratio, d = 4, 128
    s = _Setup([8, 4], ratio, d, True, "auto", device)
    kv, sc = torch.randn(12, 2 * d, device=device), torch.randn(12, 2 * d, device=device)
    qsl, seq = torch.tensor([0, 8, 12], device=device), torch.tensor([8, 4], device=device)
    args = (s.weight, s.table, s.cache, s.block_table)
    auto = {"ratio": ratio, "kv_cache_dtype": "auto"}
    with pytest.raises(ValueError, match="kv must be"):
        compress_kv(kv[:, :100], sc[:, :100], s.state, s.slots, qsl, seq, *args, **auto)
    with pytest.raises(ValueError, match="state"):
        compress_kv(kv, sc, s.state[:, :, :4], s.slots, qsl, seq, *args, **auto)
    with pytest.raises(ValueError, match="distinct"):
        compress_kv(kv, sc, s.state, s.slots[[0, 0]], qsl, seq, *args, **auto)
    with pytest.raises(ValueError, match="state_slots must lie"):
        compress_kv(kv, sc, s.state, s.slots + 10, qsl, seq, *args, **auto)
    with pytest.raises(ValueError, match="seq_lens must be >="):
        compress_kv(kv, sc, s.state, s.slots, qsl, torch.tensor([8, 3], device=device), *args, **auto)
    with pytest.raises(ValueError, match="cos_sin_cache has"):
        compress_kv(kv, sc, s.state, s.slots, qsl, seq, s.weight, s.table[:4], s.cache, s.block_table, **auto)
    with pytest.raises(ValueError, match="fp8_v4 compressed cache holds d = 512"):
        compress_kv(kv, sc, s.state, s.slots, qsl, seq, s.weight, s.table, allocate_v4_cache(2, 4, device=device),
                    s.block_table, ratio=ratio)  # fmt: skip
    bad_bt = torch.full_like(s.block_table, 99)
    with pytest.raises(ValueError, match="block_table refers"):
        compress_kv(kv, sc, s.state, s.slots, qsl, seq, s.weight, s.table, s.cache, bad_bt, **auto)
    before = s.cache.clone()
    compress_kv(kv, sc, s.state, s.slots, qsl, seq, s.weight, s.table, s.cache, bad_bt, validate=False, **auto)
    assert torch.equal(before.isnan(), s.cache.isnan())  # entries through a missing block are dropped


def _hf_config(ratio):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip("transformers has no deepseek_v4")
    return transformers.DeepseekV4Config(
        hidden_size=64, head_dim=128, qk_rope_head_dim=64, num_attention_heads=2, num_hidden_layers=2,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": ratio},
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64},
        max_position_embeddings=1024, index_head_dim=64, index_n_heads=2,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_compress_matches_transformers(kind, device):
    """compress_kv and its reference against transformers' DeepseekV4{CSA,HCA}Compressor (fp32, no cache)."""
    cfg = _hf_config(8)  # skips without transformers' deepseek_v4
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    m = (hf.DeepseekV4CSACompressor if kind == "csa" else hf.DeepseekV4HCACompressor)(cfg).float()
    ratio = m.compress_rate
    with torch.no_grad():
        for p in m.parameters():  # HF zero-initialises the position bias: randomise everything
            p.copy_(torch.randn_like(p) * 0.5)
        m.kv_norm.weight.copy_(torch.rand_like(m.kv_norm.weight) + 0.5)
    if kind == "csa":
        m.indexer.forward = lambda h, *a, **k: torch.zeros(h.shape[0], h.shape[1], 1, dtype=torch.long)
    L = 5 * ratio + 3
    x = torch.randn(1, L, 64)
    with torch.no_grad():
        want = m(x, None, torch.arange(L)[None], None, 0)[0][0, 0]  # [L // ratio, 128]
        kv = x[0] @ m.kv_proj.weight.T
        score = x[0] @ m.gate_proj.weight.T + m.position_bias[torch.arange(L) % ratio]
    table = rope_cache_ref(m.rotary_emb.compress_inv_freq, L + 1) * m.rotary_emb.compress_attention_scaling
    w = m.kv_norm.weight.detach()
    ref = compress_kv_ref(kv, score, w, table, ratio, cfg.rms_norm_eps)
    assert_close("reference vs transformers", want, ref, 1e-5, 1e-5, 1e-9)
    state = allocate_compressor_state(1, ratio, 128, overlap=kind == "csa", device=device)
    cache = torch.zeros(L // ratio, 1, 128, device=device)
    one = torch.zeros(1, dtype=torch.int32, device=device)
    compress_kv(kv.to(device), score.to(device), state, one, torch.tensor([0, L], device=device),
                torch.tensor([L], device=device), w.to(device), table.to(device), cache,
                torch.arange(L // ratio, dtype=torch.int32, device=device)[None], ratio=ratio, eps=cfg.rms_norm_eps,
                kv_cache_dtype="auto")  # fmt: skip
    assert_close("compress_kv vs transformers", want, cache[:, 0], 2e-5, 2e-5, 1e-9)


@pytest.mark.gpu
def test_compress_decode_cuda_graph(device):
    """Decode steps replayed from one CUDA graph (static inputs updated in place) give the reference entries."""
    ratio, d, B = 4, 512, 3
    s = _Setup([41, 38, 45], ratio, d, True, "fp8_v4", device)
    s.table = _table(64, device)
    n0 = [33, 30, 37]
    s.step([(0, n) for n in n0])  # eager prefill
    kv = torch.zeros(B, 2 * d, device=device)
    sc = torch.zeros(B, 2 * d, device=device)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
    seq = torch.tensor(n0, dtype=torch.int32, device=device)

    def load(step):
        for b in range(B):
            kv[b], sc[b] = s.kv[b][n0[b] + step], s.score[b][n0[b] + step]
        seq.copy_(torch.tensor([n + step + 1 for n in n0], dtype=torch.int32))

    def fn():
        compress_kv(kv, sc, s.state, s.slots, qsl, seq, s.weight, s.table, s.cache, s.block_table, ratio=ratio)

    load(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles; a repeated step is idempotent
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for step in range(8):
        load(step)
        graph.replay()
    torch.cuda.synchronize()
    for b in range(B):
        n = (n0[b] + 8) // ratio
        assert_close(f"graph entries {b}", s.ref(b)[:n], s.entries(b)[:n], 1e-3, 2**-4, 1e-3)


def test_leading_rows_outside_requests(device):
    """Rows before query_start_loc[0] belong to no request: nothing is pooled from or written for them."""
    ratio, d = 4, 128
    s = _Setup([12], ratio, d, True, "auto", device)
    s.step([(0, 5)])
    junk = torch.randn(3, 2 * d, device=device) * 100
    compress_kv(torch.cat([junk, s.kv[0][5:]]), torch.cat([junk, s.score[0][5:]]), s.state, s.slots[:1],
                torch.tensor([3, 6], device=device), torch.tensor([8], device=device), s.weight, s.table, s.cache,
                s.block_table, ratio=ratio, kv_cache_dtype="auto")  # fmt: skip
    s.step([(8, 12)])  # entry 2 pools positions 4..11: position 4 comes from the state
    assert_close("offset batch", s.ref(0), s.entries(0), 2e-5, 2e-5, 1e-9)


def test_entry_rows_into_fp8_indexer_cache(device):
    """The indexer's compressed keys (d = 128): entry rows + slots from compress_kv, stored by
    concat_and_cache_indexer_k in the fp8 indexer layout (SPEC §2.5)."""
    from openmla.ops.indexer import alloc_indexer_k_cache, concat_and_cache_indexer_k
    from openmla.reference.indexer import dequantize_indexer_k_cache_ref

    ratio, d, lens = 4, 128, [13, 9]
    s = _Setup(lens, ratio, d, True, "auto", device)
    T = sum(lens) + 2  # two padding rows
    kv = torch.cat(s.kv + [torch.zeros(2, 2 * d, device=device)])
    sc = torch.cat(s.score + [torch.zeros(2, 2 * d, device=device)])
    rows = torch.full((T, d), float("nan"), device=device)
    slots = torch.full((T,), 77, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 13, 22], dtype=torch.int32, device=device)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    compress_kv(kv, sc, s.state, s.slots, qsl, seq, s.weight, s.table, None, s.block_table, ratio=ratio,
                block_size=s.bs_c, entry_rows=rows, entry_slots=slots)  # fmt: skip
    emit = torch.tensor([(p + 1) % ratio == 0 for n in lens for p in range(n)] + [False, False], device=device)
    assert bool((slots[~emit] == -1).all()) and bool(rows[~emit].isnan().all())
    cache = alloc_indexer_k_cache(s.cache.shape[0], s.bs_c, d, cache_dtype="fp8", device=device)
    concat_and_cache_indexer_k(rows.nan_to_num(0.0), cache, slots, cache_dtype="fp8", scale_fmt="ue8m0")
    flat = dequantize_indexer_k_cache_ref(cache, "fp8").reshape(-1, d)
    for b in range(2):
        i = torch.arange(lens[b] // ratio, device=device)
        got = flat[s.block_table[b, i // s.bs_c].long() * s.bs_c + i % s.bs_c]
        assert_close(f"indexer keys {b}", s.ref(b), got, 1e-3, 2**-4, 1e-3)
    with pytest.raises(ValueError, match="block_size"):
        compress_kv(kv, sc, s.state, s.slots, qsl, seq, s.weight, s.table, None, s.block_table, ratio=ratio,
                    entry_rows=rows)  # fmt: skip


def test_strided_index_inputs(device):
    """Non-contiguous 1-D query_start_loc / seq_lens / state_slots give the same entries."""
    s = _Setup([9, 6], 4, 128, True, "auto", device)

    def strided(values):
        t = torch.tensor(values, dtype=torch.int32, device=device)
        return torch.stack([t, t * 0 - 7], dim=1)[:, 0]

    compress_kv(torch.cat(s.kv), torch.cat(s.score), s.state, strided(s.slots.tolist()), strided([0, 9, 15]),
                strided([9, 6]), s.weight, s.table, s.cache, s.block_table, ratio=4, kv_cache_dtype="auto")  # fmt: skip
    for b in range(2):
        assert_close(f"entries {b}", s.ref(b), s.entries(b), 2e-5, 2e-5, 1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_random_schedules_identical(seed, device):
    """Random ratios, lengths and per-step token counts (requests interleaved, some idle): the same bytes as
    one prefill of every request."""
    g = torch.Generator().manual_seed(seed)
    ratio = [2, 4, 8][seed]
    overlap = seed != 2
    lens = torch.randint(1, 5 * ratio, (3,), generator=g).tolist()
    one = _Setup(lens, ratio, 128, overlap, "auto", device)
    one.cache.view(torch.uint8).fill_(0)
    many = _Setup(lens, ratio, 128, overlap, "auto", device)
    many.kv, many.score, many.weight, many.block_table = one.kv, one.score, one.weight, one.block_table
    many.cache.view(torch.uint8).fill_(0)
    one.step([(0, n) for n in lens])
    done = [0] * len(lens)
    while any(d < n for d, n in zip(done, lens)):
        chunks = []
        for b, n in enumerate(lens):
            k = min(n - done[b], int(torch.randint(0, 2 * ratio + 2, (1,), generator=g)))
            chunks.append((done[b], done[b] + k))
            done[b] += k
        many.step(chunks)
    assert torch.equal(one.raw().cpu(), many.raw().cpu())
