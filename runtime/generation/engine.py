"""``GenerationEngine``: the asyncio shell around ``StepRunner`` for one generation model.

One worker task loops over steps: it plans on the event loop (cheap), runs the model
forward and sampling on the engine's own thread, then commits and hands each new
token to its request's stream. Requests, aborts and settings changes happen on the
event loop between those points, so the scheduler is only ever touched from there;
a settings change takes effect at the next step.

Every accepted request gets exactly one outcome: its last token (with a finish
reason), or an error raised from its stream (RequestExpired, ModelError,
ShuttingDown), or cancellation when its consumer goes away.

Stop strings (``stop``) are matched on the decoded text as it is handed to the
stream (``runtime.generation.stops``): the text before the first one is delivered,
the request ends at once with finish reason "stop" and outcome ok, and its KV blocks
are freed, exactly as if it had sampled its end token.

LoRA adapters (a model with ``adapter_targets``): ``submit(adapter=)`` names a
registered one; ``register_adapter``/``load_adapter`` read and check an adapter's PEFT
files and register it, ``unload_adapter`` refuses new requests for it at once, lets the
sequences naming it finish, then takes it off the device. They answer as the request
engine's methods of the same names do (the control API serves both).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence as Seq

from batchscope.storage.records import RecorderLike
from batchscope.threadnames import name_native
from runtime.core.clock import MonotonicClock
from runtime.api.errors import (BatchScopeError, ClientError, ModelError, ModelNotReady,
                                RequestExpired, RequestTooLarge, ShuttingDown, ValidationError)
from runtime.engine.otel_spans import BatchInfo
from runtime.generation.config import GenerationConfig
from runtime.generation.model import GenerationModel
from runtime.generation.runner import StepRunner
from runtime.generation.scheduler import Sequence, StepResult
from runtime.generation.stops import StopMatcher

#: a prompt text longer than max_model_len x this many characters cannot fit, and is
#: refused before it is tokenized (tokenizing holds the event loop)
MAX_CHARS_PER_TOKEN = 32


@dataclass(slots=True)
class TokenEvent:
    """One generated token as a stream yields it."""

    token_id: int
    #: the text this token completes (may be empty in the middle of a character)
    text: str
    #: 0 for the first generated token
    index: int
    #: None while generating; "stop" (end token or stop string) or "length" on the last event
    finish_reason: str | None = None


class GenerationStream:
    """Async iterator over one request's ``TokenEvent``s; closing it cancels the request."""

    def __init__(self, engine: "GenerationEngine", seq: Sequence, decoder: Any,
                 stops: StopMatcher | None = None) -> None:
        self._engine = engine
        self.seq = seq
        self._decoder = decoder
        self._stops = stops
        self._queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        #: tokens handed on so far (a step may hand on several of one request)
        self._delivered = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.seq.prompt_ids)

    @property
    def output_tokens(self) -> int:
        return len(self.seq.output_ids)

    def __aiter__(self) -> "GenerationStream":
        return self

    async def __anext__(self) -> TokenEvent:
        if self.done and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            self.done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.done = True
            raise item
        return item

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop generating for this request if it has not ended (outcome cancelled)."""
        if self.seq.outcome is None:
            self._engine._abort(self.seq.seq_id)
        self.done = True

    # -- fed by the engine ----------------------------------------------------------
    def _token(self, token: int, final: bool) -> bool:
        """Hand on one token; True when it is the request's last: it ended (``final``),
        or its text reached a stop string."""
        text = self._decoder.feed(token) if self._decoder is not None else ""
        if final and self._decoder is not None:
            text += self._decoder.flush()
        reason = self.seq.finish_reason if final else None
        if self._stops is not None:
            text, stopped = self._stops.feed(text)
            if stopped:
                if final:  # it ended on this token too: the stop string is what the
                    self.seq.finish_reason = "stop"  # client is told, so its trace says it
                final, reason = True, "stop"
            elif final:
                text += self._stops.flush()
        self._queue.put_nowait(TokenEvent(
            token_id=token, text=text, index=self._delivered, finish_reason=reason))
        self._delivered += 1
        if final:
            self._queue.put_nowait(None)
        return final

    def _fail(self, error: BaseException) -> None:
        self._queue.put_nowait(error)


class GenerationEngine:
    def __init__(self, model: GenerationModel, config: GenerationConfig | None = None, *,
                 recorder: RecorderLike | None = None, instance_id: str = "local",
                 clock: Any = None, device: Any = "cpu", draft_model: Any = None) -> None:
        self.clock = clock or MonotonicClock()
        self.runner = StepRunner(model, config, recorder=recorder, instance_id=instance_id,
                                 clock=self.clock, draft_model=draft_model)
        self.model = model
        self.device = device
        self.on_settings_change: list[Callable[[str, int, GenerationConfig], None]] = []
        self._streams: dict[int, GenerationStream] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._worker: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._ready = False
        self._accepting = False
        self._stopping = False
        self._seed_counter = 0
        #: the server's tracer (``runtime.engine.tracing``) when it traces this model's
        #: requests (set by the service; the HTTP layer begins and ends the traces)
        self.tracer: Any = None
        self.runner.on_traced_step = self._traced_step

    @property
    def name(self) -> str:
        return self.model.name

    def is_ready(self) -> bool:
        return self._ready and self._accepting

    # -- life cycle -----------------------------------------------------------------
    async def start(self) -> None:
        if self._worker is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"gen-{self.name}",
                                            initializer=name_native)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.runner.setup, self.device)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._ready = True
        self._accepting = True
        self._stopping = False
        self._worker = loop.create_task(self._run(), name=f"generation-{self.name}")

    async def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Refuse new requests, let queued and running ones finish, then end the rest."""
        self._accepting = False
        self._stopping = True
        if self._worker is None:
            return
        if self.runner.has_work():
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=drain_timeout_s)
            except asyncio.TimeoutError:
                pass
        self._ready = False
        self._worker.cancel()
        try:
            await self._worker
        except asyncio.CancelledError:
            pass
        self._worker = None
        ended = self.runner.abort_all("cancelled", ShuttingDown(
            f"{self.name!r} shut down before this request finished; retry on another instance"))
        self._deliver_ended(ended)
        self.runner.flush_events()
        if self._executor is not None:
            # a step still in flight finishes on its own; its results are no longer wanted
            self._executor.shutdown(wait=False)
            self._executor = None

    # -- requests -------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int] | None = None, prompt_text: str | None = None, *,
               max_new_tokens: int | None = None, priority: int | None = None,
               timeout_ms: float | None = None, ignore_eos: bool = False,
               temperature: float = 0.0, seed: int | None = None,
               stop: Seq[str] = (), speculative: bool | None = None,
               adapter: str | None = None) -> GenerationStream:
        """Queue a request and return its stream; raises at once when it is refused.
        ``stop``: strings that end generation where the text reaches one (needs the
        model's tokenizer to turn tokens into text). ``speculative``: False opts out of
        speculative decoding, True asks for it (served without where there is none).
        ``adapter``: a registered LoRA adapter (404 naming the loaded ones otherwise)."""
        if not self._accepting:
            if self._stopping:
                raise ShuttingDown(f"{self.name!r} is shutting down and takes no new requests")
            raise ModelNotReady(f"{self.name!r} is not started yet; retry in a moment")
        adapter = self.runner.adapter_of(adapter)
        if (prompt_token_ids is None) == (prompt_text is None):
            raise ClientError("give exactly one of a prompt text or a list of prompt token ids")
        if prompt_text is not None:
            if not isinstance(prompt_text, str):
                raise ClientError("the prompt text must be a string")
            if self.model.tokenizer is None:
                raise ClientError(f"{self.name!r} has no tokenizer; send prompt token ids")
            most = self.runner.config.max_model_len * MAX_CHARS_PER_TOKEN
            if len(prompt_text) > most:  # refused before the tokenizer holds the loop
                raise RequestTooLarge(
                    f"the prompt has {len(prompt_text)} characters, more than "
                    f"{most} ({MAX_CHARS_PER_TOKEN} per token of max_model_len="
                    f"{self.runner.config.max_model_len}) could fit; shorten it")
            prompt_token_ids = self.model.tokenizer.encode(prompt_text)
        if not isinstance(prompt_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids):
            raise ClientError("prompt token ids must be a list of integers")
        if isinstance(stop, str) or not all(isinstance(s, str) for s in stop):
            raise ClientError("stop must be a list of strings")
        if any(stop) and self.model.tokenizer is None:
            raise ClientError(f"{self.name!r} has no tokenizer, so its output has no text to "
                              "match stop strings against; leave stop out")
        if temperature and seed is None:
            self._seed_counter += 1
            seed = self._seed_counter
        seq = self.runner.new_sequence(
            prompt_token_ids, max_new_tokens=max_new_tokens, priority=priority,
            timeout_ms=timeout_ms, ignore_eos=ignore_eos, temperature=temperature, seed=seed,
            speculative=speculative, adapter=adapter)
        decoder = self.model.tokenizer.decoder() if self.model.tokenizer is not None else None
        stream = GenerationStream(self, seq, decoder, StopMatcher(stop) if any(stop) else None)
        self._streams[seq.seq_id] = stream
        self._idle.clear()
        self._wake.set()
        return stream

    def check_room(self, count: int, priority: int | None = None,
                   adapter: str | None = None) -> None:
        """Refuse a request of ``count`` sequences the queue cannot take whole
        (``StepRunner.check_room``) before any of them is submitted."""
        if self._accepting:
            self.runner.check_room(count, priority, adapter)

    async def generate(self, prompt_token_ids: list[int] | None = None,
                       prompt_text: str | None = None, *, max_new_tokens: int | None = None,
                       priority: int | None = None, timeout_ms: float | None = None,
                       ignore_eos: bool = False, temperature: float = 0.0,
                       seed: int | None = None, stop: Seq[str] = (),
                       speculative: bool | None = None,
                       adapter: str | None = None) -> AsyncIterator[TokenEvent]:
        """Yield the request's tokens as they are generated (see ``submit`` for errors)."""
        stream = self.submit(prompt_token_ids, prompt_text, max_new_tokens=max_new_tokens,
                             priority=priority, timeout_ms=timeout_ms, ignore_eos=ignore_eos,
                             temperature=temperature, seed=seed, stop=stop,
                             speculative=speculative, adapter=adapter)
        try:
            async for event in stream:
                yield event
        finally:
            stream.close()

    def _abort(self, seq_id: int) -> None:
        seq = self.runner.abort(seq_id, "cancelled")
        self._streams.pop(seq_id, None)
        if seq is not None and not self.runner.has_work():
            self._idle.set()

    # -- adapters ---------------------------------------------------------------------
    def _registry(self) -> Any:
        registry = self.runner.adapters
        if registry is None:
            raise ValidationError(f"model {self.name!r} declares no adapter targets; it takes "
                                  "no adapters")
        return registry

    def adapter_names(self) -> list[str]:
        """The adapters requests may name now (none for a model that takes none)."""
        registry = self.runner.adapters
        return [] if registry is None else registry.names()

    def adapter_entries(self) -> list[str]:
        """Every registered adapter's name, those being unloaded included."""
        registry = self.runner.adapters
        return [] if registry is None else [e.name for e in registry.entries()]

    def adapters(self) -> list[dict]:
        """The registered adapters, each with its slot on the device (or None) and the
        sequences (waiting or running) that name it."""
        registry = self.runner.adapters
        step = self.runner.scheduler.adapters
        if registry is None or step is None:
            return []
        out = []
        for entry in registry.entries():
            row = entry.to_dict()
            row["slot"] = step.cache.slot_of(entry.name)
            row["queued"] = step.depth.get(entry.name, 0)
            out.append(row)
        return out

    def register_adapter(self, name: str, path: str, requested_by: str = "api") -> dict:
        """Read, check and register an adapter (ValidationError 422 when it does not fit
        the base, InsufficientMemory 507 past ``adapter_memory_mb``: nothing changes)."""
        registry = self._registry()
        return self._add_adapter(registry, registry.read(name, path), requested_by)

    async def load_adapter(self, name: str, path: str, requested_by: str = "api") -> dict:
        """``register_adapter`` with the files read off the event loop."""
        registry = self._registry()
        adapter = await asyncio.to_thread(registry.read, name, path)
        return self._add_adapter(registry, adapter, requested_by)

    def _add_adapter(self, registry: Any, adapter: Any, requested_by: str) -> dict:
        runner = self.runner
        now = self.clock.now()
        entry = registry.add(adapter, runner.config.adapter_memory_mb, now)
        cache = runner.scheduler.adapters.cache
        if cache.slot_of(entry.name) is not None and not cache.pinned(entry.name):
            cache.evict(entry.name)  # replaced: the next step that needs it loads the new weights
        runner.event(now, "adapter_registered",
                     f"adapter {entry.name!r} of {self.name!r} registered from {entry.path}",
                     adapter=entry.name, path=entry.path, bytes=entry.nbytes,
                     requested_by=requested_by)
        return entry.to_dict()

    async def unload_adapter(self, name: str, requested_by: str = "api",
                             poll_s: float = 0.005) -> dict:
        """Refuse new requests for the adapter, let the sequences naming it finish, then
        take it off the device and forget it."""
        registry = self._registry()
        registry.retire(name)
        step = self.runner.scheduler.adapters
        queued = step.depth.get(name, 0)
        try:
            while step.depth.get(name, 0) or step.cache.pinned(name):
                await asyncio.sleep(poll_s)
        finally:
            slot = step.cache.evict(name)
            registry.remove(name)
        now = self.clock.now()
        if slot is not None:
            self.runner.event(now, "adapter_evict", f"adapter {name!r} left slot {slot} "
                              "(unloaded)", adapter=name, slot=slot, reason="unloaded")
        self.runner.event(now, "adapter_unloaded", f"adapter {name!r} of {self.name!r} "
                          "unloaded", adapter=name, finished_queued=queued,
                          requested_by=requested_by)
        return {"name": name, "unloaded": True, "finished_queued": queued}

    # -- settings and figures ---------------------------------------------------------
    def get_settings(self) -> tuple[int, GenerationConfig]:
        return self.runner.get_settings()

    def update_settings(self, changes: dict, requested_by: str = "api") -> tuple[int, GenerationConfig]:
        version, config = self.runner.update_settings(changes, requested_by)
        for listener in list(self.on_settings_change):
            listener(self.name, version, config)
        self._wake.set()
        return version, config

    def stats(self) -> dict[str, Any]:
        out = self.runner.stats()
        out["ready"] = self.is_ready()
        return out

    def _traced_step(self, step: int, started_s: float, now: float, out: Any,
                     failed: bool) -> None:
        """A step that a request whose spans are exported joined: its span, made once
        with the first of them (``runtime.engine.otel_spans.BatchInfo``: a step's shape)."""
        otel = getattr(self.tracer, "otel", None)
        if otel is None:
            return
        runner = self.runner
        cfg = runner.config
        to_wall = runner.clock.to_wall
        tokens = out.prefill_tokens + out.decode_tokens + out.draft_tokens
        otel.batch(BatchInfo(step, self.name, to_wall(started_s), to_wall(now),
                             out.num_live_chunks, cfg.max_num_seqs,
                             tokens + out.padding_tokens, tokens, None, cfg.mode,
                             runner.settings_version, "error" if failed else "ok",
                             out.prefill_tokens, out.decode_tokens + out.draft_tokens))

    # -- the worker -----------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        runner = self.runner
        while True:
            if not runner.has_work():
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            out = runner.plan()
            self._deliver_ended(out.expired)
            if out.is_empty:
                # nothing could run (only possible right after expiries); let the loop breathe
                await asyncio.sleep(0.001)
                continue
            started = self.clock.now()
            try:
                sampled = await loop.run_in_executor(self._executor, runner.execute, out)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._deliver_ended(runner.fail(out, exc, started))
                continue
            self._deliver(runner.commit(out, sampled, started))

    def _deliver(self, result: StepResult) -> None:
        # a sequence that verified proposed tokens gets several: only its last is final
        last = {seq.seq_id: i for i, (seq, _) in enumerate(result.new_tokens)}
        for i, (seq, token) in enumerate(result.new_tokens):
            stream = self._streams.get(seq.seq_id)
            if stream is None:
                continue
            ended = seq.outcome is not None and last[seq.seq_id] == i
            if stream._token(token, ended):
                self._streams.pop(seq.seq_id, None)
                if not ended:  # its text reached a stop string
                    self.runner.stop_early(seq.seq_id)

    def _deliver_ended(self, ended: list[Sequence]) -> None:
        """Hand an error to the streams of requests that ended without a final token."""
        for seq in ended:
            stream = self._streams.pop(seq.seq_id, None)
            if stream is not None:
                stream._fail(self._error_for(seq))

    def _error_for(self, seq: Sequence) -> BaseException:
        if isinstance(seq.error, BatchScopeError):
            return seq.error
        if seq.outcome == "expired":
            waited_ms = ((seq.finished_s or 0.0) - seq.arrival_s) * 1000.0
            return RequestExpired(
                f"the request waited {waited_ms:.0f} ms without getting a place in the running "
                "batch, past its timeout; retry later or give a longer timeout_ms")
        if seq.outcome == "error":
            err = seq.error
            return ModelError(f"the model failed while generating for this request "
                              f"({type(err).__name__}: {err}); the request was not completed")
        return ShuttingDown("the request was cancelled before it finished")
