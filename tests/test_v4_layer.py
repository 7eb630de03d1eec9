"""The V4 attention layer and its metadata: index sets against the references; the layer (``sparse_mla`` with the
fused inverse RoPE, in fp32 and bf16, over "auto" and fp8_v4 caches) against the same layer in fp32 with
:func:`openmla.reference.sparse.sparse_mla_ref` as its attention, step by step across prefill, chunked prefill and
decode; the gathered prefill route against the paged one; bad input."""

from __future__ import annotations

import math

import pytest
import torch

import openmla.layers.v4 as v4_layer
from openmla.engine.models.deepseek_v4 import DeepseekV4ForCausalLM, rope_table
from openmla.layers.rope import rope_inv_freq
from openmla.layers.v4 import V4_LAYER_TYPES, DeepseekV4Attention, gather_split
from openmla.metadata import BatchSpec, V4MetadataBuilder
from openmla.metadata.v4 import compressed_block_size, ring_blocks
from openmla.reference.sparse import sparse_mla_ref
from openmla.reference.v4 import hca_indices_ref, swa_indices_ref
from openmla.utils import testing

DEV = testing.suite_device()


@pytest.fixture(autouse=True, scope="module")
def _torch_topk_on_cpu():
    # torch.topk for the indexer's threshold under the interpreter: the same result, faster on 2 CPU cores.
    mp = pytest.MonkeyPatch()
    if DEV.type == "cpu":
        mp.setattr(v4_layer, "INDEXER_TOPK_IMPL", "torch")
    yield
    mp.undo()


BS, WINDOW, MAX_LEN = 8, 8, 64


