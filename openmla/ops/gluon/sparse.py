"""Hopper (sm90) tier of sparse MLA (V3.2 DSA and V4) for 64-head blocks: a warp-specialised Gluon kernel.

Same contract as :func:`openmla.ops.sparse.sparse_mla`'s Triton kernel (``_sparse_mla_fwd_kernel``) for dense
indices, bf16 q and d_v 512: V3.2 rows (q ``[T, H, 576]``: 512 latent + 64 rope, V = the latent; bf16 ``"auto"`` or
``"fp8_ds_mla"`` cache) and V4 rows (q ``[T, H, 512]``, K = V = the whole row; bf16 ``"auto"`` or ``"fp8_v4"``), one
source or two (``extra_kv_cache``: its own block size and strides, dense ``[T, K2]`` indices, optional lengths),
sinks, and V4's fused inverse RoPE of the output. One program owns (query row, a block of 64 heads, one split of
the row's concatenated key list: main entries ``[0, n1)``, then extra entries ``[n1, n1 + n2)``, as the Triton
kernel; a tile that straddles the two takes each row from its own cache), the grid is ``(T x head blocks, splits)``
with the head blocks of a row adjacent (H = 128: the second reads the row's keys from L2). One split writes ``out``
(sink and inverse RoPE applied) and the sink-free natural-log ``lse``; several write the normalised fp32 partials
and LSEs that ``_sparse_mla_merge_fwd_kernel`` merges (it applies the sink and the rotation; ``o_part [S, T, H,
512]``, ``lse_part [S, T, H]``, -inf for no key).

Why (docs/sparse_mla.md "H200 figures"): Triton gives the scores dot warps ``[8, 1]`` at 64 rows, so both
warpgroups compute the whole score tile, and it overlaps nothing. Here:

* a 4-warp producer partition gathers each 64-key tile into a ring of ``STAGES`` bf16 tiles ``[64, 512]`` (+ ``[64,
  64]`` rope for V3.2; 128-byte swizzle, wgmma operands), waiting on per-stage "empty" mbarriers and signalling
  "ready" ones. bf16 rows: ``cp.async`` of 16 bytes (masked rows are zero-filled, never read), completion tracked by
  ``cp.async.mbarrier.arrive.noinc`` (ready count = producer threads). fp8 rows (``fp8_ds_mla`` 656 bytes,
  ``fp8_v4`` 576 data bytes + 8 exponent bytes after the block's rows): 16-byte loads of the e4m3 bytes into
  registers, ``e4m3 x fp32 scale`` rounded to bf16 (NaN -> 0, as the Triton kernel), stored into the stage, fence,
  partition barrier, one arrive: the dequant runs beside the consumers' MMAs instead of before them.
* two consumer warpgroups (8 warps): ``S = Q K^T`` as 9 (V3.2) or 8 (V4) chained async wgmmas with
  ``NVMMADistributedLayout([3, 0], warps_per_cta=[4, 2])``, so each warpgroup scores half of the tile's keys
  (m64n32k16, no duplicated QK^T); online softmax in base 2 in registers (the row max across the warpgroups through
  the compiler's shared-memory reduction, row sums kept per key column until the epilogue); P (bf16) through shared
  memory; ``O += P V`` with each warpgroup owning 256 of the 512 output columns (128 fp32 registers a thread).
  The consumers recompute each key's validity from the index row(s) (a slot < 0 or >= its source's slots, or past
  the split, scores -inf; its zero-filled row adds nothing to P V).

bf16 rows (the default variant "asym", the consumers above for fp8 rows): warpgroup 0 (the default partition)
scores the whole 64-key tile (m64n64k16), runs the softmax and ``O[:, :256] += P V``, tile j - 1's P V issued before
tile j's scores; warpgroup 1 (a worker partition) takes P and the rows' rescale factors from shared memory and runs
``O[:, 256:] += P V`` beside warpgroup 0's next scores and softmax, then its half of the epilogue with the final
factors warpgroup 0 leaves in shared memory (mbarriers: P ready, P free, final factors written / read; each stage is
released by both). The tensor cores then work while warpgroup 0 computes the softmax: 1.08-1.27x at prefill.
"asym" programs walk work items (row, head block, split) in the old grid's launch order, ``k = program, program +
programs, ...`` (every partition computes the same sequence). For bf16 rows with ``WALK_MIN_ITEMS`` items an SM or
more (prefill; ``WALK``) one program an SM walks them: the producer copies each item's Q (cp.async, its own ready /
empty barriers: it lands once the scorer's last scores of the item before are done), and the ring, the P barriers
and the final factors run on across items, so the next item's first tiles and Q land during the current item's
last P V and epilogue (a V4 prefill row has 8-16 tiles). Otherwise one program an item (the scorer loads Q).

One kernel body: ``D_QK`` (576 / 512: the rope chunk and its ring exist or not), ``FMT`` (the producer),
``HAS_EXTRA`` and ``HAS_ROPE`` are constexprs; V3.2's one-source specialisations compile to the code they had before
V4's were added (sm90 offline SASS, the loops' instruction counts unchanged).

Shared memory: V3.2 Q 73,728 + 2 stages x 73,728 + P 8,192; V4 Q 65,536 + 2 x 65,536 + P 8,192 (+ barriers /
reduction scratch) < 232,448 B.

Private variant "staged" (fp8_ds_mla, ``_gluon_opts``): the producer (56 registers) only issues ``cp.async`` of the
raw rows (16-byte e4m3 and rope pieces, 4-byte scales; invalid rows zero-filled) into 2 fp8 stages, completion by
noinc arrives, so up to two tiles' rows (2 x 64 x 656 B) are in flight; the consumers (224 registers) dequantise a
landed stage into ONE bf16 latent tile (the producer path's ``_dequant``: the same bf16 values) and clear the rope
slot's NaN, fence, release the stage ("empty"), then run the same MMAs; P goes to the tile's rope slot once both
warpgroups' scores are done, and the slot returns to the producer after P V ("free"). Shared memory: Q 73,728 + the
bf16 tile 65,536 + 2 rope slots 16,384 + 2 fp8 stages x 33,792 (e4m3 32,768 + scales 1,024) = 223,232 (+ barriers /
scratch); a separate P (8,192) would not fit with the 1,024 B static reserve.
"""

from __future__ import annotations

import torch
import triton

