"""What a scheduler hands an attention backend each step: one flattened, ragged batch.

Requests are described token-major: request ``b`` owns query rows
``query_start_loc[b]:query_start_loc[b + 1]`` and has ``seq_lens[b]`` tokens in total (cached context plus
the new ones), so its new tokens sit at positions ``seq_lens[b] - qlen_b .. seq_lens[b] - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BatchSpec"]


@dataclass
class BatchSpec:
    r"""One scheduled step, as the attention metadata builders consume it.

    Host-side fields (``query_start_loc_cpu``, the ints) are what a builder may branch on without
    synchronising with the device; the device tensors are only ever read by kernels or device copies.

    Attributes:
        query_start_loc (torch.Tensor): `[num_reqs + 1]`, int32, on the compute device; cumulative
            query lengths (``query_start_loc[0] == 0``). Padding requests of a CUDA-graph replay repeat
            the last value (query length 0).
        query_start_loc_cpu (torch.Tensor): the same values, int32, on the CPU.
        seq_lens (torch.Tensor): `[num_reqs]`, int32, device; context + new tokens per request.
        block_table (torch.Tensor): `[num_reqs, max_blocks]`, int32, device; logical -> physical block.
        slot_mapping (torch.Tensor): `[num_input_tokens]`, int64 (or int32), device; the cache slot each
            token is written to, -1 for padding tokens.
        num_reqs (int): requests in the batch (padding requests included).
        num_actual_tokens (int): real tokens, ``query_start_loc_cpu[-1]``.
        max_query_len (int): longest query of the batch (an upper bound is fine; never below it).
        max_seq_len (int): longest ``seq_lens`` entry (an upper bound is fine; without ``seq_lens_cpu`` the
            builders check the block table against it, so it must not exceed ``block_table``'s width in tokens).
        causal (bool): causal attention among each request's new tokens (False only for non-causal
            drafts; a plain prefill or a speculative verify is causal).
        seq_lens_cpu (torch.Tensor | None): `[num_reqs]`, int32, CPU copy of ``seq_lens``. Needed to plan
            chunked-context prefill without a host synchronisation; when given, every build checks the lengths
            against the queries and the block table on the host.
        num_input_tokens (int | None): rows of the (possibly CUDA-graph padded) token buffers, at least
            ``num_actual_tokens``; defaults to ``num_actual_tokens``.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    seq_lens_cpu: torch.Tensor | None = None
    num_input_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.num_input_tokens is None:
            self.num_input_tokens = self.num_actual_tokens
        self.validate()

    def validate(self) -> None:
        """Check shapes, dtypes and the host-side invariants (no device synchronisation): ``query_start_loc``
        starts at 0, does not decrease and ends at ``num_actual_tokens``; ``seq_lens_cpu``, when given, is
        bounded by ``max_seq_len``. The device tensors are trusted to hold the CPU copies' values.

        Raises:
            TypeError: a field has the wrong type or dtype.
            ValueError: shapes or counts disagree.
        """
        B = self.num_reqs
        for name in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "block_table", "slot_mapping"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"BatchSpec.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.is_floating_point() or t.dtype == torch.bool:
                raise TypeError(f"BatchSpec.{name} must be an integer tensor, got {t.dtype}")
        for name in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "block_table"):
            if getattr(self, name).dtype != torch.int32:
                raise TypeError(f"BatchSpec.{name} must be int32, got {getattr(self, name).dtype}")
        if self.query_start_loc_cpu.device.type != "cpu":
            raise ValueError(f"BatchSpec.query_start_loc_cpu must be on the CPU, got {self.query_start_loc_cpu.device}")
        if self.seq_lens_cpu is not None and (
            not isinstance(self.seq_lens_cpu, torch.Tensor) or self.seq_lens_cpu.is_floating_point()
        ):
            raise TypeError(f"BatchSpec.seq_lens_cpu must be an integer tensor; got {self.seq_lens_cpu!r:.80}")
        if self.seq_lens_cpu is not None and self.seq_lens_cpu.device.type != "cpu":
            raise ValueError(f"BatchSpec.seq_lens_cpu must be on the CPU, got {self.seq_lens_cpu.device}")
        if not isinstance(B, int) or B < 0:
            raise ValueError(f"BatchSpec.num_reqs must be a non-negative int, got {B!r}")
        if tuple(self.query_start_loc.shape) != (B + 1,) or tuple(self.query_start_loc_cpu.shape) != (B + 1,):
            raise ValueError(
                f"query_start_loc must be [{B + 1}] on both devices; got {tuple(self.query_start_loc.shape)} "
                f"and {tuple(self.query_start_loc_cpu.shape)}"
            )
        if tuple(self.seq_lens.shape) != (B,):
            raise ValueError(f"seq_lens must be [{B}]; got {tuple(self.seq_lens.shape)}")
        if self.block_table.dim() != 2 or self.block_table.shape[0] != B:
            raise ValueError(f"block_table must be [{B}, max_blocks]; got {tuple(self.block_table.shape)}")
        devices = {t.device for t in (self.query_start_loc, self.seq_lens, self.block_table, self.slot_mapping)}
        if len(devices) != 1:
            raise ValueError(f"the device tensors of a BatchSpec must share one device; got {devices}")
        if B and int(self.query_start_loc_cpu[0]) != 0:
            raise ValueError("query_start_loc[0] must be 0")
        if B and bool((self.query_start_loc_cpu[1:] < self.query_start_loc_cpu[:-1]).any()):
            raise ValueError(f"query_start_loc must not decrease; got {self.query_start_loc_cpu.tolist()}")
        qmax = int((self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]).max()) if B else 0
        if isinstance(self.max_query_len, bool) or not isinstance(self.max_query_len, int) or self.max_query_len < qmax:
            # (a smaller hint would size the decode plan below a request's rows)
            raise ValueError(f"max_query_len must be an int >= the longest query ({qmax}); got {self.max_query_len!r}")
        if self.seq_lens_cpu is not None:
            if tuple(self.seq_lens_cpu.shape) != (B,):
                raise ValueError(f"seq_lens_cpu must be [{B}]; got {tuple(self.seq_lens_cpu.shape)}")
            top = int(self.seq_lens_cpu.max()) if B else 0
            if top > self.max_seq_len:
                raise ValueError(f"max_seq_len {self.max_seq_len} is below the longest seq_lens entry ({top})")
        total = int(self.query_start_loc_cpu[-1])
        if total != self.num_actual_tokens:
            raise ValueError(f"num_actual_tokens {self.num_actual_tokens} != query_start_loc[-1] {total}")
        if self.num_input_tokens < self.num_actual_tokens:
            raise ValueError(f"num_input_tokens {self.num_input_tokens} < num_actual_tokens {self.num_actual_tokens}")
        if self.slot_mapping.dim() != 1 or self.slot_mapping.shape[0] < self.num_actual_tokens:
            raise ValueError(
                f"slot_mapping must be 1-D with at least {self.num_actual_tokens} entries; got "
                f"{tuple(self.slot_mapping.shape)}"
            )

    @property
    def device(self) -> torch.device:
        return self.seq_lens.device

    def query_lens_cpu(self) -> torch.Tensor:
        """`[num_reqs]`, int32, CPU: each request's query length."""
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]


