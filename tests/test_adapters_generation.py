"""LoRA adapters on the bundled generation model (``decoder``) under continuous batching:
a sequence's tokens and logits in mixed steps (other adapters of other ranks, base rows,
prefill chunks next to decodes) against the same request alone, against the adapter
merged into the weights and against PEFT's own forward; the scheduler's adapter limits,
slot cache and pins (counts only, a fake clock); and a served ``decoder`` answering
``/v1/completions`` with ``model: "decoder:<adapter>"``."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.adapters.lora import AdapterRef, LoraAdapter, random_pairs, read_peft, write_peft
from runtime.api.errors import ModelNotFound
from runtime.generation.config import GenerationConfig
from runtime.generation.model import ByteTokenizer
from runtime.generation.runner import StepRunner
from runtime.generation.scheduler import Scheduler, Sequence
from runtime.models.decoder import TinyDecoder
from tests.factories import serving

D_MODEL, N_LAYERS = 64, 2
#: prompts of mixed lengths and the adapter each request names (None: the base model)
REQUESTS = [(None, 23), ("a", 17), ("b", 9), ("c", 30), ("a", 5), (None, 12), ("b", 26)]
CONFIG = GenerationConfig(block_size=4, num_cache_blocks=256, max_model_len=128,
                          max_num_seqs=8, max_num_batched_tokens=40,
                          long_prefill_token_threshold=8)
MAX_NEW = 10


def _decoder() -> TinyDecoder:
    return TinyDecoder(d_model=D_MODEL, n_layers=N_LAYERS, seed=3)


def _targets() -> dict[str, tuple[int, int]]:
    return _decoder().adapter_targets


def _prompt(i: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(50 + i)
    return torch.randint(0, 256, (n,), generator=gen).tolist()


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, str]:
    """Three adapters of mixed ranks: ``a`` rank 4 everywhere, ``b`` a rank per module
    (8 on the attention projections, 2 on the MLP), ``c`` rank 16 on the MLP only."""
    root = tmp_path_factory.mktemp("decoder-adapters")
    targets = _targets()
    b_ranks = {m: 8 if m.endswith(("qkv", "out")) else 2 for m in targets}
    mlp = {m: dims for m, dims in targets.items() if m.endswith(("up", "down"))}
    pairs = {"a": random_pairs(targets, 4, seed=11, std=0.08),
             "b": random_pairs(targets, b_ranks, seed=12, std=0.08),
             "c": random_pairs(mlp, 16, seed=13, std=0.05)}
    out = {}
    for name, p in pairs.items():
        out[name] = str(root / name)
        write_peft(out[name], p, base_model="decoder")
    return out


def _runner(model: TinyDecoder, adapter_dirs: dict[str, str], config: GenerationConfig = CONFIG,
            **kwargs) -> StepRunner:
    runner = StepRunner(model, config, **kwargs)
    for name, path in adapter_dirs.items():
        runner.adapters.add(runner.adapters.read(name, path), config.adapter_memory_mb, 0.0)
    runner.setup("cpu")
    return runner


def _logged(model: TinyDecoder) -> dict[int, dict[int, torch.Tensor]]:
    """Wrap ``model.step`` to keep each chunk's logits rows: seq id -> {position: row}."""
    seen: dict[int, dict[int, torch.Tensor]] = {}
    step = model.step

    def logging_step(chunks):
        logits = step(chunks)
        row = 0
        for c in chunks:
            end = c.start_pos + len(c.token_ids)
            for j in range(c.num_logits):
                seen.setdefault(c.seq_id, {})[end - c.num_logits + j] = logits[row].clone()
                row += 1
        return logits

    model.step = logging_step  # type: ignore[method-assign]
    return seen


def _run(runner: StepRunner, requests, **kwargs) -> tuple[list[Sequence], list]:
    seqs = [runner.new_sequence(_prompt(i, n), max_new_tokens=MAX_NEW, ignore_eos=True,
                                adapter=name, **kwargs)
            for i, (name, n) in requests]
    steps = []
    while runner.has_work():
        out, _ = runner.step()
        steps.append(out)
    return seqs, steps


