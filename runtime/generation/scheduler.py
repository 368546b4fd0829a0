"""Iteration-level scheduling of generation requests: a synchronous state machine.

The caller drives it, passing the time in::

    scheduler.add_request(seq)                     # joins the waiting queue
    out = scheduler.schedule(now)                  # which tokens of which sequences run this step
    logits = model.step(out.chunks)                # (the caller runs the model and samples)
    result = scheduler.update_from_output(out, sampled_tokens, now)

Every sequence is described by its known tokens (prompt + generated so far) and how
many of them already have KV entries (``num_computed``). A step computes the
missing ones, capped by ``max_num_batched_tokens`` (and, per sequence, by
``long_prefill_token_threshold``): a long prompt is prefilled in chunks, a running
sequence computes its one newest token. When a chunk reaches the end of a sequence's
known tokens, the sampled token is appended.

Speculative decoding: ``schedule(now, num_spec_tokens=k)`` gives a running sequence
that is decoding (and has not opted out) up to ``k`` more slots in its chunk, with
their budget and KV blocks (never at the price of a preemption). The caller puts the
proposed tokens there (``ScheduledChunk.add_drafts``), the model computes them all in
one forward, and ``update_from_output`` appends the accepted prefix plus one more
token, then rolls back what was rejected: ``num_computed`` stops before the newest
token and the blocks beyond the sequence's tokens go back to the pool.

Continuous mode: waiting requests join at the next step as long as their prompt's
blocks fit, and a sequence leaves (freeing its blocks) as soon as it ends. When the
cache runs short for running sequences to grow, the lowest-priority, newest one is
preempted: its blocks are freed and it goes back to the waiting queue keeping its
tokens, to be recomputed when it resumes.

Static mode: a batch is admitted only when nothing is running, each member reserving
blocks for its whole possible length; no one joins until the whole batch has ended.
It runs like one padded batch tensor: a member that finished gets its result at once
but keeps its slot and its blocks, and its row is still computed each step (a pad
row: its last position again, sampling nothing) until the longest member finishes.

LoRA adapters (``enable_adapters``, for a model that declares adapter targets): a
sequence names its adapter once (``Sequence.adapter``) and keeps it over all its steps;
each chunk carries its sequence's device slot (``ScheduledChunk.adapter_slot``) and the
step the slots it uses (``SchedulerOutput.adapters``). Which sequences run together
follows ``adapter_mixing``, ``max_adapters_per_batch`` and the slot cache
(``adapter_slots``), as ``runtime.generation.adapters`` describes; a sequence refused
for its adapter stays in its place in the queue while later ones may join.

Every sequence ends exactly once, with an outcome: ok, expired, cancelled or error.
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass, field
from typing import Any

from runtime.api.errors import ClientError, ValidationError
from runtime.generation.adapters import StepAdapters
from runtime.generation.config import GenerationConfig
from runtime.generation.kv_cache import BlockManager

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(slots=True)
class Sequence:
    """One generation request as the scheduler sees it."""

    seq_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    priority: int
    arrival_s: float
    #: monotonic time after which the request expires if it has not started yet
    deadline_s: float | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: str = WAITING
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    #: why generation stopped: "stop" (end token) or "length" (max_new_tokens / max_model_len)
    finish_reason: str | None = None
    #: ok | expired | cancelled | error
    outcome: str | None = None
    error: BaseException | None = None
    num_preemptions: int = 0
    #: sampling state kept across steps (e.g. a seeded torch.Generator)
    sampler_state: Any = None
    #: False: this request opted out of speculative decoding
    speculate: bool = True
    #: the LoRA adapter the request named (None: the base model)
    adapter: str | None = None
    #: the number of the step it was first scheduled in: the batch it joined
    #: (``StepRunner.step_seq``; its request row's and trace's ``batch_seq``)
    first_step: int | None = None
    #: its request's spans are exported: the step it joins gets a span of its own
    traced: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        n_prompt = len(self.prompt_ids)
        if stop <= n_prompt:
            return self.prompt_ids[start:stop]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt:stop - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[:stop - n_prompt]

    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: lower priority number first, then earlier arrival."""
        return (self.priority, self.arrival_s, self.seq_id)


