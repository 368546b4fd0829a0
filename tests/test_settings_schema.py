"""The settings schema (``batchscope.settings``) agrees with the config dataclasses and
the tables of docs/batching.md, its bounds are what the dataclasses enforce, and its text
forms round-trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from batchscope.settings import (BATCHING, GENERATION, Setting, fields_for, markdown_table,
                                 setting, table_markers, with_tables)
from runtime.api.config import BatchingConfig
from runtime.api.errors import ConfigError
from runtime.generation.config import FIXED_AT_START, GenerationConfig
from runtime.tools.cli import build_parser, model_settings

DOCS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "batching.md"
KINDS = {"request": BatchingConfig, "generate": GenerationConfig}


# -- (a) one Setting per dataclass field, same defaults ---------------------------------------
@pytest.mark.parametrize("kind, cls", KINDS.items())
def test_every_field_has_a_setting_with_the_same_default(kind, cls):
    schema = fields_for(kind)
    assert [s.name for s in schema] == [f.name for f in dataclasses.fields(cls)]
    defaults = cls()
    for s in schema:
        assert getattr(defaults, s.name) == s.default, s.name
        assert s.problem(s.default) is None, s.name
        assert s.doc.strip() and s.describe()


def test_schema_shape():
    assert fields_for("request") is BATCHING and fields_for("generate") is GENERATION
    with pytest.raises(ValueError, match="'request' or 'generate'"):
        fields_for("batch")
    for s in BATCHING + GENERATION:
        assert (s.kind == "choice") == bool(s.choices), s.name
        assert (s.max_items is not None) == (s.kind == "int_list"), s.name
        assert s.nullable == (s.null_means is not None), s.name
        if s.min is not None and s.max is not None:
            assert s.min <= s.max, s.name
    assert setting("request", "max_batch_size").unit == "requests"
    assert setting("generate", "max_batch_size") is None
    assert FIXED_AT_START == ("block_size", "num_cache_blocks", "max_model_len")


# -- (b) docs/batching.md holds exactly the generated tables -----------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_the_batching_guide_holds_the_generated_table(kind):
    text = DOCS_PAGE.read_text()
    start, end = table_markers(kind)
    assert text.count(start) == 1 and text.count(end) == 1, \
        f"docs/batching.md needs one {start} ... {end}"
    between = text.split(start, 1)[1].split(end, 1)[0]
    assert between.strip() == markdown_table(kind), (
        "the settings table of docs/batching.md is out of date; run "
        "`python -m batchscope.settings --write-docs`")


def test_with_tables_rewrites_only_between_the_markers():
    start, end = table_markers("request")
    doc = f"before\n{start}\nold table\n{end}\nafter\n"
    out = with_tables(doc)
    assert out == f"before\n{start}\n{markdown_table('request')}\n{end}\nafter\n"
    assert with_tables(out) == out


# -- (c) the dataclasses enforce the schema's bounds, naming the field --------------------------
def _bad_values(s: Setting) -> list:
    if s.kind == "bool":
        return ["yes", 1]
    if s.kind == "choice":
        return ["nope", 3]
    if s.kind == "int_list":
        bad = [(0,), ("8",), [8]]
        if s.max is not None:
            bad.append((int(s.max) + 1,))
        if s.max_items is not None:
            bad.append(tuple(range(1, s.max_items + 2)))
        if s.min_items:
            bad.append(())
        return bad
    bad = ["12", True, float("nan")]
    if s.min is not None:
        bad.append(s.min if s.min_exclusive else s.min - 1)
    if s.max is not None:
        bad.append(s.max + 1)
    if s.kind == "int":
        bad.append(float(s.default if s.default is not None else s.min))  # 8.0: not an int
    if not s.nullable:
        bad.append(None)
    return bad


def _cases():
    for kind, cls in KINDS.items():
        for s in fields_for(kind):
            for value in _bad_values(s):
                yield pytest.param(cls, s, value, id=f"{s.name}={value!r}"[:60])


@pytest.mark.parametrize("cls, s, value", list(_cases()))
def test_out_of_bounds_values_are_refused_naming_the_field(cls, s, value):
    assert s.problem(value) is not None
    with pytest.raises(ConfigError) as err:
        cls(**{s.name: value})
    assert f"{s.name}=" in err.value.message and "Nothing was changed" in err.value.message


@pytest.mark.parametrize("kind, cls", KINDS.items())
def test_bounds_themselves_are_accepted(kind, cls):
    for s in fields_for(kind):
        for bound in (s.min, s.max):
            if bound is None or s.kind not in ("int", "float") or (bound == s.min and s.min_exclusive):
                continue
            value = int(bound) if s.kind == "int" else float(bound)
            assert s.problem(value) is None, (s.name, value)


def test_messages_say_what_would_be_valid():
    with pytest.raises(ConfigError, match=r"max_batch_size=0 must be an integer from 1 to 4096"):
        BatchingConfig(max_batch_size=0)
    with pytest.raises(ConfigError, match=r"max_queue_delay_ms=-1 must be null \(work-conserving\) "
                                          r"or a number of milliseconds from 0 to 60000"):
        BatchingConfig(max_queue_delay_ms=-1)
    with pytest.raises(ConfigError, match=r"policy='greedy' is not one of static, dynamic, adaptive"):
        BatchingConfig(policy="greedy")
    with pytest.raises(ConfigError, match=r"default_priority=3 must be an integer from 0 to 2 "
                                          r"\(priority_levels=3\)"):
        BatchingConfig(default_priority=3)
    with pytest.raises(ConfigError, match=r"adaptive_floor_ms=5.0 is above adaptive_ceiling_ms=1.0"):
        BatchingConfig(adaptive_floor_ms=5.0, adaptive_ceiling_ms=1.0)
    with pytest.raises(ConfigError, match=r"bucket_edges=\[64, 32\] must be strictly increasing"):
        BatchingConfig(bucket_edges=(64, 32))
    with pytest.raises(ConfigError, match=r"preferred_batch_sizes \[64\] exceed max_batch_size=32"):
        BatchingConfig(preferred_batch_sizes=(8, 64))
    with pytest.raises(ConfigError, match="max_num_batched_tokens=4 is below max_num_seqs=8"):
        GenerationConfig(max_num_seqs=8, max_num_batched_tokens=4)


def test_huge_lists_are_refused_with_a_short_message():
    edges = list(range(1, 100_001))
    with pytest.raises(ConfigError) as err:
        BatchingConfig().with_changes({"bucket_edges": edges})
    message = err.value.message
    assert "bucket_edges=" in message and "at most 64" in message and "100000 items" in message
    assert len(message) < 400
    with pytest.raises(ConfigError, match="preferred_batch_sizes=.*at most 64"):
        BatchingConfig().with_changes({"preferred_batch_sizes": [1] * 65})
    assert BatchingConfig().with_changes({"bucket_edges": list(range(1, 65))}).bucket_edges[-1] == 64


def test_with_changes_puts_json_values_in_python_form():
    config = BatchingConfig().with_changes({"bucket_edges": [16, 32], "max_queue_delay_ms": 5,
                                            "preferred_batch_sizes": [8]})
    assert config.bucket_edges == (16, 32) and config.preferred_batch_sizes == (8,)
    assert isinstance(config.max_queue_delay_ms, float)
    with pytest.raises(ConfigError, match=r"bucket_edges='16,32' must be null \(derived from "
                                          r"the observed lengths\) or a non-empty list"):
        BatchingConfig().with_changes({"bucket_edges": "16,32"})
    assert GenerationConfig().with_changes({"default_timeout_ms": 50}).default_timeout_ms == 50.0


# -- (d) text forms ----------------------------------------------------------------------------
def _sample_values(s: Setting) -> list:
    values = [s.default]
    if s.kind == "bool":
        values += [True, False]
    elif s.kind == "choice":
        values += list(s.choices)
    elif s.kind == "int_list":
        values += [(), (16,), (16, 32, 64)]
    elif s.kind == "int":
        values += [int(s.min), int(s.max)]
    else:
        values += [2.5, 1e-3, 123456.789]
        values += [float(b) for b in (s.min, s.max)
                   if b is not None and not (b == s.min and s.min_exclusive)]
    if s.nullable:
        values.append(None)
    return values


@pytest.mark.parametrize("s", BATCHING + GENERATION, ids=lambda s: s.name)
def test_parse_text_round_trips(s):
    for value in _sample_values(s):
        assert s.parse_text(s.to_text(value)) == value, (s.name, value)


def test_parse_text_forms_and_mistakes():
    delay = setting("request", "max_queue_delay_ms")
    for text in ("", "null", "None", "auto", " off "):
        assert delay.parse_text(text) is None
    assert delay.parse_text("2.5") == 2.5
    edges = setting("request", "bucket_edges")
    assert edges.parse_text("16,32") == (16, 32) == edges.parse_text("[16, 32]")
    assert setting("request", "bucketing").parse_text("off") is False
    with pytest.raises(ValueError, match="max_batch_size: 'lots' is not an integer"):
        setting("request", "max_batch_size").parse_text("lots")
    with pytest.raises(ValueError, match="max_batch_size"):
        setting("request", "max_batch_size").parse_text("")  # not nullable
    with pytest.raises(ValueError, match="bucket_edges: '16,x' is not a comma-separated list"):
        edges.parse_text("16,x")
    with pytest.raises(ValueError, match="policy: 'greedy' is not one of"):
        setting("request", "policy").parse_text("greedy")
    with pytest.raises(ValueError, match="is not a number"):
        delay.parse_text("inf")


# -- the CLI flags come from the schema ----------------------------------------------------------
def test_every_batching_setting_is_a_serve_flag():
    parser = build_parser()
    for s in BATCHING:
        if s.kind == "bool":
            assert getattr(parser.parse_args(["serve", s.flag]), s.name) is True
            assert getattr(parser.parse_args(["serve", "--no-" + s.flag[2:]]), s.name) is False
        else:
            args = parser.parse_args(["serve", s.flag, s.to_text(s.default)])
            assert getattr(args, s.name) == s.default, s.flag
    args = parser.parse_args(["serve", "--max-batch-size", "16", "--no-bucketing",
                              "--max-queue-delay-ms", "none", "--bucket-edges", "16,32",
                              "--policy", "adaptive"])
    assert (args.max_batch_size, args.bucketing, args.max_queue_delay_ms, args.bucket_edges,
            args.policy) == (16, False, None, (16, 32), "adaptive")
    assert not hasattr(args, "max_queue_size")  # only the flags given apply


def test_set_takes_json_or_the_flag_text():
    args = build_parser().parse_args(["serve", "--set", "double.bucket_edges=16,32",
                                      "--set", "double.preferred_batch_sizes=[4, 8]",
                                      "--set", "double.default_timeout_ms=none",
                                      "--set", "double.pad_to=bucket"])
    from runtime.models.toys import DoubleModel

    config = model_settings(args, {"double": DoubleModel()}, {})["double"]
    assert config == BatchingConfig(bucket_edges=(16, 32), preferred_batch_sizes=(4, 8),
                                    pad_to="bucket")


# -- the autopilot and derived bucket edges -------------------------------------------------------
def test_the_autopilot_needs_the_dynamic_policy_and_derived_edges_are_the_default():
    defaults = BatchingConfig()
    assert defaults.bucket_edges is None and defaults.autopilot_slo_p99_ms is None
    assert defaults.to_dict()["bucket_edges"] is None
    assert BatchingConfig(bucket_edges=(16, 32)).to_dict()["bucket_edges"] == [16, 32]
    with pytest.raises(ConfigError, match=r"autopilot_slo_p99_ms=40 needs policy='dynamic' "
                                          r"\(policy='static'\)"):
        BatchingConfig(policy="static", autopilot_slo_p99_ms=40.0)
    on = BatchingConfig().with_changes({"autopilot_slo_p99_ms": 40})
    assert on.autopilot_slo_p99_ms == 40.0
    with pytest.raises(ConfigError, match="needs policy='dynamic'"):
        on.with_changes({"policy": "adaptive"})
    edges = setting("request", "bucket_edges")
    assert edges.parse_text("auto") is None and edges.to_text(None) == "null"
    assert edges.to_text(()) == "[]" and edges.parse_text("[]") == ()
    assert "derived from the observed lengths" in edges.describe()
    assert setting("request", "autopilot_slo_p99_ms").parse_text("off") is None
    args = build_parser().parse_args(["serve", "--bucket-edges", "auto",
                                      "--autopilot-slo-p99-ms", "40", "--auto-bucket-count", "4"])
    assert (args.bucket_edges, args.autopilot_slo_p99_ms, args.auto_bucket_count) == (None, 40.0, 4)