@pytest.fixture(scope="module")
def mixed(adapter_dirs):
    """Every request together: (sequences, their logits by position, the steps)."""
    model = _decoder()
    logits = _logged(model)
    runner = _runner(model, adapter_dirs)
    seqs, steps = _run(runner, list(enumerate(REQUESTS)))
    return seqs, logits, steps


def test_steps_mixed_adapters_ranks_base_rows_prefill_and_decodes(mixed):
    _, _, steps = mixed
    mixed_steps = [out for out in steps
                   if len({c.adapter_slot for c in out.chunks}) >= 3
                   and -1 in {c.adapter_slot for c in out.chunks}
                   and out.prefill_tokens and out.decode_tokens]
    assert mixed_steps, "no step mixed adapters, base rows, prefill chunks and decodes"
    assert all(s.outcome == "ok" and len(s.output_ids) == MAX_NEW for s in mixed[0])


@pytest.mark.parametrize("index", range(len(REQUESTS)))
def test_a_sequence_in_mixed_steps_equals_it_alone(mixed, adapter_dirs, index):
    seqs, logits, _ = mixed
    model = _decoder()
    alone_logits = _logged(model)
    (alone,), _ = _run(_runner(model, adapter_dirs), [(index, REQUESTS[index])])
    assert alone.output_ids == seqs[index].output_ids
    got, want = logits[seqs[index].seq_id], alone_logits[alone.seq_id]
    # the rows the sequence sampled from: the last prompt position onwards
    first = len(alone.prompt_ids) - 1
    for pos in range(first, alone.num_tokens - 1):
        torch.testing.assert_close(got[pos], want[pos], atol=1e-5, rtol=0)


def _merge(model: TinyDecoder, adapter: LoraAdapter) -> None:
    """Merge ``adapter`` into the set-up ``model``'s weights (``W + scale * (B A)^T``)."""
    for module, pair in adapter.pairs.items():
        _, layer, part = module.split(".")
        model.weights[f"{layer}.{part}"] += pair.scale * (pair.b @ pair.a).T


def _read(adapter_dirs: dict[str, str], name: str) -> LoraAdapter:
    return read_peft(adapter_dirs[name], _targets(), name)


@pytest.mark.parametrize("index", [1, 2, 3])
def test_a_sequence_with_an_adapter_equals_the_adapter_merged(mixed, adapter_dirs, index):
    seqs, logits, _ = mixed
    name = REQUESTS[index][0]
    merged = _decoder()
    merged_logits = _logged(merged)
    runner = StepRunner(merged, CONFIG)
    runner.setup("cpu")
    _merge(merged, _read(adapter_dirs, name))
    seq = runner.new_sequence(_prompt(index, REQUESTS[index][1]), max_new_tokens=MAX_NEW,
                              ignore_eos=True)
    while runner.has_work():
        runner.step()
    assert seq.output_ids == seqs[index].output_ids
    for pos, row in merged_logits[seq.seq_id].items():
        if pos >= len(seq.prompt_ids) - 1:
            torch.testing.assert_close(logits[seqs[index].seq_id][pos], row, atol=1e-5, rtol=0)


def test_the_adapters_change_what_is_generated(mixed):
    seqs, logits, _ = mixed
    base = _prompt(1, REQUESTS[1][1])
    model = _decoder()
    model.setup("cpu", 64, 4)
    full = model.forward_full(base + seqs[1].output_ids)
    diff = (full[len(base) - 1] - logits[seqs[1].seq_id][len(base) - 1]).abs().max()
    assert diff > 1e-2
    assert len({tuple(s.output_ids) for s in seqs}) == len(seqs)


class _Block(nn.Module):
    def __init__(self, weights: dict[str, torch.Tensor], layer: int) -> None:
        super().__init__()
        for part in ("qkv", "out", "up", "down"):
            w = weights[f"{layer}.{part}"]
            linear = nn.Linear(w.shape[0], w.shape[1], bias=False)
            with torch.no_grad():
                linear.weight.copy_(w.T)
            setattr(self, part, linear)


