"""Attention layers that own their weights and call the ops with a step's metadata."""

from openmla.layers.mla import KV_CACHE_DTYPES, MLAAttention
from openmla.layers.norm import RMSNorm
from openmla.layers.rope import RotaryEmbedding, mla_softmax_scale, yarn_get_mscale
from openmla.layers.sparse_mla import SparseMLAAttention

__all__ = [
    "KV_CACHE_DTYPES",
    "MLAAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SparseMLAAttention",
    "mla_softmax_scale",
    "yarn_get_mscale",
]
