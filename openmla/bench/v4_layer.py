"""Family ``v4_layer``: one DeepSeek V4 attention layer's decode step per layer type, beside FlashMLA's decode.

A shape spec is ``v4layer <swa|csa|hca> h<heads> b<batch> s<context> [w<window>] [k<top-k>] [r<ratio>]
[d<hidden>] [bs<block>] [bf16]``: b requests of s cached tokens each decode one token through a
``DeepseekV4Attention`` with V4-Flash's proportions (hidden d = 4096, q_lora and o_lora d / 4, 8 output groups,
an indexer of h heads x 128, window 128, CSA ratio 4 with top-k 512, HCA ratio 128) over fp8_v4 caches and fp8
indexer keys (``bf16``: bf16 caches and keys) of 64-token blocks, every slot filled. Two parts per point:

* ``layer``: the whole layer step (q / kv projections and norms, the SWA write, the compressor, for CSA the
  indexer's compressor, scores and top-k over the request's ``s / 4`` entries, the attention with the fused
  inverse RoPE, the grouped output projection), under CUDA-graph replay; no peer (nothing else computes it).
* ``attention``: ``sparse_mla`` alone on the layer's own q, caches and index sets (the window plus the top-k or
  all HCA entries), beside ``flash_mla_with_kvcache`` (MODEL1 sparse decode, q padded to 64 / 128 heads) on the
  same bytes; ``check`` is the cosine of the two outputs without the inverse RoPE (FlashMLA has none).

FLOPs: attention ``2 h keys (512 + 512)``, plus for the layer the projections' ``2 b (weights)`` and the indexer's
``2 b h_i 128 entries``; bytes: the rows read (+ the weights and indexer keys for the layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from openmla import concat_and_cache_indexer_k, concat_and_cache_v4, sparse_mla
from openmla.bench.context import BenchContext, cosine
from openmla.engine.models.deepseek_v4 import DeepseekV4ForCausalLM, rope_table
from openmla.layers.rope import rope_inv_freq
from openmla.layers.v4 import DeepseekV4Attention
from openmla.metadata import BatchSpec, V4MetadataBuilder

OP_LAYER, OP_ATTN = "DeepseekV4Attention decode", "V4 decode attention (sparse_mla)"
OP = f"{OP_LAYER} (whole layer; its attention beside FlashMLA)"
TYPES = {"swa": "sliding_attention", "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}
PEER_HEADS = (64, 128)  # the head counts FlashMLA's sparse decode takes
ROW_BYTES = {"fp8": 584, "bf16": 1024}
_FLASH = [f"v4layer {t} h64 b{b} s{s}" for t in ("swa", "csa", "hca") for b in (64, 128) for s in (16384, 65536)]
PRESETS = {
    "default": _FLASH,
    "quick": ["v4layer swa h64 b128 s16384", "v4layer csa h64 b128 s16384", "v4layer hca h64 b128 s16384"],
    "tiny": ["v4layer swa h2 b2 s20 w8 d64 bs16", "v4layer csa h2 b2 s39 w8 k4 d64 bs16 bf16",
             "v4layer csa h2 b1 s39 w8 k4 d64 bs16", "v4layer hca h2 b1 s40 w8 r16 d64 bs16"],  # CPU (interpreter)
}  # fmt: skip


@dataclass(frozen=True)
class V4LayerShape:
    kind: str
    h: int
    b: int
    s: int
    w: int = 128
    k: int = 512
    r: int = 0  # 0: 4 for CSA, 128 for HCA
    d: int = 4096
    bs: int = 64
    dtype: str = "fp8"
    spec: str = ""

    def __str__(self) -> str:
        return self.spec

    @property
    def ratio(self) -> int:
        return self.r or {"swa": 1, "csa": 4, "hca": 128}[self.kind]


def parse(spec: str) -> V4LayerShape:
    """``"v4layer csa h64 b128 s16384"`` -> :class:`V4LayerShape` (ValueError on a bad spec)."""
    toks = spec.split()
    bad = ValueError(f"bad v4_layer shape {spec!r}: want 'v4layer <swa|csa|hca> h<heads> b<batch> s<context> "
                     "[w<window>] [k<top-k>] [r<ratio>] [d<hidden>] [bs<block>] [bf16]'")  # fmt: skip
    if len(toks) < 2 or toks[0] != "v4layer" or toks[1] not in TYPES:
        raise bad
    f: dict = {"kind": toks[1], "spec": spec}
    for tok in toks[2:]:
        if tok in ("bf16", "fp8"):
            f["dtype"] = tok
            continue
        key = "bs" if tok.startswith("bs") else tok[0]
        val = tok[len(key) :]
        if key not in ("h", "b", "s", "w", "k", "r", "d", "bs") or not val.isdigit() or int(val) < 1:
            raise bad
        f[key] = int(val)
    if not {"h", "b", "s"} <= f.keys():
        raise bad
    return V4LayerShape(**f)


def _layer(shape: V4LayerShape, dev) -> DeepseekV4Attention:
    d, h = shape.d, shape.h
    layer = DeepseekV4Attention(
        hidden_size=d, num_heads=h, q_lora_rank=d // 4, o_groups=math.gcd(8, h), o_lora_rank=d // 4,
        layer_type=TYPES[shape.kind], compress_ratio=shape.ratio, window=shape.w, index_n_heads=h,
        index_head_dim=128, index_topk=shape.k, kv_cache_dtype="fp8_v4" if shape.dtype == "fp8" else "auto",
        indexer_cache_dtype="fp8" if shape.dtype == "fp8" else "auto",
    ).to(dev)  # fmt: skip
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, device=dev, generator=g) / math.sqrt(p.shape[-1]))
            keep = any(k in name for k in DeepseekV4ForCausalLM.FP32_KEYS)
            p.data = p.data.to(torch.float32 if keep else torch.bfloat16)
    theta = 1e4 if shape.kind == "swa" else 16e4
    inv_freq, _ = rope_inv_freq(64, {"rope_type": "default", "rope_theta": theta}, shape.s + 2)
    layer.cos_sin_cache = rope_table(inv_freq, shape.s + 2).to(dev)
    return layer.eval()


def _fill_slots(cache: torch.Tensor, width: int, write, dev) -> None:
    """Random ~N(0, 1) bf16 rows of ``width`` into every slot of ``cache`` through its writer
    ``write(rows, slots)``, 64k rows at a time."""
    slots = cache.shape[0] * cache.shape[1]
    for s0 in range(0, slots, 1 << 16):
        n = min(1 << 16, slots - s0)
        write(torch.randn(n, width, device=dev, dtype=torch.bfloat16),
              torch.arange(s0, s0 + n, device=dev, dtype=torch.int64))  # fmt: skip


def _fill(cache: torch.Tensor, kv_dtype: str, dev) -> None:
    """Every slot of a V4 cache, written by the cache writer."""

    def write(rows, slot):
        concat_and_cache_v4(rows[:, :448], rows[:, 448:], cache, slot, kv_cache_dtype=kv_dtype, validate=False)

    _fill_slots(cache, 512, write, dev)


def _fill_indexer(cache: torch.Tensor, cache_dtype: str, dev) -> None:
    """Every indexer key: bf16 rows, or e4m3 with UE8M0 scales through the key writer."""
    if cache_dtype == "auto":
        cache.normal_()
        return

    def write(rows, slot):
        concat_and_cache_indexer_k(rows, cache, slot, cache_dtype="fp8", scale_fmt="ue8m0", validate=False)

    _fill_slots(cache, cache.shape[2] - 4, write, dev)


def run(shape: V4LayerShape, ctx: BenchContext) -> list[dict]:
    """Time one point: the layer step, its attention alone and FlashMLA's decode on the same caches."""
    dev, b, s, h = ctx.device, shape.b, shape.s, shape.h
    torch.manual_seed(0)
    layer = _layer(shape, dev)
    kv_dtype = layer.kv_cache_dtype
    per = -(-(s + 1) // shape.bs)
    cache = layer.make_cache(b * per, shape.bs, b, dtype=torch.bfloat16, device=dev)
    for c in (cache.swa, cache.compressed):
        if c is not None:
            _fill(c, kv_dtype, dev)
    if cache.indexer is not None:
        _fill_indexer(cache.indexer, layer.indexer_cache_dtype, dev)
    ratios = (layer.ratio,) if layer.compressor is not None else ()
    builder = V4MetadataBuilder(block_size=shape.bs, window=shape.w, ratios=ratios, max_num_seqs=b,
                                max_num_batched_tokens=b, max_model_len=s + 1, device=dev)  # fmt: skip
    qsl = torch.arange(b + 1, dtype=torch.int32)
    sl = torch.full((b,), s + 1, dtype=torch.int32)
    bt = torch.arange(b * per, dtype=torch.int32).view(b, per)
    slots = (bt[:, s // shape.bs] * shape.bs + s % shape.bs).long()
    spec = BatchSpec(query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=sl.to(dev), block_table=bt.to(dev),
                     slot_mapping=slots.to(dev), num_reqs=b, num_actual_tokens=b, max_query_len=1, max_seq_len=s + 1,
                     seq_lens_cpu=sl, num_input_tokens=b)  # fmt: skip
    md = builder.build(spec)
    x = torch.randn(b, shape.d, device=dev, dtype=torch.bfloat16)

    def own_layer():
        return layer(x, md, cache)

    with torch.inference_mode():
        own_layer()
        q, extra = layer.prepare(x, md, cache)  # the attention's own inputs, as the layer forms them
    kw = dict(kv_cache_dtype=kv_dtype, topk_length=md.swa_lens, attn_sink=layer.sinks, d_v=512,
              extra_kv_cache=extra[0], extra_indices=extra[1], extra_topk_length=extra[2], validate=False)  # fmt: skip
    out = torch.empty(b, h, 512, dtype=torch.bfloat16, device=dev)

    def own_attn():
        sparse_mla(q, cache.swa, md.swa_indices, layer.scaling, out=out, return_lse=False,
                   inv_rope_positions=md.positions, cos_sin_cache=layer.cos_sin_cache, **kw)  # fmt: skip

    own_attn()
    fns, check = {"layer": own_layer, "openmla": own_attn}, None
    fm = ctx.peer("flash_mla")
    if fm is not None:
        try:
            hp = next((p for p in PEER_HEADS if p >= h), None)
            if hp is None or kv_dtype != "fp8_v4":
                raise ValueError(f"FlashMLA's sparse decode takes {PEER_HEADS} heads and an fp8 cache")
            plain = sparse_mla(q, cache.swa, md.swa_indices, layer.scaling, **kw)[0]
            qp = torch.zeros(b, 1, hp, 512, device=dev, dtype=torch.bfloat16)
            qp[:, 0, :h] = q
            sp = torch.zeros(hp, device=dev)
            sp[:h] = layer.sinks
            kc = cache.swa.view(torch.float8_e4m3fn).unsqueeze(2)
            ip = md.swa_indices.view(b, 1, -1)
            ex = {}  # SWA layers: the window alone; CSA / HCA: the compressed entries as FlashMLA's extra source
            if extra[0] is not None:
                ex = dict(extra_k_cache=cache.compressed.view(torch.float8_e4m3fn).unsqueeze(2),
                          extra_indices_in_kvcache=extra[1].view(b, 1, -1), extra_topk_length=extra[2])  # fmt: skip
            meta = fm.get_mla_metadata()[0]

            def peer():
                return fm.flash_mla_with_kvcache(qp, kc, None, None, 512, meta, softmax_scale=layer.scaling,
                                                 is_fp8_kvcache=True, indices=ip, topk_length=md.swa_lens,
                                                 attn_sink=sp, **ex)  # fmt: skip

            check = cosine(plain, peer()[0][:, 0, :h])
            fns["flashmla"] = peer
        except Exception as exc:  # the peer refuses this shape: its column stays empty
            ctx.note(f"# flashmla failed at {shape}: {type(exc).__name__}: {exc}".splitlines()[0])
    with torch.inference_mode():
        t = ctx.time(fns, graph=True)
    # keys per row: the window plus the compressed entries it read
    n_c = float(extra[2].sum()) if extra[2] is not None else 0.0
    keys = float(md.swa_lens.sum()) + n_c
    row = ROW_BYTES[shape.dtype]
    attn_bytes = keys * row + 2 * b * h * 512 * 2
    entries = s // layer.ratio if layer.is_csa else 0
    weights = sum(p.numel() * p.element_size() for p in layer.parameters())
    w_flops = 2.0 * b * sum(p.numel() for n, p in layer.named_parameters() if p.dim() == 2)
    idx_flops = 2.0 * b * h * 128 * entries
    key_bytes = 128 + 4 if layer.indexer_cache_dtype == "fp8" else 128 * 2  # an indexer key (e4m3 + its scale)
    layer_bytes = attn_bytes + weights + b * entries * key_bytes
    attn_flops = 2.0 * h * keys * 1024
    rows = ctx.rows(OP_LAYER, f"{shape} (layer)", {"openmla": t["layer"]}, flops=attn_flops + w_flops + idx_flops,
                    nbytes=layer_bytes, dtype=shape.dtype)  # fmt: skip
    attn_t = {k: v for k, v in t.items() if k != "layer"}
    return rows + ctx.rows(OP_ATTN, f"{shape} (attention)", attn_t, flops=attn_flops, nbytes=attn_bytes,
                           dtype=shape.dtype, peer="flashmla", check=check)  # fmt: skip