class _DecoderModule(nn.Module):
    """The decoder as an ``nn.Module`` with ``layers.<i>.qkv`` ... for PEFT to wrap; its
    forward is ``TinyDecoder.forward_full`` with each weight product a module call."""

    def __init__(self, model: TinyDecoder) -> None:
        super().__init__()
        self.cfg = model
        self.w = model._generate_weights()
        self.layers = nn.ModuleList([_Block(self.w, i) for i in range(model.n_layers)])

    def forward(self, ids: list[int]) -> torch.Tensor:
        m, w, n = self.cfg, self.w, len(ids)
        x = w["embed"][torch.tensor(ids)] + w["pos"][:n]
        for block in self.layers:
            qkv = block.qkv(F.layer_norm(x, (m.d_model,))).view(n, 3, m.n_heads, m.head_dim)
            q, k, v = (qkv[:, j].transpose(0, 1) for j in range(3))
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)
            x = x + block.out(attn.reshape(n, m.d_model))
            x = x + block.down(F.gelu(block.up(F.layer_norm(x, (m.d_model,)))))
        return F.layer_norm(x, (m.d_model,)) @ w["head"]


@pytest.mark.parametrize("index", [1, 2, 3])
def test_peft_forward_agrees_with_the_mixed_steps(mixed, adapter_dirs, index):
    """PEFT's LoRA layers on the decoder as modules (the oracle): the same greedy tokens,
    and logits within 1e-4 (its attention runs without the paged cache, as
    ``forward_full`` does)."""
    peft = pytest.importorskip("peft")
    seqs, logits, _ = mixed
    seq = seqs[index]
    wrapped = peft.PeftModel.from_pretrained(_DecoderModule(_decoder()),
                                             adapter_dirs[REQUESTS[index][0]]).eval()
    with torch.inference_mode():
        full = wrapped.base_model.model(seq.prompt_ids + seq.output_ids)
    first = len(seq.prompt_ids) - 1
    assert full[first:-1].argmax(dim=-1).tolist() == seq.output_ids
    for pos in range(first, seq.num_tokens - 1):
        torch.testing.assert_close(logits[seq.seq_id][pos], full[pos], atol=1e-4, rtol=0)


def test_speculative_verification_keeps_the_adapters_tokens(mixed, adapter_dirs):
    """Prompt-lookup proposals come from the base text, the verification runs with the
    sequence's adapter: the greedy tokens are those generated without speculation."""
    seqs, _, _ = mixed
    config = CONFIG.with_changes({"speculative_method": "ngram", "spec_auto_switch": False,
                                  "num_speculative_tokens": 3})
    runner = _runner(_decoder(), adapter_dirs, config)
    spec, steps = _run(runner, list(enumerate(REQUESTS)))
    drafted = [c for out in steps for c in out.chunks if c.draft_ids and c.adapter_slot >= 0]
    assert drafted, "no sequence with an adapter verified proposed tokens"
    assert [s.output_ids for s in spec] == [s.output_ids for s in seqs]


def test_requests_record_their_adapter_and_slot_loads(adapter_dirs):
    rows = []

    class Recorder:
        def put(self, record):
            rows.append(record)

    runner = _runner(_decoder(), adapter_dirs, recorder=Recorder())
    _run(runner, [(1, ("a", 6)), (2, (None, 4))])
    requests = [r for r in rows if type(r).__name__ == "RequestRow"]
    assert sorted((r.adapter or "") for r in requests) == ["", "a"]
    loads = [r for r in rows if getattr(r, "kind", None) == "adapter_load"]
    assert len(loads) == 1 and "'a'" in loads[0].message
    with pytest.raises(ModelNotFound, match=r"loaded adapters are \['a', 'b', 'c'\]"):
        runner.new_sequence([1, 2, 3], adapter="nope")


# -- the scheduler: limits, slots and pins -------------------------------------------------
def _ref(name: str) -> AdapterRef:
    return AdapterRef(name, f"/adapters/{name}", 1)


def _scheduler(**changes) -> Scheduler:
    config = GenerationConfig(block_size=4, num_cache_blocks=256, max_model_len=64,
                              max_num_seqs=16, max_num_batched_tokens=256).with_changes(changes)
    sch = Scheduler(config)
    sch.enable_adapters(_ref)
    return sch