from openmla.ops.gluon._lang import (
    GLUON_AVAILABLE,
    async_copy,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from openmla.ops.gluon.decode import SMEM_LIMIT
from openmla.ops.gluon.stores import row_store_layout

__all__ = [
    "BLOCK_H",
    "GLUON_AVAILABLE",
    "GLUON_OPTS",
    "gluon_opts_bits",
    "gluon_sparse_unsupported",
    "sparse_mla_fwd_gluon",
]

D_QK, D_V, D_R = 576, 512, 64  # V3.2 rows; V4 rows are D_V wide (K = V)
D_QKS = (D_QK, D_V)  # the q widths the kernel takes
BLOCK_H = 64  # heads per program: one wgmma M of 64 per warpgroup
BLOCK_N = 64  # keys per tile: each consumer warpgroup scores 32 of them
NARROW_MAX_H = 32  # head counts the narrow kernel (openmla/ops/gluon/sparse_narrow.py) takes by default
STAGES = 2  # bf16 tiles in the ring (73,728 B each for V3.2, 65,536 for V4)
NUM_WARPS = 8  # the two consumer warpgroups (the default partition)
# registers of a producer thread (setmaxnreg) by (cache format, D_QK); the consumers get the rest of the register
# file. V4's consumers need 216-232 (sm90 offline: at 208-224 they spilled 8-24 bytes), so its bf16 producer runs on
# 40 (consumers 232) and its fp8_v4 one on 72 (consumers 216; 56 spilled in the producer)
PRODUCER_REGS = {(0, 576): 56, (1, 576): 88, (0, 512): 40, (2, 512): 72}
# "asym" on bf16 rows: programs walk the items when there are at least this many an SM (prefill: 15-62 at 1k-4k
# rows); at decode's 1-2 an SM one program an item was faster (H200 stop 50: h64 b128 bf16 100.4 vs 106.1 us)
WALK_MIN_ITEMS = 4
FP8_PASSES = 2  # row blocks of a tile the fp8 producers load and dequantise in turn (registers)
_FORMATS = {"auto": 0, "fp8_ds_mla": 1, "fp8_v4": 2}
# variants (``sparse_mla(_gluon_opts=...)``, private; bits of the kernel's OPTS constexpr; 0 = the plain code; the
# defaults are DEFAULT_OPTS below); "lazy" takes any call (V4 too: no spill beyond the plain code's, sm90 offline),
# the others V3.2 one-source calls only:
# "nanpack" (fp8_ds_mla): the producer's NaN -> 0 on the packed bf16 pairs (set.num.u32.bf16x2 + and: one
#   instruction a value, not FSETP + FSEL on each fp32); the same bf16 values (the fp32 product rounded to bf16);
#   fp8_v4 rows always take that form (``_dequant_pow2``), so it is refused there
# "lazy": the consumers' lazy row max of decode_seesaw (moves only past LAZY_T), the O rescale skipped per warp by a
#   vote when none of its rows' factors changed
# "staged" (fp8_ds_mla, fp8_v4): the producer only cp.asyncs the raw rows (e4m3 bytes, scales or exponent bytes,
#   bf16 rope) into a ring of fp8 staging stages (many rows in flight); the consumers dequantise each stage into ONE
#   bf16 tile (the same bf16 values), release it, then run the MMAs; V3.2's P lives in the tile's rope slot (see
#   _smem_bytes); fp8_v4 needs 16-byte aligned blocks (openmla's padded blocks, or an even block size unpadded)
# "wide" (H <= NARROW_MAX_H): the 64-head kernel instead of the narrow one (openmla/ops/gluon/sparse_narrow.py), which
#   takes "nanpack" only
# "ring" (the narrow kernel's fp8_v4 rows, or fp8_ds_mla rows of one source, at H <= RING_MAX_H; the default in one
#   split with aligned blocks and rows, fp8_default_bits): each producer cp.asyncs its next tile's (V3.2: half
#   tile's) raw rows into its own raw stage while it dequantises the one before from registers
#   (openmla/ops/gluon/sparse_narrow.py, _gather_v4_ring / _gather_ds_ring); the narrow kernel's only (the 64-head
#   kernel's with one raw half-stage: 0.89x / 0.85x the plain code at fp8_v4 h64 / h128 b128, H200 stop 56: dropped)
# "asym" (not with "staged"; the default for bf16 rows): asymmetric consumers: warpgroup 0 scores the whole tile
#   (m64n64k16), runs the softmax and its half of P V one tile behind the scores; warpgroup 1, a worker partition,
#   runs the other half of P V from P and the rows' factors in shared memory, beside warpgroup 0's next scores and
#   softmax (the two-warpgroup consumers run the scores, the softmax and P V in turn, both together)
GLUON_OPTS = {"nanpack": 1, "lazy": 2, "staged": 4, "wide": 8, "asym": 16, "ring": 32}
_ASYM = 16
_RING = 32
RING_MAX_H = 16  # "ring": two raw (half-)stages (73 / 41 KB) fit beside the narrow kernel's ring at HB <= 16 only
ASYM_PV_REGS = 168  # "asym": warpgroup 1's registers (its half of O is 128 a thread)
_WIDE = GLUON_OPTS["wide"]
_FP8_ONLY_OPTS = 1 | 4
_STAGED = 4
# the staged producers only compute addresses, by format (fp8_ds_mla 56: consumers 224, as with bf16 rows; fp8_v4
# 48: consumers 232, which V4's widening needs (sm90 offline: 8-16 bytes spilled at 224))
STAGED_PRODUCER_REGS = {1: 56, 2: 48}
_V4_DATA_BYTES = 576  # fp8_v4: a token's 448 e4m3 + 64 bf16 in its block; its 8 exponent bytes after the block's rows


# the variants a call runs by default, by cache format: measured on the H200 (benchmarks/RESULTS.md): fp8_ds_mla (V3.2,
# one source) staged + nanpack + lazy 1.12-1.14x the plain code at h16-h128 b64-b128 (preset "gopts", stop 39); bf16
# rows (V3.2 and V4, one or two sources) asym + lazy 1.08-1.27x the lazy plain code at prefill, 0.98-1.08x at decode
# (preset "asym", stop 48); fp8_v4 rows the plain code; in one split with aligned blocks "ring" at H <= 16 (fp8_v4, and
# fp8_ds_mla of one source; fp8_default_bits: it needs the cache's strides, known only at the call)
DEFAULT_OPTS = {"fp8_ds_mla": ("staged", "nanpack", "lazy"), "auto": ("asym", "lazy")}


def is_narrow(H: int, opts: int = 0) -> bool:
    """Whether a call of H heads (OPTS bits ``opts``) runs the narrow kernel: H <= NARROW_MAX_H, not "wide"."""
    return H <= NARROW_MAX_H and not opts & _WIDE


def default_opts(kv_cache_dtype: str, d_qk: int, has_extra: bool, H: int = BLOCK_H) -> tuple[str, ...]:
    """The variants of DEFAULT_OPTS that a call takes when ``sparse_mla`` is given no ``_gluon_opts`` (the narrow
    kernel's: "nanpack" for fp8_ds_mla rows)."""
    if is_narrow(H):
        return ("nanpack",) if kv_cache_dtype == "fp8_ds_mla" else ()
    if kv_cache_dtype == "auto":  # any row width and sources
        return DEFAULT_OPTS["auto"]
    if d_qk != D_QK or has_extra:
        return ()
    return DEFAULT_OPTS.get(kv_cache_dtype, ())


def fp8_default_bits(kv_cache, extra_kv_cache, kv_cache_dtype: str, H: int, num_splits: int) -> int:
    """The OPTS bits a call on the defaults (no ``_gluon_opts``) adds for fp8 rows in one split with 16-byte aligned
    blocks (and rows): "ring" at H <= RING_MAX_H (the narrow kernel; fp8_ds_mla rows of one source or fp8_v4 rows);
    0 otherwise. Measured faster there: ring 1.01-1.14x at fp8_v4 h8 / h16 b128 q2 and 1.04-1.07x at fp8_ds_mla h8 /
    h16 b64-b128 (H200, stop 56; H100 1.06-1.16x and 1.08x, stops 54-55). Split calls (small batches: one-tile
    programs) keep the plain code: there the staging only adds latency (fp8_v4 h8 b1 q2 9.2 -> 9.8 us with "ring").
    fp8_v4 rows at 33-64 heads keep the plain code too: "staged" + "lazy" was 1.025x there on the H100 (h64 b128 q2)
    but 0.993x on the H200 and 0.86x at a paged prefill (h64 t4096: 1527.6 against 1311.0 us, stop 56)."""
    from openmla.ops.sparse import _cache_views

    if kv_cache_dtype not in ("fp8_v4", "fp8_ds_mla") or num_splits != 1 or H > RING_MAX_H:
        return 0
    if kv_cache_dtype == "fp8_ds_mla" and extra_kv_cache is not None:
        return 0
    fmt = _FORMATS[kv_cache_dtype]
    for c in (kv_cache, extra_kv_cache):
        if c is not None and any(stride % 16 for stride in _cache_views(c, fmt)[1:]):
            return 0
    return _RING


def gluon_opts_bits(opts, kv_cache_dtype: str, d_qk: int, has_extra: bool, H: int = BLOCK_H) -> int:
    """The kernel's OPTS bits for ``sparse_mla(_gluon_opts=...)`` (names of GLUON_OPTS; () = 0, the plain code).
    ValueError for an unknown name, or a call the variants do not cover ("staged": fp8_ds_mla calls of one source
    and fp8_v4 calls; "nanpack": fp8_ds_mla calls of one source; "lazy": any call; "wide": H <= NARROW_MAX_H;
    the narrow kernel: "nanpack" on fp8_ds_mla rows only)."""
    if isinstance(opts, str) or not isinstance(opts, (tuple, list, frozenset, set)):
        raise ValueError(f"_gluon_opts must be a tuple of names from {tuple(GLUON_OPTS)}; got {opts!r}")
    bits = 0
    for name in opts:
        if name not in GLUON_OPTS:
            raise ValueError(f"_gluon_opts: unknown variant {name!r} (one of {tuple(GLUON_OPTS)})")
        bits |= GLUON_OPTS[name]
    if bits & _WIDE and H > NARROW_MAX_H:
        raise ValueError(f"_gluon_opts 'wide' chooses the 64-head kernel at H <= {NARROW_MAX_H}; H is {H}")
    ring_ok = kv_cache_dtype == "fp8_v4" or (kv_cache_dtype == "fp8_ds_mla" and not has_extra)
    if bits & _RING and not (is_narrow(H, bits) and ring_ok and H <= RING_MAX_H):
        raise ValueError(f"_gluon_opts 'ring' is the narrow kernel's producer of fp8_v4 rows or of fp8_ds_mla rows of "
                         f"one source at H <= {RING_MAX_H}")  # fmt: skip
    if is_narrow(H, bits) and bits & _RING:
        if bits & ~(_RING | GLUON_OPTS["nanpack"]) or (bits & 1 and kv_cache_dtype != "fp8_ds_mla"):
            raise ValueError(f"_gluon_opts 'ring' takes 'nanpack' on fp8_ds_mla rows only; got {tuple(opts)}")
        return bits
    if is_narrow(H, bits):
        if bits & ~GLUON_OPTS["nanpack"] or (bits and kv_cache_dtype != "fp8_ds_mla"):
            raise ValueError(f"the narrow kernel (H <= {NARROW_MAX_H}) takes 'nanpack' on fp8_ds_mla rows only "
                             f"(or 'wide' for the 64-head kernel); got {tuple(opts)}")  # fmt: skip
        return bits
    if bits & _FP8_ONLY_OPTS and kv_cache_dtype not in ("fp8_ds_mla", "fp8_v4"):
        raise ValueError(f"_gluon_opts 'nanpack' / 'staged' change the fp8 paths; the cache is {kv_cache_dtype!r}")
    if bits & _FP8_ONLY_OPTS and kv_cache_dtype == "fp8_ds_mla" and (d_qk != D_QK or has_extra):
        raise ValueError("_gluon_opts 'nanpack' / 'staged' cover fp8_ds_mla calls of one source only")
    if bits & 1 and kv_cache_dtype == "fp8_v4":
        raise ValueError("_gluon_opts 'nanpack' changes fp8_ds_mla rows only (fp8_v4 rows clear NaN on pairs always)")
    if bits & _ASYM and bits & _STAGED:
        raise ValueError("_gluon_opts 'asym' runs on the plain path's bf16 ring; 'staged' has one bf16 tile")
    return bits


def producer_regs(fmt: int, d_qk: int, opts: int = 0) -> int:
    """The producer's setmaxnreg count for (cache format, row width, OPTS bits)."""
    if opts & _STAGED:
        return STAGED_PRODUCER_REGS[fmt]
    return PRODUCER_REGS[(fmt, d_qk)]


def _smem_bytes(d_qk: int = D_QK, opts: int = 0) -> int:
    """Shared memory of one program: Q + the bf16 ring + P + barriers / reduction scratch (an upper bound).
    "staged": Q + one bf16 latent tile + STAGES bf16 rope slots (P aliases the tile's slot once its scores are done)
    + STAGES fp8 stages (64 x 512 e4m3 + 64 x 4 fp32 scales); V4 likewise with P apart and 8 exponent bytes a row."""
    if opts & _STAGED and d_qk == D_V:  # V4: Q + one bf16 tile + P + fp8 stages + raw rope slots + exponent words
        return (BLOCK_H * D_V * 2 + BLOCK_N * D_V * 2 + BLOCK_H * BLOCK_N * 2
                + STAGES * BLOCK_N * (D_V + D_R * 2 + 8) + 2048)  # fmt: skip
    if opts & _STAGED:
        return (BLOCK_H * D_QK * 2 + BLOCK_N * D_V * 2 + STAGES * BLOCK_N * D_R * 2
                + STAGES * BLOCK_N * (D_V + 16) + 2048)  # fmt: skip
    asym = 2 * BLOCK_H * 4 if opts & _ASYM else 0  # the rows' factors, per tile and final
    return BLOCK_H * d_qk * 2 + STAGES * BLOCK_N * d_qk * 2 + BLOCK_H * BLOCK_N * 2 + asym + 2048


if GLUON_AVAILABLE:
    from openmla.ops.gluon.decode_seesaw import LAZY_T, RESCALE_ASM, RESCALE_CONSTRAINTS
    from openmla.ops.gluon.transposed import _finish_rows

    # 16-byte output stores for V4 rows (WIDE_O): an "asym" warpgroup's [64, 256] half, the two consumer warpgroups'
    # [64, 512]; V3.2's 576-wide tiles leave too little shared memory for the conversion's ~4 KB scratch
    _O_HALF = gl.constexpr(row_store_layout(256))
    _O_FULL = gl.constexpr(row_store_layout(512, warps_n=2))

    _ASYM_PV_REGS = gl.constexpr(ASYM_PV_REGS)

    @gluon.jit
    def _tile_slots(p_idx, n0, hi, num_slots, BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """Entries ``[n0, n0 + BLOCK_N)`` of an index row (``layout``: a 1-D slice layout): the int32 slots (0
        where invalid) and which are valid (inside the split, ``0 <= slot < num_slots``)."""
        o_n = n0 + gl.arange(0, BLOCK_N, layout=layout)
        m_n = o_n < hi
        slot = gl.load(p_idx + o_n, mask=m_n, other=-1)
        ok = m_n & (slot >= 0) & (slot < num_slots)
        return gl.where(ok, slot, 0), ok

    @gluon.jit
    def _tile_slots2(p_idx, p_eidx, n0, hi, n1, num_slots, e_num_slots, BLOCK_N: gl.constexpr,
                     layout: gl.constexpr):  # fmt: skip
        """Two sources: entries ``[n0, n0 + BLOCK_N)`` of the concatenated list (main ``[0, n1)``, then extra):
        (main slots, valid main, extra slots, valid extra), slots 0 where invalid; each entry is in one source."""
        o_n = n0 + gl.arange(0, BLOCK_N, layout=layout)
        m_n = o_n < hi
        m_a = m_n & (o_n < n1)
        slot = gl.load(p_idx + o_n, mask=m_a, other=-1)
        ok = m_a & (slot >= 0) & (slot < num_slots)
        m_b = m_n & (o_n >= n1)
        e_slot = gl.load(p_eidx + (o_n - n1), mask=m_b, other=-1)
        e_ok = m_b & (e_slot >= 0) & (e_slot < e_num_slots)
        return gl.where(ok, slot, 0), ok, gl.where(e_ok, e_slot, 0), e_ok

    @gluon.jit
    def _row_split(idx, lens, eidx, elens, i_t, i_s, stride_i_t, stride_ei_t, K, EK, HAS_LEN: gl.constexpr,
                   HAS_EXTRA: gl.constexpr, E_HAS_LEN: gl.constexpr, NUM_SPLITS: gl.constexpr,
                   BLOCK_N: gl.constexpr):  # fmt: skip
        """Row i_t's index lists and split i_s of them (the Triton kernel's split rule: the extra entries follow the
        main ones in one list, splits of whole BLOCK_N tiles): (main and extra index rows, main entries n1, the
        split's entries ``[lo, hi)``, its tiles)."""
        p_idx = idx + i_t * stride_i_t
        n1 = K
        if HAS_LEN:
            n1 = gl.minimum(gl.maximum(gl.load(lens + i_t), 0), K)
        n = n1
        p_eidx = p_idx
        if HAS_EXTRA:
            p_eidx = eidx + i_t * stride_ei_t
            n2 = EK
            if E_HAS_LEN:
                n2 = gl.minimum(gl.maximum(gl.load(elens + i_t), 0), EK)
            n = n1 + n2
        chunk = gl.cdiv(gl.cdiv(n, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = i_s * chunk
        hi = gl.minimum(lo + chunk, n)
        n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
        return p_idx, p_eidx, n1, lo, hi, n_tiles

    @gluon.jit
    def _row_offsets(slot, stride_kv_b, stride_kv_p, PAGE: gl.constexpr):
        """int64 element offsets of cache rows from (checked, >= 0) slots: block and offset as uint32 (a shift and a
        mask for a power-of-two PAGE), then widened."""
        s = slot.to(gl.uint32, bitcast=True)
        return (s // PAGE).to(gl.int64) * stride_kv_b + (s % PAGE).to(gl.int64) * stride_kv_p

    @gluon.jit
    def _v4_offsets(slot, stride_kv_b, PAGE: gl.constexpr):
        """fp8_v4 byte offsets of (checked) slots: the token's data row (576 bytes at p * 576 in its block) and its
        exponent bytes (at PAGE * 576 + p * 8)."""
        s = slot.to(gl.uint32, bitcast=True)
        blk = (s // PAGE).to(gl.int64) * stride_kv_b
        i_p = (s % PAGE).to(gl.int64)
        return blk + i_p * 576, blk + PAGE * 576 + i_p * 8

    @gluon.jit
    def _gather_bf16(kv, ekv, p_idx, p_eidx, lat, rope, ready, empty, lo, hi, n1, n_tiles, stride_kv_b, stride_kv_p,
                     stride_ekv_b, stride_ekv_p, num_slots, e_num_slots, PAGE: gl.constexpr, E_PAGE: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_TAIL: gl.constexpr, HAS_EXTRA: gl.constexpr,
                     J0: gl.constexpr = 0, J_STEP: gl.constexpr = 1, t0=0):  # fmt: skip
        """Producer, bf16 rows: cp.async every valid row of a tile into its stage (16 bytes a thread; invalid rows
        zero-filled, never read); each thread's copies complete the stage's ready barrier (noinc arrive). HAS_TAIL:
        the rope columns 512..575 into their own ring; HAS_EXTRA: each row from its own source. Tiles ``J0, J0 +
        J_STEP, ...`` (the narrow kernel's producers take every other one); ``t0``: the ring position of tile 0 (the
        tiles of the items a persistent program ran before)."""
        NW: gl.constexpr = gl.num_warps()
        LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])  # [16, 64] a pass
        ROW: gl.constexpr = gl.SliceLayout(1, LAYOUT)
        o_c = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, LAYOUT)), 0)
        for j in range(J0, n_tiles, J_STEP):
            stage = (t0 + j) % STAGES
            if HAS_EXTRA:
                slot, ok, e_slot, e_ok = _tile_slots2(p_idx, p_eidx, lo + j * BLOCK_N, hi, n1, num_slots, e_num_slots,
                                                      BLOCK_N, ROW)  # fmt: skip
                p_row = gl.where(ok, kv + _row_offsets(slot, stride_kv_b, stride_kv_p, PAGE),
                                 ekv + _row_offsets(e_slot, stride_ekv_b, stride_ekv_p, E_PAGE))  # fmt: skip
                p_row = gl.expand_dims(p_row, 1)
                ok = ok | e_ok
            else:
                slot, ok = _tile_slots(p_idx, lo + j * BLOCK_N, hi, num_slots, BLOCK_N, ROW)
                p_row = gl.expand_dims(kv + _row_offsets(slot, stride_kv_b, stride_kv_p, PAGE), 1)
            m2 = gl.expand_dims(ok, 1)
            mbarrier.wait(empty.index(stage), (((t0 + j) // STAGES) & 1) ^ 1)  # fresh barriers pass parity 1 at once
            dst = lat.index(stage)
            for c in gl.static_range(8):
                async_copy.async_copy_global_to_shared(dst.slice(c * 64, 64, dim=1), p_row + (c * 64 + o_c), mask=m2)
            if HAS_TAIL:
                async_copy.async_copy_global_to_shared(rope.index(stage), p_row + (512 + o_c), mask=m2)
            async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)

    @gluon.jit
    def _dequant_group(b_q, b_s):
        """e4m3 bytes [N, G] x the row's fp32 group scale [N] -> bf16 (fp32 product rounded to bf16, as the Triton
        kernel), NaN (byte or scale) -> 0; invalid rows were loaded as byte 0 and a finite scale. (Clearing NaN in
        fp16 before widening costs more here: byte permutes, sm90 offline SASS 1664 -> 1871 a tile.)"""
        b_v = b_q.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(b_s, 1)
        return gl.where(b_v != b_v, 0.0, b_v).to(gl.bfloat16)

    @gluon.jit
    def _bf16_nan_to_zero(b_v):
        """bf16 NaN -> +0 on packed pairs: a 0xFFFF mask per non-NaN half (``set.num``), then ``and``."""
        return gl.inline_asm_elementwise("{ .reg .b32 m; set.num.u32.bf16x2 m, $1, $1; and.b32 $0, $1, m; }",
                                         "=r,r", [b_v], dtype=gl.bfloat16, is_pure=True, pack=2)  # fmt: skip

    @gluon.jit
    def _dequant_group_nanpack(b_q, b_s):
        """``_dequant_group`` with NaN -> 0 after the bf16 pack (on pairs): the same bf16 values (an fp32 NaN
        rounds to a bf16 NaN, which becomes +0; everything else is the fp32 product rounded to bf16)."""
        b_v = b_q.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(b_s, 1)
        return _bf16_nan_to_zero(b_v.to(gl.bfloat16))

    @gluon.jit
    def _dequant(b_q, b_s, NANPACK: gl.constexpr):
        if NANPACK:
            return _dequant_group_nanpack(b_q, b_s)
        else:
            return _dequant_group(b_q, b_s)

    @gluon.jit
    def _gather_fp8(kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16, p_idx, p_eidx, lat, rope, ready, empty, lo, hi, n1,
                    n_tiles, stride_kv_b, stride_kv_p, stride_ekv_b, stride_ekv_p, num_slots, e_num_slots,
                    PAGE: gl.constexpr, E_PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    PASSES: gl.constexpr, HAS_EXTRA: gl.constexpr, NANPACK: gl.constexpr = False,
                    J0: gl.constexpr = 0, J_STEP: gl.constexpr = 1, AHEAD: gl.constexpr = False):  # fmt: skip
        """Producer, fp8_ds_mla rows (656 bytes: 512 e4m3, 4 fp32 scales, 64 bf16): a tile in PASSES row blocks,
        each loaded (16 bytes a thread) then dequantised into the bf16 stage; then fence, partition barrier and one
        arrive on the stage's ready barrier. HAS_EXTRA: each row's three views from its own source. Tiles ``J0, J0
        + J_STEP, ...``; AHEAD (one pass, one source): each tile's slots are loaded while the previous tile is in
        flight, so its row loads wait for one memory latency, not two."""
        NW: gl.constexpr = gl.num_warps()
        R: gl.constexpr = BLOCK_N // PASSES
        B8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])  # e4m3 bytes, [16, 128] a pass
        R16: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])  # rope bf16, [16, 64] a pass
        ROW8: gl.constexpr = gl.SliceLayout(1, B8)
        ROW16: gl.constexpr = gl.SliceLayout(1, R16)
        o_b = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, B8)), 0)
        o_r = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, R16)), 0)
        SLOTS_AHEAD: gl.constexpr = AHEAD and PASSES == 1 and not HAS_EXTRA
        if SLOTS_AHEAD:
            slot_n, ok_n = _tile_slots(p_idx, lo + J0 * BLOCK_N, hi, num_slots, R, ROW8)
            slot_rn, ok_rn = _tile_slots(p_idx, lo + J0 * BLOCK_N, hi, num_slots, R, ROW16)
        for j in range(J0, n_tiles, J_STEP):
            stage = j % STAGES
            dst = lat.index(stage)
            for h in gl.static_range(PASSES):
                n0 = lo + j * BLOCK_N + h * R
                if SLOTS_AHEAD:
                    slot, ok = slot_n, ok_n
                    row = _row_offsets(slot, stride_kv_b, stride_kv_p, PAGE)  # bytes
                    p_row = kv + row
                    p_s = kv_f32 + row // 4 + 128  # the 4 fp32 scales at byte 512
                elif HAS_EXTRA:
                    slot, ok, e_slot, e_ok = _tile_slots2(p_idx, p_eidx, n0, hi, n1, num_slots, e_num_slots, R, ROW8)
                    row = _row_offsets(slot, stride_kv_b, stride_kv_p, PAGE)  # bytes
                    e_row = _row_offsets(e_slot, stride_ekv_b, stride_ekv_p, E_PAGE)
                    p_row = gl.where(ok, kv + row, ekv + e_row)
                    p_s = gl.where(ok, kv_f32 + row // 4, ekv_f32 + e_row // 4) + 128  # the 4 fp32 scales at byte 512
                    ok = ok | e_ok
                else:
                    slot, ok = _tile_slots(p_idx, n0, hi, num_slots, R, ROW8)
                    row = _row_offsets(slot, stride_kv_b, stride_kv_p, PAGE)  # bytes
                    p_row = kv + row
                    p_s = kv_f32 + row // 4 + 128  # the 4 fp32 scales at byte 512
                m2 = gl.expand_dims(ok, 1)
                p_b = gl.expand_dims(p_row, 1) + o_b
                # every load of the pass first (one latency), then the conversions
                q0 = gl.load(p_b, mask=m2, other=0)
                q1 = gl.load(p_b + 128, mask=m2, other=0)
                q2 = gl.load(p_b + 256, mask=m2, other=0)
                q3 = gl.load(p_b + 384, mask=m2, other=0)
                s0 = gl.load(p_s, mask=ok, other=0.0)
                s1 = gl.load(p_s + 1, mask=ok, other=0.0)
                s2 = gl.load(p_s + 2, mask=ok, other=0.0)
                s3 = gl.load(p_s + 3, mask=ok, other=0.0)
                if HAS_EXTRA:
                    slot_r, ok_r, e_slot_r, e_ok_r = _tile_slots2(p_idx, p_eidx, n0, hi, n1, num_slots, e_num_slots,
                                                                  R, ROW16)  # fmt: skip
                    r_a = _row_offsets(slot_r, stride_kv_b, stride_kv_p, PAGE)
                    r_b = _row_offsets(e_slot_r, stride_ekv_b, stride_ekv_p, E_PAGE)
                    p_r = gl.where(ok_r, kv_b16 + r_a // 2, ekv_b16 + r_b // 2)
                    p_r = gl.expand_dims(p_r + 264, 1) + o_r  # 64 bf16 at byte 528
                    ok_r = ok_r | e_ok_r
                else:
                    if SLOTS_AHEAD:
                        slot_r, ok_r = slot_rn, ok_rn
                    else:
                        slot_r, ok_r = _tile_slots(p_idx, n0, hi, num_slots, R, ROW16)
                    row_r = _row_offsets(slot_r, stride_kv_b, stride_kv_p, PAGE)
                    p_r = gl.expand_dims(kv_b16 + row_r // 2 + 264, 1) + o_r  # 64 bf16 at byte 528
                b_r = gl.load(p_r, mask=gl.expand_dims(ok_r, 1), other=0.0)
                if SLOTS_AHEAD:  # the producer's next tile (past the split: all invalid, nothing read)
                    slot_n, ok_n = _tile_slots(p_idx, n0 + J_STEP * BLOCK_N, hi, num_slots, R, ROW8)
                    slot_rn, ok_rn = _tile_slots(p_idx, n0 + J_STEP * BLOCK_N, hi, num_slots, R, ROW16)
                if h == 0:
                    mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
                part = dst.slice(h * R, R, dim=0)
                part.slice(0, 128, dim=1).store(_dequant(q0, s0, NANPACK))
                part.slice(128, 128, dim=1).store(_dequant(q1, s1, NANPACK))
                part.slice(256, 128, dim=1).store(_dequant(q2, s2, NANPACK))
                part.slice(384, 128, dim=1).store(_dequant(q3, s3, NANPACK))
                rope.index(stage).slice(h * R, R, dim=0).store(gl.where(b_r != b_r, 0.0, b_r))
            fence_async_shared()  # generic-proxy stores before the consumers' wgmma reads
            gl.thread_barrier()  # the producer warps' stores are all done
            mbarrier.arrive(ready.index(stage), count=1)

    @gluon.jit
    def _gather_staged(kv, kv_f32, kv_b16, p_idx, lat8, sc8, rope, ready, empty, free, lo, hi, n_tiles, stride_kv_b,
                       stride_kv_p, num_slots, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr):  # fmt: skip
        """Producer, fp8_ds_mla rows, "staged": cp.async only (nothing waits in registers): a tile's e4m3 bytes (16
        bytes a thread, [64, 512]) and fp32 scales (4 bytes, [4, 64]) into the fp8 stage once the consumers have
        dequantised it ("empty"), its bf16 rope into the rope slot once the slot's P V is done ("free"; raw, the
        consumers clear NaN); invalid rows zero-filled; each thread's copies complete "ready" (noinc arrive)."""
        NW: gl.constexpr = gl.num_warps()
        B8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])  # e4m3 bytes, [16, 128] a repeat
        R16: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])  # rope bf16, [16, 64]
        SC: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NW, 1], [1, 0])  # scales [group, row], [4, 32]
        ROW8: gl.constexpr = gl.SliceLayout(1, B8)
        ROW16: gl.constexpr = gl.SliceLayout(1, R16)
        ROWSC: gl.constexpr = gl.SliceLayout(0, SC)
        o_b = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, B8)), 0)
        o_r = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, R16)), 0)
        o_g = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, SC)), 1)
        # the scale rows [STAGES * 4, 64] (a 1-D layout: the consumers read rows) seen as [STAGES, 4, 64]
        sc8_3 = sc8._reinterpret(gl.float32, [STAGES, 4, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        for j in range(n_tiles):
            stage = j % STAGES
            phase = ((j // STAGES) & 1) ^ 1  # fresh barriers pass parity 1 at once
            n0 = lo + j * BLOCK_N
            slot, ok = _tile_slots(p_idx, n0, hi, num_slots, BLOCK_N, ROW8)
            p_b = gl.expand_dims(kv + _row_offsets(slot, stride_kv_b, stride_kv_p, PAGE), 1) + o_b
            m2 = gl.expand_dims(ok, 1)
            slot_s, ok_s = _tile_slots(p_idx, n0, hi, num_slots, BLOCK_N, ROWSC)
            row_s = _row_offsets(slot_s, stride_kv_b, stride_kv_p, PAGE)
            p_s = gl.expand_dims(kv_f32 + row_s // 4 + 128, 0) + o_g  # the 4 fp32 scales at byte 512
            m_s = gl.expand_dims(ok_s, 0) & (o_g < 4)
            slot_r, ok_r = _tile_slots(p_idx, n0, hi, num_slots, BLOCK_N, ROW16)
            row_r = _row_offsets(slot_r, stride_kv_b, stride_kv_p, PAGE)
            p_r = gl.expand_dims(kv_b16 + row_r // 2 + 264, 1) + o_r  # 64 bf16 at byte 528
            m_r = gl.expand_dims(ok_r, 1)
            mbarrier.wait(empty.index(stage), phase)
            dst = lat8.index(stage)
            for c in gl.static_range(4):
                async_copy.async_copy_global_to_shared(dst.slice(c * 128, 128, dim=1), p_b + c * 128, mask=m2)
            async_copy.async_copy_global_to_shared(sc8_3.index(stage), p_s, mask=m_s)
            mbarrier.wait(free.index(stage), phase)
            async_copy.async_copy_global_to_shared(rope.index(stage), p_r, mask=m_r)
            async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)

    @gluon.jit
    def _widen_staged(src8, sc, stage, lat, rope_s, NANPACK: gl.constexpr):
        """Consumers, "staged": the landed fp8 stage (e4m3 [64, 512]; scales: rows ``4 stage + g`` of ``sc``
        [STAGES * 4, 64]) -> the bf16 latent tile (``_dequant``: the producer path's values, NaN -> 0; zero-filled
        rows give 0), and the rope slot's NaN -> 0 in place. 16 bytes a thread a load, a warp [8, 64] (a row per
        thread: one scale; two rows' 16-byte pieces a quarter warp: 8 distinct bank groups through the fp8 stage's
        and the bf16 tile's swizzles)."""
        NW: gl.constexpr = gl.num_warps()
        L8: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [NW, 1], [1, 0])  # [64, 64] a repeat
        R16: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        for c in gl.static_range(8):  # [64, 64] pieces (16 values a thread live): a scale group is two of them
            if c % 2 == 0:
                b_s = sc.index(stage * 4 + c // 2).load(gl.SliceLayout(1, L8))
            b_q = src8.slice(c * 64, 64, dim=1).load(L8)
            lat.slice(c * 64, 64, dim=1).store(_dequant(b_q, b_s, NANPACK))
        b_r = rope_s.load(R16)
        rope_s.store(gl.where(b_r != b_r, 0.0, b_r))

    @gluon.jit
    def _e8m0_bf16(b_e):
        """UE8M0 exponent bytes (int32 [N], 0..255) -> bf16 scales 2^(byte - 127), exact (byte 0: the subnormal
        2^-127, byte 255: NaN)."""
        bits = gl.where(b_e == 0, 0x40, gl.where(b_e == 255, 0x7FC0, b_e << 7))
        return bits.to(gl.int16).to(gl.bfloat16, bitcast=True)

    @gluon.jit
    def _v4_scale(p_e, ok):
        """The exponent bytes at ``p_e`` -> bf16 scales (``_e8m0_bf16``); an invalid row reads byte 127 (scale 1,
        its bytes are 0)."""
        return _e8m0_bf16(gl.load(p_e, mask=ok, other=127).to(gl.int32))

    @gluon.jit
    def _dequant_pow2(b_q, b_s):
        """e4m3 bytes [N, G] x bf16 power-of-two scales [N] -> bf16, NaN -> 0: each e4m3 value exactly in bf16,
        then bf16x2 products (one rounding of the exact product, so the bf16 values of ``_dequant_group``'s fp32
        product) with NaN cleared on the pairs: 3.5 instructions a value against 5 (sm90 SASS)."""
        b_v = b_q.to(gl.float8e4nv, bitcast=True).to(gl.float32).to(gl.bfloat16)
        b_s2 = gl.broadcast(gl.expand_dims(b_s, 1), b_v)[0]
        return gl.inline_asm_elementwise(
            "{ .reg .b32 m; mul.rn.bf16x2 $0, $1, $2; set.num.u32.bf16x2 m, $0, $0; and.b32 $0, $0, m; }",
            "=r,r,r", [b_v, b_s2], dtype=gl.bfloat16, is_pure=True, pack=2)  # fmt: skip

    @gluon.jit
    def _v4_rows(p_idx, p_eidx, n0, hi, n1, num_slots, e_num_slots, stride_kv_b, stride_ekv_b, PAGE: gl.constexpr,
                 E_PAGE: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr,
                 HAS_EXTRA: gl.constexpr):  # fmt: skip
        """fp8_v4 rows of entries ``[n0, n0 + BLOCK_N)`` (``layout``: a 1-D slice layout): (byte offsets of the data
        rows, of the exponent bytes, whether each row is the main source's, whether it is valid); with HAS_EXTRA a
        row that is not the main source's reads the extra one (:func:`_pick`), invalid rows read masked."""
        if HAS_EXTRA:
            slot, ok, e_slot, e_ok = _tile_slots2(p_idx, p_eidx, n0, hi, n1, num_slots, e_num_slots, BLOCK_N, layout)
            row, ex = _v4_offsets(slot, stride_kv_b, PAGE)
            e_row, e_ex = _v4_offsets(e_slot, stride_ekv_b, E_PAGE)
            return gl.where(ok, row, e_row), gl.where(ok, ex, e_ex), ok, ok | e_ok
        else:
            slot, ok = _tile_slots(p_idx, n0, hi, num_slots, BLOCK_N, layout)
            row, ex = _v4_offsets(slot, stride_kv_b, PAGE)
            return row, ex, ok, ok

    @gluon.jit
    def _pick(main, a, b, HAS_EXTRA: gl.constexpr):
        """``a`` where a row is the main source's, else ``b`` (one source: ``a``)."""
        if HAS_EXTRA:
            return gl.where(main, a, b)
        else:
            return a

    @gluon.jit
    def _gather_staged_v4(kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16, p_idx, p_eidx, lat8, ex8, rope8, ready, empty,
                          lo, hi, n1, n_tiles, stride_kv_b, stride_ekv_b, num_slots, e_num_slots, PAGE: gl.constexpr,
                          E_PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                          HAS_EXTRA: gl.constexpr):  # fmt: skip
        """Producer, fp8_v4 rows, "staged": cp.async only, as ``_gather_staged``: a tile's e4m3 bytes (16 bytes a
        thread; one [64, 512] copy whose columns past 448 are zero-filled: one copy, so one partition barrier, not
        seven) into the fp8 stage, its exponent bytes as two 4-byte words a row (rows of ``ex8`` [STAGES * 2, 64]:
        word-major, so a consumer reads one word of every row) and its bf16 rope into the stage's rope slot (raw: the
        consumers clear NaN), once the consumers have dequantised the stage ("empty"); invalid rows zero-filled;
        each thread's copies complete "ready" (noinc arrive). Rows of either source."""
        NW: gl.constexpr = gl.num_warps()
        B8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])  # e4m3 bytes, [16, 128] a repeat
        R16: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])  # rope bf16, [16, 64]
        EXL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [2, NW // 2], [1, 0])  # exponent words [word, row]
        ROW8: gl.constexpr = gl.SliceLayout(1, B8)
        ROW16: gl.constexpr = gl.SliceLayout(1, R16)
        ROWEX: gl.constexpr = gl.SliceLayout(0, EXL)
        o_b = gl.expand_dims(gl.arange(0, 512, layout=gl.SliceLayout(0, B8)), 0)
        o_r = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, R16)), 0)
        o_w = gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(1, EXL)), 1)
        ex8_3 = ex8._reinterpret(gl.float32, [STAGES, 2, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        for j in range(n_tiles):
            stage = j % STAGES
            phase = ((j // STAGES) & 1) ^ 1  # fresh barriers pass parity 1 at once
            n0 = lo + j * BLOCK_N
            row, _, main, ok = _v4_rows(p_idx, p_eidx, n0, hi, n1, num_slots, e_num_slots, stride_kv_b, stride_ekv_b,
                                        PAGE, E_PAGE, BLOCK_N, ROW8, HAS_EXTRA)  # fmt: skip
            p_b = gl.expand_dims(_pick(main, kv + row, ekv + row, HAS_EXTRA), 1) + o_b
            m2 = gl.expand_dims(ok, 1) & (o_b < 448)
            _, ex, main_e, ok_e = _v4_rows(p_idx, p_eidx, n0, hi, n1, num_slots, e_num_slots, stride_kv_b,
                                           stride_ekv_b, PAGE, E_PAGE, BLOCK_N, ROWEX, HAS_EXTRA)  # fmt: skip
            p_e = gl.expand_dims(_pick(main_e, kv_f32 + ex // 4, ekv_f32 + ex // 4, HAS_EXTRA), 0) + o_w
            m_e = gl.expand_dims(ok_e, 0) & (o_w < 2)
            row_r, _, main_r, ok_r = _v4_rows(p_idx, p_eidx, n0, hi, n1, num_slots, e_num_slots, stride_kv_b,
                                              stride_ekv_b, PAGE, E_PAGE, BLOCK_N, ROW16, HAS_EXTRA)  # fmt: skip
            p_r = gl.expand_dims(_pick(main_r, kv_b16 + row_r // 2, ekv_b16 + row_r // 2, HAS_EXTRA) + 224, 1) + o_r
            m_r = gl.expand_dims(ok_r, 1)
            mbarrier.wait(empty.index(stage), phase)
            async_copy.async_copy_global_to_shared(lat8.index(stage), p_b, mask=m2)
            async_copy.async_copy_global_to_shared(ex8_3.index(stage), p_e, mask=m_e)
            async_copy.async_copy_global_to_shared(rope8.index(stage), p_r, mask=m_r)
            async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)

    @gluon.jit
    def _widen_staged_v4(src8, ex, stage, lat, rope_s):
        """Consumers, fp8_v4 "staged": the landed fp8 stage (e4m3 [64, 448] of [64, 512]; exponent words: rows
        ``2 stage + w`` of ``ex``) -> the bf16 tile's 448 latent columns (``_dequant_pow2``: the producer path's
        values, NaN -> 0; zero-filled rows give 0), then the rope slot's values (NaN -> 0) into columns 448..511."""
        NW: gl.constexpr = gl.num_warps()
        L8: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [NW, 1], [1, 0])  # [64, 64] a repeat
        R16: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        for c in gl.static_range(7):  # [64, 64] pieces, one exponent byte a row each
            if c % 4 == 0:
                w = ex.index(stage * 2 + c // 4).load(gl.SliceLayout(1, L8)).to(gl.int32, bitcast=True)
            b_s = _e8m0_bf16((w >> (8 * (c % 4))) & 255)
            b_q = src8.slice(c * 64, 64, dim=1).load(L8)
            lat.slice(c * 64, 64, dim=1).store(_dequant_pow2(b_q, b_s))
        b_r = rope_s.load(R16)
        lat.slice(448, 64, dim=1).store(gl.where(b_r != b_r, 0.0, b_r))

    @gluon.jit
    def _v4_ring_issue(kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16, p_idx, p_eidx, raw8, ex8, rope8, raw_ready, r, n0, hi,
                       n1, stride_kv_b, stride_ekv_b, num_slots, e_num_slots, PAGE: gl.constexpr,
                       E_PAGE: gl.constexpr, HAS_EXTRA: gl.constexpr):  # fmt: skip
        """cp.async of the fp8_v4 rows of entries ``[n0, n0 + ROWS)`` (either source; invalid rows zero-filled) into
        raw stage ``r`` (``raw8 [NS * 7, ROWS, 64]`` e4m3 groups, 16 bytes a copy; ``rope8 [NS, ROWS, 64]`` bf16;
        ``ex8 [NS * 2, ROWS]`` the exponent bytes as two 4-byte words a row, word-major); each thread's copies
        complete ``raw_ready[r]`` (noinc arrive). "ring": the narrow kernel's tiles."""
        ROWS: gl.constexpr = raw8.shape[1]
        NS: gl.constexpr = rope8.shape[0]
        NW: gl.constexpr = gl.num_warps()
        CP: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [NW, 1], [1, 0])  # e4m3 bytes [ROWS, 64], 16 a copy
        R16: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])  # rope bf16 [ROWS, 64]
        EXL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [2, NW // 2], [1, 0])  # exponent words [2, ROWS]
        o_b = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, CP)), 0)
        o_r = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, R16)), 0)
        o_w = gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(1, EXL)), 1)
        row, _, main, ok = _v4_rows(p_idx, p_eidx, n0, hi, n1, num_slots, e_num_slots, stride_kv_b, stride_ekv_b,
                                    PAGE, E_PAGE, ROWS, gl.SliceLayout(1, CP), HAS_EXTRA)  # fmt: skip
        p_b = gl.expand_dims(_pick(main, kv + row, ekv + row, HAS_EXTRA), 1) + o_b
        m2 = gl.expand_dims(ok, 1)
        row_r, _, main_r, ok_r = _v4_rows(p_idx, p_eidx, n0, hi, n1, num_slots, e_num_slots, stride_kv_b,
                                          stride_ekv_b, PAGE, E_PAGE, ROWS, gl.SliceLayout(1, R16),
                                          HAS_EXTRA)  # fmt: skip
        p_r = gl.expand_dims(_pick(main_r, kv_b16 + row_r // 2, ekv_b16 + row_r // 2, HAS_EXTRA) + 224, 1) + o_r
        _, ex, main_e, ok_e = _v4_rows(p_idx, p_eidx, n0, hi, n1, num_slots, e_num_slots, stride_kv_b, stride_ekv_b,
                                       PAGE, E_PAGE, ROWS, gl.SliceLayout(0, EXL), HAS_EXTRA)  # fmt: skip
        p_e = gl.expand_dims(_pick(main_e, kv_f32 + ex // 4, ekv_f32 + ex // 4, HAS_EXTRA), 0) + o_w
        for c in gl.static_range(7):
            async_copy.async_copy_global_to_shared(raw8.index(r * 7 + c), p_b + c * 64, mask=m2)
        async_copy.async_copy_global_to_shared(rope8.index(r), p_r, mask=gl.expand_dims(ok_r, 1))
        ex8_3 = ex8._reinterpret(gl.float32, [NS, 2, ROWS], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        async_copy.async_copy_global_to_shared(ex8_3.index(r), p_e, mask=gl.expand_dims(ok_e, 0) & (o_w < 2))
        async_copy.mbarrier_arrive(raw_ready.index(r), increment_count=False)

    @gluon.jit
    def _v4_raw_load(raw8, ex8, rope8, r, L8: gl.constexpr, R16: gl.constexpr):
        """Raw stage ``r`` of fp8_v4 rows (``_v4_ring_issue``'s buffers) into registers: the 7 e4m3 groups in layout
        L8, the two exponent words of each row, the bf16 rope in layout R16."""
        ROW: gl.constexpr = gl.SliceLayout(1, L8)
        return (raw8.index(r * 7 + 0).load(L8), raw8.index(r * 7 + 1).load(L8), raw8.index(r * 7 + 2).load(L8),
                raw8.index(r * 7 + 3).load(L8), raw8.index(r * 7 + 4).load(L8), raw8.index(r * 7 + 5).load(L8),
                raw8.index(r * 7 + 6).load(L8), ex8.index(r * 2).load(ROW).to(gl.int32, bitcast=True),
                ex8.index(r * 2 + 1).load(ROW).to(gl.int32, bitcast=True), rope8.index(r).load(R16))  # fmt: skip

    @gluon.jit
    def _v4_store_rows(dst, raw):
        """``_v4_raw_load``'s rows dequantised (``_dequant_pow2``, the exponent byte of group c in word c // 4) into
        the bf16 rows ``dst`` [R, 512]: columns 0..447 the latent, 448..511 the rope (NaN -> 0)."""
        w0 = raw[7]
        w1 = raw[8]
        dst.slice(0, 64, dim=1).store(_dequant_pow2(raw[0], _e8m0_bf16(w0 & 255)))
        dst.slice(64, 64, dim=1).store(_dequant_pow2(raw[1], _e8m0_bf16((w0 >> 8) & 255)))
        dst.slice(128, 64, dim=1).store(_dequant_pow2(raw[2], _e8m0_bf16((w0 >> 16) & 255)))
        dst.slice(192, 64, dim=1).store(_dequant_pow2(raw[3], _e8m0_bf16((w0 >> 24) & 255)))
        dst.slice(256, 64, dim=1).store(_dequant_pow2(raw[4], _e8m0_bf16(w1 & 255)))
        dst.slice(320, 64, dim=1).store(_dequant_pow2(raw[5], _e8m0_bf16((w1 >> 8) & 255)))
        dst.slice(384, 64, dim=1).store(_dequant_pow2(raw[6], _e8m0_bf16((w1 >> 16) & 255)))
        b_r = raw[9]
        dst.slice(448, 64, dim=1).store(gl.where(b_r != b_r, 0.0, b_r))

    @gluon.jit
    def _gather_v4(kv, kv_b16, ekv, ekv_b16, p_idx, p_eidx, lat, ready, empty, lo, hi, n1, n_tiles, stride_kv_b,
                   stride_ekv_b, num_slots, e_num_slots, PAGE: gl.constexpr, E_PAGE: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PASSES: gl.constexpr, HAS_EXTRA: gl.constexpr,
                   J0: gl.constexpr = 0, J_STEP: gl.constexpr = 1):  # fmt: skip
        """Producer, fp8_v4 rows (SPEC §2.4: a token's 448 e4m3 in 7 groups of 64 with a UE8M0 exponent each, then
        64 bf16 rope; the exponents after the block's rows): a tile in PASSES row blocks, each loaded (16 bytes a
        thread: a row's 64 values in 4 threads, so one row layout serves every load) then dequantised into the bf16
        stage (columns 448..511 the rope values, NaN -> 0); fence, partition barrier, one arrive. Tiles ``J0, J0 +
        J_STEP, ...``."""
        NW: gl.constexpr = gl.num_warps()
        R: gl.constexpr = BLOCK_N // PASSES
        VEC: gl.constexpr = R * 64 // (NW * 32)  # values a thread per [R, 64] load (16 at R = 32: 16-byte loads)
        B64: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // 64, 64 // VEC], [NW, 1], [1, 0])  # bytes or bf16
        ROW: gl.constexpr = gl.SliceLayout(1, B64)
        o_b = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, B64)), 0)
        for j in range(J0, n_tiles, J_STEP):
            stage = j % STAGES
            dst = lat.index(stage)
            for h in gl.static_range(PASSES):
                n0 = lo + j * BLOCK_N + h * R
                row, ex, main, ok = _v4_rows(p_idx, p_eidx, n0, hi, n1, num_slots, e_num_slots, stride_kv_b,
                                             stride_ekv_b, PAGE, E_PAGE, R, ROW, HAS_EXTRA)  # fmt: skip
                p_row = _pick(main, kv + row, ekv + row, HAS_EXTRA)
                p_ex = _pick(main, kv + ex, ekv + ex, HAS_EXTRA)
                p_rope = _pick(main, kv_b16 + row // 2, ekv_b16 + row // 2, HAS_EXTRA) + 224  # 64 bf16 at byte 448
                m2 = gl.expand_dims(ok, 1)
                p_b = gl.expand_dims(p_row, 1) + o_b
                # every load of the pass first (one latency), then the conversions
                q0 = gl.load(p_b, mask=m2, other=0)
                q1 = gl.load(p_b + 64, mask=m2, other=0)
                q2 = gl.load(p_b + 128, mask=m2, other=0)
                q3 = gl.load(p_b + 192, mask=m2, other=0)
                q4 = gl.load(p_b + 256, mask=m2, other=0)
                q5 = gl.load(p_b + 320, mask=m2, other=0)
                q6 = gl.load(p_b + 384, mask=m2, other=0)
                b_r = gl.load(gl.expand_dims(p_rope, 1) + o_b, mask=m2, other=0.0)
                s0 = _v4_scale(p_ex, ok)
                s1 = _v4_scale(p_ex + 1, ok)
                s2 = _v4_scale(p_ex + 2, ok)
                s3 = _v4_scale(p_ex + 3, ok)
                s4 = _v4_scale(p_ex + 4, ok)
                s5 = _v4_scale(p_ex + 5, ok)
                s6 = _v4_scale(p_ex + 6, ok)
                if h == 0:
                    mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
                part = dst.slice(h * R, R, dim=0)
                part.slice(0, 64, dim=1).store(_dequant_pow2(q0, s0))
                part.slice(64, 64, dim=1).store(_dequant_pow2(q1, s1))
                part.slice(128, 64, dim=1).store(_dequant_pow2(q2, s2))
                part.slice(192, 64, dim=1).store(_dequant_pow2(q3, s3))
                part.slice(256, 64, dim=1).store(_dequant_pow2(q4, s4))
                part.slice(320, 64, dim=1).store(_dequant_pow2(q5, s5))
                part.slice(384, 64, dim=1).store(_dequant_pow2(q6, s6))
                part.slice(448, 64, dim=1).store(gl.where(b_r != b_r, 0.0, b_r))
            fence_async_shared()  # generic-proxy stores before the consumers' wgmma reads
            gl.thread_barrier()  # the producer warps' stores are all done
            mbarrier.arrive(ready.index(stage), count=1)

    @gluon.jit
    def _producer(kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16, p_idx, p_eidx, lat, rope, ready, empty, lo, hi, n1,
                  n_tiles, stride_kv_b, stride_kv_p, stride_ekv_b, stride_ekv_p, num_slots, e_num_slots,
                  PAGE: gl.constexpr, E_PAGE: gl.constexpr, FMT: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, PASSES: gl.constexpr, HAS_TAIL: gl.constexpr, HAS_EXTRA: gl.constexpr,
                  OPTS: gl.constexpr, J0: gl.constexpr = 0, J_STEP: gl.constexpr = 1,
                  AHEAD: gl.constexpr = False):  # fmt: skip
        """The producer warpgroup: the cache format's gather (OPTS: the private variants' bits) of tiles ``J0, J0 +
        J_STEP, ...`` (AHEAD: fp8_ds_mla slots a tile ahead, ``_gather_fp8``)."""
        if FMT == 0:
            _gather_bf16(kv, ekv, p_idx, p_eidx, lat, rope, ready, empty, lo, hi, n1, n_tiles, stride_kv_b,
                         stride_kv_p, stride_ekv_b, stride_ekv_p, num_slots, e_num_slots, PAGE, E_PAGE, BLOCK_N,
                         STAGES, HAS_TAIL, HAS_EXTRA, J0, J_STEP)  # fmt: skip
        elif FMT == 1:
            _gather_fp8(kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16, p_idx, p_eidx, lat, rope, ready, empty, lo, hi, n1,
                        n_tiles, stride_kv_b, stride_kv_p, stride_ekv_b, stride_ekv_p, num_slots, e_num_slots, PAGE,
                        E_PAGE, BLOCK_N, STAGES, PASSES, HAS_EXTRA, (OPTS & 1) != 0, J0, J_STEP, AHEAD)  # fmt: skip
        else:
            _gather_v4(kv, kv_b16, ekv, ekv_b16, p_idx, p_eidx, lat, ready, empty, lo, hi, n1, n_tiles, stride_kv_b,
                       stride_ekv_b, num_slots, e_num_slots, PAGE, E_PAGE, BLOCK_N, STAGES, PASSES, HAS_EXTRA, J0,
                       J_STEP)  # fmt: skip

    @gluon.jit
    def _q_rows(q, i_t, h0, H, stride_q_t, stride_q_h, ROWS: gl.constexpr):
        """Pointers to the first 64 columns of heads ``h0 + [0, ROWS)`` of row i_t's q (16 bytes a thread), which
        heads exist (< H), and the column offsets ``[1, 64]`` (add ``c * 64`` for chunk c)."""
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        o_h = h0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LD))
        p_q = q + i_t * stride_q_t + gl.expand_dims(o_h.to(gl.int64) * stride_q_h, 1)
        o_c = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, LD)), 0)
        return p_q, gl.expand_dims(o_h < H, 1), o_c

    @gluon.jit
    def _q_to_smem(q, q_smem, i_t, h0, H, stride_q_t, stride_q_h, ROWS: gl.constexpr, D_QK: gl.constexpr):
        """Heads ``h0 + [0, ROWS)`` of row i_t's q ``[ROWS, D_QK]`` -> the D_QK / 64 swizzled chunks of ``q_smem``
        (heads past H are zeros: finite scores, never stored), fenced for the wgmmas, the partition synchronised."""
        p_q, m_ld, o_c = _q_rows(q, i_t, h0, H, stride_q_t, stride_q_h, ROWS)
        for c in gl.static_range(D_QK // 64):
            q_smem.index(c).store(gl.load(p_q + (c * 64 + o_c), mask=m_ld, other=0.0))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _qk(q_smem, lat, rope, s_init, HAS_TAIL: gl.constexpr):
        """Start ``S = Q K^T`` for one tile: 8 latent chunks (+ the rope chunk), chained async wgmmas."""
        s = warpgroup_mma(q_smem.index(0), lat.slice(0, 64, dim=1).permute((1, 0)), s_init, use_acc=False,
                          is_async=True)  # fmt: skip
        for c in gl.static_range(1, 8):
            s = warpgroup_mma(q_smem.index(c), lat.slice(c * 64, 64, dim=1).permute((1, 0)), s, is_async=True)
        if HAS_TAIL:
            s = warpgroup_mma(q_smem.index(8), rope.permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _tile_ok(p_idx, p_eidx, n0, hi, n1, num_slots, e_num_slots, BLOCK_N: gl.constexpr, layout: gl.constexpr,
                 HAS_EXTRA: gl.constexpr):  # fmt: skip
        """Which entries of ``[n0, n0 + BLOCK_N)`` name a valid key (of either source)."""
        if HAS_EXTRA:
            _, ok, _, e_ok = _tile_slots2(p_idx, p_eidx, n0, hi, n1, num_slots, e_num_slots, BLOCK_N, layout)
            ok = ok | e_ok
        else:
            _, ok = _tile_slots(p_idx, n0, hi, num_slots, BLOCK_N, layout)
        return ok

    @gluon.jit
    def _inverse_rope(x, rope_pos, i_t, cos_sin, stride_cs, num_pos, ROPE: gl.constexpr):
        """fp32 ``x [M, N]`` (a token's heads) with its last ROPE columns' interleaved pairs rotated by minus the
        token's angle, ``(a, b) -> (a c + b s, b c - a s)`` (SPEC §7.8, the Triton kernel's ``_inverse_rope_tail``);
        a position outside ``[0, num_pos)`` gets cos 1, sin 0. ``x`` is seen as ``[M, N / ROPE, ROPE / 2, 2]`` so
        that cos / sin are ROPE / 2 values (a few registers a thread, not one per pair column: 64 there spilled)
        and only the last ROPE-wide column block takes the rotation."""
        M: gl.constexpr = x.shape[0]
        N: gl.constexpr = x.shape[1]
        NC: gl.constexpr = N // ROPE
        a, b = gl.split(gl.reshape(x, [M, NC, ROPE // 2, 2]))
        L2: gl.constexpr = gl.SliceLayout(0, a.type.layout)  # (column block, pair)
        o_k = gl.arange(0, ROPE // 2, layout=gl.SliceLayout(0, L2))
        pos = gl.load(rope_pos + i_t).to(gl.int64)
        m_k = (o_k >= 0) & (pos >= 0) & (pos < num_pos)
        p_cs = cos_sin + pos * stride_cs + o_k
        b_cos = gl.expand_dims(gl.expand_dims(gl.load(p_cs, mask=m_k, other=1.0).to(gl.float32), 0), 0)
        b_sin = gl.expand_dims(gl.expand_dims(gl.load(p_cs + ROPE // 2, mask=m_k, other=0.0).to(gl.float32), 0), 0)
        last = gl.expand_dims(gl.expand_dims(gl.arange(0, NC, layout=gl.SliceLayout(1, L2)) == NC - 1, 1), 0)
        a2 = gl.where(last, a * b_cos + b * b_sin, a)
        b2 = gl.where(last, b * b_cos - a * b_sin, b)
        return gl.reshape(gl.join(a2, b2), [M, N])

    @gluon.jit
    def _online_p(b_s, ok, b_m, scale_log2, LAZY: gl.constexpr):
        """One tile's online-softmax core (base 2, rows on axis 0): scores of invalid keys -inf, the new row max
        (LAZY: moved only past LAZY_T), P and the factor of the old max: ``(P, alpha, new max)``."""
        b_s = gl.where(gl.expand_dims(ok, 0), b_s * scale_log2, float("-inf"))
        if LAZY:
            b_mx = gl.max(b_s, axis=1)
            b_m_new = gl.where(b_mx > b_m + LAZY_T, b_mx, b_m)
        else:
            b_m_new = gl.maximum(b_m, gl.max(b_s, axis=1))
        b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        return gl.exp2(b_s - gl.expand_dims(b_m_use, 1)), gl.exp2(b_m - b_m_use), b_m_new

    @gluon.jit
    def _sink_factor(b_r, b_lse, empty, sink, o_hs, m_hs):
        """The output factors ``b_r`` times ``sigmoid(lse - sink)`` of heads ``o_hs`` (``m_hs``: inside H), 0 for an
        empty row (as the Triton kernel's ``_sink_factor``)."""
        b_sk = gl.load(sink + o_hs, mask=m_hs, other=float("-inf"))
        e = gl.exp2((b_sk - gl.where(empty, 0.0, b_lse)) * 1.4426950408889634)
        return b_r * gl.where(empty, 0.0, 1.0 / (1.0 + e))

    @gluon.jit
    def _softmax_step(b_s, ok, b_m, b_lv, b_lc, scale_log2, ROW_L: gl.constexpr, HAS_TAIL: gl.constexpr,
                      LAZY: gl.constexpr):  # fmt: skip
        """One tile's online softmax (base 2): scores of invalid keys -inf, the row max (LAZY: moved only past
        LAZY_T), P, the rescale factor of the old max, the row sums (per key column, or per column group for V4)."""
        b_p, b_alpha, b_m_new = _online_p(b_s, ok, b_m, scale_log2, LAZY)
        if HAS_TAIL:
            b_lv = b_lv * gl.expand_dims(b_alpha, 1) + b_p
        else:
            b_a3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(b_alpha, ROW_L), 1), 2)
            b_lc = b_lc * b_a3 + gl.sum(gl.reshape(b_p, [b_p.shape[0], 2, 4, 8]), axis=2)
        return b_p, b_alpha, b_m_new, b_lv, b_lc

    @gluon.jit
    def _rescale(acc, b_alpha, ROW_O: gl.constexpr, LAZY: gl.constexpr):
        """O times the rows' factors; LAZY: a warp multiplies only when one of its rows' factors is not exactly 1
        (a vote, then a uniform branch around the 128 multiplies, as decode_seesaw's ``_seesaw_rescale_lazy``)."""
        b_a = gl.convert_layout(b_alpha, ROW_O)
        if LAZY:
            moved = gl.inline_asm_elementwise(
                "{ .reg .pred p, q; setp.neu.f32 p, $2, 0f3F800000; setp.neu.or.f32 p, $3, 0f3F800000, p; "
                "vote.sync.any.pred q, p, -1; selp.u32 $0, 1, 0, q; mov.u32 $1, $0; }",
                "=r,=r,f,f", [b_a], dtype=gl.int32, is_pure=True, pack=2)  # fmt: skip
            return gl.inline_asm_elementwise(RESCALE_ASM, RESCALE_CONSTRAINTS,
                                             [acc, gl.expand_dims(moved, 1), gl.expand_dims(b_a, 1)],
                                             dtype=gl.float32, is_pure=True, pack=128)  # fmt: skip
        else:
            return acc * gl.expand_dims(b_a, 1)

    @gluon.jit
    def _consumer(q, q_smem, lat, rope, p_smem, ready, empty, lat8, sc8, free, p_idx, p_eidx, sink, out, lse, o_part,
                  lse_part, rope_pos, cos_sin, scale_log2, stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_l_t,
                  stride_cs, num_pos, T, H, i_t, i_hb, i_s, lo, hi, n1, n_tiles, num_slots, e_num_slots,
                  D_QK: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_SPLITS: gl.constexpr,
                  HAS_EXTRA: gl.constexpr, HAS_SINK: gl.constexpr, HAS_ROPE: gl.constexpr, ROPE: gl.constexpr,
                  FENCE: gl.constexpr, OPTS: gl.constexpr):  # fmt: skip
        """The two consumer warpgroups: Q to shared memory, the online softmax over the ring's tiles, the epilogue
        (OPTS: the private variants' bits; "lazy" 2, "staged" 4: ``lat`` is the one bf16 tile, ``lat8`` / ``sc8``
        the fp8 stages (V4: ``sc8`` the exponent words, ``rope`` the stages' raw rope); V3.2: P in ``rope``'s slot,
        ``free`` its release)."""
        LAZY: gl.constexpr = (OPTS & 2) != 0
        STAGED: gl.constexpr = (OPTS & 4) != 0
        P_IN_ROPE: gl.constexpr = STAGED and D_QK > 512
        BLOCK_M: gl.constexpr = 64
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, BLOCK_N // 2, 16])  # fmt: skip
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, 256, 16])  # fmt: skip
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)

        _q_to_smem(q, q_smem, i_t, i_hb * BLOCK_M, H, stride_q_t, stride_q_h, BLOCK_M, D_QK)

        b_m = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
        b_lv = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)  # row sums per key column until the epilogue
        acc = gl.zeros([BLOCK_M, 512], gl.float32, O_LAYOUT)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)
        # V4: the row sums as each thread's 4 column groups summed in registers (4 registers, not 16; the consumer
        # spilled without it); V3.2 keeps them per key column (its code unchanged)
        b_lc = gl.sum(gl.reshape(s_zero, [BLOCK_M, 2, 4, 8]), axis=2)
        ROW_L: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, b_lc.type.layout))
        for j in range(n_tiles):
            stage = j % STAGES
            ok = _tile_ok(p_idx, p_eidx, lo + j * BLOCK_N, hi, n1, num_slots, e_num_slots, BLOCK_N, COL_S,
                          HAS_EXTRA)  # fmt: skip
            mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
            if STAGED:  # dequantise the landed fp8 stage into the one bf16 tile, then hand the stage back at once
                k_lat = lat.index(0)
                if D_QK > 512:
                    _widen_staged(lat8.index(stage), sc8, stage, k_lat, rope.index(stage),
                                  (OPTS & 1) != 0)  # fmt: skip
                else:
                    _widen_staged_v4(lat8.index(stage), sc8, stage, k_lat, rope.index(stage))
                fence_async_shared()  # generic-proxy writes before the wgmma reads
                gl.thread_barrier()  # the whole tile is written; both warpgroups are done reading the fp8 stage
                mbarrier.arrive(empty.index(stage), count=1)
            else:
                if FENCE:  # cp.async wrote the stage (generic proxy): order it before the wgmma reads
                    fence_async_shared()
                k_lat = lat.index(stage)
            b_s = _qk(q_smem, k_lat, rope.index(stage), s_zero, D_QK > 512)
            b_s = warpgroup_mma_wait(0, deps=(b_s,))
            if P_IN_ROPE:  # P overwrites the rope slot: both warpgroups' scores must be done
                gl.thread_barrier()
                p_tile = rope.index(stage)
            else:
                p_tile = p_smem
            b_p, b_alpha, b_m, b_lv, b_lc = _softmax_step(b_s, ok, b_m, b_lv, b_lc, scale_log2, ROW_L,
                                                          D_QK > 512, LAZY)  # fmt: skip
            p_tile.store(b_p.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()  # each warpgroup reads all of P

            acc = _rescale(acc, b_alpha, ROW_O, LAZY)
            acc = warpgroup_mma(p_tile, k_lat, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            gl.thread_barrier()  # both warpgroups are done with this stage and with P
            if P_IN_ROPE:
                mbarrier.arrive(free.index(stage), count=1)  # the producer may refill the rope slot (P's)
            elif not STAGED:
                mbarrier.arrive(empty.index(stage), count=1)  # the producer may refill it

        # epilogue: natural-log LSE of the scaled scores (sink-free), -inf and zeros for a row with no key
        if D_QK > 512:
            b_l = gl.sum(b_lv, axis=1)
        else:
            b_l = gl.convert_layout(gl.sum(gl.sum(b_lc, axis=2), axis=1), ROW_S)
        empty_r, b_lse, b_r = _finish_rows(b_l, b_m, 1.0)
        o_hs = i_hb * BLOCK_M + gl.arange(0, BLOCK_M, layout=ROW_S)
        m_hs = o_hs < H
        if NUM_SPLITS == 1:
            if HAS_SINK:
                b_r = _sink_factor(b_r, b_lse, empty_r, sink, o_hs, m_hs)
            gl.store(lse + i_t * stride_l_t + o_hs, b_lse, mask=m_hs)
            b_o = acc * gl.expand_dims(gl.convert_layout(b_r, ROW_O), 1)
            if HAS_ROPE:  # after normalisation and sink (a rotation commutes with the row scaling), as Triton's
                b_o = gl.convert_layout(_inverse_rope(b_o, rope_pos, i_t, cos_sin, stride_cs, num_pos, ROPE),
                                        O_LAYOUT)  # fmt: skip
        else:  # the merge kernel applies the sink and the inverse RoPE
            gl.store(lse_part + (i_s * T + i_t) * H + o_hs, b_lse, mask=m_hs)
            b_o = acc * gl.expand_dims(gl.convert_layout(b_r, ROW_O), 1)
        # V4 rows: 16-byte stores (see _O_FULL)
        _store_out(b_o, out, o_part, stride_o_t, stride_o_h, T, H, i_t, i_hb, i_s, 0, NUM_SPLITS,
                   _O_FULL if D_QK == 512 else O_LAYOUT)  # fmt: skip

    @gluon.jit
    def _asym_item(k, idx, lens, eidx, elens, stride_i_t, stride_ei_t, T, K, EK, N_HB: gl.constexpr,
                   HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, E_HAS_LEN: gl.constexpr, NUM_SPLITS: gl.constexpr,
                   BLOCK_N: gl.constexpr):  # fmt: skip
        """Work item ``k`` of the "asym" walk -> (row i_t (int64), head block i_hb, split i_s, then ``_row_split``'s
        index rows, main entries, split bounds and tiles): the order in which the block scheduler handed out the old
        ``(T x head blocks, splits)`` grid, the head blocks of a row adjacent."""
        per_s = T * N_HB
        i_s = k // per_s
        r = k - i_s * per_s
        i_t = (r // N_HB).to(gl.int64)
        p_idx, p_eidx, n1, lo, hi, n_tiles = _row_split(idx, lens, eidx, elens, i_t, i_s, stride_i_t, stride_ei_t, K,
                                                        EK, HAS_LEN, HAS_EXTRA, E_HAS_LEN, NUM_SPLITS,
                                                        BLOCK_N)  # fmt: skip
        return i_t, r % N_HB, i_s, p_idx, p_eidx, n1, lo, hi, n_tiles

    @gluon.jit
    def _q_async(q, q_smem, q_ready, q_empty, i, i_t, h0, H, stride_q_t, stride_q_h, D_QK: gl.constexpr):
        """The producer's copy of the ``i``-th item's Q (heads ``h0 + [0, 64)`` of row i_t, heads past H zero-filled)
        into ``q_smem`` by cp.async, once the scorer's last scores of the item before are done; each producer thread
        completes ``q_ready`` (noinc arrive)."""
        p_q, m_q, o_c = _q_rows(q, i_t, h0, H, stride_q_t, stride_q_h, 64)
        mbarrier.wait(q_empty, (i & 1) ^ 1)  # fresh barriers pass parity 1 at once (the first item)
        for c in gl.static_range(D_QK // 64):
            async_copy.async_copy_global_to_shared(q_smem.index(c), p_q + (c * 64 + o_c), mask=m_q)
        async_copy.mbarrier_arrive(q_ready, increment_count=False)

    @gluon.jit
    def _asym_producer(q, q_smem, q_ready, q_empty, kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16, idx, lens, eidx, elens,
                       lat, rope, ready, empty, stride_q_t, stride_q_h, stride_i_t, stride_ei_t, stride_kv_b,
                       stride_kv_p, stride_ekv_b, stride_ekv_p, T, H, K, EK, num_slots, e_num_slots, n_items,
                       PAGE: gl.constexpr, E_PAGE: gl.constexpr, FMT: gl.constexpr, D_QK: gl.constexpr,
                       N_HB: gl.constexpr, NUM_SPLITS: gl.constexpr, HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr,
                       E_HAS_LEN: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PASSES: gl.constexpr,
                       OPTS: gl.constexpr, WALK: gl.constexpr):  # fmt: skip
        """Variant "asym", the producer warpgroup, item after item: WALK (bf16 rows, persistent programs): each
        item's Q (``_q_async``), then its tiles into the ring, whose position runs on across items; else (one item a
        program, the scorer loads Q): the format's gather."""
        k = gl.program_id(0)
        t = 0
        i = 0
        while k < n_items:
            i_t, i_hb, i_s, p_idx, p_eidx, n1, lo, hi, n_tiles = _asym_item(k, idx, lens, eidx, elens, stride_i_t,
                                                                       stride_ei_t, T, K, EK, N_HB, HAS_LEN,
                                                                       HAS_EXTRA, E_HAS_LEN, NUM_SPLITS,
                                                                       BLOCK_N)  # fmt: skip
            if WALK:
                _q_async(q, q_smem, q_ready, q_empty, i, i_t, i_hb * 64, H, stride_q_t, stride_q_h, D_QK)
                _gather_bf16(kv, ekv, p_idx, p_eidx, lat, rope, ready, empty, lo, hi, n1, n_tiles, stride_kv_b,
                             stride_kv_p, stride_ekv_b, stride_ekv_p, num_slots, e_num_slots, PAGE, E_PAGE, BLOCK_N,
                             STAGES, D_QK > 512, HAS_EXTRA, 0, 1, t)  # fmt: skip
            else:
                _producer(kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16, p_idx, p_eidx, lat, rope, ready, empty, lo, hi,
                          n1, n_tiles, stride_kv_b, stride_kv_p, stride_ekv_b, stride_ekv_p, num_slots, e_num_slots,
                          PAGE, E_PAGE, FMT, BLOCK_N, STAGES, PASSES, D_QK > 512, HAS_EXTRA, OPTS)  # fmt: skip
            t += n_tiles
            i += 1
            k += gl.num_programs(0)

    @gluon.jit
    def _asym_scorer(q, q_smem, lat, rope, p_smem, a_smem, f_smem, ready, empty, p_ready, p_free, fin, f_free, q_ready,
                     q_empty, idx, lens, eidx, elens, sink, out, lse, o_part, lse_part, scale_log2, stride_q_t,
                     stride_q_h, stride_i_t, stride_ei_t, stride_o_t, stride_o_h, stride_l_t, T, H, K, EK, num_slots,
                     e_num_slots, n_items, D_QK: gl.constexpr, N_HB: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, NUM_SPLITS: gl.constexpr, HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr,
                     E_HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, FENCE: gl.constexpr, LAZY: gl.constexpr,
                     WALK: gl.constexpr):  # fmt: skip
        """Variant "asym", warpgroup 0 (the default partition), item after item: the whole score tile ``S = Q K^T``
        (m64n64k16), the softmax, P and the rows' rescale factors to shared memory for warpgroup 1, and ``O[:, :256]
        += P V[:, :256]`` (P from shared memory too: held in registers as well, it spilled) one tile behind the
        scores: tile j - 1's P V is issued before tile j's scores, so it runs while tile j lands and its stage goes
        back before the softmax (issued after the scores, it held each stage a tile longer: 3-12% slower at decode,
        the same at prefill); the epilogue of the left half, the LSE, and the rows' final factors (1 / l, the sink)
        for warpgroup 1. WALK (bf16 rows, persistent programs): Q comes from the producer and goes back once the
        item's last scores are done, so the next item's Q lands during this item's last P V and epilogue; else (one
        item a program) loaded here."""
        BLOCK_M: gl.constexpr = 64
        HALF: gl.constexpr = 256
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])  # fmt: skip
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
        COL_S: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        HAS_TAIL: gl.constexpr = D_QK > 512

        k = gl.program_id(0)
        t = 0  # tiles of the items before (the ring position and P's phase)
        i = 0  # items before (Q's and the final factors' phases)
        while k < n_items:
            i_t, i_hb, i_s, p_idx, p_eidx, n1, lo, hi, n_tiles = _asym_item(k, idx, lens, eidx, elens, stride_i_t,
                                                                       stride_ei_t, T, K, EK, N_HB, HAS_LEN,
                                                                       HAS_EXTRA, E_HAS_LEN, NUM_SPLITS,
                                                                       BLOCK_N)  # fmt: skip
            if WALK:
                mbarrier.wait(q_ready, i & 1)
                fence_async_shared()  # the producer's cp.async (generic proxy) before the wgmma reads
            else:
                _q_to_smem(q, q_smem, i_t, i_hb * BLOCK_M, H, stride_q_t, stride_q_h, BLOCK_M, D_QK)

            b_m = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
            b_l = gl.zeros([BLOCK_M], gl.float32, ROW_S)
            acc = gl.zeros([BLOCK_M, HALF], gl.float32, O_LAYOUT)
            s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)
            if n_tiles > 0:
                # ---- tile 0: scores and softmax (no P V yet)
                st0 = t % STAGES
                ok = _tile_ok(p_idx, p_eidx, lo, hi, n1, num_slots, e_num_slots, BLOCK_N, COL_S, HAS_EXTRA)
                mbarrier.wait(ready.index(st0), (t // STAGES) & 1)
                if FENCE:  # cp.async wrote the stage (generic proxy): order it before the wgmma reads
                    fence_async_shared()
                s_tok = _qk(q_smem, lat.index(st0), rope.index(st0), s_zero, HAS_TAIL)
                b_s = warpgroup_mma_wait(0, deps=(s_tok,))
                b_p, b_alpha, b_m, b_l = _asym_softmax(b_s, ok, b_m, b_l, scale_log2, LAZY)
                _asym_publish(b_p, b_alpha, p_smem, a_smem, p_ready, p_free, t)
                acc = _rescale(acc, b_alpha, ROW_O, LAZY)
                # ---- steady state: P V of tile j - 1, then the scores and softmax of tile j
                for j in range(1, n_tiles):
                    stage = (t + j) % STAGES
                    pst = (t + j - 1) % STAGES
                    ok = _tile_ok(p_idx, p_eidx, lo + j * BLOCK_N, hi, n1, num_slots, e_num_slots, BLOCK_N, COL_S,
                                  HAS_EXTRA)  # fmt: skip
                    # P V of tile j - 1 first: it runs while tile j lands, and its stage goes back before the softmax
                    o_tok = warpgroup_mma(p_smem, lat.index(pst).slice(0, HALF, dim=1), acc, is_async=True)
                    mbarrier.wait(ready.index(stage), ((t + j) // STAGES) & 1)
                    if FENCE:
                        fence_async_shared()
                    s_tok = _qk(q_smem, lat.index(stage), rope.index(stage), s_zero, HAS_TAIL)
                    acc = warpgroup_mma_wait(1, deps=(o_tok,))  # issued first, so done when one group is left
                    mbarrier.arrive(empty.index(pst), count=1)  # warpgroup 0 is done with tile j - 1's stage
                    b_s = warpgroup_mma_wait(0, deps=(s_tok,))
                    b_p, b_alpha, b_m, b_l = _asym_softmax(b_s, ok, b_m, b_l, scale_log2, LAZY)
                    _asym_publish(b_p, b_alpha, p_smem, a_smem, p_ready, p_free, t + j)
                    acc = _rescale(acc, b_alpha, ROW_O, LAZY)
                if WALK:
                    mbarrier.arrive(q_empty, count=1)  # the item's last scores are done: the next Q may land
                # ---- P V of the last tile
                lst = (t + n_tiles - 1) % STAGES
                o_tok = warpgroup_mma(p_smem, lat.index(lst).slice(0, HALF, dim=1), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(o_tok,))
                mbarrier.arrive(empty.index(lst), count=1)
            elif WALK:
                mbarrier.arrive(q_empty, count=1)

            # epilogue: natural-log LSE of the scaled scores (sink-free), -inf and zeros for a row with no key
            empty_r, b_lse, b_r = _finish_rows(b_l, b_m, 1.0)
            o_hs = i_hb * BLOCK_M + gl.arange(0, BLOCK_M, layout=ROW_S)
            m_hs = o_hs < H
            if NUM_SPLITS == 1:
                if HAS_SINK:
                    b_r = _sink_factor(b_r, b_lse, empty_r, sink, o_hs, m_hs)
                gl.store(lse + i_t * stride_l_t + o_hs, b_lse, mask=m_hs)
            else:
                gl.store(lse_part + (i_s * T + i_t) * H + o_hs, b_lse, mask=m_hs)
            mbarrier.wait(f_free, (i & 1) ^ 1)  # warpgroup 1 has read the item before's factors
            f_smem.store(b_r)  # the rows' final factors for warpgroup 1
            gl.thread_barrier()
            mbarrier.arrive(fin, count=1)
            b_o = acc * gl.expand_dims(gl.convert_layout(b_r, ROW_O), 1)
            _store_out(b_o, out, o_part, stride_o_t, stride_o_h, T, H, i_t, i_hb, i_s, 0, NUM_SPLITS,
                       _O_HALF if D_QK == 512 else O_LAYOUT)  # fmt: skip
            t += n_tiles
            i += 1
            k += gl.num_programs(0)

    @gluon.jit
    def _asym_softmax(b_s, ok, b_m, b_l, scale_log2, LAZY: gl.constexpr):
        """Variant "asym": one tile's online softmax (base 2) on the whole score tile: invalid keys -inf, the row max
        (LAZY: moved only past LAZY_T), P, the old rows' factor, the row sums."""
        b_p, b_alpha, b_m_new = _online_p(b_s, ok, b_m, scale_log2, LAZY)
        return b_p, b_alpha, b_m_new, b_l * b_alpha + gl.sum(b_p, axis=1)

    @gluon.jit
    def _asym_publish(b_p, b_alpha, p_smem, a_smem, p_ready, p_free, j):
        """Variant "asym": tile j's P (bf16) and the rows' factors into shared memory for warpgroup 1, once it is
        done with tile j - 1's (fresh barriers pass parity 1 at once)."""
        mbarrier.wait(p_free, (j & 1) ^ 1)
        p_smem.store(b_p.to(gl.bfloat16))
        a_smem.store(b_alpha)
        fence_async_shared()  # P's generic-proxy stores before warpgroup 1's wgmma reads
        gl.thread_barrier()
        mbarrier.arrive(p_ready, count=1)

    @gluon.jit
    def _store_out(b_o, out, o_part, stride_o_t, stride_o_h, T, H, i_t, i_hb, i_s, C0: gl.constexpr,
                   NUM_SPLITS: gl.constexpr, ST: gl.constexpr):  # fmt: skip
        """A block's normalised rows ``[64, N]`` (heads ``i_hb * 64 + [0, 64)``, columns ``C0 + [0, N)``) into ``out``
        (bf16, stored from layout ST: ``_O_HALF`` / ``_O_FULL`` for 16-byte stores, or b_o's own) or the split's
        fp32 partial (from b_o's layout)."""
        N: gl.constexpr = b_o.shape[1]
        if NUM_SPLITS == 1:
            b_o = gl.convert_layout(b_o.to(out.dtype.element_ty), ST)
        L: gl.constexpr = b_o.type.layout
        o_ho = i_hb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, L))
        m_o = gl.expand_dims(o_ho < H, 1)
        o_v = gl.expand_dims(C0 + gl.arange(0, N, layout=gl.SliceLayout(0, L)), 0)
        if NUM_SPLITS == 1:
            p_o = out + i_t * stride_o_t + gl.expand_dims(o_ho.to(gl.int64) * stride_o_h, 1) + o_v
            gl.store(p_o, b_o, mask=m_o)
        else:
            part = ((i_s * T + i_t) * H + o_ho.to(gl.int64)) * 512
            gl.store(o_part + gl.expand_dims(part, 1) + o_v, b_o, mask=m_o)

    @gluon.jit
    def _asym_pv(lat, p_smem, a_smem, f_smem, ready, empty, p_ready, p_free, fin, f_free, idx, lens, eidx, elens, out,
                 o_part, rope_pos, cos_sin, stride_i_t, stride_ei_t, stride_o_t, stride_o_h, stride_cs, num_pos, T, H,
                 K, EK, n_items, N_HB: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 NUM_SPLITS: gl.constexpr, HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, E_HAS_LEN: gl.constexpr,
                 HAS_ROPE: gl.constexpr, ROPE: gl.constexpr, FENCE: gl.constexpr, LAZY: gl.constexpr,
                 WIDE_O: gl.constexpr):  # fmt: skip
        """Variant "asym", warpgroup 1 (a worker partition), item after item: ``O[:, 256:] += P V[:, 256:]`` with P and
        the rows' rescale factors from warpgroup 0 through shared memory; the epilogue of the right half (V4's inverse
        RoPE: its last ROPE columns are this half's; WIDE_O: 16-byte stores)."""
        HALF: gl.constexpr = 256
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])  # fmt: skip
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        k = gl.program_id(0)
        t = 0
        i = 0
        while k < n_items:
            i_t, i_hb, i_s, _pi, _pe, _n1, _lo, _hi, n_tiles = _asym_item(k, idx, lens, eidx, elens, stride_i_t,
                                                                       stride_ei_t, T, K, EK, N_HB, HAS_LEN,
                                                                       HAS_EXTRA, E_HAS_LEN, NUM_SPLITS,
                                                                       BLOCK_N)  # fmt: skip
            acc = gl.zeros([64, HALF], gl.float32, O_LAYOUT)
            for j in range(n_tiles):
                stage = (t + j) % STAGES
                mbarrier.wait(ready.index(stage), ((t + j) // STAGES) & 1)
                mbarrier.wait(p_ready, (t + j) & 1)
                if FENCE:
                    fence_async_shared()
                acc = _rescale(acc, a_smem.load(ROW_O), ROW_O, LAZY)
                acc = warpgroup_mma(p_smem, lat.index(stage).slice(HALF, HALF, dim=1), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                gl.thread_barrier()  # every warp of this warpgroup is done with P and the stage
                mbarrier.arrive(p_free, count=1)
                mbarrier.arrive(empty.index(stage), count=1)
            mbarrier.wait(fin, i & 1)
            b_o = acc * gl.expand_dims(f_smem.load(ROW_O), 1)
            mbarrier.arrive(f_free, count=1)  # the factors are read: warpgroup 0 may write the next item's
            if NUM_SPLITS == 1 and HAS_ROPE:  # after normalisation and sink, as the two-warpgroup consumers
                b_o = gl.convert_layout(_inverse_rope(b_o, rope_pos, i_t, cos_sin, stride_cs, num_pos, ROPE), O_LAYOUT)
            _store_out(b_o, out, o_part, stride_o_t, stride_o_h, T, H, i_t, i_hb, i_s, HALF, NUM_SPLITS,
                       _O_HALF if WIDE_O else O_LAYOUT)  # fmt: skip
            t += n_tiles
            i += 1
            k += gl.num_programs(0)

    @gluon.jit
    def _sparse_mla_gluon_fwd_kernel(
        q,  # [T, H, D_QK] bf16
        kv,  # [num_blocks, PAGE, D_QK] bf16 (FMT 0), uint8 [num_blocks, PAGE, 656] (FMT 1) or fp8_v4 bytes (FMT 2)
        kv_f32,  # FMT 1: the same memory as fp32
        kv_b16,  # FMT 1, 2: the same memory as bf16
        idx,  # [T, K] int32 global slots
        lens,  # [T] int32 (HAS_LEN)
        ekv,  # the extra source, like kv (HAS_EXTRA)
        ekv_f32,
        ekv_b16,
        eidx,  # [T, EK] int32 (HAS_EXTRA)
        elens,  # [T] int32 (E_HAS_LEN)
        sink,  # [H] fp32 (HAS_SINK)
        out,  # [T, H, 512] bf16
        lse,  # [T, H] fp32
        o_part,  # [NUM_SPLITS, T, H, 512] fp32 (NUM_SPLITS > 1)
        lse_part,  # [NUM_SPLITS, T, H] fp32
        rope_pos,  # [T] int (HAS_ROPE): the token's position, whose angle the output's last ROPE dims undo
        cos_sin,  # [P, ROPE] float (HAS_ROPE): [cos | sin] per position
        scale_log2,  # sm_scale * log2(e)
        stride_q_t,
        stride_q_h,
        stride_kv_b,
        stride_kv_p,
        stride_ekv_b,
        stride_ekv_p,
        stride_i_t,
        stride_ei_t,
        stride_o_t,
        stride_o_h,
        stride_l_t,
        stride_cs,
        num_pos,
        T,
        H,
        K,
        EK,
        num_slots,
        e_num_slots,
        PAGE: gl.constexpr,
        E_PAGE: gl.constexpr,
        FMT: gl.constexpr,
        D_QK: gl.constexpr,
        N_HB: gl.constexpr,
        NUM_SPLITS: gl.constexpr,
        HAS_LEN: gl.constexpr,
        HAS_EXTRA: gl.constexpr,
        E_HAS_LEN: gl.constexpr,
        HAS_SINK: gl.constexpr,
        HAS_ROPE: gl.constexpr,
        ROPE: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        FP8_PASSES: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
        OPTS: gl.constexpr = 0,
        WALK: gl.constexpr = False,  # "asym", bf16 rows: persistent programs walk many items each (see the launcher)
    ):
        """One program per (row, 64-head block, split), or ("asym") programs walking those items; see the module
        docstring."""
        ASYM: gl.constexpr = (OPTS & 16) != 0
        gl.static_assert(num_warps == (4 if ASYM else 8), "the consumer warpgroups of the default partition")
        gl.static_assert(BLOCK_N == 64, "64-key tiles: each consumer warpgroup scores 32 keys")
        gl.static_assert((D_QK == 576 and FMT != 2) or (D_QK == 512 and FMT != 1), "V3.2 rows or V4 rows")
        if not ASYM:  # "asym" programs walk items (row, head block, split) themselves: a 1-D grid
            i_hb = gl.program_id(0) % N_HB
            i_t = (gl.program_id(0) // N_HB).to(gl.int64)
            i_s = gl.program_id(1)
            p_idx, p_eidx, n1, lo, hi, n_tiles = _row_split(idx, lens, eidx, elens, i_t, i_s, stride_i_t, stride_ei_t,
                                                            K, EK, HAS_LEN, HAS_EXTRA, E_HAS_LEN, NUM_SPLITS,
                                                            BLOCK_N)  # fmt: skip

        SW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], gl.bfloat16)
        STAGED: gl.constexpr = (OPTS & 4) != 0
        PW: gl.constexpr = 4  # producer warps (one warpgroup)
        if STAGED and FMT == 2:
            # "staged", V4: ONE bf16 tile (448 latent + 64 rope columns), P apart, STAGES fp8 stages (raw e4m3 rows
            # in [64, 512] bytes, the V3.2 swizzle), STAGES raw rope slots and the exponent words
            F8V: gl.constexpr = gl.SwizzledSharedLayout(64, 1, 2, order=[1, 0])
            q_smem = gl.allocate_shared_memory(gl.bfloat16, [D_QK // 64, 64, 64], SW)
            lat = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, 512], SW)
            p_smem = gl.allocate_shared_memory(gl.bfloat16, [64, BLOCK_N], P_SMEM)
            lat8 = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 512], F8V)
            rope8 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64],
                                              gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))  # fmt: skip
            ex8 = gl.allocate_shared_memory(gl.float32, [STAGES * 2, BLOCK_N],
                                            gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # fmt: skip
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for st in gl.static_range(STAGES):
                mbarrier.init(ready.index(st), count=PW * 32)  # one noinc cp.async arrive per producer thread
                mbarrier.init(empty.index(st), count=1)  # the fp8 stage dequantised
            fence_async_shared()

            gl.warp_specialize([
                (_consumer, (q, q_smem, lat, rope8, p_smem, ready, empty, lat8, ex8, empty, p_idx, p_eidx, sink, out,
                             lse, o_part, lse_part, rope_pos, cos_sin, scale_log2, stride_q_t, stride_q_h, stride_o_t,
                             stride_o_h, stride_l_t, stride_cs, num_pos, T, H, i_t, i_hb, i_s, lo, hi, n1, n_tiles,
                             num_slots, e_num_slots, D_QK, BLOCK_N, STAGES, NUM_SPLITS, HAS_EXTRA, HAS_SINK, HAS_ROPE,
                             ROPE, False, OPTS)),
                (_gather_staged_v4, (kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16, p_idx, p_eidx, lat8, ex8, rope8,
                                     ready, empty, lo, hi, n1, n_tiles, stride_kv_b, stride_ekv_b, num_slots,
                                     e_num_slots, PAGE, E_PAGE, BLOCK_N, STAGES, HAS_EXTRA)),
            ], [PW], [PRODUCER_REGS])  # fmt: skip

            for st in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(st))
                mbarrier.invalidate(empty.index(st))
        elif STAGED:
            # "staged": ONE bf16 latent tile, STAGES rope slots (P aliases one once its scores are done) and STAGES
            # fp8 stages (raw e4m3 rows; odd rows swap their 64-byte halves, so the consumers' 16-byte loads of two
            # rows' 64 bytes each hit distinct banks, as do the producer's cp.async of a row's 128 bytes)
            gl.static_assert(FMT == 1 and D_QK == 576 and not HAS_EXTRA, "staged: V3.2 fp8_ds_mla, one source")
            F8: gl.constexpr = gl.SwizzledSharedLayout(64, 1, 2, order=[1, 0])
            F1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
            q_smem = gl.allocate_shared_memory(gl.bfloat16, [D_QK // 64, 64, 64], SW)
            lat = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_N, 512], SW)
            rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], SW)
            lat8 = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 512], F8)
            sc8 = gl.allocate_shared_memory(gl.float32, [STAGES * 4, BLOCK_N], F1)  # [stage, group] rows of scales
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for st in gl.static_range(STAGES):
                mbarrier.init(ready.index(st), count=PW * 32)  # one noinc cp.async arrive per producer thread
                mbarrier.init(empty.index(st), count=1)  # the fp8 stage dequantised
                mbarrier.init(free.index(st), count=1)  # the rope slot (and P) done with
            fence_async_shared()  # barrier inits visible to the async proxy and the other partitions

            gl.warp_specialize([
                (_consumer, (q, q_smem, lat, rope, rope, ready, empty, lat8, sc8, free, p_idx, p_eidx, sink, out, lse,
                             o_part, lse_part, rope_pos, cos_sin, scale_log2, stride_q_t, stride_q_h, stride_o_t,
                             stride_o_h, stride_l_t, stride_cs, num_pos, T, H, i_t, i_hb, i_s, lo, hi, n1, n_tiles,
                             num_slots, e_num_slots, D_QK, BLOCK_N, STAGES, NUM_SPLITS, HAS_EXTRA, HAS_SINK, HAS_ROPE,
                             ROPE, False, OPTS)),
                (_gather_staged, (kv, kv_f32, kv_b16, p_idx, lat8, sc8, rope, ready, empty, free, lo, hi, n_tiles,
                                  stride_kv_b, stride_kv_p, num_slots, PAGE, BLOCK_N, STAGES)),
            ], [PW], [PRODUCER_REGS])  # fmt: skip

            for st in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(st))
                mbarrier.invalidate(empty.index(st))
                mbarrier.invalidate(free.index(st))
        elif ASYM:
            # "asym": the plain path's ring and P, the rows' factors (per tile, and final) for warpgroup 1; programs
            # walk the items (row, head block, split) in launch order, one an SM for bf16 rows
            F1A: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
            q_smem = gl.allocate_shared_memory(gl.bfloat16, [D_QK // 64, 64, 64], SW)
            lat = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 512], SW)
            if D_QK > 512:
                rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], SW)
            else:
                rope = lat  # no rope columns (V4): never read
            p_smem = gl.allocate_shared_memory(gl.bfloat16, [64, BLOCK_N], P_SMEM)
            a_smem = gl.allocate_shared_memory(gl.float32, [64], F1A)
            f_smem = gl.allocate_shared_memory(gl.float32, [64], F1A)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            # P ready / free, the final factors written / read, Q landed / done with
            sync = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
            for st in gl.static_range(STAGES):
                mbarrier.init(ready.index(st), count=PW * 32 if FMT == 0 else 1)
                mbarrier.init(empty.index(st), count=2)  # both warpgroups' P V of the stage
            for b in gl.static_range(4):
                mbarrier.init(sync.index(b), count=1)
            mbarrier.init(sync.index(4), count=PW * 32)  # one noinc cp.async arrive per producer thread
            mbarrier.init(sync.index(5), count=1)
            fence_async_shared()
            n_items = T * N_HB * NUM_SPLITS

            gl.warp_specialize([
                (_asym_scorer, (q, q_smem, lat, rope, p_smem, a_smem, f_smem, ready, empty, sync.index(0),
                                sync.index(1), sync.index(2), sync.index(3), sync.index(4), sync.index(5), idx, lens,
                                eidx, elens, sink, out, lse, o_part, lse_part, scale_log2, stride_q_t, stride_q_h,
                                stride_i_t, stride_ei_t, stride_o_t, stride_o_h, stride_l_t, T, H, K, EK, num_slots,
                                e_num_slots, n_items, D_QK, N_HB, BLOCK_N, STAGES, NUM_SPLITS, HAS_LEN, HAS_EXTRA,
                                E_HAS_LEN, HAS_SINK, FMT == 0, (OPTS & 2) != 0, WALK)),
                (_asym_pv, (lat, p_smem, a_smem, f_smem, ready, empty, sync.index(0), sync.index(1), sync.index(2),
                            sync.index(3), idx, lens, eidx, elens, out, o_part, rope_pos, cos_sin, stride_i_t,
                            stride_ei_t, stride_o_t, stride_o_h, stride_cs, num_pos, T, H, K, EK, n_items, N_HB,
                            BLOCK_N, STAGES, NUM_SPLITS, HAS_LEN, HAS_EXTRA, E_HAS_LEN, HAS_ROPE, ROPE, FMT == 0,
                            (OPTS & 2) != 0, D_QK == 512)),
                (_asym_producer, (q, q_smem, sync.index(4), sync.index(5), kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16,
                                  idx, lens, eidx, elens, lat, rope, ready, empty, stride_q_t, stride_q_h, stride_i_t,
                                  stride_ei_t, stride_kv_b, stride_kv_p, stride_ekv_b, stride_ekv_p, T, H, K, EK,
                                  num_slots, e_num_slots, n_items, PAGE, E_PAGE, FMT, D_QK, N_HB, NUM_SPLITS, HAS_LEN,
                                  HAS_EXTRA, E_HAS_LEN, BLOCK_N, STAGES, FP8_PASSES, OPTS, WALK)),
            ], [4, PW], [_ASYM_PV_REGS, PRODUCER_REGS])  # fmt: skip

            for st in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(st))
                mbarrier.invalidate(empty.index(st))
            for b in gl.static_range(6):
                mbarrier.invalidate(sync.index(b))
        else:
            q_smem = gl.allocate_shared_memory(gl.bfloat16, [D_QK // 64, 64, 64], SW)
            lat = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 512], SW)
            if D_QK > 512:
                rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], SW)
            else:
                rope = lat  # no rope columns (V4): never read
            p_smem = gl.allocate_shared_memory(gl.bfloat16, [64, BLOCK_N], P_SMEM)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for st in gl.static_range(STAGES):
                # bf16: one noinc cp.async arrive per producer thread; fp8: one arrive after the partition barrier
                mbarrier.init(ready.index(st), count=PW * 32 if FMT == 0 else 1)
                mbarrier.init(empty.index(st), count=1)
            fence_async_shared()  # barrier inits visible to the async proxy and the other partitions

            gl.warp_specialize([
                (_consumer, (q, q_smem, lat, rope, p_smem, ready, empty, lat, lat, empty, p_idx, p_eidx, sink,
                             out, lse, o_part, lse_part, rope_pos, cos_sin, scale_log2, stride_q_t, stride_q_h,
                             stride_o_t, stride_o_h, stride_l_t, stride_cs, num_pos, T, H, i_t, i_hb, i_s, lo, hi,
                             n1, n_tiles, num_slots, e_num_slots, D_QK, BLOCK_N, STAGES, NUM_SPLITS, HAS_EXTRA,
                             HAS_SINK, HAS_ROPE, ROPE, FMT == 0, OPTS)),
                (_producer, (kv, kv_f32, kv_b16, ekv, ekv_f32, ekv_b16, p_idx, p_eidx, lat, rope, ready, empty,
                             lo, hi, n1, n_tiles, stride_kv_b, stride_kv_p, stride_ekv_b, stride_ekv_p, num_slots,
                             e_num_slots, PAGE, E_PAGE, FMT, BLOCK_N, STAGES, FP8_PASSES, D_QK > 512, HAS_EXTRA,
                             OPTS)),
            ], [PW], [PRODUCER_REGS])  # fmt: skip

            for st in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(st))
                mbarrier.invalidate(empty.index(st))


