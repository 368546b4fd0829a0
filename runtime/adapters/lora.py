"""LoRA adapters: reading PEFT's layout, checking it against the base model, and the
batched forward term that lets rows of one batch use different adapters.

A LoRA adapter adds to a target linear layer ``y = x W^T + b`` the low-rank term
``scale * (x A^T) B^T`` with ``A`` of shape ``(r, in)``, ``B`` of shape ``(out, r)`` and
``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA). An adapter is read
from PEFT's files: a directory holding ``adapter_config.json`` and
``adapter_model.safetensors`` (keys ``base_model.model.<module>.lora_A.weight`` and
``...lora_B.weight``), ``rank_pattern``/``alpha_pattern`` giving modules their own rank
and alpha. ``read_peft`` checks every tensor against the model's declared targets
(``ModelAPI.adapter_targets``: module name -> ``(in_features, out_features)``) and raises
``ValidationError`` naming what does not fit; nothing is kept from a refused adapter.

``AdapterBank`` holds the adapters resident on the device in slots: per target, the
``A`` matrices stacked as ``(slots + 1, r_max, in)`` and the ``B`` matrices, scale
folded in, as ``(slots + 1, out, r_max)``; adapters of smaller rank are padded with
zeros, which adds nothing, and the last slot stays zero for rows without an adapter.
A batch gives every row its slot (``activate``); each target layer then computes its
base output once for the whole batch and adds the rows' terms with one gather and two
batched matrix products (``lora_term``): ``(x A_g^T) B_g^T`` with ``A_g``/``B_g`` the
rows' matrices. That formulation was chosen by measurement on the CPU against a loop
over the batch's adapters and a stacked product over every slot with a row mask
(``benchmarks/bench_adapters.py`` prints the three) for rows of many tokens; for rows of
one vector each (``wide``) the loop (``segment_term``) is the faster and is used. On a GPU,
Punica's SGMV/BGMV kernels would replace both.
"""

from __future__ import annotations

import json
import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from runtime.api.errors import ValidationError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: the prefix PEFT gives module names in its saved files
PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(slots=True)
class LoraPair:
    """One target's matrices: ``a`` ``(r, in)``, ``b`` ``(out, r)``, and the scale."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(slots=True)
class LoraAdapter:
    """A LoRA adapter read and checked against a model's targets."""

    name: str
    pairs: dict[str, LoraPair]
    path: str = ""

    @property
    def nbytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size()
                   for p in self.pairs.values())

    @property
    def ranks(self) -> dict[str, int]:
        return {module: pair.rank for module, pair in self.pairs.items()}

    @property
    def max_rank(self) -> int:
        return max((p.rank for p in self.pairs.values()), default=0)


def _pattern_value(module: str, patterns: Mapping[str, Any], default: Any) -> Any:
    """PEFT's ``rank_pattern``/``alpha_pattern`` lookup: a key matches a module whose
    name is the key or ends with ``.key`` (keys may be regular expressions)."""
    for key, value in patterns.items():
        if module == key or re.fullmatch(rf"(?:.*\.)?(?:{key})", module):
            return value
    return default


def read_config(path: str) -> dict:
    """The adapter's ``adapter_config.json`` (ValidationError when unreadable)."""
    file = os.path.join(path, CONFIG_FILE)
    try:
        with open(file, encoding="utf-8") as fh:
            config = json.load(fh)
    except FileNotFoundError:
        raise ValidationError(f"adapter directory {path!r} has no {CONFIG_FILE}; an adapter "
                              f"is PEFT's layout: {CONFIG_FILE} and {WEIGHTS_FILE}") from None
    except (OSError, ValueError) as exc:
        raise ValidationError(f"cannot read {file}: {exc}") from None
    if not isinstance(config, dict):
        raise ValidationError(f"{file} must hold a JSON object")
    return config