class _Driver:
    """Adds sequences and runs steps with a sampled token of 1 for every completing chunk."""

    def __init__(self, sch: Scheduler) -> None:
        self.sch = sch
        self.ids = 0
        self.now = 0.0
        self.steps = []

    def add(self, adapter: str | None, prompt: int = 4, max_new: int = 3) -> Sequence:
        self.ids += 1
        seq = Sequence(self.ids, [1] * prompt, max_new, 1, float(self.ids), adapter=adapter)
        self.sch.add_request(seq)
        return seq

    def step(self):
        self.now += 1.0
        out = self.sch.schedule(self.now)
        self.steps.append(out)
        sampled = {c.seq_id: 1 for c in out.chunks if c.completes}
        self.sch.update_from_output(out, sampled, self.now)
        return out

    def running(self) -> set:
        return {s.adapter for s in self.sch.running}

    def drain(self, limit: int = 500) -> None:
        for _ in range(limit):
            if not self.sch.has_work():
                return
            self.step()
        raise AssertionError("the scheduler did not finish its sequences")


def _names(out) -> set:
    slots = out.adapters.slots if out.adapters is not None else {}
    return {slots[c.adapter_slot].name for c in out.chunks if c.adapter_slot >= 0}


def _no_pins(sch: Scheduler) -> None:
    step = sch.adapters
    assert step.pins() == 0 and not step.running() and not step.depth
    assert step.cache.waiting() == []


def test_a_step_holds_at_most_max_adapters_per_batch():
    d = _Driver(_scheduler(max_adapters_per_batch=2))
    a1, b1, c1, base, a2 = d.add("a"), d.add("b"), d.add("c"), d.add(None), d.add("a")
    d.step()
    # c is past the limit; after it, only the base may join (a2 would renew a's hold)
    assert {s.seq_id for s in d.sch.running} == {a1.seq_id, b1.seq_id, base.seq_id}
    assert [s.seq_id for s in d.sch.waiting] == [c1.seq_id, a2.seq_id]
    d.sch.abort(a1.seq_id, d.now)
    out = d.step()
    assert c1.status == "running" and a2.status == "waiting"
    assert _names(out) == {"b", "c"}
    for _ in range(30):
        d.add(["a", "b", "c", "d", None][d.ids % 5])
    d.drain()
    assert all(len(_names(out)) <= 2 for out in d.steps)
    _no_pins(d.sch)


def test_limits_lowered_while_sequences_run_hold_from_the_next_step():
    d = _Driver(_scheduler(max_adapters_per_batch=3))
    a1, b1, c1 = d.add("a", max_new=6), d.add("b", max_new=6), d.add("c", max_new=6)
    d.step()
    d.sch.config = d.sch.config.with_changes({"max_adapters_per_batch": 1})
    late_a, late_d = d.add("a"), d.add("d")
    out = d.step()
    assert _names(out) == {"a"} and {c.seq_id for c in out.chunks} == {a1.seq_id}
    # b and c sit out: nothing new joins past them, not even another sequence of a
    assert late_a.status == "waiting" and late_d.status == "waiting"
    d.drain()
    assert all(len(_names(out)) <= 1 for out in d.steps[1:])
    ends = sorted([a1, b1, c1], key=lambda s: s.finished_s)
    assert ends == [a1, b1, c1] and late_a.first_scheduled_s >= c1.finished_s
    _no_pins(d.sch)


def test_without_mixing_a_step_holds_one_adapter_or_the_base():
    d = _Driver(_scheduler(adapter_mixing=False))
    base1, a1, base2, a2 = d.add(None), d.add("a"), d.add(None), d.add("a")
    d.step()
    assert [s.seq_id for s in d.sch.running] == [base1.seq_id]  # a1 is next: base2 waits
    d.drain()
    for out in d.steps:
        groups = {c.adapter_slot for c in out.chunks}
        assert len(groups) == 1, groups
    order = sorted([base1, a1, base2, a2], key=lambda s: s.first_scheduled_s)
    assert order == [base1, a1, a2, base2] or order == [base1, a1, base2, a2]
    _no_pins(d.sch)


