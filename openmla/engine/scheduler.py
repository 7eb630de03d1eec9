"""Continuous-batching scheduler: decodes first, chunked prefill under a token budget, preemption.

Each step the scheduler picks, within ``max_num_batched_tokens`` tokens and ``max_num_seqs`` requests:

1. every running request in the decode phase (one new token, plus up to ``num_spec_tokens`` drafts
   to verify), oldest first;
2. running requests still in their (chunked) prefill, as many prompt tokens as the budget leaves;
3. waiting requests, oldest first (a preempted request re-enters at the front), as prompt chunks.

When the cache runs out of blocks for a running request, the most recently admitted request that is
not yet scheduled this step is preempted by recompute: its blocks are freed, its computed-token count
reset, and it goes back to the front of the waiting queue with its prompt *and* the tokens it already
generated, which are prefilled again when it is readmitted. No request is lost: a request only leaves
the scheduler when it has produced ``max_new_tokens`` tokens.

Token accounting: ``num_computed_tokens`` counts the tokens whose KV is in the cache. A request in the
decode phase has every token but its last (just sampled) one computed.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from openmla.engine.blocks import BlockManager
from openmla.engine.drafter import NgramDrafter

__all__ = ["Request", "RequestStatus", "ScheduledRequest", "Scheduler", "SchedulerOutput"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request (greedy, exactly ``max_new_tokens`` new tokens, no early stop)."""

    req_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.remaining_new_tokens <= 0

    @property
    def in_decode_phase(self) -> bool:
        return self.num_tokens - self.num_computed_tokens == 1


