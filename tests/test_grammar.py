"""Structured output: the grammar guest's replies parse and validate against their JSON Schema, with the
default model (greedy and sampled) and with a random tiny model whose logits favour nothing."""

import json
import subprocess
import sys

import pytest

from floe.actor import IncompleteJSON, SchemaUnsupported, builtin_guest, grammar_actor, send_json
from floe.actor.grammar import SchemaCheck
from floe.engine import SamplingParams

PERSON = {  # nested objects
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "address"],
}
SHOPPING = {  # arrays
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
                   "prices": {"type": "array", "items": {"type": "number"}, "maxItems": 4}},
    "required": ["items", "prices"],
}
ORDER = {  # enums, const, booleans, null
    "type": "object",
    "properties": {"size": {"enum": ["small", "medium", "large"]},
                   "drink": {"type": "string", "enum": ["tea", "coffee"]}, "version": {"const": 2},
                   "hot": {"type": "boolean"}, "note": {"type": "null"}},
    "required": ["size", "drink", "version", "hot", "note"],
}
PROFILE = {  # optional fields, anyOf, type lists
    "type": "object",
    "properties": {"user": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                   "email": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                   "score": {"type": ["number", "null"]}},
    "required": ["user"],
    "additionalProperties": False,
}
TREE = {  # $defs and a recursive $ref
    "$defs": {"node": {"type": "object",
                       "properties": {"label": {"type": "string"},
                                      "children": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                   "maxItems": 2}},
                       "required": ["label"]}},
    "$ref": "#/$defs/node",
}
SCHEMAS = {"nested objects": PERSON, "arrays": SHOPPING, "enums": ORDER, "optional fields": PROFILE,
           "$ref": TREE}
PROMPTS = {"nested objects": "Describe a person and where they live.", "arrays": "Write a shopping list.",
           "enums": "Order a drink.", "optional fields": "Make a user profile.", "$ref": "Draw a small tree."}


def valid(value, schema, root=None) -> bool:
    """Whether value satisfies schema, for the keywords the grammar guest implements (written out here:
    the jsonschema package is not a dependency)."""
    root = root or schema
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].removeprefix("#").strip("/").split("/"):
            target = target[part] if part else target
        return valid(value, target, root)
    if "anyOf" in schema:
        return any(valid(value, s, root) for s in schema["anyOf"])
    if "const" in schema and value != schema["const"]:
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    types = schema.get("type")
    if isinstance(types, list):
        return any(valid(value, {**schema, "type": t}, root) for t in types)
    checks = {"object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
              "string": lambda v: isinstance(v, str), "null": lambda v: v is None,
              "boolean": lambda v: isinstance(v, bool),
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
    if types and not checks[types](value):
        return False
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        if schema.get("additionalProperties") is False and any(k not in props for k in value):
            return False
        return all(valid(v, props[k], root) for k, v in value.items() if k in props)
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
        return all(valid(v, schema.get("items", {}), root) for v in value)
    if isinstance(value, str):
        return schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value))
    return True


def test_the_validator_used_here_rejects_what_it_should():
    assert valid({"name": "a", "address": {"city": "b", "zip": 1}}, PERSON)
    assert not valid({"name": "a", "address": {"city": "b", "zip": "1"}}, PERSON)
    assert not valid({"size": "huge", "drink": "tea", "version": 2, "hot": True, "note": None}, ORDER)
    assert not valid({"user": "u", "extra": 1}, PROFILE)
    assert not valid({"label": "a", "children": [{"children": []}]}, TREE)
    assert valid({"label": "a", "children": [{"label": "b"}]}, TREE)


@pytest.fixture(scope="module")
def engine(native_engine):
    """The default model as `floe run` and `floe serve` run it on a CPU (conftest's native_engine): the
    mask, not the weights, makes a reply valid."""
    return native_engine


def replies(engine, name, n, params=None, seed=0):
    """n replies to the schema's prompt, each in a fresh conversation of one actor (the guest keeps its
    vocabulary and its masks across them)."""
    values = []
    with grammar_actor(engine, seed=seed) as actor:
        for _ in range(n):
            values.append(send_json(actor, PROMPTS[name], SCHEMAS[name], fresh=True, max_tokens=160,
                                    params=params).value)
    return values


@pytest.mark.parametrize("name", SCHEMAS)
def test_greedy_and_sampled_replies_validate_against_their_schema(engine, name):
    values = replies(engine, name, 1) + replies(engine, name, 2, SamplingParams(temperature=1.0), seed=3)
    for value in values:
        assert valid(value, SCHEMAS[name]), (name, value)


SAMPLED_REPLIES = 8  # per schema here; `python bench/grammar.py --validity 100` runs the full hundred


@pytest.mark.slow
@pytest.mark.parametrize("name", SCHEMAS)
def test_sampled_replies_validate(engine, name):
    values = replies(engine, name, SAMPLED_REPLIES, SamplingParams(temperature=1.0, top_p=0.95), seed=100)
    invalid = [v for v in values if not valid(v, SCHEMAS[name])]
    assert len(values) == SAMPLED_REPLIES and not invalid, invalid


