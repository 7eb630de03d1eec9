"""Rotary position embedding of DeepSeek V2/V3 MLA, applied as the Hugging Face model applies it.

Frequencies: ``inv_freq[i] = theta ** (-2i / d)`` for the ``d = qk_rope_head_dim`` rope dims, changed by
the configured scaling (``rope_parameters["rope_type"]``):

* ``"default"``: unchanged.
* ``"linear"``: divided by ``factor``.
* ``"yarn"`` (DeepSeek V3: factor 40 over 4096 original positions): frequencies below the
  ``beta_slow`` rotation count are interpolated (divided by ``factor``), those above ``beta_fast`` kept,
  with a linear ramp between; cos and sin are multiplied by the attention factor
  ``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`` (1 for DeepSeek V3, whose two
  mscales are equal). The softmax scale separately gains ``get_mscale(factor, mscale_all_dim) ** 2``
  (:func:`mla_softmax_scale`).

Layout: with ``interleave`` (DeepSeek's checkpoints) the rope dims are rotated in adjacent pairs
``(x0, x1), (x2, x3), ...`` and the result is written de-interleaved, ``[rotated evens | rotated odds]``,
which is what the HF model stores in its cache; without it the NeoX "rotate half" layout is used.
Both layouts give the same q.k products as long as q and k use the same one.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "yarn_get_mscale", "mla_softmax_scale", "rope_inv_freq"]

_SUPPORTED = ("default", "linear", "yarn")


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _rope_type(rope_parameters: dict | None) -> str:
    if not rope_parameters:
        return "default"
    return rope_parameters.get("rope_type", rope_parameters.get("type", "default")) or "default"


def mla_softmax_scale(qk_head_dim: int, rope_parameters: dict | None) -> float:
    """Softmax scale of DeepSeek MLA: ``qk_head_dim ** -0.5``, times ``mscale ** 2`` under rope scaling.

    As in the HF model, any non-default rope type with a non-zero ``mscale_all_dim`` multiplies the
    scale by ``yarn_get_mscale(factor, mscale_all_dim) ** 2`` (SPEC §0). The same scale serves the
    prefill (head dim ``qk_nope + qk_rope``) and the absorbed decode (head dim 576).

    Args:
        qk_head_dim (int): ``qk_nope_head_dim + qk_rope_head_dim`` (192 for DeepSeek V3).
        rope_parameters (dict | None): the model's rope parameters.

    Returns:
        float: the scale applied to ``q . k``.
    """
    scale = qk_head_dim**-0.5
    if _rope_type(rope_parameters) != "default":
        mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = yarn_get_mscale(rope_parameters["factor"], mscale_all_dim)
            scale = scale * m * m
    return scale


def rope_inv_freq(
    dim: int, rope_parameters: dict | None, max_position_embeddings: int, theta: float | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin attention factor for ``dim`` rope dims.

    Args:
        dim (int): rope head dim (even).
        rope_parameters (dict | None): ``rope_type``, ``rope_theta`` and the scaling fields.
        max_position_embeddings (int): the model's context length (YaRN's default ``factor``).
        theta (float | None): base, when not in ``rope_parameters`` (default 10000).

    Returns:
        (inv_freq `[dim // 2]` fp32 on the CPU, attention_factor float).

    Raises:
        ValueError: an odd ``dim`` or an unsupported rope type.
    """
    if dim % 2:
        raise ValueError(f"rope head dim must be even; got {dim}")
    params = dict(rope_parameters or {})
    rope_type = _rope_type(params)
    if rope_type not in _SUPPORTED:
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {_SUPPORTED})")
    base = float(params.get("rope_theta", theta if theta is not None else 10000.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    pos_freqs = base**exponents
    inv_freq = 1.0 / pos_freqs
    if rope_type == "default":
        return inv_freq, 1.0
    factor = params.get("factor")
    if rope_type == "linear":
        return 1.0 / (float(factor) * pos_freqs), 1.0

    # YaRN
    original = params.get("original_max_position_embeddings", max_position_embeddings)
    if factor is None:
        factor = max_position_embeddings / original
    factor = float(factor)
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # the dim index whose wavelength makes num_rotations turns over the original context
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + inv_freq * keep
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    r"""DeepSeek rotary embedding on the rope parts of q and k.

    cos/sin are computed on the fly from the positions, in fp32, exactly as the HF model does
    (``positions * inv_freq``), then cast to the activation dtype.

    Args:
        dim (int): rope head dim (``qk_rope_head_dim``, 64 for DeepSeek V3).
        max_position_embeddings (int): the model's context length.
        rope_parameters (dict | None): rope type, theta and scaling fields (HF ``rope_parameters``).
        interleave (bool): pairwise (DeepSeek) layout, written back de-interleaved (HF ``rope_interleave``).
    """

    def __init__(
        self, dim: int, max_position_embeddings: int, rope_parameters: dict | None = None, interleave: bool = True
    ) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(dim, rope_parameters, max_position_embeddings)
        self.dim = dim
        self.interleave = interleave
        self.attention_factor = attention_factor
        # fp32 whatever the model dtype: kept out of the module's buffers so .to(bf16) leaves it alone.
        self.inv_freq = inv_freq
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position's angles: two `[T, dim // 2]` tensors of ``dtype``."""
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:  # first call on a device (before any graph capture)
            inv_freq = self._inv_freq_on.setdefault(positions.device, self.inv_freq.to(positions.device))
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        cos = freqs.cos() * self.attention_factor
        sin = freqs.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(
        self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the rope parts.

        Args:
            positions (torch.Tensor): `[T]`, int64 (or int32); absolute positions.
            q_pe (torch.Tensor): `[T, H, dim]`, float.
            k_pe (torch.Tensor): `[T, dim]`, float (the single MLA key head).

        Returns:
            (q_pe `[T, H, dim]`, k_pe `[T, dim]`), new contiguous tensors of the input dtypes.

        Raises:
            ValueError: mismatched shapes.
        """
        if q_pe.dim() != 3 or q_pe.shape[-1] != self.dim or k_pe.shape != (q_pe.shape[0], self.dim):
            raise ValueError(
                f"expected q_pe [T, H, {self.dim}] and k_pe [T, {self.dim}]; "
                f"got {tuple(q_pe.shape)}, {tuple(k_pe.shape)}"
            )
        if positions.shape != (q_pe.shape[0],):
            raise ValueError(f"positions must be [{q_pe.shape[0]}]; got {tuple(positions.shape)}")
        cos, sin = self.cos_sin(positions, q_pe.dtype)
        q_out = self._rotate(q_pe, cos[:, None, :], sin[:, None, :])
        k_out = self._rotate(k_pe, cos, sin)
        return q_out, k_out
