"""Plain fp32 PyTorch references of every openmla op: the oracle the tests compare against."""

from openmla.reference.cache import (  # noqa: F401
    concat_and_cache_mla_ref,
    dequantize_rows_ref,
    ds_mla_row_ref,
    expand_page_indices_ref,
    gather_cache_ref,
    quantize_fp8_ref,
)
from openmla.reference.decode import mla_decode_ref  # noqa: F401
from openmla.reference.indexer import (  # noqa: F401
    concat_and_cache_indexer_k_ref,
    dequantize_indexer_k_cache_ref,
    gather_indexer_k_ref,
    indexer_logits_ref,
    indexer_topk_ref,
    quantize_indexer_k_ref,
    split_fp8_indexer_cache_ref,
    topk_from_logits_ref,
)
from openmla.reference.prefill import (  # noqa: F401
    flash_attn_varlen_ref,
    merge_attn_states_ref,
    mla_prefill_with_context_ref,
)
from openmla.reference.sparse import (  # noqa: F401
    apply_attn_sink_ref,
    build_ragged_indices_from_dense_ref,
    convert_req_index_to_global_index_ref,
    sparse_mla_ref,
    sparse_seq_lens_ref,
)
from openmla.reference.v4 import (  # noqa: F401
    combine_topk_swa_indices_ref,
    compress_kv_ref,
    concat_and_cache_v4_ref,
    csa_topk_global_ref,
    dequantize_and_gather_k_cache_ref,
    dequantize_v4_cache_ref,
    gather_cache_v4_ref,
    hca_indices_ref,
    inverse_rope_rows_ref,
    rope_rows_ref,
    swa_indices_ref,
)