def read_peft(path: str, targets: Mapping[str, tuple[int, int]], name: str, *,
              max_rank: int = 64, dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """Read the PEFT adapter in directory ``path`` and check it against ``targets``;
    ``ValidationError`` naming every mismatch (unknown modules, shapes, ranks, options
    this runtime does not apply)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not targets:
        raise ValidationError("this model declares no adapter targets; it takes no adapters")
    config = read_config(path)
    problems: list[str] = []
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        problems.append(f"peft_type is {peft_type!r}; only LORA adapters are served")
    if config.get("use_dora"):
        problems.append("use_dora is set; DoRA adapters are not served")
    if config.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out is set; the targets are nn.Linear layers (out, in)")
    if config.get("bias", "none") not in ("none", None):
        problems.append(f"bias={config.get('bias')!r}; only bias='none' adapters are served")
    if problems:
        raise ValidationError(f"adapter {name!r} at {path}: " + "; ".join(problems))
    file = os.path.join(path, WEIGHTS_FILE)
    try:
        tensors = load_file(file)
    except FileNotFoundError:
        raise ValidationError(f"adapter directory {path!r} has no {WEIGHTS_FILE}") from None
    except (OSError, SafetensorError, ValueError) as exc:
        raise ValidationError(f"cannot read {file}: {exc}") from None
    found: dict[str, dict[str, torch.Tensor]] = {}
    unknown: list[str] = []
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            unknown.append(key)
            continue
        found.setdefault(match["module"], {})[match["which"]] = tensor
    r_default = int(config.get("r", 8))
    alpha_default = float(config.get("lora_alpha", r_default))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora"))
    pairs: dict[str, LoraPair] = {}
    for module in sorted(found):
        parts = found[module]
        if module not in targets:
            unknown.append(module)
            continue
        if set(parts) != {"A", "B"}:
            problems.append(f"{module}: lora_{'B' if 'A' in parts else 'A'} is missing")
            continue
        a, b = parts["A"], parts["B"]
        fan_in, fan_out = targets[module]
        rank = int(_pattern_value(module, rank_pattern, r_default))
        if a.dim() != 2 or b.dim() != 2:
            problems.append(f"{module}: lora_A and lora_B must be matrices, got "
                            f"{list(a.shape)} and {list(b.shape)}")
            continue
        if tuple(a.shape) != (rank, fan_in):
            problems.append(f"{module}: lora_A has shape {list(a.shape)}, the base layer "
                            f"needs [{rank}, {fan_in}] (rank {rank}, in_features {fan_in})")
        if tuple(b.shape) != (fan_out, rank):
            problems.append(f"{module}: lora_B has shape {list(b.shape)}, the base layer "
                            f"needs [{fan_out}, {rank}] (out_features {fan_out}, rank {rank})")
        if not 1 <= rank <= max_rank:
            problems.append(f"{module}: rank {rank} is outside 1..{max_rank}, the ranks this "
                            "model takes")
        alpha = float(_pattern_value(module, alpha_pattern, alpha_default))
        scale = alpha / math.sqrt(rank) if rslora else alpha / max(rank, 1)
        pairs[module] = LoraPair(a.to(dtype).contiguous(), b.to(dtype).contiguous(), scale)
    if unknown:
        problems.append(f"modules the model has no target of: {sorted(unknown)[:8]}"
                        + (f" (and {len(unknown) - 8} more)" if len(unknown) > 8 else "")
                        + f"; its targets are like {sorted(targets)[:4]}")
    if not pairs and not problems:
        problems.append(f"{WEIGHTS_FILE} holds no lora_A/lora_B weights")
    if problems:
        raise ValidationError(f"adapter {name!r} at {path} does not fit the base model: "
                              + "; ".join(problems))
    return LoraAdapter(name, pairs, os.path.abspath(path))


def write_peft(path: str, pairs: Mapping[str, LoraPair], *, base_model: str = "") -> None:
    """Write ``pairs`` in PEFT's layout (``rank_pattern``/``alpha_pattern`` for modules
    whose rank or scale differ from the first)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    modules = sorted(pairs)
    first = pairs[modules[0]]
    r, alpha = first.rank, first.scale * first.rank
    rank_pattern = {m: pairs[m].rank for m in modules if pairs[m].rank != r}
    alpha_pattern = {m: pairs[m].scale * pairs[m].rank for m in modules
                     if pairs[m].scale * pairs[m].rank != alpha}
    config = {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": base_model,
              "r": r, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
              "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
              "inference_mode": True}
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    tensors = {}
    for module in modules:
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = pairs[module].a.contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = pairs[module].b.contiguous()
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))


def random_pairs(targets: Mapping[str, tuple[int, int]], rank: int | Mapping[str, int],
                 seed: int, *, alpha: float | None = None, std: float = 0.05) -> dict[str, LoraPair]:
    """Deterministic adapter weights for every target (tests, the demo): both matrices
    non-zero, so the term is visible (PEFT initialises ``B`` to zero)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, LoraPair] = {}
    for module in sorted(targets):
        fan_in, fan_out = targets[module]
        r = rank if isinstance(rank, int) else rank[module]
        a = torch.randn(r, fan_in, generator=gen) * std
        b = torch.randn(fan_out, r, generator=gen) * std
        out[module] = LoraPair(a, b, (alpha if alpha is not None else 2.0 * r) / r)
    return out


# -- the batched forward term -----------------------------------------------------------
def lora_term(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Every row's adapter term: ``x`` ``(n, ..., in)``, ``a`` ``(slots, r, in)``, ``b``
    ``(slots, out, r)`` (scale folded in), ``rows`` ``(n,)`` slot indices ->
    ``(n, ..., out)``: one gather and two batched matrix products."""
    n = x.shape[0]
    flat = x.reshape(n, -1, x.shape[-1])
    a_rows = a.index_select(0, rows)
    b_rows = b.index_select(0, rows)
    out = torch.bmm(torch.bmm(flat, a_rows.transpose(1, 2)), b_rows.transpose(1, 2))
    return out.reshape(*x.shape[:-1], b.shape[1])


