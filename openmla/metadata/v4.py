"""DeepSeek V4 step metadata: per-token positions, sliding-window and compressed index sets, compressor slots.

One :class:`V4MetadataBuilder` serves every layer of a step. From a :class:`~openmla.metadata.BatchSpec` it
derives, on the device and without a host synchronisation:

* ``positions [T]``: ``seq_lens[b] - qlen_b + j`` for the j-th new token of request b (0 for padding rows);
* the sliding-window slots of every token (``swa_indices``), read from the SWA cache (same block table);
* per compression ratio r of the model: the compressed caches' block size ``bs_c = block_size // r`` (or 1
  when ``r >= block_size``: compressed entry i of a request lives in slot
  ``block_table[b, i // bs_c] * bs_c + i % bs_c`` of a cache with as many blocks as the main one), the HCA
  index set (every visible entry ``i < (pos + 1) // r``), and the per-row view the CSA indexer scores with
  (each query row its own "request" over the ``(pos + 1) // r`` entries it may see);
* ``state_slots [B]``: each request's compressor-state slot, written by the runner into a persistent buffer;
* with ``swa_ring_blocks = n``: the SWA cache is a ring of n blocks per state slot (slot s owns blocks
  ``[s n, (s + 1) n)``, position p in block ``s n + (p // block_size) % n``), so it holds the last
  ``n * block_size`` tokens of a request instead of all of them; ``slot_mapping`` and the SWA indices then point
  into the ring. ``n = ring_blocks(window, max_query_len, block_size)`` keeps every row a step reads or writes
  distinct.

Every output is a view of a persistent buffer sized for ``max_num_batched_tokens`` rows and ``max_num_seqs``
requests (``slot_mapping`` without a ring: a view of the spec's own, the runner's persistent token buffer), so a
decode step captured in a CUDA graph replays against the same addresses after ``build``. ``build`` checks the step on
the host values alone (``query_start_loc_cpu``, ``seq_lens_cpu`` when given, ints) and never synchronises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openmla.metadata.batch import BatchSpec, check_block_table_covers, check_slot_mapping_rows, host_seq_len_bound
from openmla.metadata.dense import _same_device
from openmla.ops._validate import check_positive_ints
from openmla.ops.v4_indices import hca_indices, swa_indices

#: HCA index rows are padded to a multiple of this (FlashMLA's sparse decode takes index widths of 64k).
HCA_WIDTH_MULTIPLE = 64

__all__ = ["V4CompressedMetadata", "V4Metadata", "V4MetadataBuilder", "compressed_block_size", "ring_blocks"]


def ring_blocks(window: int, max_query_len: int, block_size: int) -> int:
    """SWA ring blocks per request: a step's window rows and new rows span ``window + max_query_len - 1``
    positions, so at most ``ceil((window + max_query_len - 1) / block_size) + 1`` blocks, which must not alias."""
    return -(-(window + max_query_len - 1) // block_size) + 1


def compressed_block_size(block_size: int, ratio: int) -> int:
    """Block size of a ratio-``ratio`` compressed cache sharing the main cache's block table.

    Raises:
        ValueError: neither of ``block_size`` and ``ratio`` divides the other (entries would straddle blocks).
    """
    if ratio < 1 or block_size < 1:
        raise ValueError(f"block_size ({block_size}) and ratio ({ratio}) must be >= 1")
    if block_size % ratio and ratio % block_size:
        raise ValueError(f"block_size {block_size} and compress ratio {ratio}: one must divide the other")
    return max(1, block_size // ratio)


@dataclass
class V4CompressedMetadata:
    """What the layers of one compression ratio read.

    Attributes:
        ratio (int), block_size (int): the ratio and the compressed caches' block size.
        hca_indices (torch.Tensor): `[T, width]` int32 compressed slots of every visible entry, -1 after.
        hca_lens (torch.Tensor): `[T]` int32 ``(pos + 1) // ratio`` (0 for padding rows).
        row_query_start_loc (torch.Tensor): `[T + 1]` int32 ``0..T``: each row its own request (indexer).
        row_block_table (torch.Tensor): `[T, max_blocks]` int32: the block table row of each token's request.
    """

    ratio: int
    block_size: int
    hca_indices: torch.Tensor
    hca_lens: torch.Tensor
    row_query_start_loc: torch.Tensor
    row_block_table: torch.Tensor


@dataclass
class V4Metadata:
    """One V4 step (views of the builder's persistent buffers; shapes use T = ``num_input_tokens``).

    Attributes:
        positions (torch.Tensor): `[T]` int64.
        slot_mapping (torch.Tensor): `[T]` int64 SWA-cache slots, -1 for padding rows.
        query_start_loc (torch.Tensor): `[B + 1]` int32. seq_lens (torch.Tensor): `[B]` int32.
        block_table (torch.Tensor): `[B, max_blocks]` int32 (the SWA cache's and, with ``bs_c``, the
            compressed caches').
        state_slots (torch.Tensor): `[B]` int32 compressor-state slots.
        swa_indices (torch.Tensor): `[T, window]` int32 SWA slots. swa_lens (torch.Tensor): `[T]` int32.
        compressed (dict[int, V4CompressedMetadata]): per compression ratio.
        block_size (int), window (int), num_tokens (int), num_reqs (int), max_query_len (int).
        swa_block_table (torch.Tensor | None): `[B, max_blocks]` int32, the SWA cache's block table (the ring's
            with ``swa_ring_blocks``, else ``block_table``): the gathered prefill route reads the window through it.
        query_start_loc_cpu (torch.Tensor | None), seq_lens_cpu (torch.Tensor | None): the spec's host copies, so
            a layer can plan a prefill workspace without a host synchronisation (None when the spec has none).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    state_slots: torch.Tensor
    swa_indices: torch.Tensor
    swa_lens: torch.Tensor
    compressed: dict[int, V4CompressedMetadata]
    block_size: int
    window: int
    num_tokens: int
    num_reqs: int
    max_query_len: int
    swa_block_table: torch.Tensor | None = None
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None


class V4MetadataBuilder:
    r"""Builds :class:`V4Metadata` into persistent buffers.

    Args:
        block_size (int): the SWA (main) cache's block size.
        window (int): the sliding window W (keys ``[pos - W + 1, pos]``).
        ratios (tuple[int, ...]): the model's compression ratios (CSA's and HCA's; empty for SWA-only models).
        max_num_seqs (int), max_num_batched_tokens (int), max_model_len (int): engine limits.
        device (torch.device | str): where the buffers live.
        max_blocks_per_seq (int | None): block-table width (default ``ceil(max_model_len / block_size)``).
        swa_ring_blocks (int | None): SWA ring blocks per state slot (module docstring); None: the SWA cache uses
            the scheduler's blocks and ``spec.slot_mapping`` (every token resident).

    Raises:
        ValueError: a size or ratio that is not a positive int, block size and a ratio of which neither divides the
            other, or a ring too small for the window.
    """

    def __init__(
        self,
        *,
        block_size: int,
        window: int,
        ratios: tuple[int, ...],
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        device: torch.device | str,
        max_blocks_per_seq: int | None = None,
        swa_ring_blocks: int | None = None,
    ) -> None:
        check_positive_ints(
            ("block_size", block_size),
            ("window", window),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        )
        for name, v in (("max_blocks_per_seq", max_blocks_per_seq), ("swa_ring_blocks", swa_ring_blocks)):
            if v is not None:
                check_positive_ints((name, v))
        for i, r in enumerate(ratios):
            check_positive_ints((f"ratios[{i}]", r))
        self.block_size, self.window = int(block_size), int(window)
        self.ratios = tuple(sorted({int(r) for r in ratios}))
        self.bs_c = {r: compressed_block_size(self.block_size, r) for r in self.ratios}
        self.max_num_seqs, self.max_tokens = int(max_num_seqs), int(max_num_batched_tokens)
        self.max_model_len = int(max_model_len)
        self.device = torch.device(device)
        self.max_blocks_per_seq = max_blocks_per_seq or -(-self.max_model_len // self.block_size)
        T, B, dev = self.max_tokens, self.max_num_seqs, self.device
        i32 = dict(dtype=torch.int32, device=dev)
        self._positions = torch.zeros(T, dtype=torch.int64, device=dev)
        self._qsl = torch.zeros(B + 1, **i32)
        self._seq_lens = torch.zeros(B, **i32)
        self._bt = torch.zeros(B, self.max_blocks_per_seq, **i32)
        self._arange = torch.arange(T + 1, **i32)
        self.state_slots = torch.arange(B, **i32)  # the runner writes each step's slots here
        self._swa = torch.full((T, self.window), -1, **i32)
        self._swa_lens = torch.zeros(T, **i32)
        self._req = torch.zeros(T, dtype=torch.int64, device=dev)
        self._row_bt = torch.zeros(T, self.max_blocks_per_seq, **i32)
        self.swa_ring_blocks = swa_ring_blocks
        if swa_ring_blocks is not None:
            if swa_ring_blocks < ring_blocks(self.window, 1, self.block_size):
                raise ValueError(f"swa_ring_blocks {swa_ring_blocks} cannot hold a window of {self.window}")
            self._logical = torch.arange(self.max_blocks_per_seq, dtype=torch.int64, device=dev) % swa_ring_blocks
            self._swa_bt = torch.zeros(B, self.max_blocks_per_seq, **i32)
            self._swa_slots = torch.full((T,), -1, dtype=torch.int64, device=dev)
        self._hca = {}
        for r in self.ratios:
            width = -(-max(1, -(-self.max_model_len // r)) // HCA_WIDTH_MULTIPLE) * HCA_WIDTH_MULTIPLE
            self._hca[r] = (torch.full((T, width), -1, **i32), torch.zeros(T, **i32))

    def _blocks_needed(self, seq_len: int) -> int:
        """Block-table columns a request of ``seq_len`` tokens uses: its SWA positions (unless in the ring) and
        each ratio's compressed entries ``[0, seq_len // r)`` in blocks of ``bs_c``."""
        need = 0 if self.swa_ring_blocks is not None else -(-seq_len // self.block_size)
        for r in self.ratios:
            need = max(need, -(-(seq_len // r) // self.bs_c[r]))
        return need

    def build(self, spec: BatchSpec) -> V4Metadata:
        """Fill the buffers for ``spec`` (device ops only; the checks read host values only, no synchronisation).

        Raises:
            TypeError: ``spec`` is not a BatchSpec.
            ValueError: more rows or requests than the buffers hold, a block table wider than them or narrower than
                the longest request needs (``seq_lens_cpu``, else ``max_seq_len``), a request longer than
                ``max_model_len`` (the HCA rows and the RoPE tables end there), ``seq_lens_cpu`` (when given) below a
                query length, fewer ``slot_mapping`` entries than rows, a query that overruns the SWA ring, or
                tensors on another device.
        """
        if not isinstance(spec, BatchSpec):
            raise TypeError(f"build expects a BatchSpec, got {type(spec).__name__}")
        T, B = spec.num_input_tokens, spec.num_reqs
        if T > self.max_tokens or B > self.max_num_seqs:
            raise ValueError(f"step of {T} rows / {B} requests exceeds the builder ({self.max_tokens} / "
                             f"{self.max_num_seqs})")  # fmt: skip
        W = spec.block_table.shape[1]
        if W > self.max_blocks_per_seq:
            raise ValueError(f"block_table width {W} > {self.max_blocks_per_seq}")
        if not _same_device(spec.device, self.device):
            raise ValueError(f"batch tensors are on {spec.device} but the builder's buffers on {self.device}")
        if spec.max_seq_len > self.max_model_len:
            raise ValueError(f"batch has a request of up to {spec.max_seq_len} tokens (max_seq_len) but "
                             f"max_model_len {self.max_model_len}")  # fmt: skip
        check_slot_mapping_rows(spec)
        longest = host_seq_len_bound(spec)  # host values only: no device sync
        check_block_table_covers(spec, self._blocks_needed(longest), longest, self.block_size)
        qsl_cpu = spec.query_start_loc_cpu.tolist()  # host tensor: no device sync
        max_qlen = max([qsl_cpu[i + 1] - qsl_cpu[i] for i in range(B)], default=0)
        n = self.swa_ring_blocks
        if n is not None and ring_blocks(self.window, max_qlen, self.block_size) > n:  # the longest query, not a hint
            raise ValueError(f"a query of {max_qlen} rows overruns the SWA ring of {n} blocks")

        # The step's request tensors, copied into persistent buffers (a captured graph reads these addresses).
        nb = self.device.type == "cuda"
        qsl, seq_lens, bt = self._qsl[: B + 1], self._seq_lens[:B], self._bt[:B, :W]
        qsl.copy_(spec.query_start_loc, non_blocking=nb)
        seq_lens.copy_(spec.seq_lens, non_blocking=nb)
        bt.copy_(spec.block_table, non_blocking=nb)
        rows = self._arange[:T].to(torch.int64)
        if B:
            # token -> request: the last request whose first row is <= t (rows past qsl[B] are padding).
            req = torch.searchsorted(qsl[1:].to(torch.int64), rows, right=True).clamp_(max=B - 1)
            valid = rows < qsl[B].to(torch.int64)
            qlen = (qsl[1:] - qsl[:-1]).to(torch.int64)
            pos = seq_lens.to(torch.int64)[req] - qlen[req] + rows - qsl[:-1].to(torch.int64)[req]
            pos = torch.where(valid, pos, torch.zeros_like(pos))
        else:  # no request: every row is padding
            req, valid, pos = torch.zeros_like(rows), torch.zeros_like(rows, dtype=torch.bool), torch.zeros_like(rows)
        self._positions[:T].copy_(pos)
        self._req[:T].copy_(req)
        if self.ratios:
            if B:
                self._row_bt[:T, :W].copy_(bt[req])
            else:
                self._row_bt[:T, :W].zero_()
        slot_mapping, swa_bt = spec.slot_mapping[:T], bt
        if self.swa_ring_blocks is not None:
            bs = self.block_size
            base = self.state_slots[:B].to(torch.int64) * n
            self._swa_bt[:B, :W].copy_(base[:, None] + self._logical[None, :W])
            if B:
                ring = (base[req] + torch.div(pos, bs, rounding_mode="floor") % n) * bs + pos % bs
                self._swa_slots[:T].copy_(torch.where(valid & (slot_mapping >= 0), ring, -1))
            else:
                self._swa_slots[:T].fill_(-1)
            slot_mapping, swa_bt = self._swa_slots[:T], self._swa_bt[:B, :W]
        if B == 0:  # the index kernels need a request: padding rows see nothing
            self._swa[:T].fill_(-1)
            self._swa_lens[:T].zero_()
            for idx, lens in self._hca.values():
                idx[:T].fill_(-1)
                lens[:T].zero_()
        else:
            swa_indices(
                qsl, seq_lens, swa_bt, block_size=self.block_size, window=self.window, num_tokens=T,
                slot_mapping=slot_mapping, out_indices=self._swa, out_lens=self._swa_lens, validate=False,
            )  # fmt: skip
            for r in self.ratios:
                idx, lens = self._hca[r]
                hca_indices(
                    qsl, seq_lens, bt, block_size=self.bs_c[r], ratio=r, width=idx.shape[1], num_tokens=T,
                    slot_mapping=slot_mapping, out_indices=idx, out_lens=lens, validate=False,
                )  # fmt: skip
        compressed = {}
        for r in self.ratios:
            idx, lens = self._hca[r]
            compressed[r] = V4CompressedMetadata(
                ratio=r,
                block_size=self.bs_c[r],
                hca_indices=idx[:T],
                hca_lens=lens[:T],
                row_query_start_loc=self._arange[: T + 1],
                row_block_table=self._row_bt[:T, :W],
            )
        return V4Metadata(
            positions=self._positions[:T],
            slot_mapping=slot_mapping,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=bt,
            state_slots=self.state_slots[:B],
            swa_indices=self._swa[:T],
            swa_lens=self._swa_lens[:T],
            compressed=compressed,
            block_size=self.block_size,
            window=self.window,
            num_tokens=T,
            num_reqs=B,
            max_query_len=max_qlen,
            swa_block_table=swa_bt,
            query_start_loc_cpu=spec.query_start_loc_cpu,
            seq_lens_cpu=spec.seq_lens_cpu,
        )
