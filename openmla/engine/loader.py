"""Model loading: a built-in tiny random DeepSeek V3 (seeded), or a local HF checkpoint directory.

A checkpoint directory holds an HF ``config.json`` (``model_type: deepseek_v3`` or ``deepseek_v32``) and
``*.safetensors`` weights with the HF names. Routed experts may be stored per expert
(``mlp.experts.{e}.gate_proj.weight`` and friends, the on-disk layout of DeepSeek's and HF's checkpoints) or
fused (``mlp.experts.gate_up_proj`` / ``down_proj``, the HF in-memory layout); both load.
Multi-token-prediction layers past ``num_hidden_layers`` are ignored.
"""

from __future__ import annotations

import json
import math
import os
import re

import torch

from openmla.engine.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from openmla.engine.models.deepseek_v4 import (
    DeepseekV4Config,
    build_v4_model,
    hf_v4_state_dict,
    random_v4_state_dict,
    tiny_v4_config,
)
from openmla.engine.models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM, tiny_v32_config

__all__ = [
    "tiny_config",
    "random_state_dict",
    "fuse_experts",
    "unfuse_experts",
    "load_checkpoint",
    "save_checkpoint",
    "build_model",
    "load_model",
]


#: The tiny model's rope: YaRN, factor 4 over 64 original positions (so mscale enters the softmax scale).
TINY_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}


def tiny_config(**overrides) -> DeepseekV3Config:
    """A tiny DeepSeek V3 that keeps the real cache row (512 + 64) and exercises every path.

    2 layers (1 dense + 1 MoE with 4 experts in 2 groups, top-2, 1 shared), hidden 64, 4 heads,
    q_lora_rank 32, qk_nope 32, v_head 32, vocab 128, YaRN rope (factor 4 over 64 original
    positions, so the mscale enters the softmax scale) with the interleaved layout.

    Args:
        **overrides: fields of :class:`DeepseekV3Config` to change.
    """
    cfg = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        qk_nope_head_dim=32,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        max_position_embeddings=256,
        rope_parameters=dict(TINY_YARN),
    )
    cfg.update(overrides)
    return DeepseekV3Config(**cfg)


def random_state_dict(
    cfg: DeepseekV3Config, seed: int = 0, dtype: torch.dtype = torch.float32, *, decisive_routing: bool = False
) -> dict:
    """Seeded random weights with the HF (fused-expert) names.

    Linear weights are ``N(0, 1/fan_in)`` (so activations keep unit scale and the logits are far from
    uniform, which keeps greedy decoding well separated), norm weights ``1 + N(0, 0.1)``, the router
    bias ``N(0, 0.1)``. The router weight stays fp32, as in the HF model.

    Routing is a discontinuous function of the activations: at bf16 or fp8 precision a near-tie between
    two experts can flip and move a logit by O(1), which says nothing about attention. With
    ``decisive_routing`` the score-correction bias is ``2 * (E - 1 - e)`` for expert ``e``: gaps larger
    than the sigmoid scores' whole range, so every token picks the same experts (their weights still
    come from the scores) and low-precision comparisons stay meaningful.

    Args:
        cfg (DeepseekV3Config): the model shape.
        seed (int): generator seed; the same seed gives the same weights on every machine.
        dtype (torch.dtype): dtype of everything but the router.
        decisive_routing (bool): make the expert choice unambiguous (see above).

    Returns:
        dict[str, torch.Tensor]: CPU tensors.
    """
    g = torch.Generator().manual_seed(seed)
    model = _model_class(cfg)(cfg)  # only for the names and shapes
    sd = {}
    for name, t in model.state_dict().items():
        shape = tuple(t.shape)
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            v = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            v = 0.1 * torch.randn(shape, generator=g)
            if decisive_routing:
                v = 2.0 * torch.arange(shape[0] - 1, -1, -1, dtype=torch.float32)
        elif name.endswith("embed_tokens.weight"):
            v = torch.randn(shape, generator=g)
        else:
            v = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        keep_fp32 = name.endswith("mlp.gate.weight") or name.endswith("e_score_correction_bias")
        sd[name] = v.to(torch.float32 if keep_fp32 else dtype)
    return sd