#: the rows of one adapter in a batch: a slice where they are contiguous, else indices
Rows = slice | torch.Tensor


def segments(rows: list[int] | tuple[int, ...], device: Any = "cpu") -> list[tuple[int, Rows]]:
    """Each slot of ``rows`` (slot per row; negative: no adapter, left out) with its rows,
    in order of first appearance; computed once per batch, used by every layer."""
    where: dict[int, list[int]] = {}
    for i, slot in enumerate(rows):
        if slot >= 0:
            where.setdefault(slot, []).append(i)
    out: list[tuple[int, Rows]] = []
    for slot, picked in where.items():
        if picked[-1] - picked[0] + 1 == len(picked):
            out.append((slot, slice(picked[0], picked[-1] + 1)))
        else:
            out.append((slot, torch.tensor(picked, dtype=torch.int64, device=device)))
    return out


def segment_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                groups: list[tuple[int, Rows]], ranks: Mapping[int, int] | None = None
                ) -> torch.Tensor:
    """``y`` plus each row's adapter term, in place, by a loop over the batch's adapters
    (``groups`` from ``segments``): each adapter's matrices are read once, cut to its
    own rank (``ranks``: slot -> rank; default the stack's), and rows without an
    adapter cost nothing. Rows of one adapter that sit together are a slice, taken and
    written without a copy."""
    for slot, picked in groups:
        r = a.shape[1] if ranks is None else ranks.get(slot, a.shape[1])
        a_s, b_s = a[slot, :r], b[slot, :, :r]
        if isinstance(picked, slice) and x.dim() == 2:
            y[picked].addmm_(x[picked] @ a_s.T, b_s.T)
        elif isinstance(picked, slice):
            y[picked] += (x[picked] @ a_s.T) @ b_s.T
        else:
            y.index_add_(0, picked, (x.index_select(0, picked) @ a_s.T) @ b_s.T)
    return y