def test_plain_json_mode_answers_one_json_value(engine):
    with grammar_actor(engine) as actor:
        reply = send_json(actor, "List three colours.", None, max_tokens=64)
    assert reply.value is not None or reply.text == "null"
    assert json.loads(reply.text) == reply.value


@pytest.mark.parametrize("keyword, schema", [
    ("not", {"type": "object", "properties": {"code": {"type": "string", "not": {"const": "x"}}}}),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}),
    ("if", {"if": {"type": "string"}, "then": {"minLength": 2}}),
])
def test_a_schema_with_an_unsupported_keyword_is_refused_by_name(tiny_engine, keyword, schema):
    with grammar_actor(tiny_engine) as actor:
        with pytest.raises(SchemaUnsupported, match=f"unsupported JSON Schema keyword '{keyword}'"):
            send_json(actor, "hi", schema, max_tokens=8)
        assert valid(send_json(actor, "hi", {"type": "boolean"}, max_tokens=8).value, {"type": "boolean"})


def test_a_schema_that_is_not_json_is_refused(tiny_engine):
    with grammar_actor(tiny_engine) as actor:
        with pytest.raises(SchemaUnsupported, match="not JSON"):
            send_json(actor, "hi", '{"type": ', max_tokens=8)


@pytest.mark.parametrize("name", SCHEMAS)
def test_masking_lets_no_invalid_token_through_whatever_the_logits(tiny_engine, name):
    """A random model's logits favour no structure: only the mask makes these replies valid."""
    with grammar_actor(tiny_engine, seed=5) as actor:
        for _ in range(6):
            reply = send_json(actor, "x", SCHEMAS[name], instruct=False, fresh=True, max_tokens=200,
                              params=SamplingParams(temperature=1.5))
            tokens = b"".join(tiny_engine.tokenizer.token_bytes(t) for t in reply.reply.stats.token_ids)
            assert tokens.decode() == reply.text
            assert valid(reply.value, SCHEMAS[name]), reply.text


def test_a_reply_completes_within_a_tight_max_tokens(tiny_engine):
    """Near max_tokens the guest allows only tokens after which the value can still be closed."""
    with grammar_actor(tiny_engine, seed=9) as actor:
        for max_tokens in (40, 48, 60):
            reply = send_json(actor, "x", PERSON, instruct=False, fresh=True, max_tokens=max_tokens,
                              params=SamplingParams(temperature=1.5))
            assert valid(reply.value, PERSON) and reply.reply.stats.generated_tokens <= max_tokens


@pytest.mark.parametrize("schema", [{"type": "array", "items": {"type": "integer"}, "maxItems": 0},
                                    {"type": "object", "required": ["x"],
                                     "properties": {"x": {"type": "array", "maxItems": 0}}}],
                         ids=["array", "property"])
def test_an_array_of_max_items_zero_is_written_empty(tiny_engine, schema):
    """maxItems 0 let one item through: an array's first item was not checked against its maximum
    (floe serve's json_schema replies and tool calls: `[1225147655384116]` for such a schema)."""
    with grammar_actor(tiny_engine, seed=3) as actor:
        for _ in range(6):
            reply = send_json(actor, "x", schema, instruct=False, fresh=True, max_tokens=40,
                              params=SamplingParams(temperature=1.5))
            assert valid(reply.value, schema), reply.text


def test_a_max_tokens_below_the_schema_minimum_is_reported(tiny_engine):
    with grammar_actor(tiny_engine) as actor:
        with pytest.raises(IncompleteJSON, match="max_tokens"):
            send_json(actor, "x", PERSON, instruct=False, max_tokens=3)


def test_the_vocabulary_is_read_once_per_actor(tiny_engine):
    with grammar_actor(tiny_engine) as actor:
        first = send_json(actor, "x", {"type": "boolean"}, instruct=False, max_tokens=8).reply
        second = send_json(actor, "x", {"type": "boolean"}, instruct=False, max_tokens=8).reply
    reads = [r.ledger.boundaries["guest→host token ids"].calls for r in (first, second)]
    assert reads[0] > tiny_engine.config.vocab_size > 100 > reads[1]


def floe_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "floe.cli", "run", *args], capture_output=True, text=True,
                          timeout=300)


def test_floe_run_json_schema_prints_a_valid_value(tmp_path):
    (tmp_path / "order.json").write_text(json.dumps(ORDER))
    proc = floe_run("Order a drink.", "--json-schema", str(tmp_path / "order.json"), "--max-tokens", "96")
    assert proc.returncode == 0, proc.stderr
    assert valid(json.loads(proc.stdout), ORDER)


def test_floe_run_json_schema_names_the_unsupported_keyword(tmp_path):
    (tmp_path / "set.json").write_text('{"type": "array", "contains": {"const": 1}}')
    proc = floe_run("Which?", "--json-schema", str(tmp_path / "set.json"), "--max-tokens", "8")
    assert proc.returncode != 0 and "unsupported JSON Schema keyword 'contains'" in proc.stderr