@dataclass(slots=True)
class ScheduledChunk:
    """The tokens of one sequence computed in one step."""

    seq_id: int
    token_ids: list[int]
    #: position of ``token_ids[0]`` in the sequence
    start_pos: int
    block_table: list[int]
    #: the chunk reaches the end of the known tokens: a new token is sampled from its last logits
    completes: bool
    #: a single newest token of a sequence that already generated (as opposed to prefill/recompute)
    is_decode: bool
    #: a static batch's finished member whose row is still computed (nothing is sampled)
    is_padding: bool = False
    #: slots reserved after ``token_ids`` for proposed tokens (speculative decoding)
    num_draft_slots: int = 0
    #: the proposed tokens put in those slots (also appended to ``token_ids``)
    draft_ids: list[int] = field(default_factory=list)
    #: logits rows the model returns for this chunk: one per token of its last
    #: ``num_logits`` tokens (1: the next-token logits after its last token)
    num_logits: int = 1
    #: the device slot of the sequence's LoRA adapter for every token of the chunk
    #: (-1: the base model)
    adapter_slot: int = -1

    def add_drafts(self, draft_ids: list[int]) -> None:
        """Put proposed tokens in the reserved slots: they are computed after the chunk's
        tokens, and the model returns the logits after each of them as well."""
        draft_ids = list(draft_ids[:self.num_draft_slots])
        self.draft_ids = draft_ids
        self.token_ids = self.token_ids + draft_ids
        self.num_logits = 1 + len(draft_ids)


@dataclass
class SchedulerOutput:
    mode: str
    chunks: list[ScheduledChunk] = field(default_factory=list)
    #: sequences joining the running batch this step
    admitted: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    expired: list[Sequence] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    #: slots reserved for proposed tokens (speculative decoding); the tokens actually
    #: proposed are counted in ``draft_tokens`` once the caller filled them in
    draft_slots: int = 0
    draft_tokens: int = 0
    #: rows of finished static-batch members computed again (waste static batching pays)
    padding_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    #: the slots the chunks' adapters use and what each must hold
    #: (``runtime.adapters.slots.AdapterPlan``; None: only base rows)
    adapters: Any = None
    #: adapters put in a slot for this step (``SlotChange``), for the records
    adapter_changes: list = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_live_chunks(self) -> int:
        """Sequences that did useful work this step (pad rows excluded)."""
        return len(self.chunks) - self.padding_tokens


