"""FLOP and byte formulas used by the benchmarks (FlashMLA's conventions)."""

from __future__ import annotations


def decode_flops(num_tokens_x_attended: int, num_heads: int, d_qk: int = 576, d_v: int = 512) -> float:
    """2 * h_q * sum(attended keys) * (d_qk + d_v)."""
    return 2.0 * num_heads * num_tokens_x_attended * (d_qk + d_v)


def decode_bytes(
    unique_kv_tokens: int,
    kv_bytes_per_token: int,
    num_q_rows: int,
    num_heads: int,
    q_bytes: int = 2,
    o_bytes: int = 2,
    d_qk: int = 576,
    d_v: int = 512,
) -> float:
    """q + unique KV tokens x bytes/token + out."""
    return unique_kv_tokens * kv_bytes_per_token + num_q_rows * num_heads * (d_qk * q_bytes + d_v * o_bytes)


def prefill_flops(causal_pairs: int, num_heads: int, d_qk: int = 192, d_v: int = 128) -> float:
    """2 * sum_b(attended (query, key) pairs) * H * (d_qk + d_v)."""
    return 2.0 * causal_pairs * num_heads * (d_qk + d_v)