def test_lru_eviction_and_an_adapter_waiting_for_its_turn():
    """Two slots: a cold adapter past the limit waits without holding up the base, the
    adapters already running are not renewed past it (it is not starved), and it takes
    the least recently used slot once that slot's sequences have ended."""
    d = _Driver(_scheduler(adapter_slots=2, max_adapters_per_batch=2))
    a1 = d.add("a", max_new=6)
    d.step()
    b1 = d.add("b", max_new=12)
    d.step()
    c1, b2, base = d.add("c", max_new=30), d.add("b"), d.add(None)
    d.step()
    assert c1.status == "waiting" and b2.status == "waiting" and base.status == "running"
    changes = []
    while c1.status == "waiting":
        changes += d.step().adapter_changes
    assert a1.status == "finished" and b1.status == "running"
    assert [(ch.name, ch.evicted, ch.slot) for ch in changes] == [("c", "a", 0)]
    assert b2.status == "running"  # b is in the step with c: its new sequence joins
    a2 = d.add("a")
    while b1.status != "finished" or b2.status != "finished":
        assert a2.status == "waiting"
        changes += d.step().adapter_changes
    assert c1.status == "running"
    d.drain()
    assert a2.outcome == "ok"
    # a came back into the least recently used slot: b's, as c's was used later
    every = [(ch.name, ch.evicted, ch.slot) for out in d.steps for ch in out.adapter_changes]
    assert every == [("a", None, 0), ("b", None, 1), ("c", "a", 0), ("a", "b", 1)]
    cache = d.sch.adapters.cache
    assert (cache.loads, cache.evictions) == (4, 2)
    _no_pins(d.sch)


def test_cancel_and_preemption_release_the_pins():
    """A cache too small for every sequence to grow: sequences are preempted (their pins
    released, asked again when readmitted) and some are cancelled while waiting or
    running; at the end no slot is pinned and nothing waits."""
    d = _Driver(_scheduler(num_cache_blocks=24, block_size=2, adapter_slots=3,
                           max_adapters_per_batch=3))
    seqs = [d.add(["a", "b", "c", "d", None][i % 5], prompt=6, max_new=12) for i in range(12)]
    preempted = 0
    for n in range(400):
        if not d.sch.has_work():
            break
        out = d.step()
        preempted += len(out.preempted)
        assert len(_names(out)) <= 3
        step = d.sch.adapters
        # a slot is pinned once per adapter of the running set, never more
        assert step.pins() == len({s.adapter for s in d.sch.running} - {None})
        if n in (3, 7):
            victim = next(s for s in seqs if s.status == "running" and s.adapter)
            d.sch.abort(victim.seq_id, d.now)
        if n == 5:
            victim = next(s for s in seqs if s.status == "waiting" and s.adapter)
            d.sch.abort(victim.seq_id, d.now)
    assert preempted > 0
    assert not d.sch.has_work()
    assert sorted(s.outcome for s in seqs).count("cancelled") == 3
    _no_pins(d.sch)


def test_engine_unload_waits_for_running_sequences_and_cancel_leaves_no_pin(adapter_dirs):
    """Through the asyncio engine: streams naming adapters, one closed mid-way, an adapter
    unloaded while its sequences run (they finish; new requests get 404), and afterwards
    no slot pinned."""
    from runtime.generation.engine import GenerationEngine

    async def scenario():
        engine = GenerationEngine(_decoder(), CONFIG)
        for name, path in adapter_dirs.items():
            engine.register_adapter(name, path, requested_by="test")
        await engine.start()
        try:
            streams = [engine.submit(_prompt(i, n), max_new_tokens=12, ignore_eos=True,
                                     adapter=name) for i, (name, n) in enumerate(REQUESTS)]
            first = await anext(streams[2])  # "b" is running
            assert first.index == 0
            streams[2].close()
            unload = asyncio.ensure_future(engine.unload_adapter("a"))
            await asyncio.sleep(0)
            with pytest.raises(ModelNotFound):
                engine.submit([1, 2], adapter="a")
            texts = []
            for i, stream in enumerate(streams):
                if i != 2:
                    texts.append([e.token_id async for e in stream])
            done = await unload
            assert done["finished_queued"] == 2 and engine.adapter_names() == ["b", "c"]
            assert all(len(t) == 12 for t in texts)
            step = engine.runner.scheduler.adapters
            assert step.pins() == 0 and not step.depth and not step.running()
            assert [a["name"] for a in engine.adapters()] == ["b", "c"]
        finally:
            await engine.stop()

    asyncio.run(scenario())