def host_seq_len_bound(spec: BatchSpec) -> int:
    """The longest request of ``spec`` from its host values only (no device synchronisation).

    With ``seq_lens_cpu``: checks that every request's ``seq_lens`` covers its query (context + new tokens, so
    also never negative) and returns their maximum; without it the device lengths are trusted (as
    :meth:`BatchSpec.validate` does) and ``max_seq_len``, an upper bound, is returned.

    Raises:
        ValueError: a request whose ``seq_lens`` entry is below its query length.
    """
    if spec.seq_lens_cpu is None:
        return spec.max_seq_len
    if spec.num_reqs == 0:
        return 0
    qlens = spec.query_lens_cpu()
    short = (spec.seq_lens_cpu < qlens).nonzero()
    if short.numel():
        b = int(short[0, 0])
        raise ValueError(
            f"seq_lens[{b}] = {int(spec.seq_lens_cpu[b])} is below request {b}'s query length {int(qlens[b])} "
            f"(seq_lens counts the cached context plus the new tokens); seq_lens_cpu {spec.seq_lens_cpu.tolist()}"
        )
    return int(spec.seq_lens_cpu.max())


def check_block_table_covers(spec: BatchSpec, blocks_needed: int, longest: int, block_size: int) -> None:
    """Refuse a block table narrower than the ``blocks_needed`` columns a request of ``longest`` tokens uses."""
    W = spec.block_table.shape[1]
    if blocks_needed > W:
        src = "seq_lens_cpu" if spec.seq_lens_cpu is not None else "max_seq_len, no seq_lens_cpu"
        raise ValueError(
            f"block_table has {W} columns (shape {tuple(spec.block_table.shape)}) but a request of up to {longest} "
            f"tokens ({src}) at block_size {block_size} needs {blocks_needed}"
        )


def check_slot_mapping_rows(spec: BatchSpec) -> None:
    """The layers write (or skip) one slot per input row: ``slot_mapping`` must cover ``num_input_tokens``."""
    if spec.slot_mapping.shape[0] < spec.num_input_tokens:
        raise ValueError(
            f"slot_mapping must have an entry for each of the {spec.num_input_tokens} input rows (num_input_tokens, "
            f"-1 on padding rows); got shape {tuple(spec.slot_mapping.shape)}, dtype {spec.slot_mapping.dtype}"
        )
