"""Bad input at the attention layers' entry points (MLAAttention, SparseMLAAttention, DeepseekV4Attention): each test
here failed on main at 00171f8, where the input ran (reading or writing past a tensor, or with a silently wrong
result) or failed deep inside with an unclear error.

The checks read shapes, dtypes and host ints only (no device sync: the engine captures forward in CUDA graphs).
"""

from __future__ import annotations

import pytest
import torch

from openmla.engine.models.deepseek_v4 import rope_table
from openmla.layers import DeepseekV4Attention, MLAAttention, SparseMLAAttention
from openmla.layers.rope import rope_inv_freq
from openmla.layers.v4 import V4LayerCache
from openmla.metadata import BatchSpec, MLAMetadataBuilder, SparseMLAMetadataBuilder, V4MetadataBuilder

L, R, HIDDEN, BS = 64, 16, 32, 4  # tiny MLA widths (the decode kernel takes power-of-two latents)
MLA_KW = dict(hidden_size=HIDDEN, num_heads=2, q_lora_rank=16, kv_lora_rank=L, qk_nope_head_dim=16,
              qk_rope_head_dim=R, v_head_dim=16)  # fmt: skip
SPARSE_KW = dict(index_n_heads=2, index_head_dim=32, index_topk=8, **MLA_KW)