# -- served -------------------------------------------------------------------------------
def _expected_text(path: str, prompt: str, max_tokens: int) -> str:
    """The request alone, in this process, with its adapter: greedy tokens as text."""
    runner = StepRunner(TinyDecoder())
    runner.adapters.add(runner.adapters.read("x", path), 512, 0.0)
    runner.setup("cpu")
    seq = runner.new_sequence(ByteTokenizer().encode(prompt), max_new_tokens=max_tokens,
                              ignore_eos=True, adapter="x")
    while runner.has_work():
        runner.step()
    return ByteTokenizer().decode(seq.output_ids)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from runtime.adapters.demo import write_demo_adapters

    paths = write_demo_adapters(str(tmp_path_factory.mktemp("dec-adapters")), 3, "decoder")
    args = ["--model", "decoder", "--port", "0", "--no-record", "--torch-threads", "1"]
    for name in ("dec-0", "dec-1"):
        args += ["--adapter", f"{name}={paths[name]}"]
    with serving(args) as url:
        yield url, paths


def test_served_completions_name_their_adapter(server):
    url, paths = server
    with httpx.Client(timeout=60) as client:
        for name in ("dec-0", "dec-1"):
            answer = client.post(f"{url}/v1/completions", json={
                "model": f"decoder:{name}", "prompt": "adapters", "max_tokens": 6,
                "ignore_eos": True})
            assert answer.status_code == 200, answer.text
            doc = answer.json()
            assert doc["model"] == f"decoder:{name}"
            assert doc["choices"][0]["text"] == _expected_text(paths[name], "adapters", 6)
        chat = client.post(f"{url}/v1/chat/completions", json={
            "model": "decoder:dec-1", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3})
        assert chat.status_code == 200, chat.text
        base = client.post(f"{url}/v1/completions", json={
            "model": "decoder", "prompt": "adapters", "max_tokens": 6, "ignore_eos": True})
        assert base.status_code == 200
        listed = client.get(f"{url}/v2/models/decoder/adapters").json()["adapters"]
        assert [a["name"] for a in listed] == ["dec-0", "dec-1"]
        assert {a["slot"] for a in listed} == {0, 1}
        metrics = client.get(f"{url}/metrics").text
        assert 'batchscope_adapter_requests_total{adapter="dec-0",model="decoder"' in metrics


def test_served_unknown_adapter_is_404_naming_the_loaded_ones(server):
    url, _ = server
    with httpx.Client(timeout=60) as client:
        answer = client.post(f"{url}/v1/completions", json={
            "model": "decoder:nope", "prompt": "x", "max_tokens": 2})
        assert answer.status_code == 404
        message = answer.json()["error"]["message"]
        assert "decoder:dec-0" in message and "decoder:dec-1" in message


def test_served_load_and_unload_over_the_control_api(server):
    url, paths = server
    with httpx.Client(timeout=60) as client:
        answer = client.post(f"{url}/v2/models/decoder/adapters",
                             json={"name": "dec-2", "path": paths["dec-2"]})
        assert answer.status_code == 201, answer.text
        body = {"model": "decoder:dec-2", "prompt": "x", "max_tokens": 2}
        assert client.post(f"{url}/v1/completions", json=body).status_code == 200
        gone = client.delete(f"{url}/v2/models/decoder/adapters/dec-2")
        assert gone.status_code == 200, gone.text
        assert client.post(f"{url}/v1/completions", json=body).status_code == 404
        # the adapter settings of a generation model, changed live
        changed = client.patch(f"{url}/v2/models/decoder/batching",
                               json={"adapter_slots": 4, "max_adapters_per_batch": 2})
        assert changed.status_code == 200, changed.text
        stats = client.get(f"{url}/v2/models/decoder/batching/stats").json()
        assert stats["adapters"]["slots"] == 4 and stats["adapters"]["registered"] == [
            "dec-0", "dec-1"]
        too_many = client.patch(f"{url}/v2/models/decoder/batching",
                                json={"max_adapters_per_batch": 5})
        assert too_many.status_code == 422 and "adapter_slots" in too_many.text

