"""DeepSeek V4 decoder on openmla's V4 attention, with transformers' ``deepseek_v4`` parameter names.

Embeddings, copied into ``hc_mult`` residual streams -> ``num_hidden_layers`` x [hyper-connection (HC) collapse
-> RMSNorm -> :class:`~openmla.layers.v4.DeepseekV4Attention` -> HC expand + Sinkhorn-mixed residual -> the same
around the MoE] -> HC head collapse -> RMSNorm -> LM head. The arithmetic follows transformers'
``DeepseekV4ForCausalLM`` step by step (HC weights, norms, sinks and biases in fp32), so the same weights give
the same logits:

* HC: ``pre = sigmoid(.) + eps`` collapses the streams into the block input, ``post = 2 sigmoid(.)`` expands
  the block output, ``comb`` (softmax, then ``hc_sinkhorn_iters`` Sinkhorn row/column normalisations) mixes
  the input streams (``comb^T @ streams``).
* MoE: ``sqrt(softplus(x W^T))`` scores; the correction bias only chooses the top-k (or, in ``hash_moe``
  layers, ``tid2eid[input_id]`` does); the chosen scores renormalised and times ``routed_scaling_factor``;
  SwiGLU experts with ``gate <= limit`` and ``|up| <= limit``; plus one shared expert.

Experts run densely (every expert on every token, weighted by a mostly-zero routing matrix): exact, with no
data-dependent shapes (CUDA graphs), and meant for the small models this engine serves.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from openmla.layers.rope import rope_inv_freq
from openmla.layers.v4 import V4_LAYER_TYPES, DeepseekV4Attention, V4LayerCache, V4RMSNorm
from openmla.metadata.v4 import V4Metadata

__all__ = [
    "DeepseekV4Config",
    "DeepseekV4ForCausalLM",
    "build_hf_v4_model",
    "build_v4_model",
    "hf_v4_state_dict",
    "random_v4_state_dict",
    "rope_table",
    "tiny_v4_config",
]

_ACTS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}
_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_LEGACY_RATIO = {0: "sliding_attention", 1: "sliding_attention", 4: "compressed_sparse_attention",
                 128: "heavily_compressed_attention"}  # fmt: skip


@dataclass
class DeepseekV4Config:
    """The fields of an HF ``config.json`` (``model_type: deepseek_v4``) this model reads."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    layer_types: list = field(default_factory=list)
    compress_rates: dict = field(default_factory=lambda: dict(_DEFAULT_RATES))
    mlp_layer_types: list = field(default_factory=list)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict = field(default_factory=dict)  # {"main": {...}, "compress": {...}}
    partial_rotary_factor: float = 0.125
    bos_token_id: int | None = 0
    eos_token_id: int | list | None = 1
    model_type: str = "deepseek_v4"

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if not self.layer_types:
            # transformers' default pattern: 2 HCA, then CSA / HCA alternating.
            self.layer_types = ["heavily_compressed_attention"] * min(n, 2) + [
                "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))
            ]
        if not self.mlp_layer_types:
            self.mlp_layer_types = ["hash_moe"] * min(n, 3) + ["moe"] * max(0, n - 3)
        if len(self.layer_types) < n or len(self.mlp_layer_types) < n:
            raise ValueError(f"layer_types / mlp_layer_types must have {n} entries")
        self.layer_types, self.mlp_layer_types = list(self.layer_types[:n]), list(self.mlp_layer_types[:n])
        bad = [t for t in self.layer_types if t not in V4_LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types entries must be in {V4_LAYER_TYPES}; got {bad}")
        if self.head_dim != 512 or round(self.head_dim * self.partial_rotary_factor) != 64:
            raise ValueError(f"V4 attention needs head_dim 512 with 64 rope dims; got {self.head_dim}, "
                             f"partial_rotary_factor {self.partial_rotary_factor}")  # fmt: skip
        if self.hidden_act not in _ACTS or self.scoring_func != "sqrtsoftplus":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} / scoring_func {self.scoring_func!r}")
        rp = dict(self.rope_parameters or {})
        if not (isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)):
            yarn = {k: v for k, v in rp.items() if k not in ("main", "compress")}
            compress = {"rope_type": "default", **yarn, "rope_theta": self.compress_rope_theta}
            if compress["rope_type"] == "yarn":
                compress.setdefault("attention_factor", 1.0)  # V4 (and transformers) scale cos/sin by nothing
            rp = {"main": {"rope_type": "default", "rope_theta": self.rope_theta}, "compress": compress}
        self.rope_parameters = {"main": dict(rp["main"]), "compress": dict(rp["compress"])}

    def ratio(self, layer_idx: int) -> int:
        t = self.layer_types[layer_idx]
        return 1 if t == "sliding_attention" else int(self.compress_rates[t])

    @classmethod
    def from_dict(cls, d: dict) -> DeepseekV4Config:
        """Read an HF config dict (also the legacy ``compress_ratios`` / ``num_hash_layers`` fields).

        Raises:
            ValueError: a ``model_type`` other than deepseek_v4, or a shape this model does not support.
        """
        if d.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ValueError(f"expected a deepseek_v4 config, got model_type {d.get('model_type')!r}")
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names and v is not None}
        if "layer_types" not in kw and d.get("compress_ratios"):
            kw["layer_types"] = [_LEGACY_RATIO[int(r)] for r in d["compress_ratios"]]
        if "mlp_layer_types" not in kw and d.get("num_hash_layers") is not None:
            n, h = int(d.get("num_hidden_layers", cls.num_hidden_layers)), int(d["num_hash_layers"])
            kw["mlp_layer_types"] = ["hash_moe"] * min(n, h) + ["moe"] * max(0, n - h)
        rates = dict(kw.get("compress_rates") or _DEFAULT_RATES)
        for legacy, kind in (("compress_rate_csa", "compressed_sparse_attention"),
                             ("compress_rate_hca", "heavily_compressed_attention")):  # fmt: skip
            if d.get(legacy) is not None:
                rates[kind] = int(d[legacy])
        kw["compress_rates"] = rates
        if "rope_parameters" not in kw and d.get("rope_scaling"):
            kw["rope_parameters"] = dict(d["rope_scaling"])
        return cls(**kw)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        return d


