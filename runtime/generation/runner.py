"""``StepRunner``: one generation step at a time, synchronously, with its records.

It ties the scheduler, the model and sampling together and turns what happens into
records (``GenStepRow`` per step, ``RequestRow`` per ended request, aggregated
``EventRow(kind="preemption")``, ``settings_change`` events). A step is three calls
so that the asyncio engine can run the middle one off the event loop::

    out = runner.plan()                  # schedule (cheap; also ends expired requests)
    sampled = runner.execute(out)        # model forward + sampling (the slow part)
    result = runner.commit(out, sampled, started_s)

``step()`` does all three in a row, for benchmarks and tests. All methods except
``execute`` must be called from one thread; ``execute`` reads ``out`` and only writes
the proposed tokens into its chunks.

Speculative decoding (``speculative_method`` ngram or draft; ``runtime.generation.spec``):
``plan`` asks the ``SpecController`` how many slots each decoding sequence gets this
step, ``execute`` has the proposer fill them, runs the model once over everything and
verifies the proposals (``verify_greedy``, ``rejection_sample``), ``commit`` counts the
proposed and accepted tokens and the sequences that had proposals verified
(``spec_decode_*``, ``GenStepRow.spec_*``), feeds the controller and records its switches
as ``speculation`` events.

LoRA adapters (a model with ``adapter_targets``): ``adapters`` is the model's
``AdapterRegistry``; a request names a registered adapter (``new_sequence(adapter=)``),
the scheduler gives each chunk its sequence's slot, ``execute`` puts the step's adapters
in the model's ``adapter_bank`` (read from their files when a slot does not hold them
yet) before the forward, and the records carry the adapter (``RequestRow.adapter``,
``GenStepRow.adapters``: the distinct adapters of the step's sequences,
``adapter_load``/``adapter_evict`` events). Speculation stays on for such sequences:
the proposals come from the base (prompt lookup or the draft model) but the model
verifies them with the sequence's adapter, so what is kept is what the adapter would
have generated.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Callable

from batchscope.storage.records import EventRow, GenStepRow, RecorderLike, RequestRow
from runtime.adapters.registry import AdapterRegistry
from runtime.core.clock import MonotonicClock
from runtime.api.errors import ClientError, ConfigError, ModelNotFound, QueueFull, ValidationError
from runtime.device import nvtx
from runtime.engine.admission import deadline_of, priority_of
from runtime.engine.served import EVENT_INTERVAL_S, Throttle
from runtime.generation.config import GenerationConfig
from runtime.generation.model import GenerationModel, make_sampler_state, sample
from runtime.generation.scheduler import (ScheduledChunk, Scheduler, SchedulerOutput, Sequence,
                                          StepResult)
from runtime.generation.spec import (DraftRequest, SpecController, SpecCounts, SpecSwitch,
                                     make_proposer, rejection_sample, target_probs,
                                     verify_greedy)

OUTCOMES = ("ok", "expired", "cancelled", "error", "rejected")


class StepRunner:
    def __init__(self, model: GenerationModel, config: GenerationConfig | None = None, *,
                 recorder: RecorderLike | None = None, instance_id: str = "local",
                 clock: Any = None, draft_model: Any = None, proposer: Any = None) -> None:
        """``draft_model``: the draft for ``speculative_method="draft"`` (default: the
        model's own ``draft_model``, else the bundled one where it fits); ``proposer``: any
        object with ``propose``/``release`` (``runtime.generation.spec``) used instead of
        the one the method names (tests, experiments)."""
        config = config or model.generation_config or GenerationConfig.for_model(model.max_model_len)
        if model.max_model_len and config.max_model_len > model.max_model_len:
            raise ConfigError(f"max_model_len={config.max_model_len} exceeds what model "
                              f"{model.name!r} can attend over ({model.max_model_len}); "
                              f"lower max_model_len to at most {model.max_model_len}")
        self.model = model
        self.recorder = recorder
        self.instance_id = instance_id
        self.clock = clock or MonotonicClock()
        self.scheduler = Scheduler(config, eos_token_id=model.eos_token_id,
                                   vocab_size=model.vocab_size or None)
        self.settings_version = 1
        self._ids = itertools.count(1)
        self._preempted_pending: list[int] = []
        self._last_preemption_event_s: float | None = None
        self.counts: dict[str, int] = {k: 0 for k in OUTCOMES}
        self.steps = 0
        #: the number of the last step planned (run, or failed): a step's id, as a
        #: request model's batch has its ``seq`` (``GenStepRow.seq``)
        self.step_seq = 0
        #: called as ``(step, started_s, now, out, failed)`` after recording a step that a
        #: traced sequence (``Sequence.traced``) joined: its span (set by the engine)
        self.on_traced_step: Callable[[int, float, float, SchedulerOutput, bool], None] | None = None
        self._traced_joined = False
        #: refusals and expiries are events, folded into one a second (as a request
        #: model's, ``runtime.engine.booking``)
        self._rejections = Throttle(EVENT_INTERVAL_S)
        self._expiries = Throttle(EVENT_INTERVAL_S)
        self.tokens_generated = 0
        #: prompt tokens of the requests whose prefill completed (recomputation not counted)
        self.prompt_tokens = 0
        self.padding_rows = 0
        self.device: Any = "cpu"
        self._draft_model = draft_model
        self._fixed_proposer = proposer
        self.proposer = proposer if proposer is not None else make_proposer(config, model,
                                                                             draft_model)
        self.spec = SpecController()
        self.spec_counts = SpecCounts()
        #: the step's figures ``commit`` hands to ``_record_step``
        self._step_spec: tuple[int, int] = (0, 0)
        #: the LoRA adapters the model takes (None: it declares no adapter targets)
        self.adapters: AdapterRegistry | None = None
        targets = getattr(model, "adapter_targets", None)
        if targets:
            self.adapters = AdapterRegistry(model.name, targets,
                                            getattr(model, "max_adapter_rank", 64))
            self.scheduler.enable_adapters(self.adapters.ref)

    @property
    def config(self) -> GenerationConfig:
        return self.scheduler.config

    @property
    def model_name(self) -> str:
        return self.model.name

    def setup(self, device: Any = "cpu") -> None:
        cfg = self.config
        self.device = device
        self.model.setup(device, cfg.num_cache_blocks, cfg.block_size)
        self._ready_proposer(self.proposer)

    def _ready_proposer(self, proposer: Any) -> None:
        if proposer is not None and hasattr(proposer, "setup"):
            proposer.setup(self.device)

    # -- requests -------------------------------------------------------------------
    def new_sequence(self, prompt_ids: list[int], *, max_new_tokens: int | None = None,
                     priority: int | None = None, timeout_ms: float | None = None,
                     ignore_eos: bool = False, temperature: float = 0.0,
                     seed: int | None = None, speculative: bool | None = None,
                     adapter: str | None = None) -> Sequence:
        """Validate and queue a request; raises ClientError/ValidationError/QueueFull.
        ``speculative``: False opts out of speculative decoding; True asks for it (a
        model served without a proposer serves it without, and counts it). ``adapter``:
        a registered LoRA adapter (ModelNotFound naming the loaded ones otherwise)."""
        cfg = self.config
        now = self.clock.now()
        adapter = self.adapter_of(adapter)
        priority = priority_of(priority, cfg)
        deadline_s = deadline_of(timeout_ms, cfg, now)
        if not (isinstance(temperature, (int, float)) and 0 <= temperature <= 100):
            raise ValidationError(f"temperature={temperature!r} must be a number from 0 to 100")
        max_new = cfg.default_max_new_tokens if max_new_tokens is None else max_new_tokens
        self.scheduler.check(prompt_ids, max_new)
        if len(self.scheduler.waiting) >= cfg.max_queue_size:
            raise self._refused(now, priority, adapter, [len(prompt_ids)])
        seq = Sequence(seq_id=next(self._ids), prompt_ids=list(prompt_ids),
                       max_new_tokens=max_new, priority=priority, arrival_s=now,
                       deadline_s=deadline_s,
                       ignore_eos=bool(ignore_eos), temperature=float(temperature), seed=seed,
                       sampler_state=make_sampler_state(float(temperature), seed),
                       speculate=speculative is not False, adapter=adapter)
        self.scheduler.add_request(seq)
        if speculative is False:
            self.spec_counts.requests_opted_out += 1
        elif speculative and not (self.proposer is not None and cfg.speculating):
            self.spec_counts.requests_without_proposer += 1
        return seq

    def check_room(self, count: int, priority: int | None = None,
                   adapter: str | None = None) -> None:
        """Refuse at once a request of ``count`` sequences (its prompts times its choices)
        that the queue cannot take whole, before any of them is queued: more than
        ``max_queue_size`` is a mistake no retry mends (``ClientError``); more than the
        room left is ``QueueFull``, each sequence recorded as rejected."""
        cfg = self.config
        if count > cfg.max_queue_size:
            raise ClientError(f"this request asks for {count} sequences (its prompts times n) "
                              f"and the queue of {self.model_name!r} holds at most "
                              f"max_queue_size={cfg.max_queue_size}; ask for fewer choices or "
                              "prompts in one request, or raise max_queue_size")
        if count > 1 and len(self.scheduler.waiting) + count > cfg.max_queue_size:
            raise self._refused(self.clock.now(), priority_of(priority, cfg),
                                self.adapter_of(adapter), [None] * count)

    def _refused(self, now: float, priority: int, adapter: str | None,
                 lengths: list[int | None]) -> QueueFull:
        """Record ``len(lengths)`` sequences refused for a full queue (their prompt lengths,
        None where not yet tokenized) and say why: the ``QueueFull`` to raise, carrying
        ``refused_s`` (its rows' arrival, so a trace of it pairs with them)."""
        cfg = self.config
        waiting = len(self.scheduler.waiting)
        self.counts["rejected"] += len(lengths)
        at = self.clock.to_wall(now)
        for length in lengths:
            self._put(RequestRow(
                instance_id=self.instance_id, model=self.model_name, batch_seq=None,
                priority=priority, arrived_at=at, finished_at=at, queue_wait_s=0.0,
                latency_s=0.0, outcome="rejected", length=length, prompt_tokens=length,
                output_tokens=0, adapter=adapter))
        count = self._rejections.hit(now, len(lengths))
        if count:
            self.event(now, "rejected", f"{count} request(s) refused: queue of "
                       f"{self.model_name!r} is full (max_queue_size={cfg.max_queue_size})",
                       severity="warning", count=count, queue_depth=waiting,
                       max_queue_size=cfg.max_queue_size)
        room = max(0, cfg.max_queue_size - waiting)
        holds = (f"; room for {room} more, this request holds {len(lengths)}"
                 if len(lengths) > 1 else "")
        refused = QueueFull(f"{waiting} requests are already waiting for {self.model_name!r} "
                            f"(max_queue_size={cfg.max_queue_size}){holds}; retry later",
                            retry_after_s=1.0)
        refused.refused_s = now  # type: ignore[attr-defined]
        return refused

    def adapter_of(self, adapter: str | None) -> str | None:
        """The adapter a request names, checked (404 naming the loaded ones)."""
        if adapter is None or adapter == "":
            return None
        if self.adapters is None:
            raise ModelNotFound(f"model {self.model_name!r} takes no adapters; send the "
                                "request without one")
        return self.adapters.require(adapter).name

    def abort(self, seq_id: int, outcome: str = "cancelled",
              error: BaseException | None = None) -> Sequence | None:
        seq = self.scheduler.abort(seq_id, self.clock.now(), outcome, error)
        if seq is not None:
            self._record_end(seq)
        return seq

    def stop_early(self, seq_id: int, reason: str = "stop") -> Sequence | None:
        """End a running request that finished in its caller's eyes (its text reached a
        stop string): outcome ok, as if it had sampled its end token."""
        seq = self.scheduler.stop_early(seq_id, self.clock.now(), reason)
        if seq is not None:
            self._record_end(seq)
        return seq

    def abort_all(self, outcome: str, error: BaseException | None = None) -> list[Sequence]:
        ended = self.scheduler.abort_all(self.clock.now(), outcome, error)
        for seq in ended:
            self._record_end(seq)
        return ended

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- one step -------------------------------------------------------------------
    def plan(self) -> SchedulerOutput:
        k = 0
        if self.proposer is not None:
            k = self.spec.num_spec_tokens(self.config, len(self.scheduler.running))
        now = self.clock.now()
        out = self.scheduler.schedule(now, k)
        if not out.is_empty:
            self.step_seq += 1
            step, get = self.step_seq, self.scheduler.get
            for seq_id in out.admitted:
                seq = get(seq_id)
                if seq is not None and seq.first_step is None:
                    seq.first_step = step
                    if seq.traced:
                        self._traced_joined = True
        self._record_slot_changes(out)
        for seq in out.expired:
            self._record_end(seq)
        if out.expired:
            count = self._expiries.hit(now, len(out.expired))
            if count:
                self.event(now, "expired", f"{count} request(s) expired in the queue of "
                           f"{self.model_name!r}", severity="warning", count=count,
                           queue_depth=len(self.scheduler.waiting))
        for seq_id in out.preempted:  # recomputed from scratch when it resumes
            self._release(seq_id)
        return out

    def execute(self, out: SchedulerOutput) -> dict[int, list[int]]:
        """Fill the proposal slots, run the model on ``out`` and pick each completing
        chunk's tokens: one, or a verified proposal's accepted prefix and one more."""
        probs = self._propose(out) if out.draft_slots else {}
        if out.adapters is not None:
            bank = getattr(self.model, "adapter_bank", None)
            if bank is None:
                raise ConfigError(f"model {self.model_name!r} made no adapter_bank in setup")
            bank.prepare(out.adapters.slots)
        with nvtx.step_range(self.step_seq, self.model_name, out.num_live_chunks,
                             out.prefill_tokens, out.decode_tokens + out.draft_tokens):
            logits = self.model.step(self._model_chunks(out))
        rows, ids, picked = [], [], {}
        row = 0
        for chunk in out.chunks:
            if chunk.completes:
                seq = self.scheduler.get(chunk.seq_id)
                temperature = seq.temperature if seq is not None else 0.0
                state = seq.sampler_state if seq is not None else None
                if chunk.draft_ids:
                    picked[chunk.seq_id] = self._verify(
                        logits[row:row + chunk.num_logits], chunk.draft_ids,
                        probs.get(chunk.seq_id), temperature, state)
                else:
                    rows.append((row, temperature, state))
                    ids.append(chunk.seq_id)
            row += chunk.num_logits
        if rows:
            picked.update((i, [t]) for i, t in zip(ids, sample(logits, rows)))
        return picked

    def _propose(self, out: SchedulerOutput) -> dict[int, Any]:
        """Ask the proposer for each chunk with slots; put its tokens there. Returns the
        distributions of the sequences whose guesses were drawn at random."""
        proposer = self.proposer
        chunks, requests = [], []
        for chunk in out.chunks:
            seq = self.scheduler.get(chunk.seq_id) if chunk.num_draft_slots else None
            if seq is not None:
                chunks.append(chunk)
                requests.append(DraftRequest(seq, chunk.num_draft_slots))
        if proposer is None or not requests:
            return {}
        self._ready_proposer(proposer)
        probs = {}
        for chunk, proposal in zip(chunks, proposer.propose(requests)):
            chunk.add_drafts(proposal.token_ids)
            out.draft_tokens += len(chunk.draft_ids)
            if proposal.probs is not None and chunk.draft_ids:
                probs[chunk.seq_id] = proposal.probs[:len(chunk.draft_ids)]
        return probs

    def _model_chunks(self, out: SchedulerOutput) -> list[ScheduledChunk]:
        """``out.chunks``, or, for a model that returns one row per chunk, each chunk with
        proposals as single-token chunks of the same sequence."""
        if self.model.supports_num_logits or not out.draft_tokens:
            return out.chunks
        chunks = []
        for c in out.chunks:
            if c.num_logits == 1:
                chunks.append(c)
                continue
            head = len(c.token_ids) - c.num_logits
            if head:
                chunks.append(ScheduledChunk(c.seq_id, c.token_ids[:head], c.start_pos,
                                             c.block_table, False, False,
                                             adapter_slot=c.adapter_slot))
            chunks.extend(ScheduledChunk(c.seq_id, [tok], c.start_pos + j, c.block_table,
                                         True, True, adapter_slot=c.adapter_slot)
                          for j, tok in enumerate(c.token_ids) if j >= head)
        return chunks

    @staticmethod
    def _verify(logits: Any, draft_ids: list[int], draft_probs: Any, temperature: float,
                state: Any) -> list[int]:
        if temperature <= 0:
            return verify_greedy(logits.argmax(dim=-1).tolist(), draft_ids)
        import torch

        p = target_probs(logits.float().cpu(), temperature)[None]
        q = None if draft_probs is None else draft_probs[None]
        tokens, counts = rejection_sample(p, torch.tensor([draft_ids]), q, state)
        return tokens[0, :int(counts[0])].tolist()

    def commit(self, out: SchedulerOutput, sampled: dict[int, Any], started_s: float) -> StepResult:
        now = self.clock.now()
        batch = len(self.scheduler.running)
        result = self.scheduler.update_from_output(out, sampled, now)
        drafted = accepted = 0
        for chunk in out.chunks:
            if chunk.draft_ids and chunk.seq_id in sampled:
                n_acc = len(sampled[chunk.seq_id]) - 1
                self.spec_counts.add(len(chunk.draft_ids), n_acc)
                drafted += len(chunk.draft_ids)
                accepted += n_acc
        self._step_spec = (drafted, accepted)
        if self.proposer is not None:
            switch = self.spec.observe(self.config, batch, out.draft_slots > 0, drafted,
                                       accepted, len(result.new_tokens), now - started_s)
            if switch is not None:
                self._emit_switch(switch, now)
        self.steps += 1
        self.tokens_generated += len(result.new_tokens)
        for seq, _ in result.new_tokens:
            if len(seq.output_ids) == 1:  # its first token: the prompt is in the cache
                self.prompt_tokens += len(seq.prompt_ids)
        self.padding_rows += out.padding_tokens
        self._record_step(out, now, now - started_s)
        for seq in result.finished:
            self._record_end(seq)
        return result

    def fail(self, out: SchedulerOutput, error: BaseException, started_s: float) -> list[Sequence]:
        now = self.clock.now()
        failed = self.scheduler.fail_step(out, now, error)
        self._record_step(out, now, now - started_s, failed=True)
        self._put(EventRow(instance_id=self.instance_id, model=self.model_name,
                           at=self.clock.to_wall(now), kind="model_error", severity="error",
                           message=f"generation step failed: {type(error).__name__}: {error}",
                           details_json=json.dumps({"sequences": len(failed)})))
        for seq in failed:
            self._record_end(seq)
        return failed

    def step(self) -> tuple[SchedulerOutput, StepResult]:
        """plan + execute + commit in the calling thread."""
        out = self.plan()
        if out.is_empty:
            return out, StepResult()
        started = self.clock.now()
        try:
            sampled = self.execute(out)
        except Exception as exc:  # the model failed: only this step's requests fail
            return out, StepResult(finished=self.fail(out, exc, started))
        return out, self.commit(out, sampled, started)

    # -- settings -------------------------------------------------------------------
    def get_settings(self) -> tuple[int, GenerationConfig]:
        return self.settings_version, self.config

    def update_settings(self, changes: dict, requested_by: str = "api") -> tuple[int, GenerationConfig]:
        """Validate ``changes`` (ConfigError, nothing changes) and apply them from the next step."""
        old = self.config
        new = old.with_runtime_changes(changes)
        spec_keys = ("speculative_method", "prompt_lookup_min", "prompt_lookup_max",
                     "num_speculative_tokens", "max_num_seqs")
        if self._fixed_proposer is None and any(getattr(old, k) != getattr(new, k)
                                                for k in spec_keys):
            proposer = make_proposer(new, self.model, self._draft_model)  # may refuse
            for seq in self.scheduler.running:
                self._release(seq.seq_id)
            self.proposer = proposer  # a draft model is set up at its first step
            self.spec = SpecController()
        self.scheduler.config = new
        if self.scheduler.adapters is not None and old.adapter_slots != new.adapter_slots:
            self.scheduler.adapters.cache.resize(new.adapter_slots)
        self.settings_version += 1
        changed = {k: v for k, v in new.to_dict().items() if old.to_dict()[k] != v}
        self._put(EventRow(
            instance_id=self.instance_id, model=self.model_name,
            at=self.clock.wall(), kind="settings_change",
            message=f"generation settings v{self.settings_version} by {requested_by}: "
                    + (", ".join(f"{k}={v}" for k, v in changed.items()) or "no change"),
            details_json=json.dumps({"old": old.to_dict(), "new": new.to_dict(),
                                     "requested_by": requested_by,
                                     "version": self.settings_version})))
        return self.settings_version, new

    def _release(self, seq_id: int) -> None:
        if self.proposer is not None:
            self.proposer.release(seq_id)

    def flush_events(self) -> None:
        """Report preemptions still held back by the rate limit."""
        if self._preempted_pending:
            self._emit_preemptions(self.clock.now())

    # -- figures --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        sch = self.scheduler
        return {
            "mode": self.config.mode, "settings_version": self.settings_version,
            "running": len(sch.running), "waiting": len(sch.waiting),
            # the names the request engine's stats use, for tools that read both
            "queue_depth": len(sch.waiting), "in_flight": len(sch.running),
            "blocks_used": sch.blocks.num_used, "blocks_free": sch.blocks.num_free,
            "num_cache_blocks": sch.blocks.num_blocks, "block_size": sch.blocks.block_size,
            "steps": self.steps, "preemptions": sch.total_preemptions,
            "tokens_generated": self.tokens_generated, "prompt_tokens": self.prompt_tokens,
            "padding_rows": self.padding_rows,
            "requests": dict(self.counts),
            "speculation": {"method": self.config.speculative_method
                            if self.proposer is not None else "none",
                            "num_speculative_tokens": self.config.num_speculative_tokens,
                            **self.spec_counts.as_dict()},
            #: the LoRA adapters and the slot cache (None: the model takes no adapters)
            "adapters": self.adapter_stats(),
        }

    def adapter_stats(self) -> dict[str, Any] | None:
        step = self.scheduler.adapters
        if self.adapters is None or step is None:
            return None
        slots = step.cache
        return {"registered": self.adapters.names(), "slots": slots.capacity,
                "resident": len(slots.resident()), "slot_hits": slots.hits,
                "slot_misses": slots.loads, "slot_evictions": slots.evictions,
                "running": step.running(), "queued": dict(step.depth)}

    # -- records --------------------------------------------------------------------
    def _put(self, record: Any) -> None:
        if self.recorder is not None:
            self.recorder.put(record)

    def _record_step(self, out: SchedulerOutput, now: float, step_s: float,
                     failed: bool = False) -> None:
        self._put(GenStepRow(
            instance_id=self.instance_id, model=self.model_name, at=self.clock.to_wall(now),
            seq=self.step_seq,
            mode=out.mode, running=out.num_live_chunks, waiting=out.num_waiting,
            prefill_tokens=out.prefill_tokens, decode_tokens=out.decode_tokens + out.draft_tokens,
            blocks_used=out.blocks_used, blocks_free=out.blocks_free,
            preemptions=len(out.preempted), step_s=step_s,
            spec_draft_tokens=out.draft_tokens if self.proposer is not None else None,
            spec_accepted_tokens=self._step_spec[1] if self.proposer is not None else None,
            spec_sequences=sum(1 for c in out.chunks if c.draft_ids)
            if self.proposer is not None else None,
            adapters=len({c.adapter_slot for c in out.chunks
                          if c.adapter_slot >= 0 and not c.is_padding})
            if self.adapters is not None else None))
        self._step_spec = (0, 0)
        if self._traced_joined:
            self._traced_joined = False
            hook = self.on_traced_step
            if hook is not None:
                hook(self.step_seq, now - step_s, now, out, failed)
        if out.preempted:
            self._preempted_pending.extend(out.preempted)
            last = self._last_preemption_event_s
            if last is None or now - last >= self.config.preemption_event_interval_s:
                self._emit_preemptions(now)

    def event(self, now: float, kind: str, message: str, severity: str = "info",
              **details: Any) -> None:
        """An event of this model (adapters, refusals, expiries)."""
        self._put(EventRow(instance_id=self.instance_id, model=self.model_name,
                           at=self.clock.to_wall(now), kind=kind, severity=severity,
                           message=message, details_json=json.dumps(details, default=str)))

    def _record_slot_changes(self, out: SchedulerOutput) -> None:
        """An ``adapter_load`` event per adapter the step put in a slot (and an
        ``adapter_evict`` for the one it replaced), as the request engine records them."""
        for change in out.adapter_changes:
            if change.evicted is not None:
                self.event(change.at_s, "adapter_evict",
                           f"adapter {change.evicted!r} left slot {change.slot} for "
                           f"{change.name!r} (least recently used)", adapter=change.evicted,
                           slot=change.slot, reason="lru", replaced_by=change.name)
            self.event(change.at_s, "adapter_load",
                       f"adapter {change.name!r} loaded into slot {change.slot}",
                       adapter=change.name, slot=change.slot, evicted=change.evicted)

    def _emit_switch(self, switch: SpecSwitch, now: float) -> None:
        top = switch.bucket
        sizes = "1" if top == 1 else f"{top // 2 + 1}-{top}"
        self._put(EventRow(
            instance_id=self.instance_id, model=self.model_name, at=self.clock.to_wall(now),
            kind="speculation", severity="info",
            message=f"speculative decoding {'on' if switch.on else 'off'} at batch sizes "
                    f"{sizes}: {switch.reason}",
            details_json=json.dumps({
                "on": switch.on, "batch_bucket": top, "cost_on_s": switch.cost_on_s,
                "cost_off_s": switch.cost_off_s, "acceptance_rate": switch.acceptance_rate,
                "method": self.config.speculative_method,
                "num_speculative_tokens": self.config.num_speculative_tokens})))

    def _emit_preemptions(self, now: float) -> None:
        ids = self._preempted_pending
        since = self._last_preemption_event_s
        self._preempted_pending = []
        self._last_preemption_event_s = now
        sch = self.scheduler
        self._put(EventRow(
            instance_id=self.instance_id, model=self.model_name, at=self.clock.to_wall(now),
            kind="preemption", severity="warning",
            message=f"{len(ids)} sequence(s) preempted: the KV cache ran short for running "
                    "sequences to grow; they will be recomputed. Raise num_cache_blocks or "
                    "lower max_num_seqs if this repeats",
            details_json=json.dumps({
                "count": len(ids), "seq_ids": ids[:50],
                "since": None if since is None else self.clock.to_wall(since),
                "blocks_free": sch.blocks.num_free, "running": len(sch.running),
                "waiting": len(sch.waiting)})))

    def _record_end(self, seq: Sequence) -> None:
        self._release(seq.seq_id)
        self.counts[seq.outcome or "error"] = self.counts.get(seq.outcome or "error", 0) + 1
        end = seq.finished_s if seq.finished_s is not None else self.clock.now()
        n_out = len(seq.output_ids)
        started = seq.first_scheduled_s if seq.first_scheduled_s is not None else end
        ttft = None if seq.first_token_s is None else seq.first_token_s - seq.arrival_s
        tpot = (end - seq.first_token_s) / (n_out - 1) \
            if seq.first_token_s is not None and n_out > 1 else None
        self._put(RequestRow(
            instance_id=self.instance_id, model=self.model_name, batch_seq=seq.first_step,
            priority=seq.priority, arrived_at=self.clock.to_wall(seq.arrival_s),
            finished_at=self.clock.to_wall(end), queue_wait_s=started - seq.arrival_s,
            latency_s=end - seq.arrival_s, outcome=seq.outcome or "error",
            length=len(seq.prompt_ids), ttft_s=ttft, tpot_s=tpot,
            prompt_tokens=len(seq.prompt_ids), output_tokens=n_out, adapter=seq.adapter))