@dataclass
class ScheduledRequest:
    """A request's share of a step: ``num_new_tokens`` of its own tokens, then ``draft_ids``.

    The fed tokens are ``all_token_ids[c : c + num_new_tokens] + draft_ids`` at positions
    ``c, c + 1, ...`` with ``c = num_computed_tokens`` (at scheduling time).
    """

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    draft_ids: list[int] = field(default_factory=list)

    @property
    def query_len(self) -> int:
        return self.num_new_tokens + len(self.draft_ids)

    @property
    def samples(self) -> bool:
        """True when the step reaches the request's last token, so its logits give new tokens."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        c = self.num_computed_tokens
        return self.request.all_token_ids[c : c + self.num_new_tokens] + list(self.draft_ids)


@dataclass
class SchedulerOutput:
    """One step: the scheduled requests (decodes first) and who was preempted to make room."""

    scheduled: list[ScheduledRequest]
    preempted: list[str]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.query_len for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    r"""Continuous batching over a paged cache.

    Args:
        block_manager (BlockManager): the cache's blocks and per-request tables.
        max_num_seqs (int): most running requests.
        max_num_batched_tokens (int): token budget per step (drafts included).
        max_model_len (int): longest sequence (prompt + output + drafts).
        num_spec_tokens (int): drafts to verify per decode (0: plain decoding).
        drafter (NgramDrafter | None): draft proposer (default: prompt lookup).
        enable_chunked_prefill (bool): split prompts longer than the remaining budget.

    Raises:
        ValueError: on non-positive limits.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_spec_tokens: int = 0,
        drafter: NgramDrafter | None = None,
        enable_chunked_prefill: bool = True,
    ) -> None:
        for name, val in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int; got {val!r}")
        if num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0; got {num_spec_tokens}")
        if max_num_batched_tokens < 1 + num_spec_tokens:
            raise ValueError("max_num_batched_tokens must hold at least one verify step (1 + num_spec_tokens)")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_spec_tokens = num_spec_tokens
        self.drafter = drafter if drafter is not None else NgramDrafter()
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # ------------------------------------------------------------ requests
    def add_request(self, req: Request) -> None:
        """Queue a request.

        Raises:
            ValueError: an empty prompt, a non-positive ``max_new_tokens``, or a request that could
                never fit in ``max_model_len`` or in the whole cache.
        """
        if not req.prompt_ids:
            raise ValueError(f"request {req.req_id}: empty prompt")
        if req.max_new_tokens < 1:
            raise ValueError(f"request {req.req_id}: max_new_tokens must be >= 1, got {req.max_new_tokens}")
        total = len(req.prompt_ids) + req.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"request {req.req_id}: prompt + max_new_tokens = {total} > max_model_len {self.max_model_len}"
            )
        if self.bm.blocks_needed(total) > self.bm.allocator.num_blocks:
            raise ValueError(
                f"request {req.req_id}: needs {self.bm.blocks_needed(total)} blocks, the cache has "
                f"{self.bm.allocator.num_blocks}"
            )
        if req.req_id in self.finished or any(r.req_id == req.req_id for r in (*self.waiting, *self.running)):
            raise ValueError(f"duplicate request id {req.req_id!r}")
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------ schedule
    def _preempt(self, req: Request) -> None:
        self.bm.free(req.req_id)
        self.running.remove(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _drafts(self, req: Request, budget: int) -> list[int]:
        k = min(
            self.num_spec_tokens,
            req.remaining_new_tokens - 1,  # drafts past the last wanted token are wasted work
            self.max_model_len - req.num_tokens,  # verified positions must fit the model
            budget - 1,
        )
        return self.drafter.propose(req.all_token_ids, k) if k > 0 else []

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work (see the module docstring)."""
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[str] = []

        def reserve(req: Request, num_tokens: int) -> bool:
            # Make room by preempting the newest unscheduled running request; if none is left,
            # preempt req itself (False).
            while not self.bm.ensure(req.req_id, num_tokens):
                victim = next((r for r in reversed(self.running) if r is not req and r.req_id not in scheduled), None)
                if victim is None:
                    self._preempt(req)
                    preempted.append(req.req_id)
                    return False
                self._preempt(victim)
                preempted.append(victim.req_id)
            return True

        # 1. decodes (and verifies), oldest first
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or not req.in_decode_phase:
                continue
            drafts = self._drafts(req, budget)
            n = 1 + len(drafts)
            if reserve(req, req.num_computed_tokens + n):
                scheduled[req.req_id] = ScheduledRequest(req, req.num_computed_tokens, 1, drafts)
                budget -= n
        # 2. running prefills (later chunks)
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or req.req_id in scheduled:
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill:
                continue
            if reserve(req, req.num_computed_tokens + n):
                scheduled[req.req_id] = ScheduledRequest(req, req.num_computed_tokens, n)
                budget -= n
        # 3. admit waiting requests
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            remaining = req.num_tokens - req.num_computed_tokens
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill:
                break
            if not self.bm.ensure(req.req_id, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.req_id] = ScheduledRequest(req, req.num_computed_tokens, n)
            budget -= n

        items = list(scheduled.values())
        # decodes (one own token) first, prefill chunks after; stable within each group
        items.sort(key=lambda s: s.num_new_tokens != 1 or not s.samples)
        return SchedulerOutput(scheduled=items, preempted=preempted)

    # -------------------------------------------------------------- update
    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """Advance the requests of a finished step.

        Args:
            output (SchedulerOutput): what :meth:`schedule` returned for the step.
            sampled (dict[str, list[int]]): for each request whose step :attr:`~ScheduledRequest.samples`,
                the greedy token after each of its last ``1 + len(draft_ids)`` fed tokens.

        Returns:
            dict[str, list[int]]: the tokens each request gained this step.

        Raises:
            ValueError: a sampling request has the wrong number of tokens.
        """
        new_tokens: dict[str, list[int]] = {}
        for s in output.scheduled:
            req = s.request
            if not s.samples:
                req.num_computed_tokens += s.num_new_tokens
                continue
            greedy = sampled.get(req.req_id)
            if greedy is None or len(greedy) != 1 + len(s.draft_ids):
                raise ValueError(f"request {req.req_id}: expected {1 + len(s.draft_ids)} sampled tokens, got {greedy}")
            accepted = 0
            while accepted < len(s.draft_ids) and s.draft_ids[accepted] == greedy[accepted]:
                accepted += 1
            self.num_draft_tokens += len(s.draft_ids)
            self.num_accepted_tokens += accepted
            req.num_computed_tokens += s.num_new_tokens + accepted
            gained = greedy[: accepted + 1][: req.remaining_new_tokens]
            req.output_ids.extend(gained)
            new_tokens[req.req_id] = gained
            if req.is_finished:
                req.status = RequestStatus.FINISHED
                self.running.remove(req)
                self.bm.free(req.req_id)
                self.finished[req.req_id] = req
        return new_tokens
