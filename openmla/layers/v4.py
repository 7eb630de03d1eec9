"""DeepSeek V4 attention (SWA, CSA, HCA) over paged caches, with transformers' ``deepseek_v4`` parameter names.

Per token (SPEC §7): ``qr = RMSNorm(q_a_proj(x))``, ``q = q_b_proj(qr)`` per head ``[H, 512]`` with a weightless
RMSNorm, GPT-J RoPE on dims 448..511; one KV row ``RMSNorm(kv_proj(x))`` (RoPE'd the same way) is both K and V
and goes to the SWA cache. Compressed layers (ratio r) also run the compressor (:func:`openmla.compress_kv`:
its entries go to a compressed cache, its partial windows to a per-request state ring) and see, besides the
window, compressed entries ``i < (pos + 1) // r``: all of them (HCA) or the indexer's top-k (CSA; the indexer
runs its own 128-wide compressor into an indexer key cache). One softmax over both sources with a per-head
sink, scale ``512^-0.5``; the output's rope dims are rotated back by the token's angle; then the grouped
output projection (``o_groups`` blocks to ``o_lora_rank`` each) and ``o_b_proj``.

Sliding-window layers use the plain RoPE table, compressed layers (their q/kv, compressor, indexer and
inverse RoPE) the "compress" table: the model passes each layer its ``[P, 64]`` ``[cos | sin]`` table.

Attention runs :func:`openmla.sparse_mla` in every model dtype (bf16/fp16/fp32 q; fp32 with fp32 "auto" or fp8_v4
caches is the CPU oracle configuration), the inverse RoPE fused into its epilogue. Two routes (the same keys, one
softmax): **paged**, the SWA and compressed caches read directly (decode, verify, short queries, CUDA graphs); and,
for the trailing prefill requests of a step where :data:`PREFILL_ROUTE` picks it, **gathered**: both caches
dequantised into one q-dtype workspace (SPEC §7.6, ``dequantize_and_gather_k_cache`` + ``combine_topk_swa_indices``)
read as one "auto" source (on the H200, fp8_v4 h64 t4096: 1.66 ms gather included against 3.29 ms paged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from openmla.layers.mla import check_hidden_states
from openmla.metadata.v4 import V4Metadata
from openmla.ops._validate import capturing, check_positive_ints, check_tensor, describe
from openmla.ops.cache_v4 import allocate_v4_cache, concat_and_cache_v4, dequantize_and_gather_k_cache
from openmla.ops.compressor import allocate_compressor_state, compress_kv
from openmla.ops.indexer import INDEXER_CACHE_DTYPES, alloc_indexer_k_cache, concat_and_cache_indexer_k, indexer_topk
from openmla.ops.norm_rope import MAX_D as NORM_MAX_D
from openmla.ops.norm_rope import rms_norm_rope
from openmla.ops.rope import rope_rows_
from openmla.ops.sparse import sparse_mla
from openmla.ops.v4_indices import combine_topk_swa_indices, csa_topk_indices, hca_indices

__all__ = ["V4_KV_CACHE_DTYPES", "V4_LAYER_TYPES", "DeepseekV4Attention", "V4LayerCache", "V4RMSNorm"]

V4_KV_CACHE_DTYPES = ("auto", "fp8_v4")
V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
HEAD_DIM, ROPE_DIM = 512, 64
#: ``indexer_topk``'s top-k pass ("auto", "triton" radix select or "torch"; the same result). Read at call time.
INDEXER_TOPK_IMPL = "auto"
#: Prefill attention route, read at call time: "auto" (gathered where :func:`gather_split` says it pays, fp8_v4
#: caches only: for an "auto" cache the gather is a plain copy that saves no dequantisation), "paged" (never), or
#: "gathered" (the trailing requests of >= GATHER_MIN_QUERY_LEN rows, cost rule and cache dtype ignored; tests).
PREFILL_ROUTE = "auto"
#: Requests with fewer new rows (decode, speculative verify) always read the paged caches.
GATHER_MIN_QUERY_LEN = 128
#: "auto": gather only when the gathered rows' key reads are at least this many times the workspace rows written
#: (the gather reads each fp8 row once and writes it in bf16; then each key read is bf16, about half the cost).
GATHER_MIN_READS_PER_ROW = 4
#: "auto": the largest workspace, in 512-wide rows (2^18 bf16 rows = 256 MiB); larger keeps the paged route.
GATHER_MAX_WORKSPACE_ROWS = 1 << 18
_ROUTES = ("auto", "paged", "gathered")


def gather_split(qlens: list[int], seq_lens: list[int], *, ratio: int, topk: int | None, window: int,
                 route: str = "auto") -> tuple[int, int, int] | None:  # fmt: skip
    """Host-side plan of the gathered route for one layer: ``(k0, N, M)`` or None (all paged).

    Requests ``k0..B-1`` (the longest suffix whose queries have >= :data:`GATHER_MIN_QUERY_LEN` rows: the engine
    schedules decodes first) go through a workspace ``[B - k0, M, 512]``: ``N = max(seq_len // ratio)`` compressed
    rows (0 for ``ratio`` 1, a sliding layer), then ``gather_len = min(seq_len, qlen + window - 1)`` window rows.
    ``topk``: compressed entries a row reads (CSA's top-k; None: all of them, HCA; 0: none). Under ``route``
    "auto" the plan also needs ``reads >= GATHER_MIN_READS_PER_ROW * rows`` and ``rows <= GATHER_MAX_WORKSPACE_ROWS``
    (rows = ``(B - k0) * M``, reads ~ ``sum qlen * (min(seq // ratio, topk) + min(seq, window))``).
    """
    B = len(qlens)
    k0 = B
    while k0 > 0 and qlens[k0 - 1] >= GATHER_MIN_QUERY_LEN:
        k0 -= 1
    if k0 == B:
        return None
    reqs = range(k0, B)
    N = max(seq_lens[b] // ratio for b in reqs) if ratio > 1 else 0
    M = N + max(min(seq_lens[b], qlens[b] + window - 1) for b in reqs)
    if route == "auto":
        rows = (B - k0) * M
        cap = (lambda n: n) if topk is None else (lambda n: min(n, topk))
        reads = sum(qlens[b] * (cap(seq_lens[b] // ratio if ratio > 1 else 0) + min(seq_lens[b], window))
                    for b in reqs)  # fmt: skip
        if rows > GATHER_MAX_WORKSPACE_ROWS or reads < GATHER_MIN_READS_PER_ROW * rows:
            return None
    return k0, N, M


class V4RMSNorm(nn.Module):
    """transformers' V4 RMSNorm: normalise in fp32, multiply by the (fp32) weight in fp32, cast once (one
    ``rms_norm_rope`` kernel over the rows; rows wider than it takes in torch)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        D = x.shape[-1]
        if D > NORM_MAX_D:
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (self.weight.float() * xf).to(x.dtype)
        return rms_norm_rope(x.reshape(-1, D), self.eps, weight=self.weight, validate=False).view(x.shape)


@dataclass
class V4LayerCache:
    """One layer's paged state.

    Attributes:
        swa (torch.Tensor): the KV rows of every token (SWA cache, the main block size).
        compressed (torch.Tensor | None): compressed entries (CSA/HCA), block size ``bs_c``.
        indexer (torch.Tensor | None): CSA indexer keys ``[num_blocks, bs_c, index_head_dim]`` (model dtype).
        state (torch.Tensor | None): compressor state ring ``[slots, 2, coff*r, coff*512]`` fp32.
        indexer_state (torch.Tensor | None): the indexer compressor's ring (CSA).
    """

    swa: torch.Tensor
    compressed: torch.Tensor | None = None
    indexer: torch.Tensor | None = None
    state: torch.Tensor | None = None
    indexer_state: torch.Tensor | None = None


class _Compressor(nn.Module):
    """Compressor weights (transformers' names): ``coff * d`` wide projections, position bias, RMSNorm.

    ``overlap`` (CSA, whatever its ratio; transformers' rule): two series per token, ``coff = 2``.
    """

    def __init__(self, hidden_size: int, ratio: int, d: int, eps: float, overlap: bool) -> None:
        super().__init__()
        self.ratio, self.d = ratio, d
        self.coff = 2 if overlap else 1
        self.kv_proj = nn.Linear(hidden_size, self.coff * d, bias=False)
        self.gate_proj = nn.Linear(hidden_size, self.coff * d, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, self.coff * d, dtype=torch.float32))
        self.kv_norm = V4RMSNorm(d, eps)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers adds the fp32 bias to the model-dtype gate (promoting to fp32).
        return self.kv_proj(x), self.gate_proj(x) + self.position_bias[positions % self.ratio]


class _Scorer(nn.Module):
    def __init__(self, hidden_size: int, n_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)


class _Indexer(_Compressor):
    """CSA's lightning indexer: its own compressor (``index_head_dim`` wide), query projection and scorer."""

    def __init__(self, hidden_size: int, q_lora_rank: int, ratio: int, n_heads: int, head_dim: int, eps: float):
        super().__init__(hidden_size, ratio, head_dim, eps, overlap=True)
        self.n_heads, self.head_dim = n_heads, head_dim
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.scorer = _Scorer(hidden_size, n_heads)


class _CSACompressor(_Compressor):
    def __init__(self, hidden_size, q_lora_rank, ratio, index_n_heads, index_head_dim, eps) -> None:
        super().__init__(hidden_size, ratio, HEAD_DIM, eps, overlap=True)
        self.indexer = _Indexer(hidden_size, q_lora_rank, ratio, index_n_heads, index_head_dim, eps)


class _GroupedLinear(nn.Linear):
    """Block-diagonal ``[G * R, in/G]`` weight (transformers' ``o_a_proj``): group g maps its slice to R outputs."""

    def __init__(self, in_per_group: int, out_features: int, n_groups: int) -> None:
        super().__init__(in_per_group, out_features, bias=False)
        self.n_groups = n_groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, G, in/G] -> [T, G, R]
        w = self.weight.view(self.n_groups, -1, x.shape[-1])
        return torch.einsum("tgd,grd->tgr", x, w)


class DeepseekV4Attention(nn.Module):
    r"""One V4 attention layer (transformers' ``DeepseekV4Attention`` parameter names).

    Args:
        hidden_size (int), num_heads (int), q_lora_rank (int): model shape (head dim 512: 448 nope + 64 rope).
        o_groups (int), o_lora_rank (int): grouped output projection.
        layer_type (str): one of :data:`V4_LAYER_TYPES`.
        compress_ratio (int): tokens per compressed entry (CSA / HCA layers; ignored for sliding layers).
        window (int): sliding window W.
        index_n_heads (int), index_head_dim (int), index_topk (int): the CSA indexer.
        eps (float): RMSNorm epsilon.
        kv_cache_dtype (str): "auto" (model dtype rows) or "fp8_v4" (584-byte rows; any model dtype).
        indexer_cache_dtype (str): the CSA indexer's key cache: "auto" (model dtype) or "fp8" (e4m3 with a UE8M0
            scale per key, SPEC §2.5).

    Raises:
        ValueError: an unknown layer type or cache dtype; sizes that are not positive ints (``compress_ratio`` on
            compressed layers, the indexer's sizes on CSA layers), ``num_heads`` not a multiple of ``o_groups``, a CSA
            ``index_head_dim`` that is not a power of two >= 64 (its compressor's width), a negative or non-finite
            ``eps``.

    The layer needs its RoPE table: set ``cos_sin_cache`` (``[P, 64]`` ``[cos | sin]``, P above every position it
    will see) before the first forward, as :class:`~openmla.engine.models.deepseek_v4.DeepseekV4ForCausalLM` does.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int,
        o_groups: int,
        o_lora_rank: int,
        layer_type: str,
        compress_ratio: int,
        window: int,
        index_n_heads: int,
        index_head_dim: int,
        index_topk: int,
        eps: float = 1e-6,
        kv_cache_dtype: str = "auto",
        indexer_cache_dtype: str = "auto",
    ) -> None:
        super().__init__()
        if layer_type not in V4_LAYER_TYPES:
            raise ValueError(f"layer_type must be one of {V4_LAYER_TYPES}; got {layer_type!r}")
        if kv_cache_dtype not in V4_KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {V4_KV_CACHE_DTYPES}; got {kv_cache_dtype!r}")
        if indexer_cache_dtype not in INDEXER_CACHE_DTYPES:
            raise ValueError(f"indexer_cache_dtype must be one of {INDEXER_CACHE_DTYPES}; got {indexer_cache_dtype!r}")
        check_positive_ints(("hidden_size", hidden_size), ("num_heads", num_heads), ("q_lora_rank", q_lora_rank),
                            ("o_groups", o_groups), ("o_lora_rank", o_lora_rank), ("window", window))  # fmt: skip
        if num_heads % o_groups:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of o_groups ({o_groups})")
        if layer_type != "sliding_attention":  # (ignored for sliding layers)
            check_positive_ints(("compress_ratio", compress_ratio))
        if layer_type == "compressed_sparse_attention":  # (the indexer's sizes: ignored for the other layers)
            check_positive_ints(("index_n_heads", index_n_heads), ("index_head_dim", index_head_dim),
                                ("index_topk", index_topk))  # fmt: skip
            if index_head_dim < 64 or index_head_dim & (index_head_dim - 1):
                raise ValueError(f"index_head_dim must be a power of two >= 64 (the indexer's compressor width); "
                                 f"got {index_head_dim}")  # fmt: skip
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps must be a finite float >= 0; got {eps!r}")
        self.hidden_size = hidden_size
        self.layer_type, self.num_heads, self.window = layer_type, num_heads, window
        self.kv_cache_dtype, self.indexer_cache_dtype, self.eps = kv_cache_dtype, indexer_cache_dtype, eps
        self.ratio = 1 if layer_type == "sliding_attention" else compress_ratio
        self.index_topk = index_topk
        self.scaling = HEAD_DIM**-0.5
        self.o_groups = o_groups
        self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
        self.q_a_norm = V4RMSNorm(q_lora_rank, eps)
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * HEAD_DIM, bias=False)
        self.kv_proj = nn.Linear(hidden_size, HEAD_DIM, bias=False)
        self.kv_norm = V4RMSNorm(HEAD_DIM, eps)
        self.o_a_proj = _GroupedLinear(num_heads * HEAD_DIM // o_groups, o_groups * o_lora_rank, o_groups)
        self.o_b_proj = nn.Linear(o_groups * o_lora_rank, hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32))
        if layer_type == "compressed_sparse_attention":
            self.compressor = _CSACompressor(hidden_size, q_lora_rank, self.ratio, index_n_heads, index_head_dim, eps)
        elif layer_type == "heavily_compressed_attention":
            self.compressor = _Compressor(hidden_size, self.ratio, HEAD_DIM, eps, overlap=False)
        else:
            self.compressor = None
        # no positions until the model sets its table: forward refuses an empty one (the kernels leave a position
        # outside the table unrotated, so a placeholder would silently drop the RoPE)
        self.register_buffer("cos_sin_cache", torch.zeros(0, ROPE_DIM), persistent=False)

    @property
    def is_csa(self) -> bool:
        return self.layer_type == "compressed_sparse_attention"

    def make_cache(self, num_blocks: int, block_size: int, num_state_slots: int, *, dtype, device,
                   swa_blocks: int | None = None) -> V4LayerCache:  # fmt: skip
        """Allocate this layer's caches (compressed caches share the main block table at ``bs_c``; the SWA cache
        has ``swa_blocks`` blocks, default ``num_blocks``; rings per request with the builder's ``swa_ring_blocks``).
        """
        from openmla.metadata.v4 import compressed_block_size

        kw = dict(kv_cache_dtype=self.kv_cache_dtype, device=device, dtype=dtype)
        cache = V4LayerCache(swa=allocate_v4_cache(swa_blocks or num_blocks, block_size, **kw))
        if self.compressor is not None:
            bs_c = compressed_block_size(block_size, self.ratio)
            cache.compressed = allocate_v4_cache(num_blocks, bs_c, **kw)
            cache.state = allocate_compressor_state(num_state_slots, self.ratio, HEAD_DIM,
                                                    overlap=self.compressor.coff == 2, device=device)  # fmt: skip
            if self.is_csa:
                ix = self.compressor.indexer
                cache.indexer = alloc_indexer_k_cache(
                    num_blocks, bs_c, ix.head_dim, cache_dtype=self.indexer_cache_dtype, dtype=dtype, device=device
                )
                cache.indexer_state = allocate_compressor_state(num_state_slots, self.ratio, ix.head_dim,
                                                                overlap=ix.coff == 2, device=device)  # fmt: skip
        return cache

    def _compress(self, comp: _Compressor, x, md: V4Metadata, state, kv_cache, kv_cache_dtype: str, **entries) -> None:
        cm = md.compressed[self.ratio]
        kv, score = comp.project(x, md.positions)
        compress_kv(
            kv, score, state, md.state_slots, md.query_start_loc, md.seq_lens, comp.kv_norm.weight,
            self.cos_sin_cache, kv_cache, md.block_table, ratio=self.ratio, eps=self.eps,
            kv_cache_dtype=kv_cache_dtype, block_size=cm.block_size, validate=False, **entries,
        )  # fmt: skip

    def index_topk_entries(self, x, qr, md: V4Metadata, cache: V4LayerCache) -> torch.Tensor:
        """Write this step's indexer keys and return each row's top-k compressed entries (CSA layers).

        A method of the layer so that a check can wrap it per instance
        (:class:`openmla.engine.oracle.IndexerPicks` records the picks).

        Returns:
            torch.Tensor: `[T, index_topk]` int32, request-local entry ids (entry ``i`` covers tokens
            ``i * r .. i * r + r - 1``) of the best entries among the ``(pos + 1) // r`` the row may see, then -1.
        """
        ix, cm = self.compressor.indexer, md.compressed[self.ratio]
        T = x.shape[0]
        if self.indexer_cache_dtype == "auto":
            self._compress(ix, x, md, cache.indexer_state, cache.indexer, "auto")
        else:  # the entries as rows, then quantised into the fp8 key cache
            rows = torch.empty(T, ix.head_dim, dtype=x.dtype, device=x.device)
            slots = torch.empty(T, dtype=torch.int32, device=x.device)
            self._compress(ix, x, md, cache.indexer_state, None, "auto", entry_rows=rows, entry_slots=slots)
            concat_and_cache_indexer_k(rows, cache.indexer, slots, cache_dtype="fp8", scale_fmt="ue8m0", validate=False)
        qi = rope_rows_(ix.q_b_proj(qr).view(T, ix.n_heads, ix.head_dim), md.positions, self.cos_sin_cache,
                        validate=False)  # fmt: skip
        w = ix.scorer.weights_proj(x).float() * (ix.head_dim**-0.5 * ix.n_heads**-0.5)
        # Each row scores as its own request over the (pos + 1) // r entries it may see.
        return indexer_topk(
            qi, w, cache.indexer, cm.row_block_table, cm.hca_lens, cm.row_query_start_loc, self.index_topk,
            cache_dtype=self.indexer_cache_dtype, max_seq_len=cm.row_block_table.shape[1] * cm.block_size,
            topk_impl=INDEXER_TOPK_IMPL, validate=False,
        )  # fmt: skip

    def _check_step(self, x, md, cache) -> None:
        """Refuse a step the layer cannot run (host values and shapes only: no device sync)."""
        if not isinstance(md, V4Metadata):
            raise TypeError(f"md must be V4Metadata, got {type(md).__name__}")
        if not isinstance(cache, V4LayerCache):
            raise TypeError(f"cache must be a V4LayerCache (from make_cache), got {type(cache).__name__}")
        check_hidden_states("x", x, self.hidden_size, self.q_a_proj.weight)
        if x.shape[0] != md.num_tokens:
            raise ValueError(
                f"x has {x.shape[0]} rows but the metadata {md.num_tokens} (num_tokens); got {describe(x)}"
            )
        if md.window != self.window:
            raise ValueError(f"metadata built for window {md.window} but the layer's window is {self.window}")
        if self.cos_sin_cache.shape[0] == 0:
            raise ValueError("cos_sin_cache is not set: assign the layer its [P, 64] RoPE table before forward")
        need = [("swa", md.block_size)]
        if self.compressor is not None:
            if self.ratio not in md.compressed:
                raise ValueError(f"metadata has no compressed entries for ratio {self.ratio} (it has ratios "
                                 f"{sorted(md.compressed)}): build it with this layer's ratio")  # fmt: skip
            bs_c = md.compressed[self.ratio].block_size
            need += [("compressed", bs_c), ("state", None)]
            if self.is_csa:
                need += [("indexer", bs_c), ("indexer_state", None)]
        for name, block_size in need:
            t = getattr(cache, name)
            if t is None:
                raise ValueError(
                    f"cache.{name} is None but a {self.layer_type} layer needs it (make_cache allocates it)"
                )
            check_tensor(f"cache.{name}", t, last_dim_contiguous=False, kernel=False)
            # the kernels page a cache by its own block size, the metadata's slots and block tables by this one
            if block_size is not None and (t.dim() < 3 or t.shape[1] != block_size):
                raise ValueError(f"cache.{name} must have blocks of {block_size} tokens (the metadata's); "
                                 f"got {describe(t)}")  # fmt: skip

    def prepare(self, x: torch.Tensor, md: V4Metadata, cache: V4LayerCache):
        """Everything before the attention: writes this step's rows (SWA, compressor, indexer) into ``cache``.

        Returns:
            (q `[T, H, 512]` normed and RoPE'd, (compressed cache, its slots `[T, K]` int32, lens `[T]` int32),
            all None for a sliding-window layer).

        Raises:
            TypeError, ValueError: as :meth:`forward`.
        """
        self._check_step(x, md, cache)
        q, extra, _ = self._prepare(x, md, cache)
        return q, extra

    def _prepare(self, x: torch.Tensor, md: V4Metadata, cache: V4LayerCache):
        """:meth:`prepare`, plus the CSA indexer's request-local top-k `[T, K]` (None for other layers)."""
        T, H = x.shape[0], self.num_heads
        pos, table = md.positions, self.cos_sin_cache
        qr = self.q_a_norm(self.q_a_proj(x))
        # q: the heads' unweighted norm, kv: its weighted norm, each then RoPE'd, in place in one kernel
        q = self.q_b_proj(qr).view(T, H, HEAD_DIM)
        rms_norm_rope(q, self.eps, positions=pos, cos_sin_cache=table, out=q, validate=False)
        kv = self.kv_proj(x)
        rms_norm_rope(kv, self.kv_norm.eps, weight=self.kv_norm.weight, positions=pos, cos_sin_cache=table, out=kv,
                      validate=False)  # fmt: skip
        nope = HEAD_DIM - ROPE_DIM
        concat_and_cache_v4(kv[:, :nope], kv[:, nope:], cache.swa, md.slot_mapping,
                            kv_cache_dtype=self.kv_cache_dtype, validate=False)  # fmt: skip
        if self.compressor is None:
            return q, (None, None, None), None
        self._compress(self.compressor, x, md, cache.state, cache.compressed, self.kv_cache_dtype)
        cm, local = md.compressed[self.ratio], None
        if self.is_csa:  # the indexer's request-local top-k, as compressed-cache slots for the paged route
            local = self.index_topk_entries(x, qr, md, cache)
            idx, lens = csa_topk_indices(local, md.query_start_loc, md.seq_lens, md.block_table,
                                         block_size=cm.block_size, ratio=self.ratio, slot_mapping=md.slot_mapping,
                                         validate=False)  # fmt: skip
        else:
            idx, lens = cm.hca_indices, cm.hca_lens
        return q, (cache.compressed, idx, lens), local

    def _prefill_split(self, md: V4Metadata) -> tuple[int, int, int] | None:
        """:func:`gather_split` for this step, from the metadata's host copies (no device sync); None: all paged
        (route off, a CUDA graph being captured, no host copies, or padding rows past the last request)."""
        route = PREFILL_ROUTE
        if route not in _ROUTES:
            raise ValueError(f"PREFILL_ROUTE must be one of {_ROUTES}; got {route!r}")
        if route == "paged" or (route == "auto" and self.kv_cache_dtype != "fp8_v4") or capturing():
            return None
        if md.max_query_len < GATHER_MIN_QUERY_LEN:  # decode / verify steps: no host work
            return None
        if md.query_start_loc_cpu is None or md.seq_lens_cpu is None or md.swa_block_table is None:
            return None
        qsl, B = md.query_start_loc_cpu.tolist(), md.num_reqs
        if B == 0 or qsl[B] != md.num_tokens:
            return None
        qlens = [qsl[b + 1] - qsl[b] for b in range(B)]
        topk = 0 if self.compressor is None else (self.index_topk if self.is_csa else None)
        return gather_split(qlens, md.seq_lens_cpu.tolist(), ratio=self.ratio, topk=topk, window=self.window,
                            route=route)  # fmt: skip

    def _paged_attention(self, q, md: V4Metadata, cache: V4LayerCache, extra, rows: slice, out=None):
        """Rows ``rows`` over the paged SWA (main) and compressed (extra) caches."""
        idx, lens = (None, None) if extra[1] is None else (extra[1][rows], extra[2][rows])
        o, _ = sparse_mla(  # one softmax over the window and the compressed slots; the inverse RoPE fused
            q[rows], cache.swa, md.swa_indices[rows], self.scaling, kv_cache_dtype=self.kv_cache_dtype,
            topk_length=md.swa_lens[rows], attn_sink=self.sinks.float(), d_v=HEAD_DIM, extra_kv_cache=extra[0],
            extra_indices=idx, extra_topk_length=lens, inv_rope_positions=md.positions[rows],
            cos_sin_cache=self.cos_sin_cache, out=out, return_lse=False, validate=False,
        )  # fmt: skip
        return o

    def _gathered_attention(self, q, md: V4Metadata, cache: V4LayerCache, local, k0: int, N: int, M: int, r0: int,
                            out: torch.Tensor) -> None:  # fmt: skip
        """Rows ``r0:`` (requests ``k0:``) through a workspace ``[B - k0, M, 512]`` of q's dtype (SPEC §7.6):
        rows ``[0, N)`` each request's compressed entries, then its last ``min(seq, qlen + W - 1)`` tokens."""
        R, dt = md.num_reqs - k0, self.kv_cache_dtype
        qsl, seq = md.query_start_loc[k0:], md.seq_lens[k0:]
        g = torch.minimum(seq, qsl[1:] - qsl[:-1] + (self.window - 1))
        ws = torch.empty(R, M, HEAD_DIM, dtype=q.dtype, device=q.device)
        if N:
            dequantize_and_gather_k_cache(ws, cache.compressed, seq // self.ratio, md.block_table[k0:],
                                          kv_cache_dtype=dt, validate=False)  # fmt: skip
        dequantize_and_gather_k_cache(ws, cache.swa, seq, md.swa_block_table[k0:], gather_lens=g, offset=N,
                                      kv_cache_dtype=dt, validate=False)  # fmt: skip
        Tq = q.shape[0] - r0
        if self.is_csa:  # the indexer's request-local picks
            ids, topk = local[r0:], self.index_topk
        elif N:  # HCA: every visible entry, request-local
            ids, topk = hca_indices(qsl, seq, None, block_size=1, ratio=self.ratio, width=N, num_tokens=Tq,
                                    validate=False)[0], N  # fmt: skip
        else:
            ids, topk = torch.empty(Tq, 0, dtype=torch.int32, device=q.device), 0
        idx, lens = combine_topk_swa_indices(ids, qsl, seq, g, window=self.window, ratio=self.ratio, topk=topk,
                                             M=M, N=N, validate=False)  # fmt: skip
        sparse_mla(
            q[r0:], ws.view(R * M, 1, HEAD_DIM), idx, self.scaling, kv_cache_dtype="auto", topk_length=lens,
            attn_sink=self.sinks.float(), d_v=HEAD_DIM, inv_rope_positions=md.positions[r0:],
            cos_sin_cache=self.cos_sin_cache, out=out[r0:], return_lse=False, validate=False,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, md: V4Metadata, cache: V4LayerCache) -> torch.Tensor:
        """``x [T, hidden]`` (T = ``md.num_tokens``) -> ``[T, hidden]``; writes this step's rows into ``cache``.

        Raises:
            TypeError, ValueError: metadata of another builder, for another number of rows, another window or
                without this layer's compression ratio; ``x`` of another width or dtype than the layer's; a cache
                lacking a part this layer type needs, or whose block size is not the metadata's; no RoPE table set.
        """
        self._check_step(x, md, cache)
        T = x.shape[0]
        q, extra, local = self._prepare(x, md, cache)
        split = self._prefill_split(md)
        if split is None:
            o = self._paged_attention(q, md, cache, extra, slice(None))
        else:  # decode rows [0, r0) paged, the trailing prefill requests gathered, into one output
            k0, N, M = split
            r0 = int(md.query_start_loc_cpu[k0])
            o = torch.empty_like(q)
            if r0:
                self._paged_attention(q, md, cache, extra, slice(0, r0), out=o[:r0])
            self._gathered_attention(q, md, cache, local, k0, N, M, r0, o)
        o = self.o_a_proj(o.reshape(T, self.o_groups, -1)).flatten(1)
        return self.o_b_proj(o)
