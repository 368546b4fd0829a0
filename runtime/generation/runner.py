"""``StepRunner``: one generation step at a time, synchronously, with its records.

It ties the scheduler, the model and sampling together and turns what happens into
records (``GenStepRow`` per step, ``RequestRow`` per ended request, aggregated
``EventRow(kind="preemption")``, ``settings_change`` events). A step is three calls
so that the asyncio engine can run the middle one off the event loop::

    out = runner.plan()                  # schedule (cheap; also ends expired requests)
    sampled = runner.execute(out)        # model forward + sampling (the slow part)
    result = runner.commit(out, sampled, started_s)

``step()`` does all three in a row, for benchmarks and tests. All methods except
``execute`` must be called from one thread; ``execute`` only reads ``out``.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from batchscope.storage.records import EventRow, GenStepRow, RecorderLike, RequestRow
from runtime.core.clock import MonotonicClock
from runtime.api.errors import ConfigError, QueueFull, ValidationError
from runtime.device import nvtx
from runtime.engine.admission import deadline_of, priority_of
from runtime.generation.config import GenerationConfig
from runtime.generation.model import GenerationModel, make_sampler_state, sample
from runtime.generation.scheduler import Scheduler, SchedulerOutput, Sequence, StepResult

OUTCOMES = ("ok", "expired", "cancelled", "error", "rejected")


class StepRunner:
    def __init__(self, model: GenerationModel, config: GenerationConfig | None = None, *,
                 recorder: RecorderLike | None = None, instance_id: str = "local",
                 clock: Any = None) -> None:
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
        self.tokens_generated = 0
        #: prompt tokens of the requests whose prefill completed (recomputation not counted)
        self.prompt_tokens = 0
        self.padding_rows = 0

    @property
    def config(self) -> GenerationConfig:
        return self.scheduler.config

    @property
    def model_name(self) -> str:
        return self.model.name

    def setup(self, device: Any = "cpu") -> None:
        cfg = self.config
        self.model.setup(device, cfg.num_cache_blocks, cfg.block_size)

    # -- requests -------------------------------------------------------------------
    def new_sequence(self, prompt_ids: list[int], *, max_new_tokens: int | None = None,
                     priority: int | None = None, timeout_ms: float | None = None,
                     ignore_eos: bool = False, temperature: float = 0.0,
                     seed: int | None = None) -> Sequence:
        """Validate and queue a request; raises ClientError/ValidationError/QueueFull."""
        cfg = self.config
        now = self.clock.now()
        priority = priority_of(priority, cfg)
        deadline_s = deadline_of(timeout_ms, cfg, now)
        if not (isinstance(temperature, (int, float)) and 0 <= temperature <= 100):
            raise ValidationError(f"temperature={temperature!r} must be a number from 0 to 100")
        max_new = cfg.default_max_new_tokens if max_new_tokens is None else max_new_tokens
        self.scheduler.check(prompt_ids, max_new)
        if len(self.scheduler.waiting) >= cfg.max_queue_size:
            self.counts["rejected"] += 1
            self._put(RequestRow(
                instance_id=self.instance_id, model=self.model_name, batch_seq=None,
                priority=priority, arrived_at=self.clock.to_wall(now),
                finished_at=self.clock.to_wall(now), queue_wait_s=0.0, latency_s=0.0,
                outcome="rejected", length=len(prompt_ids), prompt_tokens=len(prompt_ids),
                output_tokens=0))
            raise QueueFull(f"{len(self.scheduler.waiting)} requests are already waiting for "
                            f"{self.model_name!r} (max_queue_size={cfg.max_queue_size}); "
                            "retry later", retry_after_s=1.0)
        seq = Sequence(seq_id=next(self._ids), prompt_ids=list(prompt_ids),
                       max_new_tokens=max_new, priority=priority, arrival_s=now,
                       deadline_s=deadline_s,
                       ignore_eos=bool(ignore_eos), temperature=float(temperature), seed=seed,
                       sampler_state=make_sampler_state(float(temperature), seed))
        self.scheduler.add_request(seq)
        return seq

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
        out = self.scheduler.schedule(self.clock.now())
        for seq in out.expired:
            self._record_end(seq)
        return out

    def execute(self, out: SchedulerOutput) -> dict[int, int]:
        """Run the model on ``out`` and sample one token per completing chunk."""
        with nvtx.step_range(self.steps + 1, self.model_name, out.num_live_chunks,
                             out.prefill_tokens, out.decode_tokens):
            logits = self.model.step(out.chunks)
        rows, ids = [], []
        for row, chunk in enumerate(out.chunks):
            if chunk.completes:
                seq = self.scheduler.get(chunk.seq_id)
                temperature = seq.temperature if seq is not None else 0.0
                state = seq.sampler_state if seq is not None else None
                rows.append((row, temperature, state))
                ids.append(chunk.seq_id)
        return dict(zip(ids, sample(logits, rows))) if rows else {}

    def commit(self, out: SchedulerOutput, sampled: dict[int, int], started_s: float) -> StepResult:
        now = self.clock.now()
        result = self.scheduler.update_from_output(out, sampled, now)
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
        self._record_step(out, now, now - started_s)
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
        self.scheduler.config = new
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
        }

    # -- records --------------------------------------------------------------------
    def _put(self, record: Any) -> None:
        if self.recorder is not None:
            self.recorder.put(record)

    def _record_step(self, out: SchedulerOutput, now: float, step_s: float) -> None:
        self._put(GenStepRow(
            instance_id=self.instance_id, model=self.model_name, at=self.clock.to_wall(now),
            mode=out.mode, running=out.num_live_chunks, waiting=out.num_waiting,
            prefill_tokens=out.prefill_tokens, decode_tokens=out.decode_tokens,
            blocks_used=out.blocks_used, blocks_free=out.blocks_free,
            preemptions=len(out.preempted), step_s=step_s))
        if out.preempted:
            self._preempted_pending.extend(out.preempted)
            last = self._last_preemption_event_s
            if last is None or now - last >= self.config.preemption_event_interval_s:
                self._emit_preemptions(now)

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
        self.counts[seq.outcome or "error"] = self.counts.get(seq.outcome or "error", 0) + 1
        end = seq.finished_s if seq.finished_s is not None else self.clock.now()
        n_out = len(seq.output_ids)
        started = seq.first_scheduled_s if seq.first_scheduled_s is not None else end
        ttft = None if seq.first_token_s is None else seq.first_token_s - seq.arrival_s
        tpot = (end - seq.first_token_s) / (n_out - 1) \
            if seq.first_token_s is not None and n_out > 1 else None
        self._put(RequestRow(
            instance_id=self.instance_id, model=self.model_name, batch_seq=None,
            priority=seq.priority, arrived_at=self.clock.to_wall(seq.arrival_s),
            finished_at=self.clock.to_wall(end), queue_wait_s=started - seq.arrival_s,
            latency_s=end - seq.arrival_s, outcome=seq.outcome or "error",
            length=len(seq.prompt_ids), ttft_s=ttft, tpot_s=tpot,
            prompt_tokens=len(seq.prompt_ids), output_tokens=n_out))