def _model_class(cfg: DeepseekV3Config) -> type:
    """The engine model of a config: V3.2 (sparse attention) or V3."""
    return DeepseekV32ForCausalLM if isinstance(cfg, DeepseekV32Config) else DeepseekV3ForCausalLM


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(sd: dict) -> dict:
    """Per-expert weights -> the fused ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` layout.

    Raises:
        ValueError: an expert is missing one of its three matrices.
    """
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for k, v in sd.items():
        m = _PER_EXPERT.match(k)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
        else:
            out[k] = v
    for prefix, experts in groups.items():
        n = max(experts) + 1
        try:
            gate_up = [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], 0) for e in range(n)]
            down = [experts[e]["down_proj"] for e in range(n)]
        except KeyError as err:
            raise ValueError(f"{prefix}: expert weights incomplete ({err})") from None
        out[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{prefix}.down_proj"] = torch.stack(down)
    return out


def unfuse_experts(sd: dict) -> dict:
    """The fused expert layout -> per-expert weights (the on-disk layout HF and DeepSeek write)."""
    out = {}
    for k, v in sd.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            prefix = k[: -len(".gate_up_proj")]
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = v[e, :half].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = v[e, half:].contiguous()
        elif k.endswith(".mlp.experts.down_proj"):
            prefix = k[: -len(".down_proj")]
            for e in range(v.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v
    return out


def save_checkpoint(path: str, cfg: DeepseekV3Config, state_dict: dict) -> None:
    """Write ``config.json`` and ``model.safetensors`` (per-expert layout) into ``path``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)
    tensors = {k: v.detach().contiguous().cpu() for k, v in unfuse_experts(state_dict).items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def load_checkpoint(path: str) -> tuple[DeepseekV3Config, dict]:
    """Read a local HF checkpoint directory.

    Args:
        path (str): a directory with ``config.json`` and ``*.safetensors``.

    Returns:
        (config, state dict with fused experts, CPU tensors).

    Raises:
        FileNotFoundError: no config or no weights.
    """
    from safetensors.torch import load_file

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json")
    with open(cfg_path) as f:
        d = json.load(f)
    kinds = {"deepseek_v32": DeepseekV32Config, "deepseek_v4": DeepseekV4Config}
    cfg = kinds.get(d.get("model_type"), DeepseekV3Config).from_dict(d)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path!r} has no *.safetensors weights")
    sd = {}
    for name in files:
        sd.update(load_file(os.path.join(path, name)))
    if isinstance(cfg, DeepseekV4Config):  # DeepSeek or transformers names, per-expert w1/w2/w3
        return cfg, hf_v4_state_dict(sd, cfg.num_hidden_layers)
    layer_re = re.compile(r"^model\.layers\.(\d+)\.")
    sd = {k: v for k, v in sd.items() if not ((m := layer_re.match(k)) and int(m.group(1)) >= cfg.num_hidden_layers)}
    return cfg, fuse_experts(sd)


def build_model(
    cfg: DeepseekV3Config,
    state_dict: dict,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    kv_cache_dtype: str = "auto",
    kv_scale: float = 1.0,
    indexer_cache_dtype: str | None = None,
) -> DeepseekV3ForCausalLM:
    """Instantiate the model, load ``state_dict`` strictly, move it, build the absorbed matrices.

    The router weight and bias stay fp32 whatever ``dtype`` is (HF keeps them fp32 too), as do V3.2's
    indexer ``weights_proj``. ``indexer_cache_dtype`` ("auto" / "fp8", V3.2 and V4) picks the indexer key cache.

    Raises:
        RuntimeError: missing or unexpected weights (from ``load_state_dict``).
        ValueError: ``indexer_cache_dtype`` for a model without an indexer.
    """
    if isinstance(cfg, DeepseekV4Config):  # its own fp32 rules (transformers' _keep_in_fp32_modules_strict)
        return build_v4_model(cfg, state_dict, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                              indexer_cache_dtype=indexer_cache_dtype or "auto")  # fmt: skip
    extra = {}
    if indexer_cache_dtype is not None:
        if not isinstance(cfg, DeepseekV32Config):
            raise ValueError(f"indexer_cache_dtype {indexer_cache_dtype!r}: only DeepSeek V3.2 has an indexer")
        extra["indexer_cache_dtype"] = indexer_cache_dtype
    model = _model_class(cfg)(cfg, kv_cache_dtype=kv_cache_dtype, kv_scale=kv_scale, **extra)
    sd = dict(state_dict)
    if cfg.tie_word_embeddings:
        sd.setdefault("lm_head.weight", sd.get("model.embed_tokens.weight"))
    model.load_state_dict(sd, strict=True)
    model.to(device=device)
    router = {id(t) for layer in model.model.layers if hasattr(layer.mlp, "gate") for t in layer.mlp.gate.parameters()}
    router |= {id(t) for t in getattr(model, "fp32_parameters", list)()}  # e.g. V3.2's indexer weights_proj
    for p in model.parameters():
        if id(p) not in router and p.is_floating_point():
            p.data = p.data.to(dtype)
    model.eval().requires_grad_(False)
    model.process_weights_after_loading()
    return model


def load_model(
    path: str | None = None,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    kv_cache_dtype: str = "auto",
    kv_scale: float = 1.0,
    config_overrides: dict | None = None,
    decisive_routing: bool = False,
) -> tuple[DeepseekV3ForCausalLM, dict]:
    """Load a checkpoint directory, or build the tiny random model when ``path`` is None or "tiny" ("tiny-v32":
    the tiny DeepSeek V3.2, :func:`~openmla.engine.models.deepseek_v32.tiny_v32_config`).

    ``seed``, ``config_overrides`` and ``decisive_routing`` apply to the tiny model only
    (:func:`tiny_config`, :func:`random_state_dict`).

    Returns:
        (model, state dict it was built from, fused experts, CPU tensors: what an oracle loads).
    """
    if path == "tiny-v4":
        cfg = tiny_v4_config(**(config_overrides or {}))
        sd = random_v4_state_dict(cfg, seed=seed, decisive_routing=decisive_routing)
    elif path is None or path in ("tiny", "tiny-v32"):
        make = tiny_v32_config if path == "tiny-v32" else tiny_config
        cfg = make(**(config_overrides or {}))
        sd = random_state_dict(cfg, seed=seed, decisive_routing=decisive_routing)
    else:
        cfg, sd = load_checkpoint(path)
    model = build_model(cfg, sd, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_scale=kv_scale)
    return model, sd
