"""Plain fp32 PyTorch references of the DeepSeek V4 ops (the test oracle): the fp8_v4 cache, the compressor,
the index sets, RoPE rows and E8M0 scales."""

from __future__ import annotations

import torch

V4_NOPE, V4_ROPE, V4_DATA, V4_TOKEN = 448, 64, 576, 584


# ---------------------------------------------------------------- fp8_v4 cache


def ceil_log2_ref(y: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(y))`` of positive fp32 values (int32), through frexp (no rounding of a log)."""
    m, e = torch.frexp(y.float())  # y = m * 2^e, m in [0.5, 1)
    return torch.where(m == 0.5, e - 1, e).to(torch.int32)


def v4_quantize_rows_ref(rows: torch.Tensor):
    """``[N, 512]`` -> (nope e4m3 bytes ``[N, 448]`` uint8, rope bf16 ``[N, 64]``, exponent bytes ``[N, 8]`` uint8)."""
    N = rows.shape[0]
    x = rows.float()
    g = x[:, :V4_NOPE].reshape(N, 7, 64)
    amax = torch.clamp(g.abs().amax(-1), min=1e-4)
    e = ceil_log2_ref(amax / torch.full_like(amax, 448.0))  # [N, 7]; a tensor divisor is IEEE on CUDA too
    scale = torch.pow(2.0, e.float())
    q = (g / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).reshape(N, V4_NOPE)
    exps = torch.zeros(N, 8, dtype=torch.uint8, device=rows.device)
    exps[:, :7] = (e + 127).clamp(0, 255).to(torch.uint8)
    return q, x[:, V4_NOPE:].to(torch.bfloat16), exps


def v4_block_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The bytes of an fp8_v4 cache's blocks, ``[num_blocks, block_size * 584]`` (a view, not a copy)."""
    nb, bs = cache.shape[0], cache.shape[1]
    stride = cache.stride(0) if nb > 1 else bs * V4_TOKEN
    return cache.view(torch.uint8).as_strided((nb, bs * V4_TOKEN), (stride, 1))