def gluon_sparse_unsupported(q: torch.Tensor, kv_cache: torch.Tensor, kv_cache_dtype: str, d_v: int, *,
                             ragged: bool = False, extra_kv_cache: torch.Tensor | None = None,
                             inv_rope: bool = False) -> str | None:  # fmt: skip
    """Why the Gluon kernel cannot run this (already validated) call, or None when it can: it needs Gluon, an sm90
    CUDA device, bf16 q ``[T, H, 576]`` (V3.2) or ``[T, H, 512]`` (V4), d_v 512, a bf16 ``"auto"``, ``"fp8_ds_mla"``
    or ``"fp8_v4"`` cache (and extra cache; not fp8_ds_mla with one), dense indices (``ragged``: either source's are
    ragged) and int32 slots. The fused inverse RoPE (``inv_rope``) is supported: the argument documents the call."""
    del inv_rope
    if not GLUON_AVAILABLE:
        return "triton.experimental.gluon is not installed"
    if q.device.type != "cuda":
        return f"it runs on CUDA devices only; q is on {q.device}"
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return f"it needs an sm90 (Hopper) GPU; got sm{''.join(map(str, torch.cuda.get_device_capability(q.device)))}"
    if kv_cache_dtype not in _FORMATS:
        return f"kv_cache_dtype must be one of {tuple(_FORMATS)}; got {kv_cache_dtype!r}"
    if q.dtype != torch.bfloat16 or q.shape[2] not in D_QKS:
        return f"q must be bf16 [T, H, {D_QK}] or [T, H, {D_V}]; got {q.dtype} {tuple(q.shape)}"
    if d_v != D_V:
        return f"d_v must be {D_V}; got {d_v}"
    if ragged:
        return "ragged indices are not supported (pass dense [T, K] indices with topk_length)"
    if extra_kv_cache is not None and kv_cache_dtype == "fp8_ds_mla":  # V3.2 has one source
        return "fp8_ds_mla with a second source is not supported (its producer spills, sm90 offline)"
    for name, cache in (("", kv_cache), ("extra ", extra_kv_cache)):
        if cache is None:
            continue
        if kv_cache_dtype == "auto" and cache.dtype != torch.bfloat16:
            return f"an 'auto' {name}cache must be bf16; got {cache.dtype}"
        if cache.shape[0] * cache.shape[1] >= 2**31:
            return f"the {name}cache has 2^31 slots or more (int32 slots)"
    return None


