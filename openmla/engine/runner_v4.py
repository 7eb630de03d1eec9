"""The DeepSeek V4 model runner: the V3 runner's step layout and CUDA graphs over V4 caches and metadata.

Besides the paged caches (SWA rows, compressed entries, indexer keys, all on the scheduler's block table),
V4 keeps per-request compressor state: a ring of the last ``coff * ratio`` tokens' projections per layer
(:func:`openmla.compress_kv`). The runner gives each request a state slot when it starts from position 0 (a
new request, or one preempted and recomputed: positions before 0 are never read, so a recycled slot needs
no reset) and frees it when the request finishes or is preempted.

Speculative verify: rejected drafts have written their projections into the ring, over the rows of the
positions one ring length earlier, which the next step still reads. Before a verify step the runner copies
the verifying requests' ring rows aside; at the request's next step it restores the rows of positions before
the verify step's start (those the verify step may have overwritten); accepted rows stay as written.
"""

from __future__ import annotations

import torch

from openmla.engine.runner import ModelRunner, StepInputs
from openmla.engine.scheduler import SchedulerOutput
from openmla.metadata.v4 import V4MetadataBuilder, ring_blocks

__all__ = ["V4ModelRunner"]


class V4ModelRunner(ModelRunner):
    r"""Runs a :class:`DeepseekV4ForCausalLM` on scheduled steps (arguments as :class:`ModelRunner`)."""

    def _init_attention(self, workspace_tokens: int | None) -> None:
        """The V4 builder and caches, and the compressor-state slots (``workspace_tokens`` is unused)."""
        model, max_num_seqs, num_spec_tokens = self.model, self.max_num_seqs, self.num_spec_tokens
        max_model_len, max_num_batched_tokens = self.max_model_len, self.max_num_batched_tokens
        cfg = model.config
        rings = [a.compressor.coff * a.ratio for a in model.attention_layers if a.compressor is not None]
        if rings and 1 + num_spec_tokens > min(rings):
            raise ValueError(
                f"1 + num_spec_tokens ({1 + num_spec_tokens}) must not exceed the shortest compressor ring "
                f"({min(rings)} rows): rejected drafts would overwrite rows still needed"
            )
        model.set_rope_tables(max_model_len + num_spec_tokens + 1)
        # The SWA cache: a ring per state slot holding the last window + one step of tokens (not every token).
        self.swa_ring_blocks = ring_blocks(cfg.sliding_window, max_num_batched_tokens, self.block_size)
        self.builder = V4MetadataBuilder(
            block_size=self.block_size, window=cfg.sliding_window, ratios=model.compress_ratios,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len + num_spec_tokens + 1, device=self.device,
            swa_ring_blocks=self.swa_ring_blocks,
        )  # fmt: skip
        # Slots [0, B) for requests, [B, 2B) for the dummy requests that pad a CUDA-graph batch.
        self.num_state_slots = 2 * max_num_seqs
        self.kv_caches = model.make_caches(self.bm.allocator.num_blocks, self.block_size, self.num_state_slots,
                                           dtype=self.dtype, device=self.device,
                                           swa_blocks=self.num_state_slots * self.swa_ring_blocks)  # fmt: skip
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._slot_of: dict[str, int] = {}
        self._requests: dict = {}
        self._snapshots: dict[str, tuple[int, list]] = {}  # req -> (verify start, saved rings per layer)
        self._set_state_slots([])

    # ------------------------------------------------------ state slots
    def _rings(self):
        """Every compressor ring of the model (main and indexer), layer by layer."""
        return [s for c in self.kv_caches for s in (c.state, c.indexer_state) if s is not None]

    def _set_state_slots(self, slots: list[int]) -> None:
        B = self.max_num_seqs
        full = slots + [B + i for i in range(B - len(slots))]
        self.builder.state_slots.copy_(torch.tensor(full, dtype=torch.int32), non_blocking=self.device.type == "cuda")

    def _release(self, req_id: str) -> None:
        slot = self._slot_of.pop(req_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        self._requests.pop(req_id, None)
        self._snapshots.pop(req_id, None)

    def _assign_slots(self, output: SchedulerOutput) -> None:
        for req_id in output.preempted:
            self._release(req_id)
        for req_id, req in list(self._requests.items()):
            if req.is_finished:
                self._release(req_id)
        slots = []
        for s in output.scheduled:
            req_id = s.request.req_id
            if s.num_computed_tokens == 0:
                self._release(req_id)
            if req_id not in self._slot_of:
                if s.num_computed_tokens != 0:
                    raise RuntimeError(f"request {req_id} resumes at {s.num_computed_tokens} without compressor state")
                self._slot_of[req_id] = self._free_slots.pop()
                self._requests[req_id] = s.request
            slots.append(self._slot_of[req_id])
            self._restore_after_verify(req_id, self._slot_of[req_id], s.num_computed_tokens)
            if s.draft_ids:
                slot = self._slot_of[req_id]
                self._snapshots[req_id] = (s.num_computed_tokens, [r[slot].clone() for r in self._rings()])
        self._set_state_slots(slots)

    def _restore_after_verify(self, req_id: str, slot: int, start: int) -> None:
        """Put back the ring rows of positions before the last verify step's start (rejected drafts overwrote some)."""
        snap = self._snapshots.pop(req_id, None)
        if snap is None:
            return
        v0, saved = snap
        for ring, old in zip(self._rings(), saved, strict=True):
            n = ring.shape[2]  # coff * ratio rows, position p in row p % n
            pos = [p for p in range(max(0, start - n), min(v0, start))]
            if pos:
                rows = torch.tensor([p % n for p in pos], device=ring.device)
                ring[slot, :, rows] = old[:, rows]

    # --------------------------------------------------------------- run
    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, *, all_logits: bool = False) -> tuple[torch.Tensor, StepInputs]:
        """Run one step (see :meth:`ModelRunner.execute`); assigns compressor-state slots first."""
        self._assign_slots(output)
        return super().execute(output, all_logits=all_logits)

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """Capture decode steps; the dummy capture batches use the dummy state slots."""
        self._set_state_slots([])
        super().capture_cuda_graphs()