def rope_table(inv_freq: torch.Tensor, num_pos: int) -> torch.Tensor:
    """``[num_pos, 64]`` fp32 ``[cos | sin]``, the angle an fp32 product as transformers forms it."""
    freqs = torch.arange(num_pos, dtype=torch.int64).float()[:, None] * inv_freq.float()[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=1)


class DeepseekV4HyperConnection(nn.Module):
    """``(2 + N) * N`` mixing weights from the flattened, normed streams: pre / post / Sinkhorn comb."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.hc, self.iters, self.hc_eps, self.eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor):
        """``streams [T, N, D]`` -> (post `[T, N]`, comb `[T, N, N]` fp32, collapsed `[T, D]` streams' dtype)."""
        n = self.hc
        flat = streams.reshape(streams.shape[0], -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


class DeepseekV4HyperHead(nn.Module):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.hc_eps, self.eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * cfg.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = streams.reshape(streams.shape[0], -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float())
        return ((pre + self.hc_eps).unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class DeepseekV4MLP(nn.Module):
    """The shared expert: clamped SwiGLU."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act, self.limit = _ACTS[cfg.hidden_act], cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(self.act(gate) * up)


class DeepseekV4Experts(nn.Module):
    """Routed experts, fused ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``; run densely."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))
        self.act, self.limit = _ACTS[cfg.hidden_act], cfg.swiglu_limit

    def forward(self, x: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:  # routing [T, E]
        gate, up = torch.einsum("th,eih->tei", x, self.gate_up_proj).chunk(2, dim=-1)
        h = self.act(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)
        y = torch.einsum("tei,ehi->teh", h, self.down_proj) * routing.unsqueeze(-1).to(h.dtype)
        return y.sum(dim=1).to(x.dtype)


class DeepseekV4Router(nn.Module):
    """Score-and-choose router; ``hash_moe`` layers choose by ``tid2eid[input_id]`` instead of the biased top-k."""

    def __init__(self, cfg: DeepseekV4Config, is_hash: bool) -> None:
        super().__init__()
        self.top_k, self.scale, self.is_hash = cfg.num_experts_per_tok, cfg.routed_scaling_factor, is_hash
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> the dense routing matrix ``[T, E]`` (fp32 where the scores are)."""
        scores = F.softplus(F.linear(x, self.weight)).sqrt()
        if self.is_hash:
            idx = self.tid2eid[input_ids].long()
        else:
            idx = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scale
        return torch.zeros_like(scores).scatter_(1, idx, w)


class DeepseekV4MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_idx: int) -> None:
        super().__init__()
        self.gate = DeepseekV4Router(cfg, cfg.mlp_layer_types[layer_idx] == "hash_moe")
        self.experts = DeepseekV4Experts(cfg)
        self.shared_experts = DeepseekV4MLP(cfg)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x, input_ids)) + self.shared_experts(x)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_idx: int, kv_cache_dtype: str, indexer_cache_dtype: str) -> None:
        super().__init__()
        self.self_attn = DeepseekV4Attention(
            hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
            o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, layer_type=cfg.layer_types[layer_idx],
            compress_ratio=cfg.ratio(layer_idx), window=cfg.sliding_window, index_n_heads=cfg.index_n_heads,
            index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, eps=cfg.rms_norm_eps,
            kv_cache_dtype=kv_cache_dtype, indexer_cache_dtype=indexer_cache_dtype,
        )  # fmt: skip
        self.mlp = DeepseekV4MoE(cfg, layer_idx)
        self.input_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = DeepseekV4HyperConnection(cfg)
        self.ffn_hc = DeepseekV4HyperConnection(cfg)

    def forward(self, streams, input_ids, md: V4Metadata, cache: V4LayerCache) -> torch.Tensor:
        dtype = streams.dtype
        post, comb, x = self.attn_hc(streams)
        y = self.self_attn(self.input_layernorm(x), md, cache)
        streams = post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                  streams)  # fmt: skip
        post, comb, x = self.ffn_hc(streams)
        y = self.mlp(self.post_attention_layernorm(x), input_ids)
        return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class _Backbone(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, kv_cache_dtype: str, indexer_cache_dtype: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV4DecoderLayer(cfg, i, kv_cache_dtype, indexer_cache_dtype) for i in range(cfg.num_hidden_layers)
        )
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = DeepseekV4HyperHead(cfg)


class DeepseekV4ForCausalLM(nn.Module):
    r"""DeepSeek V4 over paged V4 caches (HF names: ``model.layers.{i}.self_attn...``, ``lm_head``).

    Args:
        cfg (DeepseekV4Config): the model shape.
        kv_cache_dtype (str): "auto" or "fp8_v4" (the SWA and compressed caches).
        indexer_cache_dtype (str): "auto" or "fp8" (the CSA indexer's key cache).
    """

    #: fp32 in every model dtype, as transformers keeps them (``_keep_in_fp32_modules_strict``).
    FP32_KEYS = ("_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias", "norm.", "layernorm.")

    def __init__(self, cfg: DeepseekV4Config, kv_cache_dtype: str = "auto", indexer_cache_dtype: str = "auto") -> None:
        super().__init__()
        self.config = cfg
        self.kv_cache_dtype = kv_cache_dtype
        self.model = _Backbone(cfg, kv_cache_dtype, indexer_cache_dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rope_positions = 0

    @property
    def attention_layers(self) -> list[DeepseekV4Attention]:
        return [layer.self_attn for layer in self.model.layers]

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        return tuple(sorted({a.ratio for a in self.attention_layers if a.compressor is not None}))

    def set_rope_tables(self, num_pos: int) -> None:
        """Build the per-layer ``[num_pos, 64]`` RoPE tables (plain for sliding layers, "compress" otherwise)."""
        cfg = self.config
        tables = {}
        for kind in ("main", "compress"):
            params = cfg.rope_parameters[kind]
            inv_freq, factor = rope_inv_freq(64, params, cfg.max_position_embeddings)
            factor = float(params.get("attention_factor", factor))  # transformers multiplies cos and sin by it
            tables[kind] = (rope_table(inv_freq, num_pos) * factor).to(self.lm_head.weight.device)
        for attn in self.attention_layers:
            attn.cos_sin_cache = tables["main" if attn.compressor is None else "compress"]
        self._rope_positions = num_pos

    def make_caches(self, num_blocks: int, block_size: int, num_state_slots: int, *, dtype, device, swa_blocks=None):
        return [a.make_cache(num_blocks, block_size, num_state_slots, dtype=dtype, device=device,
                             swa_blocks=swa_blocks) for a in self.attention_layers]  # fmt: skip

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[V4LayerCache],
                md: V4Metadata) -> torch.Tensor:  # fmt: skip
        """``input_ids [T]`` -> final hidden states ``[T, hidden]`` (``positions`` is ``md.positions``)."""
        h = self.model.embed_tokens(input_ids)
        streams = h.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            streams = layer(streams, input_ids, md, cache)
        return self.model.norm(self.model.hc_head(streams))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def process_weights_after_loading(self) -> None:
        """Nothing to absorb in V4; builds default RoPE tables if none were set."""
        if not self._rope_positions:
            self.set_rope_tables(min(self.config.max_position_embeddings, 4096))


def tiny_v4_config(**overrides) -> DeepseekV4Config:
    """A tiny V4 with all three layer types: window 8, CSA ratio 4 with top-k 4, HCA ratio 16, 2 heads.

    3 layers (sliding, CSA, HCA), hidden 64, q_lora 32, o_groups 2 x o_lora 16, 4 experts (top-2, the
    first layer hash-routed), hc_mult 2, indexer 8 heads x 128, vocab 128, YaRN on the compress table.
    """
    cfg = dict(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4, routed_scaling_factor=1.5,
        max_position_embeddings=256, sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=8,
        index_head_dim=128, index_topk=4, hc_mult=2, hc_sinkhorn_iters=5,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
    )  # fmt: skip
    cfg.update(overrides)
    return DeepseekV4Config(**cfg)


def random_v4_state_dict(cfg: DeepseekV4Config, seed: int = 0, *, decisive_routing: bool = False) -> dict:
    """Seeded random fp32 weights with the HF names; sinks, position biases, router bias and ``tid2eid`` random.

    transformers initialises sinks, position biases and ``tid2eid`` to zeros, which would check nothing.
    ``decisive_routing``: the correction bias ``2 * (E - 1 - e)`` outweighs the scores' spread, so bf16 / fp8
    rounding cannot flip a top-k expert choice (the weights still come from the scores; hash layers unchanged).
    """
    g = torch.Generator().manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg)
    sd = {}
    for name, t in model.state_dict().items():
        shape = tuple(t.shape)
        if name.endswith("tid2eid"):
            v = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: shape[1]] for _ in range(shape[0])])
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            v = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("sinks") or name.endswith("e_score_correction_bias"):
            v = 0.5 * torch.randn(shape, generator=g)
            if decisive_routing and name.endswith("e_score_correction_bias"):
                v = 2.0 * torch.arange(shape[0] - 1, -1, -1, dtype=torch.float32)
        elif name.endswith("position_bias"):
            v = torch.randn(shape, generator=g)
        elif name.endswith(".scale") or name.endswith("hc_scale"):
            v = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(".base") or name.endswith("hc_base"):
            v = 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("embed_tokens.weight"):
            v = torch.randn(shape, generator=g)
        else:
            v = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        sd[name] = v if name.endswith("tid2eid") else v.float()
    return sd


def build_v4_model(
    cfg: DeepseekV4Config,
    state_dict: dict,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    kv_cache_dtype: str = "auto",
    indexer_cache_dtype: str = "auto",
) -> DeepseekV4ForCausalLM:
    """Instantiate, load ``state_dict`` strictly (HF names), move; :attr:`~DeepseekV4ForCausalLM.FP32_KEYS` stay fp32.

    Raises:
        RuntimeError: missing or unexpected weights (from ``load_state_dict``).
    """
    model = DeepseekV4ForCausalLM(cfg, kv_cache_dtype=kv_cache_dtype, indexer_cache_dtype=indexer_cache_dtype)
    sd = dict(state_dict)
    if cfg.tie_word_embeddings:
        sd.setdefault("lm_head.weight", sd.get("model.embed_tokens.weight"))
    model.load_state_dict(sd, strict=True)
    model.to(device=device)
    for name, p in model.named_parameters():
        keep = any(k in name for k in DeepseekV4ForCausalLM.FP32_KEYS)
        p.data = p.data.to(torch.float32 if keep else dtype)
    model.eval().requires_grad_(False)
    model.process_weights_after_loading()
    return model


def build_hf_v4_model(cfg: DeepseekV4Config, state_dict: dict, *, device: str | torch.device = "cpu"):
    """transformers' ``DeepseekV4ForCausalLM`` (eager, fp32, eval) with ``state_dict`` loaded strictly (the oracle)."""
    from transformers import DeepseekV4Config as HFConfig
    from transformers import DeepseekV4ForCausalLM as HFModel

    d = cfg.to_dict()
    for k in ("architectures", "model_type"):
        d.pop(k, None)
    hf_cfg = HFConfig(**d)
    hf_cfg._attn_implementation = "eager"
    model = HFModel(hf_cfg)
    sd = {k: (v if k.endswith("tid2eid") else v.float()) for k, v in state_dict.items()}
    if cfg.tie_word_embeddings:
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    model.load_state_dict(sd, strict=True)
    return model.to(device).float().eval()


# DeepSeek's checkpoint names -> transformers' (the renames of transformers' conversion_mapping["deepseek_v4"],
# applied in order to keys without their "model." prefix; save_pretrained writes the DeepSeek names back).
_V4_RENAMES = [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."), (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]  # fmt: skip
_V4_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def hf_v4_state_dict(sd: dict, num_hidden_layers: int) -> dict:
    """A V4 checkpoint's tensors (DeepSeek or transformers names, per-expert or fused) -> this model's names.

    Per-expert ``w1`` (gate) / ``w3`` (up) / ``w2`` (down) are fused into ``gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]``; multi-token-prediction weights (``mtp.*``) and layers past ``num_hidden_layers``
    are dropped.

    Raises:
        ValueError: an expert is missing one of its matrices, or the checkpoint stores FP8 weights (``scale_inv``).
    """
    scaled = [k for k in sd if k.endswith("scale_inv")]
    if scaled:
        raise ValueError(f"FP8 checkpoint weights ({scaled[0]}, ...) are not supported: convert to bf16 first")
    out, experts = {}, {}
    for key, v in sd.items():
        k = key[len("model.") :] if key.startswith("model.") else key
        if k.startswith("mtp."):
            continue
        for pat, rep in _V4_RENAMES:
            k = re.sub(pat, rep, k)
        m = re.match(r"^layers\.(\d+)\.", k)
        if m and int(m.group(1)) >= num_hidden_layers:
            continue
        k = k if k.startswith("lm_head.") else "model." + k
        em = _V4_EXPERT.match(k)
        if em:
            kind = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up"}.get(em.group(3), "down")
            experts.setdefault(em.group(1), {}).setdefault(int(em.group(2)), {})[kind] = v
        else:
            out[k] = v
    for prefix, per in experts.items():
        n = max(per) + 1
        try:
            gate_up = [torch.cat([per[e]["gate"], per[e]["up"]], 0) for e in range(n)]
            out[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
            out[f"{prefix}.down_proj"] = torch.stack([per[e]["down"] for e in range(n)])
        except KeyError as err:
            raise ValueError(f"{prefix}: expert weights incomplete ({err})") from None
    return out
