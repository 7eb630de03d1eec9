"""The transformers oracle: HF's ``DeepseekV3ForCausalLM`` with the engine's weights, and the comparison.

A causal LM's logits at position ``p`` depend only on tokens ``0..p``, so each engine step can be checked
on its own: for every request, the HF model runs on the tokens the engine had cached plus the tokens
it fed (own tokens and drafts) and its last rows must match the engine's rows. This covers prefill,
chunked prefill (context from the cache), decode and speculative verify alike.

``transformers`` is imported lazily (it is a test/demo dependency, not a runtime one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openmla.engine.generate import StepRecord
from openmla.engine.models.deepseek_v3 import DeepseekV3Config

__all__ = ["LOGIT_TOLERANCES", "LogitCheck", "build_hf_model", "check_records", "hf_greedy", "logit_tolerance"]

# (atol, rtol, cosine-difference bound) for engine logits vs the fp32 HF oracle, keyed by
# (model dtype, kv_cache_dtype). Measured on the tiny model (|logits| <= ~4) with a margin of 2-3x:
#  * fp32: the kernels accumulate in fp32 in a different order than eager PyTorch: ~4e-6.
#  * bf16: activations and weights rounded to 8 mantissa bits through 2 layers: ~0.06.
#  * fp8 KV (e4m3, 3 mantissa bits): every cached latent and rope element carries up to 2^-4 relative
#    rounding error; through the scores and the value sum it moves the logits by ~0.13 in fp32 and
#    ~0.2 in bf16. This is the format's precision, not an attention error; the cosine bound still
#    catches a wrong cache row or a wrong scale.
LOGIT_TOLERANCES = {
    (torch.float32, "auto"): (1e-4, 1e-4, 1e-8),
    (torch.bfloat16, "auto"): (0.15, 0.05, 1e-3),
    (torch.float16, "auto"): (0.05, 0.02, 1e-4),
    (torch.float32, "fp8"): (0.4, 0.1, 5e-3),
    (torch.bfloat16, "fp8"): (0.5, 0.1, 1e-2),
    (torch.float16, "fp8"): (0.5, 0.1, 1e-2),
    # V3.2's fp8_ds_mla rows (one fp32 scale per 128 latent values, bf16 rope): no worse than per-tensor fp8
    (torch.float32, "fp8_ds_mla"): (0.4, 0.1, 5e-3),
    (torch.bfloat16, "fp8_ds_mla"): (0.5, 0.1, 1e-2),
    # V4's fp8_v4 rows (UE8M0 scale per 64 nope values, bf16 rope; bf16 attention only): 0.15 / cos 1.2e-3 on the
    # tiny V4 (CPU interpreter, decisive routing); not yet measured on the H200
    (torch.bfloat16, "fp8_v4"): (0.5, 0.1, 1e-2),
}


def logit_tolerance(dtype: torch.dtype, kv_cache_dtype: str) -> tuple[float, float, float]:
    """(atol, rtol, cos_tol) for the logits of a model in ``dtype`` with a ``kv_cache_dtype`` cache."""
    return LOGIT_TOLERANCES[(dtype, kv_cache_dtype)]


def build_hf_model(cfg: DeepseekV3Config, state_dict: dict, *, device: str | torch.device = "cpu"):
    """HF ``DeepseekV3ForCausalLM`` (``DeepseekV32ForCausalLM`` for a V3.2 config; eager attention, fp32, eval)
    with ``state_dict`` loaded strictly."""
    from openmla.engine.models.deepseek_v4 import DeepseekV4Config, build_hf_v4_model
    from openmla.engine.models.deepseek_v32 import DeepseekV32Config

    if isinstance(cfg, DeepseekV4Config):
        return build_hf_v4_model(cfg, state_dict, device=device)
    if isinstance(cfg, DeepseekV32Config):
        from transformers import DeepseekV32Config as HFConfig
        from transformers import DeepseekV32ForCausalLM as DeepseekV3ForCausalLM
    else:
        from transformers import DeepseekV3Config as HFConfig
        from transformers import DeepseekV3ForCausalLM

    d = cfg.to_dict()
    d.pop("architectures", None)
    d.pop("model_type", None)
    hf_cfg = HFConfig(**d)
    hf_cfg._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(hf_cfg)
    sd = {k: v.float() for k, v in state_dict.items()}
    if cfg.tie_word_embeddings:
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    model.load_state_dict(sd, strict=True)
    return model.to(device).float().eval()


@torch.no_grad()
def hf_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Plain greedy decoding with the HF model (full recompute each token; tiny models only)."""
    dev = next(hf_model.parameters()).device
    outs = []
    for p in prompts:
        seq = list(p)
        for _ in range(max_new_tokens):
            seq.append(int(hf_model(torch.tensor([seq], device=dev)).logits[0, -1].argmax()))
        outs.append(seq[len(p) :])
    return outs


@dataclass
class LogitCheck:
    """Result of :func:`check_records`."""

    max_abs_diff: float
    max_cos_diff: float
    num_rows: int
    failures: list[str]

    @property
    def ok(self) -> bool:
        return not self.failures


@torch.no_grad()
def check_records(hf_model, records: list[StepRecord], atol: float, rtol: float, cos_tol: float) -> LogitCheck:
    """Compare recorded engine logits with the HF model's on the same token sequences.

    Args:
        hf_model: from :func:`build_hf_model`.
        records (list[StepRecord]): the engine's recorded rows.
        atol, rtol (float): per element ``|engine - hf| <= atol + rtol * |hf|``.
        cos_tol (float): bound on ``1 - 2<a,b>/(|a|^2 + |b|^2)`` per record.

    Returns:
        LogitCheck: the largest differences and a message per failing record.
    """
    dev = next(hf_model.parameters()).device
    max_abs = max_cos = 0.0
    rows = 0
    failures = []
    for r in records:
        seq = r.context_ids + r.token_ids
        ref = hf_model(torch.tensor([seq], device=dev)).logits[0, -len(r.token_ids) :].double().cpu()
        out = r.logits.double()
        err = (out - ref).abs()
        denom = (ref * ref).sum() + (out * out).sum()
        cos = float(1 - 2 * (ref * out).sum() / denom) if denom > 0 else 0.0
        max_abs, max_cos = max(max_abs, float(err.max())), max(max_cos, cos)
        rows += len(r.token_ids)
        if not bool((err <= atol + rtol * ref.abs()).all()) or not torch.isfinite(out).all() or cos > cos_tol:
            failures.append(
                f"request {r.req_id} at position {len(r.context_ids)} ({len(r.token_ids)} rows"
                f"{', verify' if r.is_verify else ''}): max |diff| {float(err.max()):.3e}, cos diff {cos:.2e}"
            )
    return LogitCheck(max_abs_diff=max_abs, max_cos_diff=max_cos, num_rows=rows, failures=failures)
