"""DeepSeek V3.2 decoder on openmla's sparse MLA attention (DSA), with the Hugging Face parameter names.

The V3 decoder (:mod:`openmla.engine.models.deepseek_v3`: RMSNorms, dense MLP for the first
``first_k_dense_replace`` layers, MoE after) with :class:`~openmla.layers.SparseMLAAttention` in every layer:
as in transformers' ``DeepseekV32ForCausalLM`` and vLLM, every layer has its own indexer and attends sparsely
(``first_k_dense_replace`` concerns the MLP only). Each layer owns two caches sharing one block table: the MLA
latent cache and the indexer key cache; the model hands the runner its metadata builder and caches
(:meth:`DeepseekV32ForCausalLM.make_metadata_builder`, :meth:`~DeepseekV32ForCausalLM.make_kv_caches`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from openmla.engine.models.deepseek_v3 import DeepseekV3Config, _Backbone, _CausalLM, _DecoderLayer, _mla_attention_args
from openmla.layers.sparse_mla import SparseMLAAttention
from openmla.metadata.sparse import SparseMLAMetadata, SparseMLAMetadataBuilder

__all__ = ["DeepseekV32Config", "DeepseekV32ForCausalLM", "tiny_v32_config"]


@dataclass
class DeepseekV32Config(DeepseekV3Config):
    """The fields of an HF ``config.json`` (``model_type: deepseek_v32``) this model reads: V3's plus the indexer's."""

    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 64

    @classmethod
    def from_dict(cls, d: dict) -> DeepseekV32Config:
        """Read an HF config dict (see :meth:`DeepseekV3Config.from_dict`).

        Raises:
            ValueError: a ``model_type`` other than deepseek_v32, an unsupported activation, or
                ``rope_interleave: false`` (V3.2's MLA rope is interleaved).
        """
        model_type = d.get("model_type", "deepseek_v32")
        if model_type != "deepseek_v32":
            raise ValueError(f"expected a deepseek_v32 config, got model_type {model_type!r}")
        cfg = super().from_dict({**d, "model_type": "deepseek_v3"})
        if not cfg.rope_interleave:
            raise ValueError("deepseek_v32 uses interleaved MLA rope; rope_interleave false is not supported")
        return cfg

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["model_type"] = "deepseek_v32"
        d["architectures"] = ["DeepseekV32ForCausalLM"]
        return d


def tiny_v32_config(**overrides) -> DeepseekV32Config:
    """The tiny V3 of :func:`openmla.engine.loader.tiny_config` plus an indexer of 8 heads x 128 with top-k 8.

    A top-k of 8 below the prompts' lengths makes the selection real (each token attends to at most 8 keys),
    and 128-wide index heads keep a non-rotary part after the 64 rope dims.
    """
    from openmla.engine.loader import tiny_config  # the loader imports the models: import lazily

    index = {k: overrides.pop(k) for k in ("index_topk", "index_head_dim", "index_n_heads") if k in overrides}
    base = asdict(tiny_config(**overrides))
    return DeepseekV32Config(**{**base, "index_topk": 8, "index_head_dim": 128, "index_n_heads": 8, **index})


class DeepseekV32DecoderLayer(_DecoderLayer):
    def __init__(self, cfg: DeepseekV32Config, layer_idx: int, kv_cache_dtype: str, indexer_cache_dtype: str) -> None:
        attn = SparseMLAAttention(
            index_n_heads=cfg.index_n_heads,
            index_head_dim=cfg.index_head_dim,
            index_topk=cfg.index_topk,
            kv_cache_dtype=kv_cache_dtype,
            indexer_cache_dtype=indexer_cache_dtype,
            **{**_mla_attention_args(cfg), "rope_interleave": True},
        )
        super().__init__(cfg, layer_idx, attn)

    def forward(self, positions, hidden_states, kv_cache, indexer_k_cache, attn_metadata):
        a = self.self_attn(positions, self.input_layernorm(hidden_states), kv_cache, indexer_k_cache, attn_metadata)
        h = hidden_states + a
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV32ForCausalLM(_CausalLM):
    r"""DeepSeek V3.2 for the paged engine; ``state_dict`` keys match the HF model's in-memory layout.

    Args:
        cfg (DeepseekV32Config): the model configuration.
        kv_cache_dtype (str): "auto" or "fp8_ds_mla" for every layer's MLA cache.
        kv_scale (float): must be 1.0 (accepted for the loader's common signature: fp8_ds_mla rows carry
            their own scales).
        indexer_cache_dtype (str): "auto" or "fp8" for every layer's indexer key cache.

    Raises:
        ValueError: a ``kv_scale`` other than 1, or what :class:`SparseMLAAttention` rejects.
    """

    def __init__(
        self, cfg: DeepseekV32Config, kv_cache_dtype: str = "auto", kv_scale: float = 1.0,
        indexer_cache_dtype: str = "auto",
    ) -> None:  # fmt: skip
        super().__init__()
        if kv_scale != 1.0:
            raise ValueError(f"kv_scale {kv_scale!r}: V3.2 caches take no per-tensor scale (fp8_ds_mla rows carry "
                             "their own)")  # fmt: skip
        self.config = cfg
        self.model = _Backbone(cfg, lambda i: DeepseekV32DecoderLayer(cfg, i, kv_cache_dtype, indexer_cache_dtype))
        self._init_lm_head(cfg)

    def fp32_parameters(self) -> list[nn.Parameter]:
        """Parameters kept fp32 whatever the model dtype: the indexers' ``weights_proj`` (as transformers keeps)."""
        return [attn.indexer.weights_proj.weight for attn in self.attention_layers]

    def make_kv_caches(
        self, num_blocks: int, block_size: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One ``(MLA cache, indexer key cache)`` pair per layer, zeroed, sharing the block layout."""
        return [
            (attn.make_kv_cache(num_blocks, block_size, dtype=dtype, device=device),
             attn.make_indexer_k_cache(num_blocks, block_size, dtype=dtype, device=device))
            for attn in self.attention_layers
        ]  # fmt: skip

    def make_metadata_builder(
        self, *, block_size: int, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
        device: torch.device | str, decode_threshold: int = 1,
    ) -> SparseMLAMetadataBuilder:  # fmt: skip
        """The step metadata builder of this model's layers."""
        return SparseMLAMetadataBuilder(
            index_topk=self.config.index_topk, block_size=block_size, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, device=device,
            decode_threshold=decode_threshold,
        )  # fmt: skip

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: SparseMLAMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm.

        Args:
            input_ids (torch.Tensor): `[T]`, int64.
            positions (torch.Tensor): `[T]`, int64.
            kv_caches (list): one ``(MLA cache, indexer key cache)`` pair per layer (:meth:`make_kv_caches`).
            attn_metadata (SparseMLAMetadata): the step's metadata.

        Returns:
            torch.Tensor: `[T, hidden_size]` of the model dtype.

        Raises:
            ValueError: a wrong number of caches.
        """
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"need {len(self.model.layers)} (MLA, indexer) cache pairs, got {len(kv_caches)}")
        h = self.model.embed_tokens(input_ids)
        for layer, (cache, icache) in zip(self.model.layers, kv_caches):
            h = layer(positions, h, cache, icache, attn_metadata)
        return self.model.norm(h)