def test_floe_run_json_schema_refuses_a_guest_that_does_not_read_schemas(tmp_path):
    (tmp_path / "order.json").write_text(json.dumps(ORDER))
    chat = str(builtin_guest("chat"))
    proc = floe_run("Order a drink.", "--json-schema", str(tmp_path / "order.json"), "--guest", chat)
    assert proc.returncode == 1 and "--json-schema needs the grammar guest" in proc.stderr, proc.stderr


# ---- hostile schemas (issue 41) ----------------------------------------------------------------------

LEFT_RECURSIVE = {
    "direct": {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "string"}]}}, "$ref": "#/$defs/a"},
    "through another anyOf": {"$defs": {"a": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/b"}]},
                                        "b": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "string"}]}},
                              "$ref": "#/$defs/a"},
}


@pytest.mark.parametrize("name", LEFT_RECURSIVE)
def test_a_schema_that_refers_to_itself_before_any_input_is_refused(tiny_engine, name):
    """It once exhausted the guest's stack (a trap); now the compiler finds the cycle of choices."""
    with grammar_actor(tiny_engine) as actor:
        with pytest.raises(SchemaUnsupported, match="refers to itself without consuming input"):
            send_json(actor, "x", LEFT_RECURSIVE[name], max_tokens=8)
        nested = {"$defs": {"a": {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/a"}, "maxItems": 2},
                                            {"type": "null"}]}}, "$ref": "#/$defs/a"}
        reply = send_json(actor, "x", nested, instruct=False, max_tokens=24)  # recursion inside [ ]: fine
        assert valid(reply.value, nested)


@pytest.mark.parametrize("keyword", ["minLength", "maxLength", "minItems", "maxItems"])
@pytest.mark.parametrize("bound", [-1, 1.5, "3", None, True])
def test_a_bound_that_is_not_a_non_negative_integer_is_refused_by_name(tiny_engine, keyword, bound):
    kind = "string" if "Length" in keyword else "array"
    with grammar_actor(tiny_engine) as actor:
        with pytest.raises(SchemaUnsupported, match=f"'{keyword}' must be a non-negative integer at #"):
            send_json(actor, "x", {"type": kind, keyword: bound}, max_tokens=8)
        whole = send_json(actor, "x", {"type": kind, keyword: 2.0}, instruct=False, max_tokens=16).value
        assert len(whole) <= 2 if keyword.startswith("max") else len(whole) >= 2  # 2.0 is 2


def test_a_minimum_past_what_the_guest_counts_is_refused_not_lowered(tiny_engine):
    """Counters hold 65,534: a larger minimum was silently lowered to it; a larger maximum bounds nothing."""
    with grammar_actor(tiny_engine) as actor:
        with pytest.raises(SchemaUnsupported, match="'minItems' above 65534 is more than this guest writes"):
            send_json(actor, "x", {"type": "array", "minItems": 100000}, max_tokens=8)
        long = {"type": "string", "maxLength": 100000}
        assert isinstance(send_json(actor, "x", long, instruct=False, max_tokens=8).value, str)


def test_a_max_tokens_no_value_fits_in_is_refused_saying_what_would(tiny_engine):
    """The guest refuses before reading the prompt and says how many bytes the shortest value takes."""
    with grammar_actor(tiny_engine) as actor:
        with pytest.raises(IncompleteJSON, match=r"max_tokens 3 is too small .* the shortest takes 41 bytes"):
            send_json(actor, "x", PERSON, instruct=False, max_tokens=3)
        assert valid(send_json(actor, "x", PERSON, instruct=False, max_tokens=41).value, PERSON)


def test_a_schema_is_checked_without_a_kv_slot_as_a_message_would_refuse_it(tiny_engine):
    """floe serve checks a structured request before it waits for a slot (a bad schema is a 400 however
    busy the server is): the check holds no KV slot and says what the grammar actor's message says."""
    bad, small = {"type": "array", "contains": {"const": 1}}, (PERSON, 3)
    with grammar_actor(tiny_engine) as actor:
        refusals = []
        for schema, max_tokens in ((bad, 8), small):
            with pytest.raises((SchemaUnsupported, IncompleteJSON)) as e:
                send_json(actor, "x", schema, instruct=False, max_tokens=max_tokens)
            refusals.append(e.value)
    taken = [tiny_engine.claim_slot() for _ in range(tiny_engine.cache.n_slots)]  # every slot busy
    check = SchemaCheck(tiny_engine, builtin_guest("grammar"))
    try:
        for _ in range(3):  # each check starts from the primed guest: none sees the one before
            unsupported = check.refusal(bad, 8)
            assert isinstance(unsupported, SchemaUnsupported) and str(unsupported) == str(refusals[0])
            short = check.refusal(*small)
            assert str(refusals[1]) == f"no reply: {short}" and isinstance(short, IncompleteJSON)
            assert check.refusal(PERSON, 41) is None and check.refusal(None, 8) is None
    finally:
        check.close()
        for slot in taken:
            tiny_engine.release_slot(slot)
