"""The engine: scheduler + model runner + greedy sampling, step by step until every request is done."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from openmla.engine.blocks import BlockManager
from openmla.engine.drafter import NgramDrafter
from openmla.engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from openmla.engine.runner import ModelRunner
from openmla.engine.scheduler import Request, Scheduler, SchedulerOutput

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "StepRecord"]


@dataclass
class EngineConfig:
    """Engine limits (see :class:`~openmla.engine.scheduler.Scheduler` and :class:`ModelRunner`).

    ``num_blocks`` defaults to enough blocks for ``max_num_seqs`` sequences of ``max_model_len``
    tokens; ``max_model_len`` defaults to the model's ``max_position_embeddings``.
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    max_model_len: int | None = None
    num_spec_tokens: int = 0
    enable_chunked_prefill: bool = True
    cuda_graphs: bool | None = None  # default: on for CUDA devices
    workspace_tokens: int | None = None
    record_logits: bool = False  # keep every step's logits of every row (for checks against an oracle)


@dataclass
class StepRecord:
    """One request's rows of one step (kept when ``record_logits``).

    Attributes:
        step (int): the engine step (0-based).
        req_id (str): the request.
        context_ids (list[int]): tokens before the fed ones (already in the cache).
        token_ids (list[int]): the fed tokens (own tokens then drafts), at positions
            ``len(context_ids), ...``.
        logits (torch.Tensor): `[len(token_ids), vocab]`, fp32, CPU.
        is_verify (bool): the step verified drafts.
    """

    step: int
    req_id: str
    context_ids: list[int]
    token_ids: list[int]
    logits: torch.Tensor
    is_verify: bool


@dataclass
class EngineStats:
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    num_graph_replays: int = 0
    elapsed_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


