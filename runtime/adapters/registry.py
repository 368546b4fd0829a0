"""``AdapterRegistry``: the adapters one served model knows, by name.

Registering reads the adapter's files and checks them against the model's targets
(``runtime.adapters.lora.read_peft``: 422 naming what does not fit) and against the
model's ``adapter_memory_mb`` (507); a refused adapter changes nothing. A request names
a registered adapter or gets 404 listing the known ones. Unloading first *retires* the
adapter: new requests for it are refused while the ones already queued still run on it
(``ref`` keeps answering for them); ``remove`` then forgets it.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any, Mapping

from runtime.adapters.lora import AdapterRef, LoraAdapter, read_peft
from runtime.api.errors import InsufficientMemory, ModelNotFound, ValidationError

#: adapter names: what a URL, a metric label and ``model: "<base>:<adapter>"`` can carry
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(slots=True)
class AdapterEntry:
    name: str
    path: str
    ref: AdapterRef
    nbytes: int
    ranks: dict[str, int]
    loaded_at: float
    retiring: bool = False

    def to_dict(self) -> dict[str, Any]:
        ranks = sorted(set(self.ranks.values()))
        return {"name": self.name, "path": self.path, "rank": max(ranks), "ranks": ranks,
                "targets": len(self.ranks), "bytes": self.nbytes,
                "state": "unloading" if self.retiring else "ready"}


class AdapterRegistry:
    """The adapters of one model (see the module docstring); methods are called on the
    event loop's thread, except ``read``."""

    def __init__(self, model: str, targets: Mapping[str, tuple[int, int]], max_rank: int) -> None:
        self.model = model
        self.targets = dict(targets)
        self.max_rank = max_rank
        self._entries: dict[str, AdapterEntry] = {}
        self._generation = 0
        self._lock = threading.Lock()

    @staticmethod
    def check_name(name: Any) -> str:
        if not isinstance(name, str) or not NAME.match(name):
            raise ValidationError(f"adapter name {name!r} must be 1 to 64 letters, digits, "
                                  "'.', '_' or '-', starting with a letter or digit")
        return name

    def read(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter's files (no registration; safe on any thread)."""
        self.check_name(name)
        if not isinstance(path, str) or not path:
            raise ValidationError("an adapter needs the path of its PEFT directory")
        return read_peft(path, self.targets, name, max_rank=self.max_rank)

    def add(self, adapter: LoraAdapter, budget_mb: float, now: float) -> AdapterEntry:
        """Register a read adapter (replacing one of the same name); 507 past the budget."""
        with self._lock:
            replaced = self._entries.get(adapter.name)
            others = sum(e.nbytes for e in self._entries.values() if e is not replaced)
            budget = int(budget_mb * 1024 * 1024)
            if others + adapter.nbytes > budget:
                raise InsufficientMemory(
                    f"adapter {adapter.name!r} takes {adapter.nbytes / 2**20:.2f} MB and the "
                    f"adapters of model {self.model!r} already take {others / 2**20:.2f} MB; "
                    f"adapter_memory_mb={budget_mb:g}. Unload an adapter or raise "
                    "adapter_memory_mb")
            if replaced is not None and replaced.retiring:
                raise ValidationError(f"adapter {adapter.name!r} is being unloaded; load it "
                                      "again once that has finished")
            self._generation += 1
            entry = AdapterEntry(adapter.name, adapter.path,
                                 AdapterRef(adapter.name, adapter.path, self._generation),
                                 adapter.nbytes, adapter.ranks, now)
            self._entries[adapter.name] = entry
            return entry

    def require(self, name: str) -> AdapterEntry:
        """The adapter a request names; 404 naming the known ones when it is not served."""
        entry = self._entries.get(name)
        if entry is None or entry.retiring:
            known = self.names()
            raise ModelNotFound(
                f"adapter {name!r} of model {self.model!r} is not loaded; loaded adapters are "
                f"{known}" + ("" if known else " (none: load one with POST "
                              f"/v2/models/{self.model}/adapters)"))
        return entry

    def ref(self, name: str) -> AdapterRef | None:
        """The adapter's ref for the batcher, also while it is retiring."""
        entry = self._entries.get(name)
        return None if entry is None else entry.ref

    def retire(self, name: str) -> AdapterEntry:
        entry = self.require(name)
        entry.retiring = True
        return entry

    def remove(self, name: str) -> None:
        with self._lock:
            self._entries.pop(name, None)

    def names(self) -> list[str]:
        return sorted(n for n, e in self._entries.items() if not e.retiring)

    def entries(self) -> list[AdapterEntry]:
        return [self._entries[n] for n in sorted(self._entries)]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())
