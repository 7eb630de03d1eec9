"""Attention layers that own their weights and call the ops with a step's metadata."""

from openmla.layers.mla import KV_CACHE_DTYPES, MLAAttention
from openmla.layers.norm import RMSNorm
from openmla.layers.rope import RotaryEmbedding, mla_softmax_scale, yarn_get_mscale
from openmla.layers.sparse_mla import SparseMLAAttention
from openmla.layers.v4 import V4_KV_CACHE_DTYPES, DeepseekV4Attention, V4LayerCache

__all__ = [
    "DeepseekV4Attention",
    "KV_CACHE_DTYPES",
    "MLAAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SparseMLAAttention",
    "V4LayerCache",
    "V4_KV_CACHE_DTYPES",
    "mla_softmax_scale",
    "yarn_get_mscale",
]
