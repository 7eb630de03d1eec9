"""DeepSeek V3 decoder on openmla's paged MLA attention, with the Hugging Face parameter names.

Embeddings -> ``num_hidden_layers`` x [RMSNorm -> :class:`~openmla.layers.MLAAttention` -> residual ->
RMSNorm -> MLP -> residual] -> RMSNorm -> LM head. The first ``first_k_dense_replace`` layers use a
dense SwiGLU MLP, the rest DeepSeek's MoE: a sigmoid router with a score-correction bias, group-limited
top-k (``n_group`` groups, best ``topk_group`` by the sum of their top-2 scores), top-k experts,
optional renormalisation, ``routed_scaling_factor``, plus the shared experts. The HF model's
arithmetic is followed step by step (router in fp32), so the same weights give the same logits.

The experts run densely (every expert on every token, weighted by a mostly-zero routing matrix):
exactly the HF result without data-dependent shapes, so a decode step can be captured in a CUDA graph.
That costs ``n_routed_experts / num_experts_per_tok`` times the expert FLOPs, fine for the tiny models
this engine serves and the reason it is not meant for full-size checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from openmla.layers import MLAAttention, RMSNorm
from openmla.metadata.dense import MLAMetadata

__all__ = ["DeepseekV3Config", "DeepseekV3ForCausalLM"]

_ACTS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


@dataclass
class DeepseekV3Config:
    """The fields of an HF ``config.json`` (``model_type: deepseek_v3``) this model reads."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    rope_interleave: bool = True
    attention_bias: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list | None = 1

    @classmethod
    def from_dict(cls, d: dict) -> DeepseekV3Config:
        """Read an HF config dict (new ``rope_parameters`` or legacy ``rope_scaling`` + ``rope_theta``).

        Raises:
            ValueError: a ``model_type`` other than deepseek_v3, or an unsupported activation.
        """
        model_type = d.get("model_type", "deepseek_v3")
        if model_type != "deepseek_v3":
            raise ValueError(f"expected a deepseek_v3 config, got model_type {model_type!r}")
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names and k != "rope_parameters"}
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", float(d.get("rope_theta", 10000.0)))
        if rope["rope_type"] == "yarn":
            rope.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 4096))
        kw["rope_parameters"] = rope
        cfg = cls(**kw)
        if cfg.hidden_act not in _ACTS:
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported ({sorted(_ACTS)})")
        return cfg

    def to_dict(self) -> dict:
        """An HF-style config dict (``model_type`` and ``architectures`` included)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["model_type"] = "deepseek_v3"
        d["architectures"] = ["DeepseekV3ForCausalLM"]
        d["num_key_value_heads"] = self.num_attention_heads
        d["num_nextn_predict_layers"] = 0
        return d


class DeepseekV3MLP(nn.Module):
    """SwiGLU MLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = _ACTS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DeepseekV3Router(nn.Module):
    """Sigmoid router with group-limited top-k; fp32 weights (as in the HF model)."""

    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        E = cfg.n_routed_experts
        if E % cfg.n_group or E // cfg.n_group < 2:
            raise ValueError(f"n_routed_experts ({E}) must split into n_group ({cfg.n_group}) groups of >= 2")
        self.weight = nn.Parameter(torch.zeros(E, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        self.num_experts, self.top_k = E, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Routing weights `[T, E]` fp32: the selected experts' weights, 0 elsewhere."""
        T, E, G = x.shape[0], self.num_experts, self.n_group
        scores = F.linear(x.to(torch.float32), self.weight.to(torch.float32)).sigmoid()
        choice = scores + self.e_score_correction_bias
        group_scores = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask[:, :, None].expand(T, G, E // G).reshape(T, E)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        w = w * self.routed_scaling_factor
        return torch.zeros(T, E, dtype=torch.float32, device=x.device).scatter_(1, idx, w)


class DeepseekV3Experts(nn.Module):
    """Routed experts stored fused, as the HF model does: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``."""

    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        E, I, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        """``x`` `[T, H]`, ``routing`` `[T, E]` fp32 -> `[T, H]` (every expert on every token, dense)."""
        gate, up = torch.einsum("th,eih->eti", x, self.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("eti,ehi->eth", self.act(gate) * up, self.down_proj)  # [E, T, H]
        return torch.einsum("eth,te->th", y.to(torch.float32), routing).to(x.dtype)


class DeepseekV3MoE(nn.Module):
    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        self.gate = DeepseekV3Router(cfg)
        self.experts = DeepseekV3Experts(cfg)
        self.shared_experts = DeepseekV3MLP(
            cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.hidden_act
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x)) + self.shared_experts(x)


def _mla_attention_args(cfg: DeepseekV3Config) -> dict:
    """The attention-layer arguments a V3-family config sets (the layer class's own extras come on top)."""
    return dict(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=cfg.rope_parameters,
        rope_interleave=cfg.rope_interleave,
        attention_bias=cfg.attention_bias,
    )


class _DecoderLayer(nn.Module):
    """``self_attn`` (given), then the layer's MLP (dense for the first ``first_k_dense_replace`` layers, MoE
    after) and its two RMSNorms; subclasses define ``forward``."""

    def __init__(self, cfg: DeepseekV3Config, layer_idx: int, self_attn: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        if layer_idx >= cfg.first_k_dense_replace:
            self.mlp = DeepseekV3MoE(cfg)
        else:
            self.mlp = DeepseekV3MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class DeepseekV3DecoderLayer(_DecoderLayer):
    def __init__(self, cfg: DeepseekV3Config, layer_idx: int, kv_cache_dtype: str, kv_scale: float) -> None:
        attn = MLAAttention(**_mla_attention_args(cfg), kv_cache_dtype=kv_cache_dtype, kv_scale=kv_scale)
        super().__init__(cfg, layer_idx, attn)

    def forward(self, positions, hidden_states, kv_cache, attn_metadata):
        h = hidden_states + self.self_attn(positions, self.input_layernorm(hidden_states), kv_cache, attn_metadata)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Backbone(nn.Module):
    """Embeddings, ``make_layer(i)`` for every layer index, the final RMSNorm (the HF ``model.`` prefix)."""

    def __init__(self, cfg: DeepseekV3Config, make_layer) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([make_layer(i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class _CausalLM(nn.Module):
    """What the V3-family causal LMs share: an LM head (tied to the embeddings when the config says so) over
    ``self.model`` (a :class:`_Backbone`), the attention layers, weight post-processing and logits."""

    def _init_lm_head(self, cfg: DeepseekV3Config) -> None:
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.model.layers]

    def process_weights_after_loading(self) -> None:
        """Build every layer's absorbed decode matrices (call after loading weights)."""
        for attn in self.attention_layers:
            attn.process_weights_after_loading()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[N, hidden_size]` -> logits `[N, vocab_size]` (model dtype)."""
        return self.lm_head(hidden_states)


class DeepseekV3ForCausalLM(_CausalLM):
    r"""DeepSeek V3 for the paged engine; ``state_dict`` keys match the HF model's in-memory layout.

    Args:
        cfg (DeepseekV3Config): the model configuration.
        kv_cache_dtype (str): "auto" or "fp8" for every layer's latent cache.
        kv_scale (float): per-tensor scale of an fp8 cache.
    """

    def __init__(self, cfg: DeepseekV3Config, kv_cache_dtype: str = "auto", kv_scale: float = 1.0) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg, lambda i: DeepseekV3DecoderLayer(cfg, i, kv_cache_dtype, kv_scale))
        self._init_lm_head(cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: MLAMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm.

        Args:
            input_ids (torch.Tensor): `[T]`, int64.
            positions (torch.Tensor): `[T]`, int64.
            kv_caches (list[torch.Tensor]): one `[num_blocks, block_size, 576]` cache per layer.
            attn_metadata (MLAMetadata): the step's metadata.

        Returns:
            torch.Tensor: `[T, hidden_size]` of the model dtype.

        Raises:
            ValueError: a wrong number of caches.
        """
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"need {len(self.model.layers)} kv caches, got {len(kv_caches)}")
        h = self.model.embed_tokens(input_ids)
        for layer, cache in zip(self.model.layers, kv_caches):
            h = layer(positions, h, cache, attn_metadata)
        return self.model.norm(h)
