"""DeepSeek V3.2 attention: MLA with the lightning indexer (DSA), sparse MLA for every token.

Weights follow the Hugging Face ``deepseek_v32`` layout: the V3 MLA projections (``q_a_proj``,
``q_a_layernorm``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``) plus
``indexer.{wq_b, wk, k_norm, weights_proj}``. Per step, for every token (decode, verify and prefill alike, as
vLLM runs V3.2):

* the latent ``[kv_c | k_pe]`` goes into the MLA cache (bf16, or the 656-byte ``fp8_ds_mla`` row);
* the indexer: ``q_I = wq_b(q_lora_normed)`` `[H_i, D_i]`, ``k_I = LayerNorm(wk(x))`` `[D_i]` (one head), NeoX
  ("rotate half") RoPE on their **first** ``qk_rope_head_dim`` dims with MLA's cos/sin (MLA itself rotates its
  last dims interleaved), ``k_I`` into the indexer key cache (model dtype, or block-split fp8), weights
  ``weights_proj(x)`` in fp32 times ``H_i^-0.5 * D_i^-0.5``; :func:`~openmla.ops.indexer.indexer_topk` gives
  each token the request-local positions of its ``index_topk`` best causal keys (a speculative verify row sees
  the keys up to its own position, so each row gets its own causal top-k);
* the positions become global slots (:func:`~openmla.ops.sparse_indices.convert_req_index_to_global_index`) and
  :func:`~openmla.ops.sparse.sparse_mla` attends to them in the absorbed MQA form (``q_nope @ W_UK`` concatenated
  with ``q_pe``, 576 wide; ``o_lat @ W_UV``).

What transformers computes (the oracle, SPEC §13.1) and this layer follows: no Hadamard rotation, q_I and k_I
unquantised with ``indexer_cache_dtype="auto"``. ``indexer_cache_dtype="fp8"`` is vLLM's fast path instead: keys
stored e4m3 with a UE8M0 scale per token and q_I quantised per head (UE8M0 scale folded into the weights).

Every model dtype runs the kernels: an fp32 model (the CPU oracle tests) runs the sparse MLA kernel in fp32 (fp32
operands, IEEE dots) like everything else, indexer included.
"""

from __future__ import annotations

import torch
from torch import nn

from openmla.layers.mla import MLAAttention, check_hidden_states, check_positions
from openmla.layers.rope import RotaryEmbedding
from openmla.metadata.sparse import SparseMLAMetadata
from openmla.ops._validate import check_positive_ints, check_tensor, describe
from openmla.ops.cache import concat_and_cache_mla
from openmla.ops.indexer import alloc_indexer_k_cache, concat_and_cache_indexer_k, indexer_topk, quantize_indexer_q
from openmla.ops.sparse import sparse_mla
from openmla.ops.sparse_indices import convert_req_index_to_global_index

__all__ = ["INDEXER_CACHE_DTYPES", "SPARSE_MLA_KV_CACHE_DTYPES", "LightningIndexer", "SparseMLAAttention"]

SPARSE_MLA_KV_CACHE_DTYPES = ("auto", "fp8_ds_mla")
INDEXER_CACHE_DTYPES = ("auto", "fp8")
_DS_MLA_ROW_BYTES = 656  # 512 e4m3 + 4 fp32 scales + 64 bf16 (SPEC §2.3)
_INDEXER_LN_EPS = 1e-6  # transformers' k_norm eps, whatever the config says


class LightningIndexer(nn.Module):
    """The V3.2 indexer's weights (HF names): ``wq_b``, ``wk``, ``k_norm`` (LayerNorm with bias), ``weights_proj``.

    ``weights_proj`` stays fp32 whatever the model dtype (transformers keeps it fp32 too).
    """

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=_INDEXER_LN_EPS)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)