def _spec(reqs, device, num_input_tokens=None, block_size=BS):
    """A BatchSpec over ``reqs = [(context, new)]``; request b owns blocks ``8b .. 8b + 7``."""
    qsl, slots, tables = [0], [], []
    for b, (c, q) in enumerate(reqs):
        qsl.append(qsl[-1] + q)
        tables.append([8 * b + i for i in range(8)])
        slots += [tables[b][p // block_size] * block_size + p % block_size for p in range(c, c + q)]
    T = num_input_tokens or qsl[-1]
    slots += [-1] * (T - len(slots))
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    sl = torch.tensor([c + q for c, q in reqs], dtype=torch.int32)
    return BatchSpec(
        query_start_loc=qsl_t.to(device), query_start_loc_cpu=qsl_t, seq_lens=sl.to(device),
        block_table=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), num_reqs=len(reqs),
        num_actual_tokens=qsl[-1], max_query_len=max(q for _, q in reqs), max_seq_len=int(sl.max()), seq_lens_cpu=sl,
        num_input_tokens=T,
    )  # fmt: skip


def _positions(reqs, device, T=None):
    pos = [p for c, q in reqs for p in range(c, c + q)]
    return torch.tensor(pos + [0] * ((T or len(pos)) - len(pos)), device=device)


def _dense_builder(device, **kw):
    opts = dict(num_heads=2, block_size=BS, max_num_seqs=4, max_model_len=32, max_num_batched_tokens=32,
                device=device, dtype=torch.float32, kv_entry=L + R, kv_lora_rank=L)  # fmt: skip
    return MLAMetadataBuilder(**{**opts, **kw})


# ------------------------------------------------------------------ MLAAttention
def test_mla_refuses_fewer_rows_than_a_padded_decode_step(device):
    """A uniform verify step padded to 3 requests x 2 rows has 6 input rows (4 real): the decode reads q and writes
    its output for all 6, so hidden states of 4 or 5 rows were read and written past their ends."""
    torch.manual_seed(0)
    layer = MLAAttention(**MLA_KW).to(device)
    cache = layer.make_kv_cache(40, BS, dtype=torch.float32, device=device)
    qsl = torch.tensor([0, 2, 4, 4], dtype=torch.int32)
    sl = torch.tensor([5, 7, 0], dtype=torch.int32)
    spec = BatchSpec(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=sl.to(device),
        block_table=torch.tensor([[0, 1], [2, 3], [0, 0]], dtype=torch.int32, device=device),
        slot_mapping=torch.tensor([3, 4, 14, 15, -1, -1], device=device), num_reqs=3, num_actual_tokens=4,
        max_query_len=2, max_seq_len=7, seq_lens_cpu=sl, num_input_tokens=6,
    )  # fmt: skip
    md = _dense_builder(device, decode_threshold=2).build(spec)
    assert md.decode.num_tokens == 6
    x, pos = torch.randn(6, HIDDEN, device=device), torch.tensor([3, 4, 5, 6, 0, 0], device=device)
    for T in (4, 5, 7):
        with pytest.raises(ValueError, match=rf"hidden_states has {T} rows but the metadata 6 \(num_input_tokens\)"):
            layer(pos[:T] if T <= 6 else torch.zeros(T, dtype=torch.int64, device=device),
                  torch.randn(T, HIDDEN, device=device), cache, md)  # fmt: skip
    assert layer(pos, x, cache, md).shape == (6, HIDDEN)  # the engine's call: every input row


@pytest.mark.parametrize("cls", [MLAAttention, SparseMLAAttention], ids=["mla", "sparse"])
def test_refuses_bad_positions_and_hidden_states(cls, device):
    """Float positions rotated by fractional angles without a word; a list or the other float dtype failed deep
    inside (AttributeError, F.linear's RuntimeError)."""
    layer = cls(**(SPARSE_KW if cls is SparseMLAAttention else MLA_KW)).to(device)
    reqs = [(3, 1), (5, 1)]
    if cls is SparseMLAAttention:
        b = SparseMLAMetadataBuilder(index_topk=8, block_size=BS, max_num_seqs=4, max_model_len=32,
                                     max_num_batched_tokens=32, device=device)  # fmt: skip
        caches = (layer.make_kv_cache(20, BS, dtype=torch.float32, device=device),
                  layer.make_indexer_k_cache(20, BS, dtype=torch.float32, device=device))  # fmt: skip
    else:
        b = _dense_builder(device)
        caches = (layer.make_kv_cache(20, BS, dtype=torch.float32, device=device),)
    md = b.build(_spec(reqs, device))
    x, pos = torch.randn(2, HIDDEN, device=device), _positions(reqs, device)
    with pytest.raises(TypeError, match="positions must be an int32 or int64 index tensor"):
        layer(pos.float() + 0.5, x, *caches, md)
    with pytest.raises(TypeError, match="positions must be a torch.Tensor"):
        layer(pos.tolist(), x, *caches, md)
    with pytest.raises(TypeError, match="hidden_states must be a torch.Tensor"):
        layer(pos, x.tolist(), *caches, md)
    with pytest.raises(TypeError, match=r"hidden_states must have the layer's dtype torch.float32; .*bfloat16"):
        layer(pos, x.bfloat16(), *caches, md)
    with pytest.raises(TypeError, match="hidden_states must have dtype in"):
        layer(pos, x.long(), *caches, md)


def test_mla_refuses_an_auto_cache_of_another_dtype(device):
    """A bf16 cache under an fp32 layer: the decode refused it, but a prefill step silently stored bf16-rounded
    latents (and its chunked context read them back) before the next decode step failed."""
    layer = MLAAttention(**MLA_KW).to(device)
    reqs = [(0, 5), (0, 3)]
    md = _dense_builder(device).build(_spec(reqs, device))
    assert md.decode is None and md.prefill is not None
    cache = layer.make_kv_cache(20, BS, dtype=torch.bfloat16, device=device)
    with pytest.raises(TypeError, match=r'kv_cache must have the dtype of hidden_states \(torch.float32\) for '
                                        r'kv_cache_dtype="auto"'):  # fmt: skip
        layer(_positions(reqs, device), torch.randn(8, HIDDEN, device=device), cache, md)


@pytest.mark.parametrize(
    "kw,err,match",
    [
        (dict(q_lora_rank=0), ValueError, "q_lora_rank must be a positive int"),  # built a rank-0 q projection
        (dict(qk_nope_head_dim=0), ValueError, "qk_nope_head_dim must be a positive int"),  # built, unchecked
        (dict(qk_nope_head_dim=None), ValueError, "qk_nope_head_dim must be a positive int"),  # TypeError on None + 1
        (dict(num_heads=True), ValueError, "num_heads must be a positive int"),  # a bool taken as 1 head
        (dict(kv_scale=float("inf")), ValueError, "kv_scale must be a positive finite float"),
        (dict(kv_scale="1"), TypeError, "kv_scale must be a float"),
        (dict(norm_eps=-1.0), ValueError, "norm_eps must be a finite float >= 0"),  # NaN norms
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else None,
)
def test_mla_constructor_refusals(kw, err, match):
    with pytest.raises(err, match=match):
        MLAAttention(**{**MLA_KW, **kw})
    if "kv_scale" not in kw:  # (the V3.2 layer refuses any kv_scale: its fp8 rows carry their own scales)
        with pytest.raises(err, match=match):  # the V3.2 layer takes the same MLA arguments
            SparseMLAAttention(**{**SPARSE_KW, **kw})


# ------------------------------------------------------------------ SparseMLAAttention
def test_sparse_refuses_caches_paged_unlike_the_metadata(device):
    """The indexer pages its key cache by the cache's own block size, the metadata's block table by the builder's:
    an indexer cache of 8-token blocks under 4-token metadata scored other keys (a silently wrong top-k)."""
    layer = SparseMLAAttention(**SPARSE_KW).to(device)
    reqs = [(9, 1), (4, 3)]
    b = SparseMLAMetadataBuilder(index_topk=8, block_size=BS, max_num_seqs=4, max_model_len=32,
                                 max_num_batched_tokens=32, device=device)  # fmt: skip
    md = b.build(_spec(reqs, device))
    x, pos = torch.randn(4, HIDDEN, device=device), _positions(reqs, device)
    kv = layer.make_kv_cache(20, BS, dtype=torch.float32, device=device)
    ik = layer.make_indexer_k_cache(20, BS, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="indexer_k_cache has blocks of 8 tokens but the metadata's block_size is 4"):
        layer(pos, x, kv, ik.view(10, 2 * BS, -1), md)
    with pytest.raises(ValueError, match="kv_cache has blocks of 8 tokens but the metadata's block_size is 4"):
        layer(pos, x, kv.view(10, 2 * BS, -1), ik, md)
    with pytest.raises(ValueError, match="indexer_k_cache must have kv_cache's 20 blocks"):
        layer(pos, x, kv, ik[:5], md)  # block ids past the indexer cache were read out of bounds
    with pytest.raises(ValueError, match="indexer_k_cache must be 3-D"):
        layer(pos, x, kv, ik.flatten(0, 1), md)


# ------------------------------------------------------------------ DeepseekV4Attention
V4_KW = dict(hidden_size=64, num_heads=4, q_lora_rank=32, o_groups=2, o_lora_rank=16, window=8, index_n_heads=4,
             index_head_dim=64, index_topk=4)  # fmt: skip
V4_TYPES = {"sliding_attention": 1, "compressed_sparse_attention": 4, "heavily_compressed_attention": 16}


def _v4(layer_type, device, table=True):
    layer = DeepseekV4Attention(layer_type=layer_type, compress_ratio=V4_TYPES[layer_type], **V4_KW)
    if table:
        inv_freq, _ = rope_inv_freq(64, {"rope_type": "default", "rope_theta": 1e4}, 64)
        layer.cos_sin_cache = rope_table(inv_freq, 64)
    return layer.to(device)


def _v4_step(layer, device, window=8, ratios=None):
    ratios = (layer.ratio,) if ratios is None and layer.compressor is not None else (ratios or ())
    b = V4MetadataBuilder(block_size=8, window=window, ratios=ratios, max_num_seqs=4, max_num_batched_tokens=16,
                          max_model_len=64, device=device)  # fmt: skip
    md = b.build(_spec([(20, 1), (10, 6)], device, block_size=8))
    return md, layer.make_cache(20, 8, 4, dtype=torch.float32, device=device), torch.randn(7, 64, device=device)


@pytest.mark.parametrize("layer_type", list(V4_TYPES), ids=lambda t: t.split("_")[0])
def test_v4_refuses_mismatched_steps(layer_type, device):
    """Before: a metadata window other than the layer's ran with that window (silently wrong attention), metadata
    without the layer's ratio raised KeyError, wrong objects AttributeError, x of another width a reshape error."""
    layer = _v4(layer_type, device)
    md, cache, x = _v4_step(layer, device)
    with pytest.raises(TypeError, match="md must be V4Metadata"):
        layer(x, object(), cache)
    with pytest.raises(TypeError, match="cache must be a V4LayerCache"):
        layer(x, md, cache.swa)
    with pytest.raises(ValueError, match=r"x must have shape \[\*, 64\]"):
        layer(torch.randn(7, 32, device=device), md, cache)
    with pytest.raises(TypeError, match="x must have the layer's dtype"):
        layer(x.bfloat16(), md, cache)
    with pytest.raises(ValueError, match=r"x has 6 rows but the metadata 7 \(num_tokens\)"):
        layer(x[:6], md, cache)
    for window in (4, 16):
        with pytest.raises(ValueError, match=f"metadata built for window {window} but the layer's window is 8"):
            layer(x, _v4_step(layer, device, window=window)[0], cache)
    with pytest.raises(ValueError, match="cache.swa must have blocks of 8 tokens"):
        layer(x, md, V4LayerCache(**{**vars(cache), "swa": cache.swa.view(10, 16, -1)}))
    if layer.compressor is not None:
        with pytest.raises(ValueError, match=f"metadata has no compressed entries for ratio {layer.ratio}"):
            layer(x, _v4_step(layer, device, ratios=(8,))[0], cache)
        with pytest.raises(ValueError, match="cache.compressed is None"):
            layer(x, md, V4LayerCache(swa=cache.swa))


def test_v4_csa_refuses_an_indexer_cache_paged_unlike_the_metadata(device):
    """The fp8 indexer keys are written by slot and read through the block table at the cache's own block size:
    an indexer cache of other blocks scored other keys (a silently wrong top-k)."""
    layer = DeepseekV4Attention(layer_type="compressed_sparse_attention", compress_ratio=4,
                                indexer_cache_dtype="fp8", **V4_KW)  # fmt: skip
    layer.cos_sin_cache = rope_table(rope_inv_freq(64, None, 64)[0], 64)
    md, cache, x = _v4_step(layer.to(device), device)
    bs_c = md.compressed[4].block_size
    wide = cache.indexer.view(cache.indexer.shape[0] // 2, 2 * bs_c, -1)
    with pytest.raises(ValueError, match=f"cache.indexer must have blocks of {bs_c} tokens"):
        layer(x, md, V4LayerCache(**{**vars(cache), "indexer": wide}))
    with pytest.raises(ValueError, match="cache.indexer_state is None"):
        layer(x, md, V4LayerCache(**{**vars(cache), "indexer_state": None}))


def test_v4_refuses_a_missing_rope_table(device):
    """The placeholder table had one zero row: position 0 lost its rope dims, every later one stayed unrotated."""
    layer = _v4("sliding_attention", device, table=False)
    md, cache, x = _v4_step(layer, device)
    with pytest.raises(ValueError, match="cos_sin_cache is not set"):
        layer(x, md, cache)
    with pytest.raises(ValueError, match="cos_sin_cache is not set"):
        layer.prepare(x, md, cache)


@pytest.mark.parametrize(
    "layer_type,kw,match",
    [
        ("sliding_attention", dict(o_groups=0), "o_groups must be a positive int"),  # ZeroDivisionError
        ("sliding_attention", dict(window=0), "window must be a positive int"),
        ("sliding_attention", dict(num_heads=0), "num_heads must be a positive int"),
        ("heavily_compressed_attention", dict(compress_ratio=0), "compress_ratio must be a positive int"),
        ("compressed_sparse_attention", dict(compress_ratio=3.5), "compress_ratio must be a positive int"),  # -> 3
        ("compressed_sparse_attention", dict(index_topk=0), "index_topk must be a positive int"),
        ("compressed_sparse_attention", dict(index_head_dim=96), "index_head_dim must be a power of two >= 64"),
        ("compressed_sparse_attention", dict(eps=float("nan")), "eps must be a finite float >= 0"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else None,
)
def test_v4_constructor_refusals(layer_type, kw, match):
    with pytest.raises(ValueError, match=match):
        DeepseekV4Attention(layer_type=layer_type, **{"compress_ratio": V4_TYPES[layer_type], **V4_KW, **kw})
