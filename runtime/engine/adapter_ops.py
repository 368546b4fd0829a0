"""``EngineAdapters``: the ``Engine``'s operations on the LoRA adapters of its models.

Listing a model's adapters (with where each is on the device), registering one from its
files (read off the event loop by ``load_adapter``), and unloading one: new requests for
it are refused, those queued or running for it finish, then it leaves the device. Each
change is an event and is told to ``on_adapters_change``'s listeners. The registry of a
model is ``runtime.adapters.registry``'s; its slots on the device are its batcher's
(``runtime.adapters.slots``).

A mixin of ``runtime.engine.engine.Engine``, whose state it uses (``_served``,
``_models``, ``_clock``, ``_booking``, ``on_adapters_change``); all methods are to be
called on the event loop's thread.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from runtime.adapters.registry import AdapterRegistry
from runtime.api.errors import ModelNotFound, ValidationError
from runtime.engine.served import ServedModel


class EngineAdapters:
    """List, register, load and unload the adapters of the engine's models."""

    # the Engine's, used here
    _models: dict[str, ServedModel]
    _clock: Any
    _booking: Any
    on_adapters_change: list
    _served: Callable[[str], ServedModel]

    @staticmethod
    def _adapter_of(served: ServedModel, adapter: str | None) -> str | None:
        """The adapter a request names, checked (404 naming the loaded ones)."""
        if adapter is None or adapter == "":
            return None
        registry = served.adapters
        if registry is None:
            raise ModelNotFound(f"model {served.name!r} takes no adapters; send the request "
                                "without one")
        return registry.require(adapter).name

    def _registry(self, model: str) -> AdapterRegistry:
        registry = self._served(model).adapters
        if registry is None:
            raise ValidationError(f"model {model!r} declares no adapter targets; it takes no "
                                  "adapters")
        return registry

    def adapters(self, model: str) -> list[dict]:
        """The adapters of ``model`` (empty for a model that takes none), each with
        whether it is resident on the device now and in which slot."""
        served = self._served(model)
        if served.adapters is None:
            return []
        slots = served.batcher.slots
        out = []
        for entry in served.adapters.entries():
            row = entry.to_dict()
            row["slot"] = slots.slot_of(entry.name) if slots is not None else None
            row["queued"] = served.batcher.adapter_depth.get(entry.name, 0)
            out.append(row)
        return out

    def adapter_names(self, model: str) -> list[str]:
        served = self._models.get(model)
        return [] if served is None or served.adapters is None else served.adapters.names()

    def register_adapter(self, model: str, name: str, path: str,
                         requested_by: str = "api") -> dict:
        """Read, check and register an adapter (ValidationError 422 when it does not fit
        the base, InsufficientMemory 507 past ``adapter_memory_mb``: nothing changes)."""
        registry = self._registry(model)
        adapter = registry.read(name, path)
        return self._add_adapter(model, registry, adapter, requested_by)

    async def load_adapter(self, model: str, name: str, path: str,
                           requested_by: str = "api") -> dict:
        """``register_adapter`` with the files read off the event loop."""
        registry = self._registry(model)
        adapter = await asyncio.to_thread(registry.read, name, path)
        return self._add_adapter(model, registry, adapter, requested_by)

    def _add_adapter(self, model: str, registry: AdapterRegistry, adapter: Any,
                     requested_by: str) -> dict:
        served = self._served(model)
        now = self._clock.now()
        entry = registry.add(adapter, served.config.adapter_memory_mb, now)
        slots = served.batcher.slots
        if slots is not None and slots.slot_of(entry.name) is not None \
                and not slots.pinned(entry.name):
            slots.evict(entry.name)  # replaced: the next batch loads the new weights
        self._booking.event(model, now, "adapter_registered",
                            f"adapter {entry.name!r} of {model!r} registered from {entry.path}",
                            adapter=entry.name, path=entry.path, bytes=entry.nbytes,
                            requested_by=requested_by)
        for listener in self.on_adapters_change:
            listener(model)
        return entry.to_dict()

    async def unload_adapter(self, model: str, name: str, requested_by: str = "api",
                             poll_s: float = 0.005) -> dict:
        """Refuse new requests for the adapter, let those queued or running for it finish,
        then take it off the device and forget it."""
        registry = self._registry(model)
        served = self._served(model)
        registry.retire(name)
        batcher = served.batcher
        queued = batcher.adapter_depth.get(name, 0)
        try:
            while batcher.adapter_depth.get(name, 0) or (
                    batcher.slots is not None and batcher.slots.pinned(name)):
                await asyncio.sleep(poll_s)
        finally:
            slot = batcher.slots.evict(name) if batcher.slots is not None else None
            registry.remove(name)
        now = self._clock.now()
        if slot is not None:
            self._booking.event(model, now, "adapter_evict",
                                f"adapter {name!r} left slot {slot} (unloaded)",
                                adapter=name, slot=slot, reason="unloaded")
        self._booking.event(model, now, "adapter_unloaded",
                            f"adapter {name!r} of {model!r} unloaded", adapter=name,
                            finished_queued=queued, requested_by=requested_by)
        for listener in self.on_adapters_change:
            listener(model)
        return {"name": name, "unloaded": True, "finished_queued": queued}