def v4_encode_blocks_ref(blocks: torch.Tensor, block_size: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write fp32 rows ``[N, 512]`` at ``slots`` into block bytes ``[num_blocks, block_size * 584]`` (in place)."""
    q, pe, exps = v4_quantize_rows_ref(rows)
    for i, slot in enumerate(slots.tolist()):
        b, p = divmod(slot, block_size)
        blk = blocks[b]
        blk[p * V4_DATA : p * V4_DATA + V4_NOPE] = q[i]
        blk[p * V4_DATA + V4_NOPE : (p + 1) * V4_DATA] = pe[i : i + 1].view(torch.uint8).reshape(-1)
        off = block_size * V4_DATA + p * 8
        blk[off : off + 8] = exps[i]


def dequantize_v4_cache_ref(cache: torch.Tensor, kv_cache_dtype: str = "fp8_v4") -> torch.Tensor:
    """Every slot of a V4 cache dequantised: fp32 ``[num_blocks * block_size, 512]``."""
    if kv_cache_dtype == "auto":
        return cache.reshape(-1, cache.shape[-1]).float()
    nb, bs = cache.shape[0], cache.shape[1]
    blocks = v4_block_bytes(cache).contiguous()
    data = blocks[:, : bs * V4_DATA].reshape(nb * bs, V4_DATA)
    exps = blocks[:, bs * V4_DATA :].reshape(nb * bs, 8)[:, :7]
    nope = data[:, :V4_NOPE].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, 7, 64)
    scale = exps.contiguous().view(torch.float8_e8m0fnu).float()  # 2^(byte - 127); 255 -> NaN
    rope = data[:, V4_NOPE:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(nope * scale[..., None]).reshape(-1, V4_NOPE), rope], dim=1)


def concat_and_cache_v4_ref(kv_c, k_pe, kv_cache, slot_mapping, *, kv_cache_dtype="fp8_v4"):
    """The cache after the writes: block bytes ``[num_blocks, bs * 584]`` (fp8_v4) or a cache copy (auto)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    rows = torch.cat([kv_c[keep].float(), k_pe[keep].float()], dim=1)
    if kv_cache_dtype == "auto":
        out = kv_cache.clone()
        out.view(-1, out.shape[-1])[slots] = rows.to(out.dtype)
        return out
    blocks = v4_block_bytes(kv_cache).clone()
    v4_encode_blocks_ref(blocks, kv_cache.shape[1], slots.cpu(), rows)
    return blocks


def _slots(block_table_row, start: int, n: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(start, start + n, device=block_table_row.device)
    return block_table_row[pos // block_size].long() * block_size + pos % block_size


def gather_cache_v4_ref(kv_cache, block_table, seq_lens, *, seq_starts=None, kv_cache_dtype="fp8_v4"):
    """fp32 ``[sum(seq_lens), 512]`` of the requests' rows, request after request."""
    flat = dequantize_v4_cache_ref(kv_cache, kv_cache_dtype)
    parts = [
        flat[_slots(block_table[b], 0 if seq_starts is None else int(seq_starts[b]), int(seq_lens[b]),
                    kv_cache.shape[1])]
        for b in range(block_table.shape[0])
    ]  # fmt: skip
    return torch.cat(parts) if parts else flat[:0]


def dequantize_and_gather_k_cache_ref(out, kv_cache, seq_lens, block_table, *, gather_lens=None, offset=0,
                                      kv_cache_dtype="fp8_v4"):  # fmt: skip
    """A float copy of ``out`` with each request's last ``gather_lens`` rows written at ``offset``."""
    flat = dequantize_v4_cache_ref(kv_cache, kv_cache_dtype)
    res = out.float().clone()
    for r in range(out.shape[0]):
        n = int(seq_lens[r])
        g = n if gather_lens is None else int(gather_lens[r])
        res[r, offset : offset + g] = flat[_slots(block_table[r], n - g, g, kv_cache.shape[1])]
    return res


# ---------------------------------------------------------------- RoPE, E8M0


def cos_sin_ref(cos_sin_cache: torch.Tensor, positions: torch.Tensor):
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache.float()[positions.long()]
    return cs[..., :half], cs[..., half:]


def rope_rows_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, *, inverse=False):
    """fp32 copy of ``x [T, ..., D]`` with its last R dims rotated (GPT-J pairs) by +- the token's angle."""
    R = cos_sin_cache.shape[1]
    y = x.float().clone()
    c, s = cos_sin_ref(cos_sin_cache, positions)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (R // 2,)
    c, s = c.reshape(shape), s.reshape(shape)
    if inverse:
        s = -s
    a, b = y[..., -R::2].clone(), y[..., -R + 1 :: 2].clone()
    y[..., -R::2] = a * c - b * s
    y[..., -R + 1 :: 2] = a * s + b * c
    return y


def rms_norm_rope_ref(x, eps, *, weight=None, positions=None, cos_sin_cache=None):
    """fp32 RMSNorm of the rows of ``x [T, (H,) D]`` (times ``weight``), then with ``positions`` the last R dims
    rotated by the token's angle; no intermediate rounding (openmla.rms_norm_rope rounds as V4 does)."""
    v = x.float()
    y = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y if positions is None else rope_rows_ref(y, positions, cos_sin_cache)


def inverse_rope_rows_ref(o, positions, cos_sin_cache):
    """fp32 ``o`` with its rope pairs rotated by minus the token's angle (SPEC §7.8)."""
    return rope_rows_ref(o, positions, cos_sin_cache, inverse=True)


def rope_cache_ref(inv_freq: torch.Tensor, num_pos: int) -> torch.Tensor:
    """``[num_pos, 2 * len(inv_freq)]`` fp32 ``[cos | sin]`` table, angles as fp32 products like transformers'
    DeepseekV4RotaryEmbedding (a float64 table differs from it by ~1e-4 at position 4k)."""
    f = torch.arange(num_pos, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    return torch.cat([f.cos(), f.sin()], dim=1)


# ---------------------------------------------------------------- compressor


def compress_kv_ref(kv, score, norm_weight, cos_sin_cache, ratio: int, eps: float = 1e-6) -> torch.Tensor:
    """One request's whole history ``kv, score [L, coff*d]`` -> fp32 entries ``[L // ratio, d]`` (SPEC §7.3)."""
    d = norm_weight.shape[0]
    coff = kv.shape[1] // d
    L = kv.shape[0]
    n = L // ratio
    kv, score = kv.float()[: n * ratio], score.float()[: n * ratio]
    if n == 0:
        return kv.new_zeros(0, d)
    kw = kv.view(n, ratio, coff * d)
    sw = score.view(n, ratio, coff * d)
    if coff == 2:  # previous window's first d dims, then the window's own second d dims
        prev_k = torch.cat([kv.new_zeros(1, ratio, d), kw[:-1, :, :d]])
        prev_s = torch.cat([kv.new_full((1, ratio, d), float("-inf")), sw[:-1, :, :d]])
        kw = torch.cat([prev_k, kw[:, :, d:]], dim=1)
        sw = torch.cat([prev_s, sw[:, :, d:]], dim=1)
    c = (kw * torch.softmax(sw, dim=1)).sum(1)
    c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    return rope_rows_ref(c, torch.arange(n, device=kv.device) * ratio, cos_sin_cache)


# ---------------------------------------------------------------- index sets


def _token_positions(query_start_loc, seq_lens):
    """[(request, position)] of every token of the batch."""
    out = []
    for b in range(seq_lens.shape[0]):
        q0, q1 = int(query_start_loc[b]), int(query_start_loc[b + 1])
        start = int(seq_lens[b]) - (q1 - q0)
        out += [(b, start + i) for i in range(q1 - q0)]
    return out


def swa_indices_ref(query_start_loc, seq_lens, block_table, block_size, window, num_tokens, is_valid=None):
    """``(indices [num_tokens, window], lens [num_tokens])`` int32 (SPEC §7.5 SWA)."""
    idx = torch.full((num_tokens, window), -1, dtype=torch.int64)
    lens = torch.zeros(num_tokens, dtype=torch.int64)
    bt = block_table.cpu().long()
    for t, (b, pos) in enumerate(_token_positions(query_start_loc.cpu(), seq_lens.cpu())):
        if is_valid is not None and not bool(is_valid[t]):
            continue
        start = max(0, pos - window + 1)
        n = pos + 1 - start
        idx[t, :n] = _slots(bt[b], start, n, block_size)
        lens[t] = n
    return idx.int(), lens.int()


def csa_topk_global_ref(topk, query_start_loc, seq_lens, block_table, block_size, ratio, is_valid=None):
    """``(global [T, K], lens [T])``: the causal valid local entries of each row, in order, as slots."""
    T, K = topk.shape
    out = torch.full((T, K), -1, dtype=torch.int64)
    lens = torch.zeros(T, dtype=torch.int64)
    bt = block_table.cpu().long()
    tk = topk.cpu().long()
    for t, (b, pos) in enumerate(_token_positions(query_start_loc.cpu(), seq_lens.cpu())):
        if is_valid is not None and not bool(is_valid[t]):
            continue
        n_vis = (pos + 1) // ratio
        ids = [i for i in tk[t].tolist() if 0 <= i < n_vis and i // block_size < bt.shape[1]]
        out[t, : len(ids)] = torch.tensor([int(bt[b, i // block_size]) * block_size + i % block_size for i in ids],
                                          dtype=torch.int64)  # fmt: skip
        lens[t] = len(ids)
    return out.int(), lens.int()


def hca_indices_ref(query_start_loc, seq_lens, block_table, block_size, ratio, width, num_tokens, is_valid=None):
    """``(indices [num_tokens, width], lens)``: all visible entries ``i < (pos+1)//ratio``; local ids when
    ``block_table`` is None, else slots."""
    idx = torch.full((num_tokens, width), -1, dtype=torch.int64)
    lens = torch.zeros(num_tokens, dtype=torch.int64)
    for t, (b, pos) in enumerate(_token_positions(query_start_loc.cpu(), seq_lens.cpu())):
        if is_valid is not None and not bool(is_valid[t]):
            continue
        n = (pos + 1) // ratio
        ids = torch.arange(n)
        idx[t, :n] = ids if block_table is None else _slots(block_table[b].cpu(), 0, n, block_size)
        lens[t] = n
    return idx.int(), lens.int()


def combine_topk_swa_indices_ref(topk, query_start_loc, seq_lens, gather_lens, window, ratio, topk_width, M, N,
                                 width):  # fmt: skip
    """``(indices [Tq, width], lens [Tq])`` into the prefill workspace ``[reqs * M, 512]`` (SPEC §7.6)."""
    qsl = query_start_loc.cpu().long() - int(query_start_loc[0])
    T = topk.shape[0]
    idx = torch.full((T, width), -1, dtype=torch.int64)
    lens = torch.zeros(T, dtype=torch.int64)
    tk = topk.cpu().long()
    for t, (b, pos) in enumerate(_token_positions(qsl, seq_lens.cpu())):
        seq, g = int(seq_lens[b]), int(gather_lens[b])
        n_top = min((pos + 1) // ratio, topk_width)
        for j in range(n_top):
            i = int(tk[t, j])
            idx[t, j] = b * M + i if 0 <= i < N else -1
        g0 = seq - g
        s0, s1 = max(pos - window + 1, 0, g0), min(pos + 1, seq)
        n_swa = max(s1 - s0, 0)
        idx[t, n_top : n_top + n_swa] = b * M + N + torch.arange(s0, s1) - g0
        lens[t] = n_top + n_swa
    return idx.int(), lens.int()