class SparseMLAAttention(MLAAttention):
    r"""DeepSeek V3.2 attention over paged MLA and indexer caches, driven by :class:`SparseMLAMetadata`.

    Args:
        index_n_heads (int): indexer heads ``H_i`` (64 for V3.2).
        index_head_dim (int): indexer head width ``D_i`` (128), at least ``qk_rope_head_dim``.
        index_topk (int): keys per token (2048).
        kv_cache_dtype (str): "auto" (MLA cache in the model dtype) or "fp8_ds_mla" (656-byte rows; needs
            ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64).
        indexer_cache_dtype (str): "auto" (keys in the model dtype: transformers' scores) or "fp8" (vLLM's
            e4m3 keys and queries with UE8M0 scales).
        **mla_kwargs: the :class:`MLAAttention` arguments (``q_lora_rank`` required), ``kv_scale`` excepted.

    Raises:
        ValueError: an unknown cache dtype, no ``q_lora_rank``, ``index_head_dim < qk_rope_head_dim``, widths the
            sparse kernel cannot take (``kv_lora_rank / 4`` a power of two >= 16, ``qk_rope_head_dim`` a power of
            two >= 16), or non-positive indexer sizes.
    """

    def __init__(
        self,
        *,
        index_n_heads: int,
        index_head_dim: int,
        index_topk: int,
        kv_cache_dtype: str = "auto",
        indexer_cache_dtype: str = "auto",
        **mla_kwargs,
    ) -> None:
        if kv_cache_dtype not in SPARSE_MLA_KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {SPARSE_MLA_KV_CACHE_DTYPES}; got {kv_cache_dtype!r}")
        if indexer_cache_dtype not in INDEXER_CACHE_DTYPES:
            raise ValueError(f"indexer_cache_dtype must be one of {INDEXER_CACHE_DTYPES}; got {indexer_cache_dtype!r}")
        if "kv_scale" in mla_kwargs:
            raise ValueError("kv_scale is a per-tensor fp8 scale; fp8_ds_mla rows carry their own scales")
        super().__init__(kv_cache_dtype="auto", **mla_kwargs)
        self.kv_cache_dtype = kv_cache_dtype  # MLAAttention knows only "auto" / "fp8": set after its checks
        self.indexer_cache_dtype = indexer_cache_dtype
        check_positive_ints(
            ("index_n_heads", index_n_heads), ("index_head_dim", index_head_dim), ("index_topk", index_topk)
        )
        L, R = self.kv_lora_rank, self.qk_rope_head_dim
        if self.q_lora_rank is None:
            raise ValueError("DeepSeek V3.2 needs q_lora_rank: the indexer's queries come from the q LoRA output")
        if index_head_dim < R:
            raise ValueError(f"index_head_dim ({index_head_dim}) must be >= qk_rope_head_dim ({R})")
        dc = L // 4
        if L % 4 or dc < 16 or dc & (dc - 1) or R < 16 or R & (R - 1):
            raise ValueError(f"sparse MLA needs kv_lora_rank / 4 and qk_rope_head_dim powers of two >= 16; "
                             f"got kv_lora_rank {L}, qk_rope_head_dim {R}")  # fmt: skip
        if kv_cache_dtype == "fp8_ds_mla" and (L, R) != (512, 64):
            raise ValueError(f"fp8_ds_mla rows hold 512 + 64 values; got kv_lora_rank {L}, qk_rope_head_dim {R}")
        self.index_n_heads, self.index_head_dim, self.index_topk = index_n_heads, index_head_dim, index_topk
        self.indexer = LightningIndexer(self.hidden_size, self.q_lora_rank, index_n_heads, index_head_dim)
        # same frequencies (YaRN included) and attention factor as MLA's rope, NeoX layout
        self.index_rotary = RotaryEmbedding(
            R, mla_kwargs.get("max_position_embeddings", 4096), mla_kwargs.get("rope_parameters"), interleave=False
        )
        self.index_weight_scale = index_n_heads**-0.5 * index_head_dim**-0.5

    # ------------------------------------------------------------ caches
    def make_kv_cache(
        self, num_blocks: int, block_size: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """A zeroed MLA cache: `[num_blocks, block_size, L + R]` of ``dtype``, or uint8 `[.., 656]` (fp8_ds_mla)."""
        if self.kv_cache_dtype == "fp8_ds_mla":
            return torch.zeros(num_blocks, block_size, _DS_MLA_ROW_BYTES, dtype=torch.uint8, device=device)
        return torch.zeros(num_blocks, block_size, self.kv_lora_rank + self.qk_rope_head_dim, dtype=dtype,
                           device=device)  # fmt: skip

    def make_indexer_k_cache(
        self, num_blocks: int, block_size: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """A zeroed indexer key cache (:func:`~openmla.ops.indexer.alloc_indexer_k_cache`) sharing the block table."""
        return alloc_indexer_k_cache(num_blocks, block_size, self.index_head_dim,
                                     cache_dtype=self.indexer_cache_dtype, dtype=dtype, device=device)  # fmt: skip

    # ------------------------------------------------------------ forward
    def index_topk_positions(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        q_resid: torch.Tensor,
        indexer_k_cache: torch.Tensor,
        md: SparseMLAMetadata,
    ) -> torch.Tensor:
        """Write this step's index keys and return each token's top-k request-local positions.

        Returns:
            torch.Tensor: ``md.topk_indices`` `[T, topk]` int32, increasing positions then -1.
        """
        T, Hi, Di, R = hidden_states.shape[0], self.index_n_heads, self.index_head_dim, self.qk_rope_head_dim
        ix = self.indexer
        q = ix.wq_b(q_resid).view(T, Hi, Di)
        k = ix.k_norm(ix.wk(hidden_states))
        q_pe, k_pe = self.index_rotary(positions, q[..., :R], k[:, :R])
        q = torch.cat([q_pe, q[..., R:]], dim=-1)
        k = torch.cat([k_pe, k[:, R:]], dim=-1)
        fp8 = self.indexer_cache_dtype == "fp8"
        concat_and_cache_indexer_k(k, indexer_k_cache, md.slot_mapping, cache_dtype=self.indexer_cache_dtype,
                                   scale_fmt="ue8m0" if fp8 else None, validate=False)  # fmt: skip
        w = ix.weights_proj(hidden_states.to(ix.weights_proj.weight.dtype)).float() * self.index_weight_scale
        if fp8:  # vLLM: q in e4m3 per head, its scale folded into the (positive-scale-commuting) weights
            q, q_scale = quantize_indexer_q(q, scale_fmt="ue8m0")
            w = w * q_scale
        return indexer_topk(
            q, w, indexer_k_cache, md.block_table, md.seq_lens, md.query_start_loc, md.topk,
            cache_dtype=self.indexer_cache_dtype, max_seq_len=md.max_seq_len,
            max_query_len=None if md.is_decode_only else md.max_query_len, out=md.topk_indices, validate=False,
        )  # fmt: skip

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        indexer_k_cache: torch.Tensor,
        attn_metadata: SparseMLAMetadata,
    ) -> torch.Tensor:
        """Attention for one step.

        Args:
            positions (torch.Tensor): `[T]`, int64; absolute positions (T = the step's input rows, padding included).
            hidden_states (torch.Tensor): `[T, hidden_size]`, the model dtype.
            kv_cache (torch.Tensor): from :meth:`make_kv_cache`.
            indexer_k_cache (torch.Tensor): from :meth:`make_indexer_k_cache` (same blocks and block table).
            attn_metadata (SparseMLAMetadata): from :class:`~openmla.metadata.sparse.SparseMLAMetadataBuilder`.

        Returns:
            torch.Tensor: `[T, hidden_size]`; padding rows hold no meaningful values.

        Raises:
            TypeError, ValueError: mismatched inputs: metadata of another builder, for another number of input rows
                or another top-k; activations of another width or dtype than the layer's; positions that are not a
                `[T]` integer tensor; caches whose block size is not the metadata's, or of different block counts.
        """
        md = attn_metadata
        if not isinstance(md, SparseMLAMetadata):
            raise TypeError(f"attn_metadata must be SparseMLAMetadata, got {type(md).__name__}")
        check_hidden_states("hidden_states", hidden_states, self.hidden_size, self.kv_a_proj_with_mqa.weight)
        T = hidden_states.shape[0]
        if T != md.num_input_tokens:
            raise ValueError(f"hidden_states has {T} rows but the metadata {md.num_input_tokens} (num_input_tokens)")
        check_positions(positions, T, hidden_states.device)
        if md.topk != min(self.index_topk, md.block_table.shape[1] * md.block_size):
            raise ValueError(f"metadata built for topk {md.topk} but the layer has index_topk {self.index_topk}")
        # the kernels page both caches by their own block size, the metadata's slots and block table by its own
        for name, cache in (("kv_cache", kv_cache), ("indexer_k_cache", indexer_k_cache)):
            check_tensor(name, cache, ndim=3, last_dim_contiguous=False, kernel=False)
            if cache.shape[1] != md.block_size:
                raise ValueError(f"{name} has blocks of {cache.shape[1]} tokens but the metadata's block_size is "
                                 f"{md.block_size}; got {describe(cache)}")  # fmt: skip
        if indexer_k_cache.shape[0] != kv_cache.shape[0]:
            raise ValueError(f"indexer_k_cache must have kv_cache's {kv_cache.shape[0]} blocks (one block table); "
                             f"got {describe(indexer_k_cache)}")  # fmt: skip
        H, P, R, L = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank

        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        q = self.q_b_proj(q_resid).view(T, H, P + R)
        latent = self.kv_a_proj_with_mqa(hidden_states)
        kv_c = self.kv_a_layernorm(latent[:, :L])
        q_pe, k_pe = self.rotary_emb(positions, q[..., P:], latent[:, L:])
        concat_and_cache_mla(kv_c, k_pe, kv_cache, md.slot_mapping, kv_cache_dtype=self.kv_cache_dtype,
                             validate=False)  # fmt: skip

        topk = self.index_topk_positions(positions, hidden_states, q_resid, indexer_k_cache, md)
        slots = convert_req_index_to_global_index(md.req_id_per_token, md.block_table, topk, md.block_size,
                                                  out=md.global_indices, validate=False)  # fmt: skip

        W_UK, W_UV = self._absorbed()
        ql_nope = torch.bmm(q[..., :P].transpose(0, 1), W_UK).transpose(0, 1)  # [T, H, L]
        q_mqa = torch.cat([ql_nope, q_pe], dim=-1)  # [T, H, L + R]
        o_lat, _ = sparse_mla(q_mqa, kv_cache, slots, self.sm_scale, kv_cache_dtype=self.kv_cache_dtype,
                              topk_length=md.sparse_lens, d_v=L, return_lse=False, validate=False)  # fmt: skip
        out = torch.bmm(o_lat.transpose(0, 1), W_UV).transpose(0, 1)  # [T, H, V]
        return self.o_proj(out.reshape(T, H * self.v_head_dim))