def sparse_mla_fwd_gluon(q, kv_cache, kv_cache_dtype: str, idx, lens, sink, out, lse, o_part, lse_part,
                         scale_log2: float, num_splits: int, *, extra_kv_cache=None, extra_indices=None,
                         extra_topk_length=None, inv_rope=None, opts: int = 0) -> None:  # fmt: skip
    """Launch the Gluon kernel over ``T x cdiv(H, 64)`` programs x ``num_splits`` ("asym": those work items walked by
    one program an SM for bf16 rows) (arguments as
    ``_sparse_mla_fwd_kernel``'s, caches as ``sparse_mla`` validated them (fp8_v4: uint8 ``[nb, bs, 584]``);
    validated by the caller and :func:`gluon_sparse_unsupported`). ``inv_rope``: ``(positions [T], cos_sin [P, R])``
    or None. One split writes ``out`` / ``lse``; several write ``o_part`` / ``lse_part`` for
    ``_sparse_mla_merge_fwd_kernel`` (which applies the sink and the inverse RoPE then). ``opts``: the OPTS bits
    of :func:`gluon_opts_bits` (0: the default code)."""
    from openmla.ops.sparse import _cache_views, _num_sms  # the Triton kernel's views and strides of a cache

    fmt = _FORMATS[kv_cache_dtype]
    T, H, d_qk = q.shape
    n_hb = triton.cdiv(H, BLOCK_H)
    has_extra = extra_kv_cache is not None
    views, stride_b, stride_p = _cache_views(kv_cache, fmt)
    ekv = extra_kv_cache if has_extra else kv_cache
    eviews, e_stride_b, e_stride_p = _cache_views(ekv, fmt)
    if fmt == 2 and opts & (_STAGED | _RING):  # cp.async of 16-byte row pieces and 4-byte exponent words
        if stride_b % 16 or e_stride_b % 16:
            raise ValueError(f"_gluon_opts 'staged' / 'ring' need fp8_v4 blocks 16-byte aligned (padded blocks, or "
                             f"an even block size); got block strides {stride_b} and {e_stride_b} B")  # fmt: skip
        views[1], eviews[1] = kv_cache.view(torch.float32), ekv.view(torch.float32)
    if fmt == 1 and opts & _RING and (stride_b % 16 or stride_p % 16):  # 16-byte cp.async of row pieces
        raise ValueError(f"_gluon_opts 'ring' needs fp8_ds_mla rows 16-byte aligned; got block / row strides "
                         f"{stride_b} / {stride_p} B")  # fmt: skip
    eidx = extra_indices if has_extra else idx
    if inv_rope is not None:
        cos_sin = inv_rope[1]
        rope_args, stride_cs, num_pos, rope_dim = inv_rope, cos_sin.stride(0), cos_sin.shape[0], cos_sin.shape[1]
    else:
        rope_args, stride_cs, num_pos, rope_dim = (lse, lse), 0, 0, 2
    args = (q, *views, idx, lens if lens is not None else idx, *eviews, eidx,
            extra_topk_length if extra_topk_length is not None else eidx, sink if sink is not None else lse, out, lse,
            o_part, lse_part, *rope_args, scale_log2, q.stride(0), q.stride(1), stride_b, stride_p, e_stride_b,
            e_stride_p, idx.stride(0), eidx.stride(0), out.stride(0), out.stride(1), lse.stride(0), stride_cs,
            num_pos, T, H, idx.shape[1], eidx.shape[1] if has_extra else 0, kv_cache.shape[0] * kv_cache.shape[1],
            ekv.shape[0] * ekv.shape[1])  # fmt: skip
    shared = dict(PAGE=kv_cache.shape[1], E_PAGE=ekv.shape[1], FMT=fmt, D_QK=d_qk, NUM_SPLITS=num_splits,
                  HAS_LEN=lens is not None, HAS_EXTRA=has_extra, E_HAS_LEN=has_extra and extra_topk_length is not None,
                  HAS_SINK=sink is not None, HAS_ROPE=inv_rope is not None, ROPE=rope_dim)  # fmt: skip
    if is_narrow(H, opts):
        from openmla.ops.gluon.sparse_narrow import launch_narrow

        launch_narrow(args, T, H, num_splits, fmt, bool(opts & GLUON_OPTS["nanpack"]), bool(opts & _RING), **shared)
        return
    if _smem_bytes(d_qk, opts) > SMEM_LIMIT:  # pragma: no cover - a constant check (the narrow kernel has its own)
        raise ValueError(f"the Gluon sparse kernel needs {_smem_bytes(d_qk, opts)} B of shared memory "
                         f"(> {SMEM_LIMIT})")  # fmt: skip
    walk = False
    if opts & _ASYM:  # a 1-D grid over the items; bf16 rows with many items an SM: one program an SM walks them
        n_items = T * n_hb * num_splits
        if n_items >= 2**31 - 2**16:  # the walk's item ids (plus a stride of programs) stay int32
            raise ValueError(f"{T} rows x {n_hb} head blocks x {num_splits} splits exceed 2**31 - 2**16 work items")
        sms = _num_sms(q.device)
        walk = fmt == 0 and n_items >= WALK_MIN_ITEMS * sms
        grid = (sms if walk else n_items,)
    else:
        grid = (T * n_hb, num_splits)
    _sparse_mla_gluon_fwd_kernel[grid](
        *args, N_HB=n_hb, BLOCK_N=BLOCK_N, STAGES=STAGES, FP8_PASSES=FP8_PASSES,
        PRODUCER_REGS=producer_regs(fmt, d_qk, opts), num_warps=4 if opts & _ASYM else NUM_WARPS,
        **({"OPTS": opts} if opts else {}),
        **({"WALK": True} if walk else {}),
        **shared,
    )  # fmt: skip