def _spec(steps, tables, num_input_tokens=None, block_size=BS):
    """BatchSpec for ``steps = [(context_len, query_len), ...]`` with per-request block lists."""
    qsl, slots = [0], []
    for (c, q), t in zip(steps, tables, strict=True):
        qsl.append(qsl[-1] + q)
        slots += [t[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
    T = num_input_tokens or qsl[-1]
    slots += [-1] * (T - len(slots))
    W = max(len(t) for t in tables)
    bt = torch.zeros(len(steps), W, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    sl = torch.tensor([c + q for c, q in steps], dtype=torch.int32)
    return BatchSpec(
        query_start_loc=qsl_t.to(DEV), query_start_loc_cpu=qsl_t, seq_lens=sl.to(DEV), block_table=bt.to(DEV),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV), num_reqs=len(steps),
        num_actual_tokens=qsl[-1], max_query_len=max(q for _, q in steps), max_seq_len=int(sl.max()),
        seq_lens_cpu=sl, num_input_tokens=T,
    )  # fmt: skip


def _builder(ratios=(4, 16), **kw):
    opts = dict(block_size=BS, window=WINDOW, ratios=ratios, max_num_seqs=4, max_num_batched_tokens=48,
                max_model_len=MAX_LEN, device=DEV)  # fmt: skip
    opts.update(kw)
    return V4MetadataBuilder(**opts)


TABLES = [[3, 1, 6, 0, 2], [5, 7, 4, 8, 9]]


def test_builder_matches_references():
    """Positions, SWA and HCA sets of a ragged step (decode + chunk) with CUDA-graph padding rows."""
    spec = _spec([(20, 1), (29, 6)], TABLES, num_input_tokens=10)
    md = _builder().build(spec)
    qsl, sl, bt = spec.query_start_loc.cpu(), spec.seq_lens.cpu(), spec.block_table.cpu()
    assert md.positions.tolist() == [20, 29, 30, 31, 32, 33, 34, 0, 0, 0]
    ref_i, ref_l = swa_indices_ref(qsl, sl, bt, BS, WINDOW, 10)
    assert torch.equal(md.swa_lens.cpu(), ref_l) and torch.equal(md.swa_indices.cpu(), ref_i)
    for r in (4, 16):
        cm = md.compressed[r]
        assert cm.block_size == compressed_block_size(BS, r) == max(1, BS // r)
        ref_i, ref_l = hca_indices_ref(qsl, sl, bt, cm.block_size, r, cm.hca_indices.shape[1], 10)
        assert torch.equal(cm.hca_lens.cpu(), ref_l) and torch.equal(cm.hca_indices.cpu(), ref_i)
        assert torch.equal(cm.row_block_table[:7].cpu(), bt[[0, 1, 1, 1, 1, 1, 1]])
    assert md.swa_lens[7:].eq(0).all() and md.compressed[4].hca_lens[7:].eq(0).all()


def test_builder_swa_ring():
    """With a ring of n blocks per state slot, SWA slots and indices point into slot s's blocks [s n, (s+1) n)."""
    n = ring_blocks(WINDOW, 6, BS)
    builder = _builder(swa_ring_blocks=n)
    builder.state_slots[:2] = torch.tensor([3, 1], dtype=torch.int32)
    spec = _spec([(40, 1), (29, 6)], [TABLES[0] + [10, 11], TABLES[1]], num_input_tokens=9)
    md = builder.build(spec)
    pos = md.positions.tolist()
    slot_of = [3] + [1] * 6

    def ring(s, p):
        return (s * n + (p // BS) % n) * BS + p % BS

    assert md.slot_mapping.tolist() == [ring(s, p) for s, p in zip(slot_of, pos)] + [-1, -1]
    for t in range(7):
        lo = max(0, pos[t] - WINDOW + 1)
        assert md.swa_indices[t, : md.swa_lens[t]].tolist() == [ring(slot_of[t], p) for p in range(lo, pos[t] + 1)]
    with pytest.raises(ValueError, match="ring"):
        _builder(swa_ring_blocks=n).build(_spec([(0, 30)], TABLES[:1]))


def test_builder_rejects_bad_geometry():
    with pytest.raises(ValueError, match="divide"):
        compressed_block_size(12, 8)
    with pytest.raises(ValueError, match="window"):
        _builder(window=0)
    with pytest.raises(ValueError, match="exceeds"):
        _builder(max_num_batched_tokens=4).build(_spec([(0, 6)], TABLES[:1]))


def _layer(layer_type, kv_cache_dtype="auto", index_topk=16, seed=0, indexer_cache_dtype="auto"):
    torch.manual_seed(seed)
    layer = DeepseekV4Attention(
        hidden_size=64, num_heads=4, q_lora_rank=32, o_groups=2, o_lora_rank=16, layer_type=layer_type,
        compress_ratio=4 if layer_type == "compressed_sparse_attention" else 16, window=WINDOW, index_n_heads=4,
        index_head_dim=128, index_topk=index_topk, kv_cache_dtype=kv_cache_dtype,
        indexer_cache_dtype=indexer_cache_dtype,
    )  # fmt: skip
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("sinks") or name.endswith("position_bias"):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    theta = 1e4 if layer_type == "sliding_attention" else 16e4
    inv_freq, _ = rope_inv_freq(64, {"rope_type": "default", "rope_theta": theta}, MAX_LEN)
    layer.cos_sin_cache = rope_table(inv_freq, MAX_LEN)
    return layer.to(DEV).eval()


def _run_steps(layer, dtype, kv_cache_dtype, schedule, xs):
    """Run the layer through ``schedule`` (a list of steps ``[(context, query), ...]`` over two requests)."""
    for name, p in layer.named_parameters():  # the engine's rule: norms, sinks, biases stay fp32
        p.data = p.data.to(torch.float32 if any(k in name for k in DeepseekV4ForCausalLM.FP32_KEYS) else dtype)
    cache = layer.make_cache(10, BS, 4, dtype=dtype, device=DEV)
    builder = _builder(ratios=(layer.ratio,) if layer.compressor is not None else ())
    outs = [[], []]
    with torch.inference_mode():
        for step in schedule:
            reqs = [i for i, s in enumerate(step) if s[1] > 0]
            spec = _spec([step[i] for i in reqs], [TABLES[i] for i in reqs])
            builder.state_slots[: len(reqs)] = torch.tensor(reqs, dtype=torch.int32)
            md = builder.build(spec)
            x = torch.cat([xs[i][step[i][0] : step[i][0] + step[i][1]] for i in reqs]).to(dtype)
            y = layer(x, md, cache).float()
            row = 0
            for i in reqs:
                outs[i].append(y[row : row + step[i][1]])
                row += step[i][1]
    _run_steps.cache = cache  # the last run's caches, for the tests that look inside
    return [torch.cat(o) for o in outs]


# Two requests: a prefill of 21, then decodes; chunks of 7 and 12, then a decode closing a ratio-4 entry.
SCHEDULE = [[(0, 21), (0, 7)], [(21, 1), (7, 12)], [(22, 1), (19, 1)]]


class _CheckedAttention:
    """``sparse_mla`` that also runs :func:`sparse_mla_ref` (fp32 torch: gathered rows, one softmax, sink, inverse
    RoPE) on the same q and caches and checks the kernel against it (fp32 q: to 1e-5; bf16: bf16 rounding)."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def __call__(self, q, kv_cache, indices, sm_scale, **kw):
        out, lse = self.kernel(q, kv_cache, indices, sm_scale, **kw)
        ref_kw = {k: v for k, v in kw.items() if k not in ("return_lse", "validate", "out")}
        ref, _ = sparse_mla_ref(q, kv_cache, indices, sm_scale, **ref_kw)
        tol = (1e-5, 1e-5, 1e-10) if q.dtype == torch.float32 else (2e-2, 1e-2, 1e-4)
        testing.assert_close(f"sparse_mla ({q.dtype}, {kw['kv_cache_dtype']})", ref, out.float(), *tol)
        self.calls += 1
        return out, lse


_FP32_RUNS = {}


def _fp32_run(layer_type, kv_cache_dtype, xs):
    """The fp32 layer (``sparse_mla`` checked against the reference at every step) over ``kv_cache_dtype``
    caches; memoised (every caller passes the same ``xs``): (outputs, caches)."""
    key = (layer_type, kv_cache_dtype)
    if key not in _FP32_RUNS:
        with pytest.MonkeyPatch.context() as mp:
            spy = _CheckedAttention(v4_layer.sparse_mla)
            mp.setattr(v4_layer, "sparse_mla", spy)
            outs = _run_steps(_layer(layer_type, kv_cache_dtype), torch.float32, kv_cache_dtype, SCHEDULE, xs)
            assert spy.calls == len(SCHEDULE)
        _FP32_RUNS[key] = outs, _run_steps.cache
    return _FP32_RUNS[key]


def _inputs():
    torch.manual_seed(1)
    return [torch.randn(24, 64, device=DEV), torch.randn(21, 64, device=DEV)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_v4"])
@pytest.mark.parametrize("layer_type", V4_LAYER_TYPES, ids=lambda t: t.split("_")[0])
def test_layer_matches_reference(layer_type, kv_cache_dtype):
    """fp32 and bf16 through ``sparse_mla`` (bf16/fp32 or fp8_v4 caches), every step's attention checked against
    ``sparse_mla_ref`` on the same inputs; the bf16 layer's outputs against the fp32 layer's, same weights and
    steps."""
    xs = _inputs()
    ref, _ = _fp32_run(layer_type, kv_cache_dtype, xs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(v4_layer, "sparse_mla", _CheckedAttention(v4_layer.sparse_mla))
        out = _run_steps(_layer(layer_type, kv_cache_dtype), torch.bfloat16, kv_cache_dtype, SCHEDULE, xs)
    # bf16 weights and activations (~2^-8 relative per op through ~10 ops); with fp8_v4 the two runs' rows also
    # round to different e4m3 values (2^-4 relative in the nope dims).
    # Measured on CPU: max |diff| 0.015 / cos 2e-5 (auto caches), 0.07 / 6e-4 (fp8_v4), outputs up to ~2.
    tol = (0.04, 0.02, 1e-4) if kv_cache_dtype == "auto" else (0.15, 0.05, 2e-3)
    for r, o in zip(ref, out, strict=True):
        testing.assert_close(f"{layer_type} {kv_cache_dtype}", r, o, *tol)


def test_layer_rejects_bad_arguments():
    kw = dict(hidden_size=64, num_heads=4, q_lora_rank=32, o_groups=2, o_lora_rank=16, compress_ratio=4, window=8,
              index_n_heads=4, index_head_dim=128, index_topk=4)  # fmt: skip
    with pytest.raises(ValueError, match="layer_type"):
        DeepseekV4Attention(layer_type="full_attention", **kw)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        DeepseekV4Attention(layer_type="sliding_attention", kv_cache_dtype="fp8", **kw)
    with pytest.raises(ValueError, match="indexer_cache_dtype"):
        DeepseekV4Attention(layer_type="compressed_sparse_attention", indexer_cache_dtype="fp4", **kw)
    with pytest.raises(ValueError, match="o_groups"):
        DeepseekV4Attention(layer_type="sliding_attention", **{**kw, "o_groups": 3})


def test_fp8_indexer_keys():
    """CSA with the fp8 indexer key cache: the keys are the auto cache's within e4m3 rounding, and with a top-k
    covering every entry the layer's output does not change."""
    from openmla.reference.indexer import dequantize_indexer_k_cache_ref

    xs = _inputs()
    lt = "compressed_sparse_attention"
    ref, ref_cache = _fp32_run(lt, "auto", xs)
    auto_keys = ref_cache.indexer.float()
    out = _run_steps(_layer(lt, indexer_cache_dtype="fp8"), torch.float32, "auto", SCHEDULE, xs)
    fp8_keys = dequantize_indexer_k_cache_ref(_run_steps.cache.indexer, "fp8")
    # e4m3: 3 mantissa bits (relative 2^-4) under a UE8M0 scale per key (up to 2x coarser)
    amax = auto_keys.abs().amax(-1, keepdim=True)
    assert ((fp8_keys - auto_keys).abs() <= amax / 8 + 1e-6).all()
    assert (fp8_keys - auto_keys).abs().max() > 0  # really quantised
    for r, o in zip(ref, out, strict=True):
        testing.assert_close("fp8 indexer, full top-k", r, o, 1e-5, 1e-5, 1e-10)


def test_gather_split_rule():
    """The host-side plan of the gathered prefill route: decode / verify rows and a prefill ahead of a decode stay
    paged; trailing prefills are gathered when their key reads pay for the workspace ("auto") and it fits."""
    kw = dict(ratio=4, topk=512, window=128)
    L = v4_layer.GATHER_MIN_QUERY_LEN
    assert gather_split([1, 1, 4], [100, 200, 300], **kw) is None
    assert gather_split([4096], [4096], **kw) == (0, 1024, 1024 + 4096)  # N = 4096 // 4, then 4096 tokens
    assert gather_split([1, 4096], [500, 4096], **kw) == (1, 1024, 1024 + 4096)  # the decode stays paged
    assert gather_split([4096, 1], [4096, 500], **kw) is None  # not a trailing prefill
    assert gather_split([200], [1000], ratio=1, topk=0, window=128) == (0, 0, 327)  # sliding: 200 + 127 rows
    # a short chunk over a long CSA context: its 2^16 compressed rows cost more than its reads save
    assert gather_split([L], [2**18 + L], **kw) is None
    assert gather_split([L], [2**18 + L], **kw, route="gathered") == (0, 2**16 + L // 4, 2**16 + L // 4 + L + 127)
    assert gather_split([4096] * 64, [4096] * 64, ratio=1, topk=0, window=128) == (0, 0, 4096)
    assert gather_split([4096] * 65, [4096] * 65, ratio=1, topk=0, window=128) is None  # over the workspace cap


# fp32 (the tight tolerance) at the compressed (CSA) layer only: the sliding and HCA layers' gathered rows keep the
# paged key order (bit-identical in bf16 too), which the bf16 cases check
_GATHER_CASES = [(t, c, d) for t in V4_LAYER_TYPES for c, d in (("auto", torch.bfloat16), ("fp8_v4", torch.bfloat16))]
_GATHER_CASES.append((next(t for t in V4_LAYER_TYPES if t.startswith("compressed")), "fp8_v4", torch.float32))


@pytest.mark.parametrize(
    "layer_type,kv_cache_dtype,dtype",
    _GATHER_CASES,
    ids=lambda v: v.split("_")[0] if isinstance(v, str) and "attention" in v else str(v).replace("torch.", ""),
)
def test_gathered_prefill_matches_paged(layer_type, kv_cache_dtype, dtype):
    """The layer with the gathered prefill route forced on (every trailing request of >= 2 rows) against the paged
    route, over SCHEDULE: a prefill of two requests (all rows gathered), a decode + chunk over context (the decode
    row paged, the chunk gathered), then decodes (paged). Paged rows match exactly (the caches are the same); the
    gathered ones within the attention's rounding (another key order; bf16: its output's rounding)."""
    xs = _inputs()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(v4_layer, "PREFILL_ROUTE", "paged")
        ref = _run_steps(_layer(layer_type, kv_cache_dtype), dtype, kv_cache_dtype, SCHEDULE, xs)
    splits = []
    gathered = DeepseekV4Attention._gathered_attention

    def spy(self, q, md, cache, local, k0, N, M, r0, out):
        splits.append((k0, r0, q.shape[0]))
        return gathered(self, q, md, cache, local, k0, N, M, r0, out)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(v4_layer, "PREFILL_ROUTE", "gathered")
        mp.setattr(v4_layer, "GATHER_MIN_QUERY_LEN", 2)
        mp.setattr(DeepseekV4Attention, "_gathered_attention", spy)
        checked = _CheckedAttention(v4_layer.sparse_mla)  # each call (paged or gathered) against the reference
        mp.setattr(v4_layer, "sparse_mla", checked)
        out = _run_steps(_layer(layer_type, kv_cache_dtype), dtype, kv_cache_dtype, SCHEDULE, xs)
    assert splits == [(0, 0, 28), (1, 1, 13)] and checked.calls == 4
    paged_rows = [slice(21, None), slice(19, None)]  # request 0's decodes, request 1's last decode
    for r, o, p in zip(ref, out, paged_rows, strict=True):
        assert torch.equal(r[p], o[p])
    # Measured on CPU (outputs up to ~2): CSA max |diff| 6e-7 fp32, 0.004 bf16 (a bf16 rounding of o through the
    # output projections); sliding and HCA bit-identical here (the same key order within each source).
    tol = (1e-5, 1e-5, 1e-10) if dtype == torch.float32 else (0.01, 0.01, 1e-5)
    for r, o in zip(ref, out, strict=True):
        testing.assert_close(f"{layer_type} {kv_cache_dtype} {dtype}: gathered vs paged", r, o, *tol)