@dataclass
class StepResult:
    #: (sequence, token id) for every token generated this step, in chunk order (a
    #: sequence that verified proposed tokens may get several, in its own order)
    new_tokens: list[tuple[Sequence, int]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    #: proposed tokens that were computed and then rejected, and blocks freed for them
    rolled_back_tokens: int = 0
    rolled_back_blocks: int = 0


class Scheduler:
    def __init__(self, config: GenerationConfig, *, eos_token_id: int | None = None,
                 vocab_size: int | None = None) -> None:
        self.config = config
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.blocks = BlockManager(config.num_cache_blocks, config.block_size)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._live: dict[int, Sequence] = {}
        #: finished members of the running static batch, still holding slot and blocks
        self.padded: list[Sequence] = []
        self.total_preemptions = 0
        self.total_steps = 0
        #: LoRA adapters (``enable_adapters``; None: the model takes none)
        self.adapters: StepAdapters | None = None

    def enable_adapters(self, refs: Any) -> None:
        """Serve sequences naming adapters; ``refs(name)`` gives a registered adapter's
        ``AdapterRef`` (None once it is gone)."""
        self.adapters = StepAdapters(self.config.adapter_slots, refs)

    # -- submission -----------------------------------------------------------------
    def check(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """Refuse a request that can never run, saying why and what would fit."""
        cfg = self.config
        if not prompt_ids:
            raise ClientError("the prompt is empty; send at least one token", param="prompt")
        if self.vocab_size is not None:
            bad = [t for t in prompt_ids if not (0 <= t < self.vocab_size)]
            if bad:
                raise ClientError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                                  f"[0, {self.vocab_size})", param="prompt")
        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
            raise ValidationError(f"max_tokens={max_new_tokens!r} must be a positive integer",
                                  param="max_tokens")
        total = len(prompt_ids) + max_new_tokens
        if len(prompt_ids) >= cfg.max_model_len:  # no max_tokens could fit: say what can
            raise ValidationError(
                f"the prompt has {len(prompt_ids)} tokens and leaves no room for one more "
                f"within max_model_len={cfg.max_model_len}; shorten it to at most "
                f"{cfg.max_model_len - 1} tokens", param="prompt")
        if total > cfg.max_model_len:
            raise ValidationError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_new_tokens}) is "
                f"{total} tokens, beyond max_model_len={cfg.max_model_len}; shorten the prompt "
                f"or ask for at most {max(0, cfg.max_model_len - len(prompt_ids))} tokens",
                param="max_tokens")
        if total > cfg.cache_tokens:
            raise ValidationError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_new_tokens}) needs "
                f"{self.blocks.blocks_for(total)} KV-cache blocks but the whole cache has "
                f"{cfg.num_cache_blocks} ({cfg.cache_tokens} tokens); ask for fewer tokens",
                param="max_tokens")

    def add_request(self, seq: Sequence) -> None:
        if seq.seq_id in self._live:
            raise ValueError(f"sequence {seq.seq_id} was already added")
        self.check(seq.prompt_ids, seq.max_new_tokens)
        if seq.adapter is not None and self.adapters is None:
            raise ValidationError("this model takes no adapters; send the request without one")
        seq.status = WAITING
        self._live[seq.seq_id] = seq
        if self.adapters is not None:
            self.adapters.added(seq.adapter)
        insort(self.waiting, seq, key=Sequence.sort_key)

    def abort(self, seq_id: int, now: float, outcome: str = "cancelled",
              error: BaseException | None = None) -> Sequence | None:
        """End a sequence wherever it is (client gone, shutdown); None if already ended."""
        seq = self._live.get(seq_id)
        if seq is None:
            return None
        if seq.status == WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self._finish(seq, now, outcome, None, error)
        self._end_padding_if_batch_over()
        return seq

    def stop_early(self, seq_id: int, now: float, reason: str = "stop") -> Sequence | None:
        """End a running sequence whose caller saw it finish (its text reached a stop
        string) as if it had sampled its end token: outcome ok, ``finish_reason`` given,
        blocks freed (a static batch's member keeps its slot). None if already ended."""
        seq = self._live.get(seq_id)
        if seq is None:
            return None
        keep_slot = seq.status == RUNNING and self.config.mode == "static"
        if seq.status == WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self._finish(seq, now, "ok", reason, keep_blocks=keep_slot)
        if keep_slot:
            self.padded.append(seq)
        self._end_padding_if_batch_over()
        return seq

    def abort_all(self, now: float, outcome: str, error: BaseException | None = None
                  ) -> list[Sequence]:
        return [s for s in (self.abort(i, now, outcome, error) for i in list(self._live))
                if s is not None]

    # -- figures --------------------------------------------------------------------
    @property
    def num_live(self) -> int:
        return len(self._live)

    def has_work(self) -> bool:
        return bool(self._live)

    def get(self, seq_id: int) -> Sequence | None:
        return self._live.get(seq_id)

    # -- one step -------------------------------------------------------------------
    def schedule(self, now: float, num_spec_tokens: int = 0) -> SchedulerOutput:
        """This step's chunks. ``num_spec_tokens``: slots for proposed tokens each decoding
        sequence gets at most (0: no speculation this step; ignored in static mode)."""
        cfg = self.config
        out = SchedulerOutput(mode=cfg.mode)
        self._expire(now, out)
        if self.adapters is not None:
            self.adapters.begin(cfg, now)
        budget = cfg.max_num_batched_tokens
        self.running.sort(key=Sequence.sort_key)
        if cfg.mode == "static":
            num_spec_tokens = 0

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.adapters is not None and not self.adapters.keep(seq.adapter):
                i += 1  # its adapter is past this step's limits (lowered while it ran)
                continue
            num_new = self._chunk_len(seq, budget)
            slots = self._draft_slots(seq, num_new, budget, num_spec_tokens,
                                      later=len(self.running) - i - 1)
            if slots:
                budget -= self._add_chunk(out, seq, num_new, slots)
                i += 1
                continue
            while not self.blocks.allocate(seq.seq_id, seq.num_computed + num_new):
                victim = self.running[-1]  # lowest priority, newest
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != RUNNING:
                break  # it preempted itself: everyone after it is gone as well
            budget -= self._add_chunk(out, seq, num_new)
            i += 1

        if cfg.mode != "static":
            self._end_padding()
        self._end_padding_if_batch_over()
        for seq in self.padded:
            if budget <= 0:
                break
            budget -= self._add_padding_chunk(out, seq)

        if cfg.mode == "static":
            if not self.running and not out.preempted:
                self._admit_static_batch(out, budget, now)
        elif not out.preempted:
            self._admit_continuous(out, budget, now)

        if self.adapters is not None:
            out.adapters, out.adapter_changes = self.adapters.plan(
                {c.adapter_slot for c in out.chunks if not c.is_padding})
        out.num_running = len(self.running)
        out.num_waiting = len(self.waiting)
        out.blocks_used = self.blocks.num_used
        out.blocks_free = self.blocks.num_free
        if out.chunks:
            self.total_steps += 1
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: dict[int, int],
                           now: float) -> StepResult:
        """Record that ``out`` ran: advance the computed counts, append sampled tokens,
        end the sequences that stopped (freeing their blocks)."""
        result = StepResult()
        for chunk in out.chunks:
            seq = self._live.get(chunk.seq_id)
            if seq is None or seq.status != RUNNING:
                continue  # aborted while the step ran
            seq.num_computed = chunk.start_pos + len(chunk.token_ids)
            if not chunk.completes:
                continue
            tokens = sampled[chunk.seq_id]
            reason = None
            for token in ([tokens] if isinstance(tokens, int) else tokens):
                token = int(token)
                seq.output_ids.append(token)
                if seq.first_token_s is None:
                    seq.first_token_s = now
                result.new_tokens.append((seq, token))
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    break
            if reason is not None:
                self.running.remove(seq)
                keep_slot = out.mode == "static" and self.config.mode == "static"
                self._finish(seq, now, "ok", reason, keep_blocks=keep_slot)
                if keep_slot:
                    self.padded.append(seq)
                result.finished.append(seq)
            elif chunk.num_draft_slots:
                self._roll_back(seq, chunk, result)
        self._end_padding_if_batch_over()
        return result

    def fail_step(self, out: SchedulerOutput, now: float, error: BaseException) -> list[Sequence]:
        """The model raised running ``out``: every sequence in it ends with outcome error."""
        failed = []
        for chunk in out.chunks:
            if chunk.is_padding:
                continue
            seq = self.abort(chunk.seq_id, now, "error", error)
            if seq is not None:
                failed.append(seq)
        return failed

    # -- internals ------------------------------------------------------------------
    def _chunk_len(self, seq: Sequence, budget: int) -> int:
        """How many of ``seq``'s missing tokens this step computes: the budget left, and
        ``long_prefill_token_threshold`` for a long prompt."""
        num_new = min(seq.num_tokens - seq.num_computed, budget)
        threshold = self.config.long_prefill_token_threshold
        return min(num_new, threshold) if threshold > 0 else num_new

    def _draft_slots(self, seq: Sequence, num_new: int, budget: int, k: int, later: int) -> int:
        """Slots for proposed tokens ``seq`` gets this step, its blocks allocated; 0 when it
        is not decoding, opted out, is about to end, or the slots would not fit in the
        budget or in the cache with a free block left for each of the ``later`` sequences
        (speculation never preempts anyone)."""
        if not (k and seq.speculate and seq.output_ids and num_new == 1
                and seq.num_tokens - seq.num_computed == 1):
            return 0
        # every verified step yields one token more than it accepts: room for slots + 1
        room = min(seq.max_new_tokens - len(seq.output_ids),
                   self.config.max_model_len - seq.num_tokens)
        slots = min(k, room - 1, budget - num_new)
        if slots <= 0:
            return 0
        need = seq.num_computed + num_new + slots
        if self.blocks.blocks_missing(seq.seq_id, need) + later > self.blocks.num_free:
            return 0
        self.blocks.allocate(seq.seq_id, need)
        return slots

    def _add_chunk(self, out: SchedulerOutput, seq: Sequence, num_new: int,
                   draft_slots: int = 0) -> int:
        start = seq.num_computed
        stop = start + num_new
        is_decode = num_new == 1 and bool(seq.output_ids) and stop == seq.num_tokens
        out.chunks.append(ScheduledChunk(
            seq_id=seq.seq_id, token_ids=seq.token_slice(start, stop), start_pos=start,
            block_table=self.blocks.block_table(seq.seq_id), completes=stop == seq.num_tokens,
            is_decode=is_decode, num_draft_slots=draft_slots, adapter_slot=self._slot_of(seq)))
        if is_decode:
            out.decode_tokens += 1
        else:
            out.prefill_tokens += num_new
        out.draft_slots += draft_slots
        return num_new + draft_slots

    def _roll_back(self, seq: Sequence, chunk: ScheduledChunk, result: StepResult) -> None:
        """After a verified step: the newest token has no KV entry yet, the positions of
        rejected proposals are forgotten and the blocks past the sequence's tokens freed."""
        computed = min(seq.num_computed, seq.num_tokens - 1)
        result.rolled_back_tokens += seq.num_computed - computed
        seq.num_computed = computed
        result.rolled_back_blocks += self.blocks.truncate(seq.seq_id, seq.num_tokens)

    def _add_padding_chunk(self, out: SchedulerOutput, seq: Sequence) -> int:
        # the last computed position again: its slot is allocated and its values do not change
        pos = seq.num_tokens - 2
        out.chunks.append(ScheduledChunk(
            seq_id=seq.seq_id, token_ids=seq.token_slice(pos, pos + 1), start_pos=pos,
            block_table=self.blocks.block_table(seq.seq_id), completes=False, is_decode=False,
            is_padding=True))
        out.padding_tokens += 1
        return 1

    def _end_padding_if_batch_over(self) -> None:
        if self.padded and not self.running:
            self._end_padding()

    def _end_padding(self) -> None:
        for seq in self.padded:
            self.blocks.free(seq.seq_id)
        self.padded = []

    def _start_running(self, out: SchedulerOutput, seq: Sequence, now: float) -> None:
        self.waiting.remove(seq)
        if seq.first_scheduled_s is None:
            seq.first_scheduled_s = now
        seq.status = RUNNING
        self.running.append(seq)
        out.admitted.append(seq.seq_id)

    def _admit_continuous(self, out: SchedulerOutput, budget: int, now: float) -> None:
        cfg = self.config
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= cfg.max_num_seqs:
                return
            # keep one free block per running sequence so the batch can keep growing
            headroom = len(self.running)
            missing = self.blocks.blocks_missing(seq.seq_id, seq.num_tokens)
            if missing + headroom > self.blocks.num_free:
                return  # strict order: a large request is not overtaken by smaller ones
            if not self._join(seq):
                continue  # its adapter waits; it keeps its place, later ones may go
            self.blocks.allocate(seq.seq_id, seq.num_tokens)
            self._start_running(out, seq, now)
            budget -= self._add_chunk(out, seq, self._chunk_len(seq, budget))

    def _admit_static_batch(self, out: SchedulerOutput, budget: int, now: float) -> None:
        cfg = self.config
        for seq in list(self.waiting):
            if len(self.running) >= cfg.max_num_seqs:
                break
            # reserve the whole possible length up front: nobody has to grow later
            full = min(len(seq.prompt_ids) + seq.max_new_tokens, cfg.max_model_len)
            if self.blocks.blocks_missing(seq.seq_id, full) > self.blocks.num_free:
                break
            if not self._join(seq):
                continue
            self.blocks.allocate(seq.seq_id, full)
            self._start_running(out, seq, now)
        for seq in self.running:
            if budget <= 0:
                break
            budget -= self._add_chunk(out, seq, self._chunk_len(seq, budget))

    def _join(self, seq: Sequence) -> bool:
        return self.adapters is None or self.adapters.join(seq.adapter)

    def _slot_of(self, seq: Sequence) -> int:
        return -1 if self.adapters is None else self.adapters.slot_of(seq.adapter)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        if self.adapters is not None:
            self.adapters.left(seq.adapter)  # asked again when it is readmitted
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = WAITING
        seq.num_preemptions += 1
        self.total_preemptions += 1
        insort(self.waiting, seq, key=Sequence.sort_key)
        out.preempted.append(seq.seq_id)

    def _expire(self, now: float, out: SchedulerOutput) -> None:
        for seq in [s for s in self.waiting if s.deadline_s is not None
                    and s.first_scheduled_s is None and now >= s.deadline_s]:
            self.waiting.remove(seq)
            self._finish(seq, now, "expired", None)
            out.expired.append(seq)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        if not seq.ignore_eos and self.eos_token_id is not None and token == self.eos_token_id:
            return "stop"
        if len(seq.output_ids) >= seq.max_new_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, now: float, outcome: str, reason: str | None,
                error: BaseException | None = None, *, keep_blocks: bool = False) -> None:
        if not keep_blocks:
            self.blocks.free(seq.seq_id)
        if self._live.pop(seq.seq_id, None) is not None and self.adapters is not None:
            if seq.status == RUNNING:
                self.adapters.left(seq.adapter)
            self.adapters.ended(seq.adapter)
        seq.status = FINISHED
        seq.finished_s = now
        seq.outcome = outcome
        seq.finish_reason = reason
        seq.error = error
