"""DeepSeek V2/V3 Multi-head Latent Attention over a paged latent cache.

Weights follow the Hugging Face layout (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` or ``q_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), so a checkpoint's state dict loads
as is. Per step (SPEC §3):

* every token's normed latent ``kv_c`` (512) and RoPE'd ``k_pe`` (64) go into the cache
  (:func:`~openmla.ops.cache.concat_and_cache_mla`, row ``[kv_c | k_pe]``);
* **decode** rows (query length <= the decode threshold, speculative verify included) run in the
  absorbed MQA form: ``q_nope @ W_UK -> [T, H, 512]``, concatenated with ``q_pe`` to 576, one
  :func:`~openmla.ops.decode.mla_decode` over the latent cache, then ``@ W_UV -> [T, H, v_head_dim]``;
* **prefill** rows run in MHA form: ``kv_b_proj`` expands the new tokens' latents into per-head keys
  and values, :func:`~openmla.ops.prefill.flash_attn_varlen` attends causally among the new tokens;
  when a request has cached context (chunked prefill), :func:`~openmla.ops.chunked_prefill.mla_prefill_with_context`
  also gathers the context from the cache chunk by chunk, expands it, attends to it and merges by LSE;
* ``o_proj`` maps the heads back to the hidden size.

``kv_cache_dtype="fp8"`` stores the cache in float8_e4m3fn with a per-tensor scale (stored = value /
scale); the decode and the context chunks read it dequantised, the new tokens of a prefill use their
exact values (as vLLM does).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from openmla.layers.norm import RMSNorm
from openmla.layers.rope import RotaryEmbedding, mla_softmax_scale
from openmla.metadata.dense import MLADecodeMetadata, MLAMetadata, MLAPrefillMetadata
from openmla.ops._validate import (
    FLOAT16_DTYPES,
    check_index,
    check_positive_ints,
    check_scale_value,
    check_tensor,
    describe,
)
from openmla.ops.cache import concat_and_cache_mla
from openmla.ops.chunked_prefill import mla_prefill_with_context
from openmla.ops.decode import mla_decode
from openmla.ops.prefill import flash_attn_varlen

__all__ = ["MLAAttention", "KV_CACHE_DTYPES", "check_kernel_widths"]

KV_CACHE_DTYPES = ("auto", "fp8")
# the absorbed decode (mla_decode) takes power-of-two latent and rope widths (small ones padded to the 16 a dot
# needs); the largest latent compiled for sm90 is 1024 (its ring of 64-key tiles then takes 174 KB of shared memory)
MAX_KV_LORA_RANK = 1024
MAX_ROPE_DIM = 128


def check_kernel_widths(kv_lora_rank: int, qk_rope_head_dim: int) -> None:
    """Raise a ValueError, in model terms, for a latent or rope width the decode kernel cannot take."""
    for name, val, top in (("kv_lora_rank", kv_lora_rank, MAX_KV_LORA_RANK),
                           ("qk_rope_head_dim", qk_rope_head_dim, MAX_ROPE_DIM)):  # fmt: skip
        if val & (val - 1) or val > top:
            raise ValueError(
                f"{name} {val}: the paged MLA decode kernel takes {name} as a power of two up to {top} "
                f"(the cache row is kv_lora_rank + qk_rope_head_dim wide and decode splits it into power-of-two tiles)"
            )


def check_hidden_states(name: str, x, width: int, weight: torch.Tensor) -> torch.Tensor:
    """A layer's activations: a `[T, width]` float tensor of its weights' dtype (any strides)."""
    check_tensor(name, x, dtypes=FLOAT16_DTYPES + (torch.float32,), ndim=2, shape=(None, width),
                 last_dim_contiguous=False, kernel=False)  # fmt: skip
    if x.dtype != weight.dtype:
        raise TypeError(f"{name} must have the layer's dtype {weight.dtype}; got {describe(x)}")
    return x


def check_positions(positions, T: int, device: torch.device) -> torch.Tensor:
    """Token positions: a `[T]` int32/int64 tensor on ``device`` (a float tensor would rotate by fractional angles)."""
    return check_index("positions", positions, ndim=1, device=device, length=T, kernel=False)


class MLAAttention(nn.Module):
    r"""DeepSeek V3 attention with a paged latent cache, driven by :class:`MLAMetadata`.

    Args:
        hidden_size (int): model width.
        num_heads (int): attention heads ``H``.
        q_lora_rank (int | None): rank of the low-rank q projection (None: a plain ``q_proj``).
        kv_lora_rank (int): latent width ``L`` (512 for DeepSeek).
        qk_nope_head_dim (int): per-head non-rotary q/k width ``P`` (128).
        qk_rope_head_dim (int): rotary width ``R`` (64); the cache row is ``L + R`` wide.
        v_head_dim (int): per-head value width ``V`` (128).
        max_position_embeddings (int): context length (for YaRN's defaults).
        rope_parameters (dict | None): HF ``rope_parameters`` (type, theta, scaling fields).
        rope_interleave (bool): DeepSeek's pairwise rope layout (HF ``rope_interleave``).
        attention_bias (bool): biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``.
        norm_eps (float): eps of ``q_a_layernorm`` / ``kv_a_layernorm`` (the HF model uses 1e-6 there
            whatever ``rms_norm_eps`` says).
        kv_cache_dtype (str): "auto" (cache in the model dtype) or "fp8" (float8_e4m3fn).
        kv_scale (float): per-tensor scale of an fp8 cache (value = stored * kv_scale).

    Raises:
        ValueError: on an unknown ``kv_cache_dtype``, non-positive sizes (``q_lora_rank`` included, unless None), a
            ``kv_scale`` that is not positive and finite, a negative or non-finite ``norm_eps``, or a ``kv_lora_rank`` /
            ``qk_rope_head_dim`` the decode kernel cannot take (:func:`check_kernel_widths`).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        max_position_embeddings: int = 4096,
        rope_parameters: dict | None = None,
        rope_interleave: bool = True,
        attention_bias: bool = False,
        norm_eps: float = 1e-6,
        kv_cache_dtype: str = "auto",
        kv_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}; got {kv_cache_dtype!r}")
        check_positive_ints(
            ("hidden_size", hidden_size),
            ("num_heads", num_heads),
            ("kv_lora_rank", kv_lora_rank),
            ("qk_nope_head_dim", qk_nope_head_dim),
            ("qk_rope_head_dim", qk_rope_head_dim),
            ("v_head_dim", v_head_dim),
        )
        if q_lora_rank is not None:  # None: a plain q_proj; 0 would project q through an empty rank
            check_positive_ints(("q_lora_rank", q_lora_rank))
        check_kernel_widths(kv_lora_rank, qk_rope_head_dim)
        for name, val in (("kv_scale", kv_scale), ("norm_eps", norm_eps)):
            if isinstance(val, bool) or not isinstance(val, (int, float)):
                raise TypeError(f"{name} must be a float; got {val!r}")
        check_scale_value("kv_scale", float(kv_scale))  # stored = value / kv_scale: inf would store zeros
        if not (math.isfinite(norm_eps) and norm_eps >= 0):
            raise ValueError(f"norm_eps must be a finite float >= 0; got {norm_eps!r}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_scale = float(kv_scale)
        H = num_heads

        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, H * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, H * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=attention_bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, H * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * v_head_dim, hidden_size, bias=attention_bias)
        self.rotary_emb = RotaryEmbedding(qk_rope_head_dim, max_position_embeddings, rope_parameters, rope_interleave)
        self.sm_scale = mla_softmax_scale(self.qk_head_dim, rope_parameters)
        self._absorbed_key: tuple | None = None
        self.W_UK: torch.Tensor | None = None  # [H, P, L]
        self.W_UV: torch.Tensor | None = None  # [H, L, V]

    # ------------------------------------------------------------ weights
    def process_weights_after_loading(self) -> None:
        """Split ``kv_b_proj`` into the absorbed decode matrices (SPEC §3.1).

        ``kv_b_proj.weight`` `[H * (P + V), L]` viewed as `[H, P + V, L]` gives ``W_UK`` `[H, P, L]`
        (q_nope @ W_UK -> latent space) and ``W_UV`` `[H, L, V]` (latent output -> value space).
        Called automatically when the weight changes (checked by tensor version, no sync).
        """
        w = self.kv_b_proj.weight
        H, P, V, L = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
        w = w.detach().view(H, P + V, L)
        self.W_UK = w[:, :P, :].contiguous()
        self.W_UV = w[:, P:, :].transpose(1, 2).contiguous()
        self._absorbed_key = (w.data_ptr(), self.kv_b_proj.weight._version, w.dtype, w.device)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight
        if self._absorbed_key != (w.data_ptr(), w._version, w.dtype, w.device):
            self.process_weights_after_loading()
        return self.W_UK, self.W_UV

    def make_kv_cache(
        self, num_blocks: int, block_size: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """A zeroed cache `[num_blocks, block_size, L + R]` for this layer (fp8 when so configured).

        Args:
            dtype (torch.dtype): the model dtype (used for "auto").
        """
        cache_dtype = torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else dtype
        return torch.zeros(
            num_blocks, block_size, self.kv_lora_rank + self.qk_rope_head_dim, dtype=cache_dtype, device=device
        )

    # ------------------------------------------------------------ forward
    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: MLAMetadata
    ) -> torch.Tensor:
        """Attention for one step.

        Args:
            positions (torch.Tensor): `[T]`, int64; each token's absolute position (T = the step's
                input rows, CUDA-graph padding included).
            hidden_states (torch.Tensor): `[T, hidden_size]`, the model dtype.
            kv_cache (torch.Tensor): `[num_blocks, block_size, L + R]`, model dtype or float8_e4m3fn.
            attn_metadata (MLAMetadata): from :class:`~openmla.metadata.dense.MLAMetadataBuilder`.

        Returns:
            torch.Tensor: `[T, hidden_size]`; padding rows hold no meaningful values.

        Raises:
            TypeError, ValueError: mismatched inputs: metadata of another builder or for another number of input
                rows (``num_input_tokens``), activations of another width or dtype than the layer's, positions that
                are not a `[T]` integer tensor, an "auto" cache of another dtype than the activations (the decode
                reads it as q's dtype).
        """
        if not isinstance(attn_metadata, MLAMetadata):
            raise TypeError(f"attn_metadata must be MLAMetadata, got {type(attn_metadata).__name__}")
        check_hidden_states("hidden_states", hidden_states, self.hidden_size, self.kv_a_proj_with_mqa.weight)
        T = hidden_states.shape[0]
        # every row the metadata describes (a padded uniform decode's rows included) is read from q and written to
        # the output: fewer rows would be read and written past their ends
        if T != attn_metadata.num_input_tokens:
            raise ValueError(f"hidden_states has {T} rows but the metadata {attn_metadata.num_input_tokens} "
                             f"(num_input_tokens); got {describe(hidden_states)}")  # fmt: skip
        check_positions(positions, T, hidden_states.device)
        if attn_metadata.slot_mapping.shape[0] < T:
            raise ValueError(f"attn_metadata.slot_mapping has {attn_metadata.slot_mapping.shape[0]} entries for {T} "
                             f"input rows")  # fmt: skip
        check_tensor("kv_cache", kv_cache, ndim=3, last_dim_contiguous=False, kernel=False)
        if self.kv_cache_dtype == "auto" and kv_cache.dtype != hidden_states.dtype:
            raise TypeError(f"kv_cache must have the dtype of hidden_states ({hidden_states.dtype}) for "
                            f'kv_cache_dtype="auto"; got {describe(kv_cache)}')  # fmt: skip
        H, P, R, L = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank

        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(T, H, P + R)
        q_nope, q_pe = q[..., :P], q[..., P:]
        latent = self.kv_a_proj_with_mqa(hidden_states)
        kv_c = self.kv_a_layernorm(latent[:, :L])
        q_pe, k_pe = self.rotary_emb(positions, q_pe, latent[:, L:])

        slots = attn_metadata.slot_mapping[:T]
        concat_and_cache_mla(  # slots come from the engine's allocator: no per-layer host sync
            kv_c, k_pe, kv_cache, slots, kv_cache_dtype=self.kv_cache_dtype, scale=self.kv_scale, validate=False
        )

        out = torch.zeros(T, H, self.v_head_dim, dtype=hidden_states.dtype, device=hidden_states.device)
        causal = attn_metadata.causal
        if attn_metadata.decode is not None:
            n = attn_metadata.decode.num_tokens
            out[:n] = self._forward_decode(q_nope[:n], q_pe[:n], kv_cache, attn_metadata.decode, causal)
        if attn_metadata.prefill is not None:
            s, e = attn_metadata.num_decode_tokens, attn_metadata.num_actual_tokens
            out[s:e] = self._forward_prefill(
                q_nope[s:e], q_pe[s:e], kv_c[s:e], k_pe[s:e], kv_cache, attn_metadata.prefill, causal
            )
        return self.o_proj(out.view(T, H * self.v_head_dim))

    def _forward_decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        md: MLADecodeMetadata,
        causal: bool,
    ) -> torch.Tensor:
        """Absorbed MQA decode: `[Td, H, P]`, `[Td, H, R]` -> `[Td, H, V]`."""
        W_UK, W_UV = self._absorbed()
        ql_nope = torch.bmm(q_nope.transpose(0, 1), W_UK)  # [H, Td, L]
        q_mqa = torch.cat([ql_nope.transpose(0, 1), q_pe], dim=-1)  # [Td, H, L + R]
        o_lat, _ = mla_decode(
            q_mqa,
            kv_cache,
            md.block_table,
            md.seq_lens,
            md.query_start_loc,
            self.sm_scale,
            causal=causal,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_scale=self.kv_scale if self.kv_cache_dtype == "fp8" else None,
            plan=md.plan,
            return_lse=False,
            d_v=self.kv_lora_rank,
            validate=False,  # the builder checked the step on the host; block ids come from the allocator
        )
        return torch.bmm(o_lat.transpose(0, 1), W_UV).transpose(0, 1)  # [Td, H, V]

    def _forward_prefill(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        md: MLAPrefillMetadata,
        causal: bool,
    ) -> torch.Tensor:
        """MHA prefill with chunked context: `[Tp, H, P]`, `[Tp, H, R]`, `[Tp, L]`, `[Tp, R]` -> `[Tp, H, V]`."""
        Tp, H, P = q_nope.shape
        q = torch.cat([q_nope, q_pe], dim=-1)  # [Tp, H, P + R]
        kv = self.kv_b_proj(kv_c).view(Tp, H, P + self.v_head_dim)
        k_nope, v = kv[..., :P], kv[..., P:]
        ctx = md.chunked_context
        if ctx is None:
            k = torch.cat([k_nope, k_pe[:, None, :].expand(Tp, H, self.qk_rope_head_dim)], dim=-1)
            cu = md.query_start_loc
            out, _ = flash_attn_varlen(
                q, k, v, cu, cu, md.max_query_len, md.max_query_len, self.sm_scale, causal=causal, return_lse=False,
                validate=False,
            )  # fmt: skip
            return out
        if not causal:
            raise ValueError("a non-causal prefill with cached context is not supported")
        out, _ = mla_prefill_with_context(
            q,
            k_nope,
            k_pe,
            v,
            kv_cache,
            md.block_table,
            ctx.context_lens,
            md.query_start_loc,
            self.kv_b_proj.weight.detach(),
            self.sm_scale,
            chunk_size=ctx.chunk_size,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_scale=self.kv_scale if self.kv_cache_dtype == "fp8" else None,
            context_lens_cpu=ctx.context_lens_cpu,
            query_start_loc_cpu=md.query_start_loc_cpu,
        )
        return out