def segment_term(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The same term as ``lora_term`` by a loop over the slots present (``segment_add``;
    measured against it in ``benchmarks/bench_adapters.py``)."""
    out = x.new_zeros(*x.shape[:-1], b.shape[1])
    return segment_add(out, x, a, b, segments(rows.tolist(), x.device))


def stacked_term(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The same term as ``lora_term`` through every slot at once, masked per row."""
    slots, rank, fan_in = a.shape
    t = x @ a.reshape(slots * rank, fan_in).T
    mask = torch.nn.functional.one_hot(rows, slots).repeat_interleave(rank, 1).to(x.dtype)
    t = t * mask.reshape(x.shape[0], *([1] * (x.dim() - 2)), slots * rank)
    return t @ b.permute(1, 0, 2).reshape(b.shape[1], slots * rank).T


#: a target layer's forward: ``linear(module_name, layer, x)``
Linear = Callable[[str, nn.Module, torch.Tensor], torch.Tensor]


def plain_linear(module: str, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A target layer without adapters."""
    return layer(x)


def sequential_forward(net: nn.Sequential, x: torch.Tensor,
                       linear: Linear = plain_linear) -> torch.Tensor:
    """``net(x)`` layer by layer, each ``nn.Linear`` through ``linear(name, layer, x)``
    (``AdapterBank.apply`` adds the rows' adapter terms); PEFT's wrapped layers run their
    adapters here too."""
    for name, layer in net.named_children():
        x = linear(name, layer, x) if isinstance(layer, nn.Linear) else layer(x)
    return x


# -- device-resident slots ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AdapterRef:
    """What the device side needs to put an adapter in a slot: its name, its files and
    the registration it belongs to (a name registered again gets a new ``generation``)."""

    name: str
    path: str
    generation: int


@dataclass(slots=True)
class _Stack:
    a: torch.Tensor
    b: torch.Tensor


@dataclass
class AdapterBank:
    """The adapters resident on the device, one per slot, stacked per target layer."""

    targets: Mapping[str, tuple[int, int]]
    device: Any = "cpu"
    dtype: torch.dtype = torch.float32
    max_rank: int = 64
    #: reads an adapter (defaults to ``read_peft``); tests may give their own
    reader: Callable[[AdapterRef], LoraAdapter] | None = None
    _stacks: dict[str, _Stack] = field(default_factory=dict)
    _capacity: int = 0
    _rank: int = 0
    _held: dict[int, AdapterRef] = field(default_factory=dict)
    #: the rows of the running batch (None: no row has an adapter)
    rows: torch.Tensor | None = None
    #: the same as each slot's rows (``segments``), for inputs of one vector per row;
    #: worked out by the first such layer of the batch
    groups: list[tuple[int, Rows]] | None = None
    _slots: list[int] | tuple[int, ...] = ()
    #: each held slot's largest rank (its stacked matrices are zero past it)
    _ranks: dict[int, int] = field(default_factory=dict)
    #: adapters put in a slot (reads of their files)
    loads: int = 0

    @classmethod
    def for_model(cls, model: Any, device: Any) -> "AdapterBank":
        """The bank of a model taking adapters (``adapter_targets``, ``max_adapter_rank``),
        made in its ``setup``."""
        return cls(model.adapter_targets, device, max_rank=model.max_adapter_rank)

    def _read(self, ref: AdapterRef) -> LoraAdapter:
        if self.reader is not None:
            return self.reader(ref)
        return read_peft(ref.path, self.targets, ref.name, max_rank=self.max_rank,
                         dtype=self.dtype)

    def _grow(self, capacity: int, rank: int) -> None:
        """Room for ``capacity`` slots (plus the zero slot) of rank ``rank``."""
        if capacity <= self._capacity and rank <= self._rank:
            return
        capacity, rank = max(capacity, self._capacity), max(rank, self._rank)
        for module, (fan_in, fan_out) in self.targets.items():
            a = torch.zeros(capacity + 1, rank, fan_in, device=self.device, dtype=self.dtype)
            b = torch.zeros(capacity + 1, fan_out, rank, device=self.device, dtype=self.dtype)
            old = self._stacks.get(module)
            if old is not None:
                a[: self._capacity, : self._rank] = old.a[: self._capacity]
                b[: self._capacity, :, : self._rank] = old.b[: self._capacity]
            self._stacks[module] = _Stack(a, b)
        self._capacity, self._rank = capacity, rank

    def holds(self, slot: int) -> AdapterRef | None:
        return self._held.get(slot)

    def put(self, slot: int, adapter: LoraAdapter, ref: AdapterRef) -> None:
        """Copy ``adapter`` into ``slot`` (rank padded with zeros, scale folded into B)."""
        self._grow(slot + 1, adapter.max_rank)
        for module, stack in self._stacks.items():
            stack.a[slot].zero_()
            stack.b[slot].zero_()
            pair = adapter.pairs.get(module)
            if pair is not None:
                r = pair.rank
                stack.a[slot, :r] = pair.a.to(self.device, self.dtype)
                stack.b[slot, :, :r] = (pair.b * pair.scale).to(self.device, self.dtype)
        self._held[slot] = ref
        self._ranks[slot] = adapter.max_rank
        self.loads += 1

    def prepare(self, slots: Mapping[int, AdapterRef]) -> None:
        """Make each slot hold its adapter (read from its files when it does not yet)."""
        for slot, ref in slots.items():
            if self._held.get(slot) != ref:
                self.put(slot, self._read(ref), ref)

    @contextmanager
    def activate(self, rows: list[int] | tuple[int, ...] | None) -> Iterator[None]:
        """Rows' slots for the forward pass inside the block (-1: no adapter)."""
        if rows is None or all(r < 0 for r in rows):
            self.rows = None
        else:
            zero = self._capacity
            self.rows = torch.tensor([zero if r < 0 else r for r in rows], dtype=torch.int64,
                                     device=self.device)
            self._slots, self.groups = rows, None
        try:
            yield
        finally:
            self.rows = None
            self._slots, self.groups = (), None

    @property
    def active(self) -> bool:
        return self.rows is not None

    def apply(self, module: str, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``layer(x)`` plus, when a batch is active, each row's adapter term."""
        return self.add(module, x, layer(x))

    def add(self, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y``, the base output of target ``module`` for input ``x``, plus each row's
        adapter term when a batch is active (for models whose layers are plain weights)."""
        rows = self.rows
        stack = self._stacks.get(module)
        if rows is None or stack is None:
            return y
        # one vector per row (``wide``, a decoder step's tokens): the loop over the batch's
        # adapters reads each adapter once, where the gather copies a row's matrices per
        # row (3.4x faster for 32 rows, 4096 -> 4096, rank 16, 8 adapters); with many
        # tokens per row the gather's copies are shared by the tokens and it is the
        # faster one
        if x.dim() == 2:
            if self.groups is None:
                self.groups = segments(self._slots, self.device)
            return segment_add(y, x, stack.a, stack.b, self.groups, self._ranks)
        return y + lora_term(x, stack.a, stack.b, rows)
