"""Metadata builder of the sparse MLA backend (DeepSeek V3.2 DSA): one set of per-token tensors a step.

Every token of a step (decode, speculative verify and prefill rows alike) runs the same path: the layer's
lightning indexer picks up to ``topk`` request-local positions per token (causal, bottom-right aligned), they
are converted to global cache slots, and sparse MLA attends to those slots in the absorbed MQA form (as vLLM
runs V3.2: no MHA prefill). So unlike the dense builder there is no decode/prefill split; the builder provides

* ``req_id_per_token`` and ``positions`` (each token's request row and absolute position, -1 on padding rows),
* ``sparse_lens`` (``min(pos + 1, topk)``, SPEC §6.2; 0 on padding rows),
* the scratch buffers every layer writes its top-k into (request-local, then global slots).

CUDA graphs: every tensor lives in a buffer allocated once in ``__init__`` (sized by ``max_num_seqs``,
``max_model_len`` and ``max_num_batched_tokens``); a build copies the step's values into them with device ops
only (``searchsorted`` on the device query starts), so it never synchronises with the device and a captured
step replays against the same addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openmla.metadata.batch import BatchSpec, check_block_table_covers, check_slot_mapping_rows, host_seq_len_bound
from openmla.metadata.dense import _cdiv, _same_device
from openmla.ops._validate import check_positive_ints
from openmla.ops.sparse_indices import sparse_seq_lens

__all__ = ["SparseMLAMetadata", "SparseMLAMetadataBuilder"]


@dataclass
class SparseMLAMetadata:
    r"""Everything the sparse MLA layers of one step read (views of the builder's persistent buffers).

    Attributes:
        num_actual_tokens (int): real tokens; rows past it (CUDA-graph padding) belong to no request.
        num_input_tokens (int): rows of the token buffers ``T`` (padding included).
        num_reqs (int): requests ``B`` (padding requests of query length 0 included).
        slot_mapping (torch.Tensor): `[T]`, int64; cache slot per token, -1 = not written (a view of the spec's
            own ``slot_mapping``, the runner's persistent token buffer, like its input ids and positions).
        query_start_loc (torch.Tensor): `[B + 1]`, int32.
        seq_lens (torch.Tensor): `[B]`, int32; context + new tokens per request.
        block_table (torch.Tensor): `[B, max_blocks_per_seq]`, int32 (columns past a request's blocks are stale
            and never read: the indexer only scores positions below ``seq_lens``).
        req_id_per_token (torch.Tensor): `[T]`, int32; each token's request row, -1 on padding rows.
        positions (torch.Tensor): `[T]`, int64; ``seq_len - qlen + j`` for the j-th new token, -1 on padding rows.
        sparse_lens (torch.Tensor): `[T]`, int32; ``min(pos + 1, topk)``, 0 on padding rows.
        topk_indices (torch.Tensor): `[T, topk]`, int32 scratch: a layer's request-local top-k (-1 padded).
        global_indices (torch.Tensor): `[T, topk]`, int32 scratch: the same as global slots (-1 = none).
        topk (int): entries per token, ``min(index_topk, max_blocks_per_seq * block_size)``.
        block_size (int): tokens per cache block.
        max_query_len (int): longest query of the step (host value).
        max_seq_len (int): the indexer's score width: ``max_blocks_per_seq * block_size`` for decode-only steps
            (static, so a captured graph serves every later length), else the step's longest sequence.
        is_decode_only (bool): every query is at most the decode threshold long.
    """

    num_actual_tokens: int
    num_input_tokens: int
    num_reqs: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    req_id_per_token: torch.Tensor
    positions: torch.Tensor
    sparse_lens: torch.Tensor
    topk_indices: torch.Tensor
    global_indices: torch.Tensor
    topk: int
    block_size: int
    max_query_len: int
    max_seq_len: int
    is_decode_only: bool


class SparseMLAMetadataBuilder:
    r"""Builds :class:`SparseMLAMetadata` for the V3.2 sparse MLA layers, once per step.

    Args:
        index_topk (int): the model's top-k (2048 for V3.2).
        block_size (int): tokens per cache block (>= 1; MLA and indexer caches share the block table).
        max_num_seqs (int): most requests in one step.
        max_model_len (int): longest sequence (sizes the block table and the decode score width).
        max_num_batched_tokens (int): most token rows in one step (padding included).
        device (torch.device | str): where the buffers live.
        decode_threshold (int): longest query counted as a decode (``1 + num_speculative_tokens``).

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(
        self,
        *,
        index_topk: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device | str,
        decode_threshold: int = 1,
    ) -> None:
        check_positive_ints(
            ("index_topk", index_topk),
            ("block_size", block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("decode_threshold", decode_threshold),
        )
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_threshold = decode_threshold
        self.device = torch.device(device)
        self.max_blocks_per_seq = _cdiv(max_model_len, block_size)
        # a row never has more than max_model_len valid keys: a wider top-k buffer would only hold -1
        self.topk = min(index_topk, self.max_blocks_per_seq * block_size)
        dev, B, T, K = self.device, max_num_seqs, max_num_batched_tokens, self.topk
        # Persistent buffers: a captured graph reads these addresses on every replay.
        self._qsl = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        self._seq_lens = torch.zeros(B, dtype=torch.int32, device=dev)
        self._block_table = torch.zeros(B, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self._rows = torch.arange(T, dtype=torch.int32, device=dev)
        self._req_id = torch.full((T,), -1, dtype=torch.int32, device=dev)
        self._positions = torch.full((T,), -1, dtype=torch.int64, device=dev)
        self._sparse_lens = torch.zeros(T, dtype=torch.int32, device=dev)
        self._topk = torch.full((T, K), -1, dtype=torch.int32, device=dev)
        self._global = torch.full((T, K), -1, dtype=torch.int32, device=dev)

    def build(self, spec: BatchSpec) -> SparseMLAMetadata:
        """Build the step's metadata from device copies and host values only (no synchronisation).

        Args:
            spec (BatchSpec): the step (any order of decodes and prefills).

        Returns:
            SparseMLAMetadata: views of the persistent buffers.

        Raises:
            TypeError: ``spec`` is not a BatchSpec.
            ValueError: the step exceeds the builder's sizes, lives on another device, or is not causal
                (the indexer's top-k is causal; non-causal drafts have no V3.2 meaning); ``slot_mapping`` has
                fewer than ``num_input_tokens`` entries; ``seq_lens_cpu`` (when given) is below a query length;
                the block table has fewer columns than the longest request (``seq_lens_cpu``, else
                ``max_seq_len``) needs (the persistent table's later columns hold an earlier step's blocks).
        """
        if not isinstance(spec, BatchSpec):
            raise TypeError(f"build expects a BatchSpec, got {type(spec).__name__}")
        B, T = spec.num_reqs, spec.num_input_tokens
        if B > self.max_num_seqs:
            raise ValueError(f"batch has {B} requests but the builder was sized for {self.max_num_seqs}")
        if T > self.max_num_batched_tokens:
            raise ValueError(
                f"batch has {T} token rows (num_input_tokens) but the builder was sized for "
                f"{self.max_num_batched_tokens}"
            )
        if spec.block_table.shape[1] > self.max_blocks_per_seq:
            raise ValueError(
                f"block_table has {spec.block_table.shape[1]} columns but max_model_len {self.max_model_len} at "
                f"block_size {self.block_size} needs at most {self.max_blocks_per_seq}"
            )
        if spec.max_seq_len > self.max_model_len:
            raise ValueError(f"batch has a request of up to {spec.max_seq_len} tokens (max_seq_len) but "
                             f"max_model_len {self.max_model_len}")  # fmt: skip
        if not _same_device(spec.device, self.device):
            raise ValueError(f"batch tensors are on {spec.device} but the builder's buffers on {self.device}")
        if not spec.causal:
            raise ValueError("sparse MLA (V3.2) needs causal steps: the indexer's top-k is causal")
        check_slot_mapping_rows(spec)
        longest = host_seq_len_bound(spec)  # host values only: no device sync
        check_block_table_covers(spec, _cdiv(longest, self.block_size), longest, self.block_size)

        nb = self.device.type == "cuda"
        qsl = self._qsl[: B + 1]
        qsl.copy_(spec.query_start_loc, non_blocking=nb)
        seq_lens = self._seq_lens[:B]
        seq_lens.copy_(spec.seq_lens, non_blocking=nb)
        W = spec.block_table.shape[1]
        self._block_table[:B, :W].copy_(spec.block_table, non_blocking=nb)
        block_table = self._block_table[:B]

        rows = self._rows[:T]
        req_id = self._req_id[:T]
        positions = self._positions[:T]
        if B:
            # request of row t: the first b with qsl[b + 1] > t (empty requests skipped); rows past qsl[B] get B
            torch.searchsorted(qsl[1:], rows, right=True, out_int32=True, out=req_id)
            valid = rows < qsl[B]
            req_c = req_id.clamp(max=B - 1).long()  # a gather index only; padding rows are masked just below
            qlen = qsl[1:] - qsl[:-1]
            pos = (seq_lens - qlen)[req_c] + (rows - qsl[:-1][req_c])
            torch.where(valid, pos.to(torch.int64), torch.full_like(positions, -1), out=positions)
            torch.where(valid, req_id, torch.full_like(req_id, -1), out=req_id)
        else:
            req_id.fill_(-1)
            positions.fill_(-1)
        sparse_lens = sparse_seq_lens(qsl, seq_lens, self.topk, num_tokens=T, out=self._sparse_lens[:T],
                                      validate=False)  # fmt: skip

        qsl_cpu = spec.query_start_loc_cpu.tolist()  # host tensor: no device sync
        max_qlen = max([qsl_cpu[i + 1] - qsl_cpu[i] for i in range(B)], default=0)
        decode_only = max_qlen <= self.decode_threshold
        max_seq_len = self.max_blocks_per_seq * self.block_size if decode_only else spec.max_seq_len
        return SparseMLAMetadata(
            num_actual_tokens=spec.num_actual_tokens,
            num_input_tokens=T,
            num_reqs=B,
            slot_mapping=spec.slot_mapping[:T],
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=block_table,
            req_id_per_token=req_id,
            positions=positions,
            sparse_lens=sparse_lens,
            topk_indices=self._topk[:T],
            global_indices=self._global[:T],
            topk=self.topk,
            block_size=self.block_size,
            max_query_len=max(max_qlen, 1),
            max_seq_len=max(max_seq_len, 1),
            is_decode_only=decode_only,
        )
