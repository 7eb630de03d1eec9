"""Metadata builders: turn a scheduled batch into what the attention layers of a step read."""

from openmla.metadata.batch import BatchSpec
from openmla.metadata.dense import (
    ChunkedContextMetadata,
    MLADecodeMetadata,
    MLAMetadata,
    MLAMetadataBuilder,
    MLAPrefillMetadata,
    split_decodes_and_prefills,
    uniform_padded_query_len,
)
from openmla.metadata.sparse import SparseMLAMetadata, SparseMLAMetadataBuilder
from openmla.metadata.v4 import V4CompressedMetadata, V4Metadata, V4MetadataBuilder

__all__ = [
    "BatchSpec",
    "ChunkedContextMetadata",
    "MLADecodeMetadata",
    "MLAMetadata",
    "MLAMetadataBuilder",
    "MLAPrefillMetadata",
    "SparseMLAMetadata",
    "SparseMLAMetadataBuilder",
    "V4CompressedMetadata",
    "V4Metadata",
    "V4MetadataBuilder",
    "split_decodes_and_prefills",
    "uniform_padded_query_len",
]
