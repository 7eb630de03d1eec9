"""openmla: portable Triton attention backends for DeepSeek-style Multi-head Latent Attention.

Conventions (every op): tokens are flattened (``q [T, H, D]``) with ``query_start_loc [B+1]`` int32;
KV caches are paged ``[num_blocks, block_size, entry]`` addressed through ``block_table [B, W]``
int32 (slot = block * block_size + offset; slot -1 = padding); LSE outputs are fp32 natural-log
log-sum-exp of the scaled scores, ``[T, H]``; an empty row gives out = 0 and lse = -inf.
"""

from openmla import device  # noqa: F401  (must come first: configures the Triton interpreter)
from openmla.ops.cache import concat_and_cache_mla, gather_cache
from openmla.ops.cache_v4 import allocate_v4_cache, concat_and_cache_v4, dequantize_and_gather_k_cache, gather_cache_v4
from openmla.ops.chunked_prefill import mla_prefill_with_context
from openmla.ops.compressor import allocate_compressor_state, compress_kv
from openmla.ops.decode import mla_decode
from openmla.ops.e8m0 import scale_to_e8m0
from openmla.ops.indexer import concat_and_cache_indexer_k, indexer_logits, indexer_topk
from openmla.ops.indices import expand_page_indices
from openmla.ops.merge import merge_attn_states
from openmla.ops.norm_rope import rms_norm_rope
from openmla.ops.plan import DecodePlan, plan_decode
from openmla.ops.prefill import flash_attn_varlen
from openmla.ops.rope import inverse_rope_rows
from openmla.ops.sparse import apply_attn_sink, sparse_mla
from openmla.ops.sparse_indices import (
    build_ragged_indices_from_dense,
    convert_req_index_to_global_index,
    sparse_seq_lens,
)
from openmla.ops.v4_indices import combine_topk_swa_indices, csa_topk_indices, hca_indices, swa_indices

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "concat_and_cache_mla",
    "gather_cache",
    "expand_page_indices",
    "mla_decode",
    "plan_decode",
    "DecodePlan",
    "flash_attn_varlen",
    "merge_attn_states",
    "mla_prefill_with_context",
    "concat_and_cache_indexer_k",
    "indexer_topk",
    "indexer_logits",
    "sparse_mla",
    "apply_attn_sink",
    "convert_req_index_to_global_index",
    "sparse_seq_lens",
    "build_ragged_indices_from_dense",
    "allocate_v4_cache",
    "concat_and_cache_v4",
    "gather_cache_v4",
    "dequantize_and_gather_k_cache",
    "allocate_compressor_state",
    "compress_kv",
    "swa_indices",
    "csa_topk_indices",
    "hca_indices",
    "combine_topk_swa_indices",
    "inverse_rope_rows",
    "rms_norm_rope",
    "scale_to_e8m0",
]
