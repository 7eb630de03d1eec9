"""Metadata builder of the dense MLA backend (DeepSeek V2/V3): split decodes from prefills, plan both.

The builder turns a :class:`~openmla.metadata.batch.BatchSpec` into an :class:`MLAMetadata` that every
MLA layer of the step reads:

* **Decodes** are the leading requests whose query length is at most ``decode_threshold`` (1 plus the
  number of speculative tokens, so verify rows are decodes). They run the absorbed MQA form over the
  latent cache (``mla_decode``) with one :func:`~openmla.ops.plan.plan_decode` work plan per step.
* **Prefills** are the rest (from the first request whose query is longer than the threshold on).
  They run MHA over the new tokens plus, for requests with cached context, the context in chunks that
  fit a fixed workspace (chunked prefill / prefix caching).

CUDA graphs: every decode tensor the layers read lives in a buffer allocated once in ``__init__``
(sized by ``max_num_seqs``, ``max_model_len`` and ``max_num_batched_tokens``), so a captured decode
step replays against stable addresses; each build only copies new values into them. A decode-only
build branches on host values alone (``query_start_loc_cpu`` and ints), so it never synchronises with
the device. Padded replays follow the uniform speculative padding rule (:func:`uniform_padded_query_len`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openmla.metadata.batch import BatchSpec, check_block_table_covers, host_seq_len_bound
from openmla.ops._validate import check_positive_ints
from openmla.ops.plan import plan_decode

__all__ = [
    "ChunkedContextMetadata",
    "MLADecodeMetadata",
    "MLAMetadata",
    "MLAMetadataBuilder",
    "MLAPrefillMetadata",
    "split_decodes_and_prefills",
    "uniform_padded_query_len",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` name the same device when the current device is 0."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    cur = torch.cuda.current_device()
    return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)


@dataclass
class MLADecodeMetadata:
    r"""Decode half of a step: the first ``num_reqs`` requests, token rows ``[0, num_tokens)``.

    Attributes:
        block_table (torch.Tensor): `[num_reqs, max_blocks_per_seq]`, int32; a view of a persistent
            buffer (columns past a request's last block are stale and never read).
        seq_lens (torch.Tensor): `[num_reqs]`, int32; keys per request (new tokens included). Padding
            requests of a uniform speculative replay get ``uniform_query_len``.
        query_start_loc (torch.Tensor): `[num_reqs + 1]`, int32; ``qo_indptr`` of the kernel
            (``arange * uniform_query_len`` for padded uniform replays).
        max_query_len (int): longest decode query (the uniform length when padded).
        max_seq_len (int): an upper bound of ``seq_lens`` (host value).
        num_reqs (int): decode requests (padding requests included).
        num_tokens (int): decode token rows (padding rows included).
        uniform_query_len (int): the synthesized uniform query length of a padded replay, else 0.
        plan (object | None): the step's decode work plan (``plan_decode``), shared by all layers.
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_reqs: int
    num_tokens: int
    uniform_query_len: int = 0
    plan: object | None = None


@dataclass
class ChunkedContextMetadata:
    r"""The plan for the prefills' cached context (chunked prefill / prefix caching).

    The context tokens of all prefill requests are laid end to end, request after request, and processed
    in chunks of ``chunk_size`` tokens (a chunk may span requests; a long context spans chunks), so the
    gathered and up-projected workspace stays bounded whatever the context lengths
    (:func:`~openmla.ops.chunked_prefill.mla_prefill_with_context` follows this plan).

    Attributes:
        context_lens (torch.Tensor): `[num_prefills]`, int32, device; cached tokens per prefill.
        context_lens_cpu (torch.Tensor): the same on the CPU.
        chunk_size (int): context tokens per chunk, over all requests.
        num_chunks (int): ``ceil(sum(context_lens) / chunk_size)``.
        total_context_tokens (int): ``sum(context_lens)``.
    """

    context_lens: torch.Tensor
    context_lens_cpu: torch.Tensor
    chunk_size: int
    num_chunks: int
    total_context_tokens: int


@dataclass
class MLAPrefillMetadata:
    r"""Prefill half of a step: requests ``[num_decodes, num_reqs)``, token rows after the decodes.

    Attributes:
        query_start_loc (torch.Tensor): `[num_prefills + 1]`, int32, device; rebased to start at 0
            (``cu_seqlens`` of the new tokens).
        query_start_loc_cpu (torch.Tensor): the same, int32, CPU.
        max_query_len (int): longest prefill query.
        block_table (torch.Tensor): `[num_prefills, max_blocks]`, int32, device.
        seq_lens (torch.Tensor): `[num_prefills]`, int32, device.
        context_lens_cpu (torch.Tensor): `[num_prefills]`, int32, CPU; cached tokens before the new ones.
        chunked_context (ChunkedContextMetadata | None): None when no prefill has context.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    max_query_len: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    context_lens_cpu: torch.Tensor
    chunked_context: ChunkedContextMetadata | None = None


@dataclass
class MLAMetadata:
    r"""Everything the MLA layers of one step read.

    Attributes:
        num_actual_tokens (int): real tokens; rows past it (CUDA-graph padding) are ignored.
        num_input_tokens (int): rows of the token buffers (padding included).
        slot_mapping (torch.Tensor): `[num_input_tokens]`, int64, device; cache slot per token, -1 = skip.
        causal (bool): causal attention among a request's new tokens.
        num_decodes, num_decode_tokens, num_prefills, num_prefill_tokens (int): the split.
        decode (MLADecodeMetadata | None), prefill (MLAPrefillMetadata | None): the two halves.
    """

    num_actual_tokens: int
    num_input_tokens: int
    slot_mapping: torch.Tensor
    causal: bool
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    decode: MLADecodeMetadata | None = None
    prefill: MLAPrefillMetadata | None = None


def split_decodes_and_prefills(query_lens: list[int], decode_threshold: int) -> int:
    """Number of leading requests that are decodes (query length <= ``decode_threshold``).

    The batch must list decodes first; the first request with a longer query starts the prefills, and
    every request after it is a prefill whatever its length (the prefill path handles any length).

    Args:
        query_lens (list[int]): per request query length (host values).
        decode_threshold (int): longest query a decode may have (1 + speculative tokens).

    Returns:
        int: the number of decode requests.
    """
    for i, n in enumerate(query_lens):
        if n > decode_threshold:
            return i
    return len(query_lens)


def uniform_padded_query_len(query_lens: list[int], max_query_len: int, num_decode_tokens: int) -> int:
    """The uniform query length a padded CUDA-graph replay gives its dummy requests, or 0.

    A graph captured for ``R`` requests of a uniform query length ``q`` replays with ``R * q`` token
    rows. When fewer requests are real, the dummy requests sit at the end with query length 0
    (``query_start_loc`` stays flat) while the token buffer still holds ``R * q`` rows. Only when the
    whole picture is consistent with one uniform length do the dummies get it (and a matching
    ``seq_len``), so that no padded row attends to nothing and the kernel sees a uniform batch:

    * there are more token rows than real query tokens, and they divide evenly over the requests
      into ``q > 1`` rows each (for ``q == 1`` the plain ``arange`` layout already covers dummies);
    * at least one request is a dummy (query length 0), the dummies form a suffix, and every real
      request has exactly ``q`` tokens (and ``max_query_len == q`` when any is real).

    Args:
        query_lens (list[int]): per decode request query length (host values; 0 for dummies).
        max_query_len (int): the longest of them.
        num_decode_tokens (int): decode token rows in the (padded) input buffer.

    Returns:
        int: ``q`` when the rule applies, else 0.
    """
    num_reqs = len(query_lens)
    if num_reqs == 0 or num_decode_tokens <= 0:
        return 0
    if num_decode_tokens <= sum(query_lens):
        return 0
    if num_decode_tokens % num_reqs:
        return 0
    uniform = num_decode_tokens // num_reqs
    if uniform <= 1:
        return 0
    real = [n for n in query_lens if n > 0]
    if len(real) == num_reqs:
        return 0
    if real and (max_query_len != uniform or any(n != uniform for n in real)):
        return 0
    first_dummy = query_lens.index(0)
    if any(n > 0 for n in query_lens[first_dummy:]):
        return 0
    return uniform


class MLAMetadataBuilder:
    r"""Builds :class:`MLAMetadata` for the dense MLA layers, once per step.

    Args:
        num_heads (int): query heads per layer (for the decode plan).
        block_size (int): tokens per cache block (>= 1).
        max_num_seqs (int): most requests in one step (sizes the persistent decode buffers).
        max_model_len (int): longest sequence (sizes the block-table buffer).
        max_num_batched_tokens (int): most tokens in one step.
        device (torch.device | str): where the buffers live.
        decode_threshold (int): longest query treated as a decode (``1 + num_speculative_tokens``).
        dtype (torch.dtype): model dtype.
        kv_entry (int): cache row width (576 = 512 latent + 64 rope).
        kv_lora_rank (int): latent width of the layers (512 for DeepSeek V3): the decode output width the
            plan's buffers are sized for; must be below ``kv_entry`` (the rest is the rope).
        workspace_tokens (int | None): context tokens per chunk of a chunked-context prefill (bounds
            its workspace); default ``min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 64 * 1024)``.
        use_plan (bool): compute a ``plan_decode`` work plan per step (on by default).
        kv_cache_dtype (str): "auto" or "fp8", the cache the decode kernel reads (the plan's tiles).

    Raises:
        ValueError: on non-positive sizes, ``kv_lora_rank >= kv_entry`` or an unknown ``kv_cache_dtype``.
    """

    def __init__(
        self,
        *,
        num_heads: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device | str,
        decode_threshold: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        kv_entry: int = 576,
        kv_lora_rank: int = 512,
        workspace_tokens: int | None = None,
        use_plan: bool = True,
        kv_cache_dtype: str = "auto",
    ) -> None:
        check_positive_ints(
            ("num_heads", num_heads),
            ("block_size", block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("decode_threshold", decode_threshold),
            ("kv_entry", kv_entry),
            ("kv_lora_rank", kv_lora_rank),
        )
        if kv_lora_rank >= kv_entry:
            raise ValueError(f"kv_lora_rank ({kv_lora_rank}) must be below kv_entry ({kv_entry}): latent + rope")
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f'kv_cache_dtype must be "auto" or "fp8"; got {kv_cache_dtype!r}')
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_threshold = decode_threshold
        self.device = torch.device(device)
        self.dtype = dtype
        self.use_plan = use_plan
        self.kv_cache_dtype = kv_cache_dtype
        self.max_blocks_per_seq = _cdiv(max_model_len, block_size)
        if workspace_tokens is None:
            workspace_tokens = min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 64 * 1024)
        if not isinstance(workspace_tokens, int) or workspace_tokens < 1:
            raise ValueError(f"workspace_tokens must be a positive int; got {workspace_tokens!r}")
        self.workspace_tokens = workspace_tokens

        dev = self.device
        # Persistent decode buffers: a captured graph reads these addresses on every replay.
        self._seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=dev)
        self._qo_indptr = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=dev)
        self._arange = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=dev)
        self._block_table = torch.zeros(max_num_seqs, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self._plans: dict[tuple[int, int], object] = {}

    # ------------------------------------------------------------------ build
    def build(self, spec: BatchSpec) -> MLAMetadata:
        """Split ``spec`` into decodes and prefills and build both halves.

        Args:
            spec (BatchSpec): the step; decodes must come first.

        Returns:
            MLAMetadata: the step's metadata (decode tensors are views of persistent buffers).

        Raises:
            TypeError: ``spec`` is not a BatchSpec.
            ValueError: the batch exceeds the sizes the builder was made for (requests, ``max_model_len``), or
                lives elsewhere; ``seq_lens_cpu`` (when given) is below a query length; the block table has fewer
                columns than the longest request (``seq_lens_cpu``, else ``max_seq_len``) needs.
        """
        if not isinstance(spec, BatchSpec):
            raise TypeError(f"build expects a BatchSpec, got {type(spec).__name__}")
        if spec.num_reqs > self.max_num_seqs:
            raise ValueError(f"batch has {spec.num_reqs} requests but the builder was sized for {self.max_num_seqs}")
        if spec.block_table.shape[1] > self.max_blocks_per_seq:
            raise ValueError(
                f"block_table has {spec.block_table.shape[1]} columns but max_model_len {self.max_model_len} at "
                f"block_size {self.block_size} needs at most {self.max_blocks_per_seq}"
            )
        if not _same_device(spec.device, self.device):
            raise ValueError(f"batch tensors are on {spec.device} but the builder's buffers on {self.device}")
        # the plan's work items and the block-table buffer cover max_model_len: a longer request would be cut
        if spec.max_seq_len > self.max_model_len:
            raise ValueError(f"batch has a request of up to {spec.max_seq_len} tokens (max_seq_len) but "
                             f"max_model_len {self.max_model_len}")  # fmt: skip
        # the decode block-table buffer's columns past the spec's hold an earlier step's blocks: never read them
        longest = host_seq_len_bound(spec)  # host values only: no device sync
        check_block_table_covers(spec, _cdiv(longest, self.block_size), longest, self.block_size)

        qsl = spec.query_start_loc_cpu.tolist()  # host tensor: no device sync
        query_lens = [qsl[i + 1] - qsl[i] for i in range(spec.num_reqs)]
        num_decodes = split_decodes_and_prefills(query_lens, self.decode_threshold)
        num_prefills = spec.num_reqs - num_decodes
        num_decode_tokens = qsl[num_decodes]
        num_prefill_tokens = spec.num_actual_tokens - num_decode_tokens
        if num_prefills == 0:
            # Decode-only: the whole (possibly padded) token buffer belongs to the decodes.
            num_decode_tokens = spec.num_input_tokens

        decode = None
        if num_decodes:
            decode = self._build_decode(spec, query_lens[:num_decodes], num_decode_tokens)
            num_decode_tokens = decode.num_tokens
        prefill = None
        if num_prefills:
            prefill = self._build_prefill(spec, num_decodes, qsl)
        return MLAMetadata(
            num_actual_tokens=spec.num_actual_tokens,
            num_input_tokens=spec.num_input_tokens,
            slot_mapping=spec.slot_mapping,
            causal=spec.causal,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            decode=decode,
            prefill=prefill,
        )

    # ----------------------------------------------------------------- decode
    def _build_decode(self, spec: BatchSpec, query_lens: list[int], num_decode_tokens: int) -> MLADecodeMetadata:
        """Decode metadata from host values and device copies only (no synchronisation)."""
        B = len(query_lens)
        max_qlen = max(query_lens)
        uniform = uniform_padded_query_len(query_lens, max_qlen, num_decode_tokens)

        seq_lens = self._seq_lens[:B]
        seq_lens.copy_(spec.seq_lens[:B], non_blocking=True)
        qo_indptr = self._qo_indptr[: B + 1]
        if uniform:
            # Dummy requests get the uniform query length and a seq_len equal to it (they attend to
            # themselves only, so no row is empty); the kernel sees B uniform requests.
            qlen_dev = spec.query_start_loc[1 : B + 1] - spec.query_start_loc[:B]
            torch.where(qlen_dev > 0, seq_lens, torch.full_like(seq_lens, uniform), out=seq_lens)
            torch.mul(self._arange[: B + 1], uniform, out=qo_indptr)
            max_qlen = uniform
            num_tokens = B * uniform
        elif max_qlen <= 1 and num_decode_tokens >= B:
            # One token per request: qo_indptr is an arange, so a padding request (query length 0 in
            # query_start_loc, seq_len 0) owns one padding row, which sees no key and comes out as 0.
            qo_indptr.copy_(self._arange[: B + 1], non_blocking=True)
            num_tokens = B
        else:
            qo_indptr.copy_(spec.query_start_loc[: B + 1], non_blocking=True)
            num_tokens = sum(query_lens)
        max_qlen = max(max_qlen, 1)  # a batch of padding requests only still plans one row each

        W = spec.block_table.shape[1]
        self._block_table[:B, :W].copy_(spec.block_table[:B], non_blocking=True)
        block_table = self._block_table[:B]

        plan = None
        if self.use_plan:
            # One plan object per (batch size, query length): a captured graph keeps reading the
            # buffers of the plan it was captured with, and each build rewrites them in place. Sized
            # for max_model_len, so its work-item capacity (the kernel's grid) never changes.
            key = (B, max_qlen)
            plan = plan_decode(
                seq_lens, qo_indptr, self.num_heads, max_query_len=max_qlen, max_seq_len=self.max_model_len,
                d_v=self.kv_lora_rank, kv_cache_dtype=self.kv_cache_dtype, out=self._plans.get(key),
                validate=False,  # the batch spec was checked on the host
            )  # fmt: skip
            self._plans[key] = plan
        return MLADecodeMetadata(
            block_table=block_table,
            seq_lens=seq_lens,
            query_start_loc=qo_indptr,
            max_query_len=max_qlen,
            max_seq_len=max(spec.max_seq_len, max_qlen),
            num_reqs=B,
            num_tokens=num_tokens,
            uniform_query_len=uniform,
            plan=plan,
        )

    # ---------------------------------------------------------------- prefill
    def _build_prefill(self, spec: BatchSpec, num_decodes: int, qsl: list[int]) -> MLAPrefillMetadata:
        """Prefill metadata; plans the context chunks on the host (reads ``seq_lens_cpu``)."""
        B = spec.num_reqs
        base = qsl[num_decodes]
        qsl_p = torch.tensor([x - base for x in qsl[num_decodes:]], dtype=torch.int32)
        query_lens = qsl_p[1:] - qsl_p[:-1]
        seq_lens_cpu = spec.seq_lens_cpu
        if seq_lens_cpu is None:  # documented: prefill planning without a host copy synchronises
            seq_lens_cpu = spec.seq_lens.cpu()
        seq_lens_p = seq_lens_cpu[num_decodes:B].to(torch.int32)
        context_lens = seq_lens_p - query_lens
        if bool((context_lens < 0).any()):
            raise ValueError(f"seq_lens {seq_lens_p.tolist()} shorter than query lengths {query_lens.tolist()}")
        qsl_dev = spec.query_start_loc[num_decodes:] - base
        chunked = self._plan_context_chunks(context_lens) if bool((context_lens > 0).any()) else None
        return MLAPrefillMetadata(
            query_start_loc=qsl_dev,
            query_start_loc_cpu=qsl_p,
            max_query_len=int(query_lens.max()),
            block_table=spec.block_table[num_decodes:B],
            seq_lens=spec.seq_lens[num_decodes:B],
            context_lens_cpu=context_lens,
            chunked_context=chunked,
        )

    def _plan_context_chunks(self, context_lens: torch.Tensor) -> ChunkedContextMetadata:
        """Chunk plan for the prefills' context (host arithmetic, one host-to-device copy)."""
        total = int(context_lens.sum())
        chunk = self.workspace_tokens
        if chunk >= self.block_size:  # whole blocks per chunk when the workspace allows
            chunk = chunk // self.block_size * self.block_size
        return ChunkedContextMetadata(
            context_lens=context_lens.to(self.device, non_blocking=True),
            context_lens_cpu=context_lens,
            chunk_size=chunk,
            num_chunks=_cdiv(total, chunk),
            total_context_tokens=total,
        )