class LLMEngine:
    r"""Greedy generation with continuous batching over paged MLA caches.

    Args:
        model (DeepseekV3ForCausalLM): weights loaded, on ``device``, in ``dtype``.
        config (EngineConfig | None): limits and options.
        device (torch.device | str | None): default: the model's device.
        dtype (torch.dtype | None): default: the dtype of the model's LM head.
        drafter (NgramDrafter | None): draft proposer for ``num_spec_tokens > 0``.
        block_manager_factory (callable | None): ``(num_blocks, block_size) -> BlockManager``; default
            :class:`BlockManager` (``openmla.parallel.engine`` passes its rank-aware DCP one).
    """

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        config: EngineConfig | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        drafter: NgramDrafter | None = None,
        block_manager_factory: Callable[[int, int], BlockManager] | None = None,
    ) -> None:
        cfg = config or EngineConfig()
        self.config = cfg
        self.model = model
        self.device = torch.device(device) if device is not None else model.lm_head.weight.device
        self.dtype = dtype or model.lm_head.weight.dtype
        self.vocab_size = model.config.vocab_size
        max_model_len = cfg.max_model_len or model.config.max_position_embeddings
        num_blocks = cfg.num_blocks or cfg.max_num_seqs * -(-max_model_len // cfg.block_size)
        self.block_manager = (block_manager_factory or BlockManager)(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=max_model_len,
            num_spec_tokens=cfg.num_spec_tokens,
            drafter=drafter,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
        )
        cuda_graphs = cfg.cuda_graphs if cfg.cuda_graphs is not None else self.device.type == "cuda"
        runner_cls = ModelRunner
        if getattr(model.config, "model_type", None) == "deepseek_v4":
            from openmla.engine.runner_v4 import V4ModelRunner as runner_cls  # V4 caches, metadata, compressor state
        self.runner = runner_cls(
            model,
            self.block_manager,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=max_model_len,
            device=self.device,
            dtype=self.dtype,
            num_spec_tokens=cfg.num_spec_tokens,
            cuda_graphs=cuda_graphs,
            workspace_tokens=cfg.workspace_tokens,
        )
        self.stats = EngineStats()
        self.records: list[StepRecord] = []
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}

    def add_request(self, prompt_ids: list[int], max_new_tokens: int, req_id: str | None = None) -> str:
        """Queue a prompt; returns its request id.

        Raises:
            ValueError: a token outside the vocabulary, or a request the engine can never fit.
        """
        prompt_ids = [int(t) for t in prompt_ids]
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        req_id = req_id if req_id is not None else str(next(self._ids))
        req = Request(req_id=req_id, prompt_ids=prompt_ids, max_new_tokens=int(max_new_tokens))
        self.scheduler.add_request(req)
        self._requests[req_id] = req
        return req_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def output_ids(self, req_id: str) -> list[int]:
        """Tokens generated so far for ``req_id`` (a copy)."""
        return list(self._requests[req_id].output_ids)

    def step(self, record: bool | None = None) -> dict[str, list[int]]:
        """Schedule, run and sample one step; returns the tokens each request gained.

        Args:
            record (bool | None): keep this step's logits in :attr:`records` (default:
                ``config.record_logits``).

        Raises:
            RuntimeError: nothing could be scheduled although requests are pending (cannot happen
                for requests that passed :meth:`add_request`'s checks).
        """
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            raise RuntimeError("no request could be scheduled although requests are pending")
        record = self.config.record_logits if record is None else record
        replays = self.runner.num_graph_replays
        logits, info = self.runner.execute(out, all_logits=record)
        greedy = logits.argmax(dim=-1).tolist()
        sampled, rec_rows = self._split_rows(out, info, greedy, record)
        if record:
            lf = logits.float().cpu()
            for s, rows in rec_rows:
                self.records.append(
                    StepRecord(
                        step=self.stats.num_steps,
                        req_id=s.request.req_id,
                        context_ids=s.request.all_token_ids[: s.num_computed_tokens],
                        token_ids=s.token_ids,
                        logits=lf[rows],
                        is_verify=bool(s.draft_ids),
                    )
                )
        new = self.scheduler.update(out, sampled)
        st = self.stats
        st.num_steps += 1
        st.num_generated_tokens += sum(len(v) for v in new.values())
        st.num_draft_tokens = self.scheduler.num_draft_tokens
        st.num_accepted_tokens = self.scheduler.num_accepted_tokens
        st.num_preemptions = self.scheduler.num_preemptions
        st.num_graph_replays += self.runner.num_graph_replays - replays
        st.elapsed_s += time.perf_counter() - t0
        return new

    @staticmethod
    def _split_rows(out: SchedulerOutput, info, greedy: list[int], record: bool):
        """Map the returned logits rows back to requests: sampled tokens and recorded row ranges."""
        sampled: dict[str, list[int]] = {}
        rec_rows = []
        i = 0
        for s in out.scheduled:
            n_sample = 1 + len(s.draft_ids) if s.samples else 0
            if record:
                rows = slice(i, i + s.query_len)
                rec_rows.append((s, rows))
                if n_sample:
                    sampled[s.request.req_id] = greedy[i + s.query_len - n_sample : i + s.query_len]
                i += s.query_len
            elif n_sample:
                sampled[s.request.req_id] = greedy[i : i + n_sample]
                i += n_sample
        return sampled, rec_rows

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[list[int]]:
        """Greedy-generate exactly ``max_new_tokens`` tokens for each prompt (no early stop).

        Args:
            prompts (list[list[int]]): token-id prompts.
            max_new_tokens (int): tokens to generate per prompt.
            progress (callable | None): called as ``progress(done_tokens, total_tokens)`` after each step.

        Returns:
            list[list[int]]: generated ids per prompt, in prompt order (prompts excluded).
        """
        ids = [self.add_request(p, max_new_tokens) for p in prompts]
        total = len(ids) * max_new_tokens
        while self.has_unfinished():
            self.step()
            if progress is not None:
                progress(sum(len(self._requests[r].output_ids) for r in ids), total)
        return [list(self._requests[r].output_ids) for r in ids]
