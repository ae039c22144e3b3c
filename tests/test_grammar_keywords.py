"""The JSON Schema keywords real clients send (pydantic's ge/le/gt/lt, formats, patterns, ...): the grammar
guest's automaton accepts exactly the values the `jsonschema` library accepts, over generated corpora,
and every value drawn from the automaton at random validates. The compiler and automaton run alone
(tests/grammar_check.c, built here with the guests' compiler); one end-to-end run samples the default
model through floe.actor.send_json."""

import decimal
import importlib.util
import json
import random
from pathlib import Path

import jsonschema
import pytest
import wasmtime

ROOT = Path(__file__).parent.parent


class Automaton:
    """The guest's schema compiler and automaton in a wasm instance of their own (no model)."""

    def __init__(self, wasm: Path) -> None:
        engine = wasmtime.Engine()
        self.store = wasmtime.Store(engine)
        instance = wasmtime.Instance(self.store, wasmtime.Module.from_file(engine, str(wasm)), [])
        self.fn = {name: instance.exports(self.store)[name] for name in
                   ("alloc", "error", "min_bytes", "compile", "accepts", "sample")}
        self.memory = instance.exports(self.store)["memory"]
        self.buffer = self._put(bytes(1 << 16))  # instances to check and values drawn go here

    def _put(self, data: bytes) -> int:
        at = self.fn["alloc"](self.store, max(len(data), 1))
        self.memory.write(self.store, data, at)
        return at

    def compile(self, schema) -> str | None:
        """None when the schema compiles, else the guest's refusal."""
        text = (schema if isinstance(schema, str) else json.dumps(schema)).encode()
        if self.fn["compile"](self.store, self._put(text), len(text)):
            return None
        at = self.fn["error"](self.store)
        raw = self.memory.read(self.store, at, at + 512)
        return raw[:raw.index(0)].decode()

    def accepts(self, text: str | bytes) -> bool:
        data = text.encode() if isinstance(text, str) else text
        self.memory.write(self.store, data, self.buffer)
        verdict = self.fn["accepts"](self.store, self.buffer, len(data))
        assert verdict >= 0, f"need() overstated what remained of {data!r} (or a reading was lost)"
        return verdict == 1

    def sample(self, seed: int, soft: int = 40) -> str:
        n = self.fn["sample"](self.store, seed, self.buffer, 1 << 16, soft)
        assert n >= 0, {-1: "a state of need n had no byte to need n - 1", -2: "ran past 64 KiB"}[n]
        return self.memory.read(self.store, self.buffer, self.buffer + n).decode()

    def min_bytes(self) -> int:
        return self.fn["min_bytes"](self.store)


@pytest.fixture(scope="module")
def automaton(tmp_path_factory) -> Automaton:
    spec = importlib.util.spec_from_file_location("guest_build", ROOT / "guests" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    out = tmp_path_factory.mktemp("grammar_check")
    return Automaton(build.build(Path(__file__).parent / "grammar_check.c", out))


def validator(schema):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def agrees(automaton: Automaton, schema, texts) -> None:
    """The automaton accepts each text exactly when jsonschema validates it."""
    assert automaton.compile(schema) is None, automaton.compile(schema)
    check = validator(schema)
    wrong = [(t, check.is_valid(json.loads(t))) for t in texts
             if automaton.accepts(t) != check.is_valid(json.loads(t))]
    assert not wrong, f"{schema}: (text, jsonschema's verdict) the automaton disagreed on: {wrong[:10]}"


def drawn_values_validate(automaton: Automaton, schema, n: int = 60) -> list:
    """n values drawn from the automaton at random: each parses and validates; they are returned."""
    assert automaton.compile(schema) is None, automaton.compile(schema)
    check = validator(schema)
    values = []
    for seed in range(n):
        text = automaton.sample(seed, soft=random.Random(seed).choice([0, 3, 12, 40]))
        value = json.loads(text)
        assert check.is_valid(value), (schema, text)
        assert automaton.accepts(text) and len(text.encode()) >= automaton.min_bytes()
        values.append(value)
    return values


# ---- integer and number bounds ------------------------------------------------------------------------

INTEGER_BOUNDS = [
    {"minimum": 0}, {"maximum": 0}, {"minimum": 1}, {"exclusiveMinimum": 0}, {"minimum": 18, "maximum": 130},
    {"minimum": -40, "maximum": 60}, {"minimum": -1000, "maximum": -7},
    {"exclusiveMinimum": -5, "exclusiveMaximum": 5},
    {"minimum": 99, "maximum": 100}, {"minimum": 100, "maximum": 999}, {"minimum": 7, "maximum": 7},
    {"minimum": 2.5, "maximum": 9.5}, {"exclusiveMinimum": 2.5, "exclusiveMaximum": 9.5},
    {"minimum": 1e3, "maximum": 12345}, {"maximum": 65535}, {"minimum": 123456789, "maximum": 987654321},
    {"minimum": 0, "exclusiveMinimum": 3, "maximum": 50, "exclusiveMaximum": 40},
    {"minimum": 9999999999999990}, {"maximum": -9999999999999990},
]


def integer_corpus(bounds: dict, rng: random.Random) -> list[str]:
    """Both sides of every bound, 0, signs, lengths, random integers; plus non-integers and -0."""
    points = [0, 1, -1, 9, 10, 11, 99, 100, 101, 999, 1000, 10**15, 10**16 - 1, -(10**16 - 1)]
    for b in bounds.values():
        points += [int(b) + d for d in range(-3, 4)] + [int(b) * 10, int(b) // 10]
    points += [rng.randrange(-10**rng.randrange(1, 17), 10**rng.randrange(1, 17)) for _ in range(200)]
    texts = [str(p) for p in points if abs(p) < 10**16]
    return texts + ["-0", "1.5", "2.0", "1e2", "-3.25"]


@pytest.mark.parametrize("bounds", INTEGER_BOUNDS, ids=compact)
def test_an_integer_between_bounds_is_accepted_exactly_when_jsonschema_accepts_it(automaton, bounds):
    schema = {"type": "integer", **bounds}
    texts = [t for t in integer_corpus(bounds, random.Random(compact(bounds))) if t != "-0" and "." not in t
             and "e" not in t]
    agrees(automaton, schema, texts)
    for odd in ("-0", "1.5", "2.0", "1e2", "01", "+1", "--1", "1-"):
        assert not automaton.accepts(odd), odd  # not how the guest writes an integer
    drawn_values_validate(automaton, schema)


NUMBER_BOUNDS = [
    {"minimum": 0}, {"exclusiveMinimum": 0}, {"maximum": 0}, {"exclusiveMaximum": 0},
    {"minimum": 0, "maximum": 1}, {"exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"minimum": -1, "maximum": 1}, {"exclusiveMinimum": -3, "maximum": 3},
    {"minimum": 5, "exclusiveMaximum": 6}, {"exclusiveMinimum": 5, "maximum": 6},
    {"minimum": -12, "exclusiveMaximum": -2}, {"minimum": 100}, {"maximum": 1e2},
    {"minimum": 0.5}, {"exclusiveMinimum": 0.25, "maximum": 0.75}, {"minimum": 2.25, "exclusiveMaximum": 2.5},
    {"exclusiveMinimum": -1.5, "exclusiveMaximum": 1.5}, {"minimum": -0.001, "maximum": 0.001},
    {"minimum": 99.99, "maximum": 100.01}, {"exclusiveMinimum": 0.999, "exclusiveMaximum": 1},
    {"minimum": -7.125}, {"exclusiveMaximum": -3.5}, {"minimum": 0.1, "maximum": 0.1},
]


def number_corpus(bounds: dict, rng: random.Random) -> list[str]:
    texts = []
    for b in bounds.values():  # each bound written out, digits past it, and numbers just either side
        plain = format(decimal.Decimal(repr(b)), "f")
        point = plain if "." in plain else plain + "."
        texts += [plain] + [point + d for d in ("0", "1", "9", "01", "99", "0001")]
        texts += [f"{b + e:.6f}" for e in (-0.01, -0.001, -1e-6, 1e-6, 0.001, 0.01)]
    for b in [0, 1, -1, *(int(v) for v in bounds.values())]:
        for d in (-1, 0, 1):
            p = b + d
            texts += [str(p), f"{p}.0", f"{p}.00", f"{p}.5", f"{p}.05", f"{p}.999", f"{p}.000001"]
            if p == 0:
                texts += ["-0", "-0.0", "-0.5", "0.0", "0.1"]
    texts += [f"{rng.uniform(-200, 200):.{rng.randrange(0, 6)}f}" for _ in range(200)]
    return texts


@pytest.mark.parametrize("bounds", NUMBER_BOUNDS, ids=compact)
def test_a_number_between_integer_bounds_is_accepted_exactly_when_jsonschema_accepts_it(automaton, bounds):
    schema = {"type": "number", **bounds}
    texts = number_corpus(bounds, random.Random(compact(bounds)))
    zeros = {t for t in texts if t.startswith("-0") and not t.strip("-0.")}
    agrees(automaton, schema, [t for t in texts if t not in zeros])
    for t in zeros:  # a negative zero is 0 written otherwise: the guest may leave it out, never break a bound
        assert not automaton.accepts(t) or validator(schema).is_valid(json.loads(t)), t
    drawn_values_validate(automaton, schema)


def test_bounds_inside_objects_arrays_and_type_lists(automaton):
    schema = {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "scores": {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
                   "maxItems": 3},
        "rank": {"type": ["integer", "null"], "minimum": 1}}, "required": ["age", "scores", "rank"]}
    agrees(automaton, schema, ['{"age":0,"scores":[],"rank":null}', '{"age":150,"scores":[0.5,10],"rank":1}',
                               '{"age":151,"scores":[],"rank":null}', '{"age":3,"scores":[0],"rank":null}',
                               '{"age":3,"scores":[10.01],"rank":2}', '{"age":3,"scores":[],"rank":0}',
                               '{"age":-1,"scores":[],"rank":null}'])
    drawn_values_validate(automaton, schema)


MULTIPLES = [
    {"multipleOf": 1}, {"multipleOf": 2}, {"multipleOf": 7}, {"multipleOf": 10}, {"multipleOf": 65535},
    {"multipleOf": 3, "minimum": 10, "maximum": 20},
    {"multipleOf": 5, "exclusiveMinimum": -25, "maximum": 25},
    {"multipleOf": 12, "minimum": 100, "maximum": 120},
    {"multipleOf": 1000, "minimum": 999, "maximum": 99999},
    {"multipleOf": 9, "minimum": -100, "exclusiveMaximum": -8}, {"multipleOf": 4.0, "minimum": 1.5},
]


@pytest.mark.parametrize("bounds", MULTIPLES, ids=compact)
@pytest.mark.parametrize("kind", ["integer", "number"])
def test_a_multiple_of_an_integer_is_accepted_exactly_when_jsonschema_accepts_it(automaton, bounds, kind):
    """A number that is a multiple of a whole number is an integer: written as one."""
    schema = {"type": kind, **bounds}
    rng = random.Random(compact(bounds))
    texts = [t for t in integer_corpus(bounds, rng) if t != "-0" and "." not in t and "e" not in t]
    texts += [str(rng.randrange(-200, 200) * int(bounds["multipleOf"])) for _ in range(100)]
    agrees(automaton, schema, [t for t in texts if abs(int(t)) < 2**53])  # jsonschema divides floats
    drawn_values_validate(automaton, schema)


@pytest.mark.parametrize("schema, says", [
    ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer of at most 16 digits lies within"),
    ({"type": "integer", "exclusiveMinimum": 4, "exclusiveMaximum": 5}, "no integer of at most 16 digits"),
    ({"type": "integer", "minimum": 1e20}, "no integer of at most 16 digits"),
    ({"type": "number", "exclusiveMinimum": 3, "maximum": 3}, "no number of at most 16 integer digits"),
    ({"type": "number", "minimum": 0.5, "exclusiveMaximum": 0.5}, "no number of at most 16 integer digits"),
    ({"type": "number", "exclusiveMinimum": 0.25, "exclusiveMaximum": 0.25000000000000001},
     "no number of at most 16 integer digits"),  # a float: the same 0.25
    ({"type": "number", "minimum": 1e-17}, "a bound with more than 16 fraction digits"),
    ({"type": "number", "exclusiveMaximum": 0.12345678901234567}, "this guest writes) in 'exclusiveMaximum'"),
    ({"type": "integer", "minimum": "3"}, "a non-number bound 'minimum' at #"),
    ({"type": "integer", "exclusiveMinimum": True}, "a non-number bound 'exclusiveMinimum'"),
    ({"enum": [1, 5, 10], "maximum": 6}, "minimum/maximum/multipleOf beside 'enum' or 'const'"),
    ({"type": "integer", "multipleOf": 7, "minimum": 1, "maximum": 6}, "(a multiple of multipleOf)"),
    ({"type": "number", "multipleOf": 0.01}, "a multiple that is not a positive integer"),
    ({"type": "integer", "multipleOf": 0}, "a multiple that is not a positive integer"),
    ({"type": "integer", "multipleOf": -3}, "in 'multipleOf' at #"),
    ({"type": "integer", "multipleOf": 70000}, "a multiple above 65535"),
])
def test_bounds_the_guest_cannot_write_are_refused_by_name(automaton, schema, says):
    refusal = automaton.compile(schema)
    assert refusal is not None and says in refusal, refusal


def test_a_bound_written_with_an_exponent_or_a_fraction_of_zeros_is_read_exactly(automaton):
    for text, schema in [
        ('{"type": "number", "minimum": 1.0E1, "maximum": 2000e-2}', {"minimum": 10, "maximum": 20}),
        ('{"type":"integer","minimum":145e-1,"exclusiveMaximum":201E-1}', {"minimum": 15, "maximum": 20}),
        ('{"type": "integer", "minimum": -0.5e-3, "maximum": 0.00001e5}', {"minimum": 0, "maximum": 1}),
    ]:
        assert automaton.compile(text) is None, automaton.compile(text)
        check = validator({"type": "number", **schema})
        for t in ["-1", "0", "1", "9", "10", "10.5", "15", "16", "20", "20.0", "20.5", "21"]:
            if "." in t and "integer" in text:
                continue
            assert automaton.accepts(t) == check.is_valid(json.loads(t)), (text, t)
    assert automaton.compile('{"type": "number", "minimum": 5e-1, "maximum": 0.05E1}') is None
    assert automaton.accepts("0.5") and automaton.accepts("0.50") and not automaton.accepts("0.51")
    assert not automaton.accepts("0.49999") and not automaton.accepts("0")


# ---- objects and arrays: additionalProperties with a schema, prefixItems -------------------------------

MAPS = [  # pydantic's dict[str, X]
    {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
    {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
    {"additionalProperties": {"type": "boolean"}},
    {"additionalProperties": False},
]


@pytest.mark.parametrize("schema", MAPS, ids=compact)
def test_a_map_s_values_follow_additional_properties(automaton, schema):
    texts = ['{}', '{"a":1}', '{"a":-1}', '{"a":1,"b":2}', '{"a":"x"}', '{"a":["x"]}', '{"a":["x","y","z"]}',
             '{"a":true}', '{"":false,"b":true}', '{"a":null}']
    agrees(automaton, schema, texts)
    assert not automaton.accepts("[]") and not automaton.accepts("1")  # untyped too: it writes an object
    drawn_values_validate(automaton, schema)


ABC = {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "null"}}
COUNTED = [
    {"type": "object", "properties": ABC, "minProperties": 2},
    {"type": "object", "properties": ABC, "required": ["c"], "maxProperties": 2},
    {"type": "object", "properties": ABC, "required": ["b"], "minProperties": 2, "maxProperties": 2},
    {"type": "object", "additionalProperties": {"type": "boolean"}, "minProperties": 1, "maxProperties": 3},
    {"type": "object", "minProperties": 1},
    {"maxProperties": 1},
]


KEYED = ["{" + ",".join(p for i, p in enumerate(['"a":1', '"b":"x"', '"c":null']) if mask >> i & 1) + "}"
         for mask in range(8)]  # every subset of the listed properties, in their order
MAPS_TEXTS = ['{"x":true}', '{"x":true,"y":false}', '{"x":true,"y":false,"z":true}', '{"w":1,"x":2}',
              '{"a":true,"b":true,"c":true,"d":true}', '{"x":[1]}', '{"x":{}}', '{"":null}']


@pytest.mark.parametrize("schema", COUNTED, ids=compact)
def test_min_and_max_properties_count_what_is_written(automaton, schema):
    """Exactly where the guest writes such objects (the listed properties in order, or any keys of a map);
    it writes no property an object does not list."""
    listed = "properties" in schema
    agrees(automaton, schema, KEYED + ([] if listed else MAPS_TEXTS))
    for text in MAPS_TEXTS if listed else []:
        assert not automaton.accepts(text)
    drawn_values_validate(automaton, schema)


TUPLES = [  # pydantic's tuple[int, str] and tuple[int, ...] with a head
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "minItems": 2,
     "maxItems": 2},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 5}, {"type": "boolean"}],
     "items": False},
    {"type": "array", "prefixItems": [{"const": "head"}], "items": {"type": "integer"}, "minItems": 3},
    {"prefixItems": [{"type": "null"}, {"enum": ["a", "b"]}, {"type": "integer"}]},
]


DRAFT7 = "http://json-schema.org/draft-07/schema#"
TUPLES += [  # draft 7's tuples (zod-to-json-schema's): items a list, additionalItems the rest
    {"$schema": DRAFT7, "type": "array", "items": [{"type": "integer"}, {"type": "string"}], "minItems": 2,
     "maxItems": 2},
    {"$schema": DRAFT7, "type": "array", "items": [{"type": "integer", "minimum": 5}, {"type": "boolean"}],
     "additionalItems": False},
    {"$schema": DRAFT7, "type": "array", "items": [{"const": "head"}], "additionalItems": {"type": "integer"},
     "minItems": 3},
]


@pytest.mark.parametrize("schema", TUPLES, ids=compact)
def test_prefix_items_hold_at_their_positions(automaton, schema):
    texts = ['[]', '[1]', '[5]', '[1,"a"]', '[5,true]', '[5,true,1]', '[1,"a",2]', '["head"]', '["head",1,2]',
             '["head",1,2,3]', '["head",1,"x"]', '[null]', '[null,"a"]', '[null,"b",7]', '[null,"c"]',
             '[null,"a",7,8]', '["a"]', '[1,2]']
    agrees(automaton, schema, texts)
    drawn_values_validate(automaton, schema)


UNIQUE = [  # pydantic's set[Literal[...]] and set[SomeEnum]
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "uniqueItems": True},
    {"type": "array", "items": {"enum": ["a", "ab", "abc", 1, 12, True, None]}, "uniqueItems": True,
     "minItems": 3},
    {"type": "array", "items": {"$ref": "#/$defs/C"}, "uniqueItems": True, "maxItems": 2,
     "$defs": {"C": {"enum": ["x", "y", "z"], "type": "string"}}},
    {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "maxItems": 1},
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": False},
]


def unique_corpus() -> list[str]:
    values = ['"red"', '"green"', '"blue"', '"a"', '"ab"', '"abc"', "1", "12", "true", "null", '"x"', '"y"',
              '"z"', "7"]
    rng = random.Random(8)
    texts = ["[" + ",".join(rng.choice(values) for _ in range(rng.randrange(1, 5))) + "]" for _ in range(400)]
    texts.append("[]")
    return sorted(set(texts))


@pytest.mark.parametrize("schema", UNIQUE, ids=compact)
def test_unique_items_over_an_enum_hold_exactly(automaton, schema):
    agrees(automaton, schema, unique_corpus())
    drawn_values_validate(automaton, schema)


@pytest.mark.parametrize("schema, says", [
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False, "minItems": 2},
     "minItems > the positions a tuple allows ('items' or 'additionalItems' false)"),
    ({"type": "array", "prefixItems": {"type": "integer"}}, "'prefixItems' must be an array of schemas"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "'uniqueItems' on items that"),
    ({"type": "array", "items": {"enum": [1, 1.0]}, "uniqueItems": True}, "'uniqueItems' on items"),
    ({"type": "array", "items": {"enum": list("abcdefghi")}, "uniqueItems": True}, "an enum of at most 8"),
    ({"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True, "minItems": 3},
     "minItems above the distinct values uniqueItems allows"),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"uniqueItems": True}]},
     "'uniqueItems' on items that are not an enum of at most 8 strings, integers, booleans or null (what "
     "this guest keeps apart) at #/prefixItems/1"),
    ({"type": "object", "additionalProperties": {"not": {}}}, "'not' at #/additionalProperties"),
    ({"type": "object", "properties": {"a": {}}, "minProperties": 2},
     "minProperties above the properties listed"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"], "maxProperties": 1},
     "maxProperties below the required properties"),
    ({"type": "object", "minProperties": 3, "maxProperties": 2}, "minProperties > maxProperties"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
     "minProperties above 1 on an object of any keys (this guest cannot keep them distinct)"),
    ({"type": "object", "minProperties": 300}, "minProperties/maxProperties above 254"),
    ({"type": "object", "maxProperties": -1}, "'maxProperties' must be a non-negative integer"),
])
def test_arrays_and_maps_the_guest_cannot_write_are_refused_by_name(automaton, schema, says):
    refusal = automaton.compile(schema)
    assert refusal is not None and says in refusal, refusal


# ---- format --------------------------------------------------------------------------------------------

WRITABLE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) not in '"\\')  # what a shaped string holds


def mutations(text: str, rng: random.Random, alphabet: str, n: int) -> list[str]:
    """n strings one edit (a deletion, insertion or replacement) away from text."""
    out = []
    for _ in range(n):
        i = rng.randrange(len(text) + 1)
        kind = rng.randrange(3)
        if kind == 0 and text:
            i = min(i, len(text) - 1)
            out.append(text[:i] + text[i + 1:])
        elif kind == 1:
            out.append(text[:i] + rng.choice(alphabet) + text[i:])
        elif text:
            i = min(i, len(text) - 1)
            out.append(text[:i] + rng.choice(alphabet) + text[i + 1:])
    return out


EXACT_FORMATS = {  # every one jsonschema accepts, bar a time's lowercase t and z and a leap second (:60)
    "date": ["2024-02-29", "2023-02-29", "2000-02-29", "1900-02-29", "2024-04-31", "2024-12-31", "2024-13-01",
             "0000-01-01", "0001-01-01", "2024-1-01", "24-01-01", "2024-01-32", "2024-11-30", "1600-02-29"],
    "time": ["12:30:00Z", "23:59:59+14:00", "24:00:00Z", "12:30:00", "12:30:00.123Z", "12:30:00.Z",
             "12:60:00Z", "00:00:00-00:00", "12:30:00+2:00", "9:30:00Z"],
    "date-time": ["2024-02-29T12:30:00Z", "2023-02-29T12:30:00Z", "2024-01-01 12:30:00Z",
                  "2024-01-01T12:30:00", "2024-06-30T23:59:59.5-03:30"],
    "uuid": ["123e4567-e89b-12d3-a456-426614174000", "123E4567-E89B-12D3-A456-426614174000",
             "123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400",
             "g23e4567-e89b-12d3-a456-426614174000"],
    "ipv4": ["192.168.0.1", "255.255.255.255", "256.1.1.1", "01.2.3.4", "1.2.3", "1.2.3.4.5", "0.0.0.0",
             "1..2.3"],
}
SUBSET_FORMATS = {"email": ["a@b.co", "first.last+tag@mail.example.org", "no-at-sign"],
                  "hostname": ["example.com", "a-b.c", "-bad.com", "x" * 64],
                  "uri": ["https://example.com/a/b?q=1", "ftp://h:21/x", "no-scheme"],
                  "duration": ["P1Y2M3DT4H5M6S", "PT1H30M", "P1W", "P1Y2W", "PT", "P", "P1DT", "P1M2Y"],
                  "ipv6": ["2001:db8:0:0:0:0:0:1", "::1", "1:2:3:4:5:6:7", "12345::"]}


def test_every_format_named_here_is_checked_by_jsonschema():
    """Else the cross-checks below could not fail (jsonschema skips a format it has no checker for)."""
    checkers = jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers
    assert set(EXACT_FORMATS) | set(SUBSET_FORMATS) <= set(checkers)


@pytest.mark.parametrize("fmt", EXACT_FORMATS)
def test_a_fixed_shape_format_is_accepted_exactly_when_jsonschema_accepts_it(automaton, fmt):
    schema = {"type": "string", "format": fmt}
    rng = random.Random(fmt)
    assert automaton.compile(schema) is None, automaton.compile(schema)
    drawn = [json.loads(automaton.sample(seed, soft=0)) for seed in range(40)]
    edits = [m for d in drawn for m in mutations(d, rng, "0123456789-:.TZ+aAg ", 6)]
    texts = EXACT_FORMATS[fmt] + drawn + edits
    if fmt in ("time", "date-time"):
        texts = [t for t in texts if ":60" not in t[-12:] and "z" not in t and "t" not in t]
    if fmt == "uuid":  # Python's UUID() drops every "-", reads the hex with int() (a sign, "_" pass)
        texts = [t for t in texts if not set(t) - set("0123456789abcdefABCDEFg-") and t.count("-") <= 4]
    agrees(automaton, schema, [json.dumps(t) for t in texts])
    drawn_values_validate(automaton, schema)


@pytest.mark.parametrize("fmt", SUBSET_FORMATS)
def test_a_format_written_as_a_subset_writes_only_values_jsonschema_accepts(automaton, fmt):
    schema = {"type": "string", "format": fmt}
    values = drawn_values_validate(automaton, schema, n=80)
    assert len(set(values)) > 40  # a subset, not one value
    check = validator(schema)
    for text in SUBSET_FORMATS[fmt]:  # what it writes of these, jsonschema accepts
        assert not automaton.accepts(json.dumps(text)) or check.is_valid(text), text
    assert automaton.accepts(json.dumps(SUBSET_FORMATS[fmt][0]))


def test_an_email_it_writes_is_one_pydantics_email_str_accepts(automaton):
    """pydantic's EmailStr checks with email-validator, stricter than jsonschema's "an @ in it": a domain
    label past 63 characters (17 of 100 sampled replies broke that: `python bench/grammar_validity.py`) or
    an address past 254 is refused. Every drawn address passes it; a too-long label is not written."""
    email_validator = pytest.importorskip("email_validator")
    schema = {"type": "string", "format": "email"}
    for value in drawn_values_validate(automaton, schema, n=200):
        email_validator.validate_email(value, check_deliverability=False)
    for text in ["a@" + "b" * 64 + ".com", "a" * 64 + "@b.com", "a@b." + "c" * 25, "a@b.c"]:
        assert not automaton.accepts(json.dumps(text)), text
    assert automaton.accepts(json.dumps("first.last+tag@mail.example.org"))


# ---- pattern -------------------------------------------------------------------------------------------

PATTERNS = [
    "^[A-Z]{3}$", "^[a-z0-9_]+$", "^\\d{3}-\\d{4}$", "^(foo|bar)+baz?$", "^a.c$", "abc", "^abc", "xyz$",
    "^[^a-c]{2,4}$", "^\\w+@\\w+\\.com$", "^(?:ab|cd){1,3}$", "^(?P<year>\\d{4})-(?P<month>\\d{2})$",
    "^[+-]?\\d+(\\.\\d+)?$", "^\\s*x\\s*$", "^[\\]a-]+$", "^a{2,}b{,2}c{3}$", "^(a|b|)c$", "^.{0,5}$",
    "^[A-Z][a-z]*( [A-Z][a-z]*)*$", "^\\x41\\u0042[\\d\\W]$", "^ab*?c+?$", "a|^b$|c$", "^a{$", "^$",
    "^[-a]\\.\\*\\?\\(\\)$", "^\\D\\S\\W$",
]


def pattern_corpus(pattern: str, automaton: Automaton, rng: random.Random) -> list[str]:
    alphabet = sorted(set(c for c in pattern if c in WRITABLE) | set("aZ09 _-.@"))
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12))) for _ in range(300)]
    drawn = [automaton.sample(seed, soft=rng.randrange(0, 8)) for seed in range(30)]
    drawn = [json.loads(d) for d in drawn]
    return texts + drawn + [m for d in drawn for m in mutations(d, rng, alphabet, 5)]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_pattern_is_accepted_exactly_when_jsonschema_accepts_it(automaton, pattern):
    """Over strings of the characters a shaped string holds (printable ASCII but '"' and '\\'): unanchored
    ends match anything, as in jsonschema's re.search."""
    schema = {"type": "string", "pattern": pattern}
    assert automaton.compile(schema) is None, automaton.compile(schema)
    texts = pattern_corpus(pattern, automaton, random.Random(pattern))
    agrees(automaton, schema, [json.dumps(t) for t in texts])
    drawn_values_validate(automaton, schema)


LENGTHS = [
    {"pattern": "^(ab)*$", "minLength": 3}, {"pattern": "^(ab)*$", "minLength": 3, "maxLength": 6},
    {"pattern": "^[a-z]+$", "maxLength": 4}, {"pattern": "x", "minLength": 2, "maxLength": 3},
    {"format": "date", "minLength": 10, "maxLength": 10}, {"pattern": "^\\d{2,8}$", "minLength": 5},
    {"format": "email", "maxLength": 8},
    {"format": "uri", "minLength": 1, "maxLength": 2083},  # pydantic's HttpUrl
    {"pattern": "^(ab)*$", "maxLength": 5}, {"pattern": "^[a-c]{3}[0-9]*$", "minLength": 2, "maxLength": 6},
]


@pytest.mark.parametrize("shape", LENGTHS, ids=compact)
def test_min_and_max_length_beside_a_pattern_or_format_hold_exactly(automaton, shape):
    """pydantic's constr(min_length=..., pattern=...): the pattern's automaton times a count of characters."""
    schema = {"type": "string", **shape}
    assert automaton.compile(schema) is None, automaton.compile(schema)
    texts = pattern_corpus(shape.get("pattern", "0123456789-@."), automaton, random.Random(compact(shape)))
    if shape.get("format") in ("email", "uri"):  # a subset: only what it writes must validate
        check = validator(schema)
        assert not [t for t in texts if automaton.accepts(json.dumps(t)) and not check.is_valid(t)]
    else:
        agrees(automaton, schema, [json.dumps(t) for t in texts + ["2024-02-29", "2023-02-29", "2024-2-29"]])
    drawn_values_validate(automaton, schema)


@pytest.mark.parametrize("schema, says", [
    ({"type": "string", "pattern": "^(a)\\1$"}, "a backreference (\\1...) in 'pattern' at #"),
    ({"type": "string", "pattern": "^(?=a)a$"}, "a lookaround"),
    ({"type": "string", "pattern": "(?<!a)b"}, "a lookaround"),
    ({"type": "string", "pattern": "\\bword\\b"}, "a word boundary"),
    ({"type": "string", "pattern": "(?i)abc"}, "an inline flag"),
    ({"type": "string", "pattern": "a++"}, "a possessive quantifier"),
    ({"type": "string", "pattern": "a**"}, "a quantifier on a quantifier"),
    ({"type": "string", "pattern": "*a"}, "a quantifier with nothing to repeat"),
    ({"type": "string", "pattern": "{2}a"}, "a quantifier with nothing to repeat"),
    ({"type": "string", "pattern": "[\\d-z]"}, "a range from a class escape"),
    ({"type": "string", "pattern": "(ab"}, "a '(' without its ')'"),
    ({"type": "string", "pattern": "ab)"}, "a ')' without its '('"),
    ({"type": "string", "pattern": "[ab"}, "a '[' without its ']'"),
    ({"type": "string", "pattern": "a^b"}, "'^' or '$' inside 'pattern'"),
    ({"type": "string", "pattern": "^\"[a-z]+\"$"}, "no string this guest writes matches 'pattern'"),
    ({"type": "string", "pattern": "^\\n$"}, "no string this guest writes matches 'pattern'"),
    ({"type": "string", "pattern": "^é$"}, "a non-ASCII character in 'pattern'"),
    ({"type": "string", "pattern": "^a{2000}$"}, "a repetition {m,n} past 1000"),
    ({"type": "string", "pattern": "^(a{1000}){1000}$"}, "repeats too much"),
    ({"type": "string", "pattern": "(a|b)*a(a|b){12}"}, "needs more than 1024 states"),
    ({"type": "string", "pattern": "^\\q$"}, "an escape this guest does not know"),
    ({"type": "string", "pattern": 3}, "'pattern' must be a string"),
    ({"type": "string", "format": "ipvanyaddress"}, "unsupported JSON Schema format 'ipvanyaddress' at #"),
    ({"type": "string", "format": "date", "pattern": "^2"}, "'pattern' beside 'format'"),
    ({"type": "string", "format": "date", "maxLength": 9}, "no string of minLength to maxLength characters"),
    ({"type": "string", "pattern": "^a+$", "minLength": 5000}, "'pattern' or 'format' takes more than 4096"),
    ({"type": "string", "pattern": "^a+$", "minLength": 3, "maxLength": 2}, "minLength > maxLength at #"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "(a|b)*a(a|b){7}"}
                                       for i in range(40)}},
     "more than 16384 automaton states in all"),
])
def test_patterns_and_formats_the_guest_cannot_write_are_refused_by_name(automaton, schema, says):
    refusal = automaton.compile(schema)
    assert refusal is not None and says in refusal, refusal


# ---- end to end: the default model through the grammar guest -------------------------------------------

def booking_schema() -> dict:
    """What pydantic sends for a model with ge/le/gt/lt bounds, a date and a pattern."""
    import datetime

    from pydantic import BaseModel, Field

    class Booking(BaseModel):
        guests: int = Field(ge=1, le=12)
        arrival: datetime.date
        nights: int = Field(gt=0, lt=31)
        rate: float = Field(ge=0, le=1000)
        room: str = Field(pattern=r"^[A-C]\d{3}$")

    return Booking.model_json_schema()


def test_pydantic_bounds_dates_and_patterns_are_all_compiled(automaton):
    schema = booking_schema()
    props = schema["properties"]
    assert {"minimum", "maximum"} <= set(props["guests"])
    assert {"exclusiveMinimum", "exclusiveMaximum"} <= set(props["nights"])
    assert props["arrival"]["format"] == "date" and "pattern" in props["room"]
    assert automaton.compile(schema) is None, automaton.compile(schema)
    drawn_values_validate(automaton, schema, n=30)


def test_default_model_replies_to_a_pydantic_schema_validate(native_engine):
    """Greedy and sampled replies of the default model (as floe run and floe serve run it on a CPU),
    masked by the grammar guest, each valid against the schema pydantic emits, formats included."""
    from floe.actor import grammar_actor, send_json
    from floe.engine import SamplingParams

    schema, check = booking_schema(), validator(booking_schema())
    prompt = "Book a room for two guests arriving on the 3rd of March 2025 for four nights."
    with grammar_actor(native_engine, seed=7) as actor:
        replies = [send_json(actor, prompt, schema, fresh=True, max_tokens=120)]
        replies += [send_json(actor, prompt, schema, fresh=True, max_tokens=120,
                              params=SamplingParams(temperature=1.0)) for _ in range(3)]
    for reply in replies:
        errors = [e.message for e in check.iter_errors(reply.value)]
        assert not errors, (reply.text, errors)


# ---- oneOf (alternatives proved apart), allOf of one schema, and what stands beside them ------------------

def pet_union() -> dict:
    """pydantic's discriminated union: oneOf of $refs, a const discriminator, a `discriminator` annotation."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int = Field(ge=0, le=9)

    class Dog(BaseModel):
        kind: Literal["dog"]
        name: str

    class Owner(BaseModel):
        pet: Cat | Dog = Field(discriminator="kind")

    return Owner.model_json_schema()


ONE_OF = [
    pet_union(),
    {"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
    {"oneOf": [{"const": "a", "title": "A"}, {"const": "b"}, {"enum": [1, 2]}]},
    {"oneOf": [
        {"type": "object", "properties": {"t": {"const": 1}, "x": {"type": "integer"}},
         "required": ["t", "x"]},
        {"type": "object", "properties": {"t": {"const": 2}, "y": {"type": "string"}}, "required": ["t"]}]},
    {"allOf": [{"$ref": "#/$defs/n"}], "description": "pydantic v1",
     "$defs": {"n": {"type": "integer", "minimum": 3}}},
]


@pytest.mark.parametrize("schema", ONE_OF, ids=lambda s: compact(s)[:60])
def test_one_of_apart_and_all_of_one_are_accepted_exactly_when_jsonschema_accepts_them(automaton, schema):
    texts = ['"a"', '"b"', '"c"', "1", "2", "3", "-4", "null", "true", '{"t":1,"x":5}', '{"t":2}',
             '{"t":2,"y":"q"}', '{"t":1}', '{"t":3}', '{"pet":{"kind":"cat","lives":3}}',
             '{"pet":{"kind":"cat","lives":10}}', '{"pet":{"kind":"dog","name":"Rex"}}',
             '{"pet":{"kind":"dog"}}', '{"pet":{"kind":"cow","name":"x"}}']
    agrees(automaton, schema, texts)
    drawn_values_validate(automaton, schema)


@pytest.mark.parametrize("schema, says", [
    ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "'oneOf' whose alternatives this guest cannot"),
    ({"oneOf": [{"type": "object", "properties": {"t": {"const": 1}}},
                {"type": "object", "properties": {"t": {"const": 2}}}]}, "cannot prove apart"),  # t optional
    ({"oneOf": [{"enum": ["a", "b"]}, {"const": "b"}]}, "cannot prove apart"),
    ({"oneOf": [{"type": "string"}, {"const": "x"}]}, "cannot prove apart"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "keyword 'allOf (of more than one schema)'"),
    ({"allOf": [{"type": "integer"}], "maximum": 3}, "keyword 'maximum' beside 'allOf' at #"),
    ({"$ref": "#/$defs/s", "maxLength": 3, "$defs": {"s": {"type": "string"}}}, "'maxLength' beside '$ref'"),
    ({"oneOf": [{"type": "string"}], "anyOf": [{"type": "string"}]}, "'anyOf' beside 'oneOf'"),
])
def test_combinations_the_guest_cannot_keep_are_refused_by_name(automaton, schema, says):
    refusal = automaton.compile(schema)
    assert refusal is not None and says in refusal, refusal


# ---- through the guest: masks over the real vocabulary, whatever the logits ---------------------------

MASKED = {
    "bounds": {"type": "object", "properties": {"n": {"type": "integer", "minimum": -20, "maximum": 300},
                                                "x": {"type": "number", "exclusiveMinimum": 0, "maximum": 5},
                                                "k": {"type": "integer", "multipleOf": 7, "minimum": 10}},
               "required": ["n", "x", "k"]},
    "formats": {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                                 "t": {"type": "string", "format": "date-time"},
                                                 "u": {"type": "string", "format": "uuid"},
                                                 "c": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"}},
                "required": ["d", "t", "u", "c"]},
    "shapes": {"type": "object", "required": ["pair", "map"], "minProperties": 3, "properties": {
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "items": False,
                 "minItems": 2},
        "map": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
        "a": {"type": "null"}, "b": {"type": "null"}}},
    "set": {"type": "object", "required": ["tags", "few"], "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "a", "ab", 1, 12]},
                 "uniqueItems": True, "minItems": 4},
        "few": {"type": "array", "items": {"enum": [True, False, None]}, "uniqueItems": True}}},
}


@pytest.mark.parametrize("name", MASKED)
def test_the_guest_s_replies_validate_whatever_the_logits_even_near_max_tokens(automaton, tiny_engine, name):
    """A random model's logits favour nothing: the mask over real tokens (and need() near max_tokens)
    alone makes every reply valid, down to the tightest max_tokens that holds a value (the shortest value's
    bytes: a token is at least one)."""
    from floe.actor import grammar_actor, send_json
    from floe.engine import SamplingParams

    schema, check = MASKED[name], validator(MASKED[name])
    assert automaton.compile(schema) is None
    shortest = automaton.min_bytes()
    with grammar_actor(tiny_engine, seed=11) as actor:
        for max_tokens in (250, shortest + 20, shortest + 3, shortest):
            reply = send_json(actor, "x", schema, instruct=False, fresh=True, max_tokens=max_tokens,
                              params=SamplingParams(temperature=1.5))
            assert reply.reply.stats.generated_tokens <= max_tokens
            assert not [e.message for e in check.iter_errors(reply.value)], reply.text


# ---- hostile input: never a crash -----------------------------------------------------------------------

def test_random_patterns_and_bounds_compile_or_are_refused_never_trap(automaton):
    """Fragments of regex syntax and odd numbers thrown together: the compiler answers each (a trap would
    raise here), a refusal says what; what compiles, its drawn values validate with jsonschema."""
    rng = random.Random(43)
    pieces = ["a", "b", "\\d", "\\w", "\\s", ".", "[", "]", "[^a-c]", "(", ")", "(?:", "|", "*", "+", "?",
              "{2}", "{1,3}", "{,2}", "{", "}", "^", "$", "\\", "\\1", "(?=", "-", "x{1000}", "[a-", "\\x4",
              "\\u00e9", '"']
    for _ in range(400):
        pattern = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 10)))
        schema = {"type": "string", "pattern": pattern}
        refusal = automaton.compile(schema)
        if refusal is not None:
            assert refusal.strip(), pattern
            continue
        try:
            check = validator(schema)
            check.is_valid("")
        except Exception:  # Python's re refuses it: jsonschema cannot judge what the guest writes
            continue
        for seed in range(3):
            text = json.loads(automaton.sample(seed, soft=rng.randrange(0, 6)))
            assert check.is_valid(text), (pattern, text)
    numbers = ["0", "-0", "1e400", "-1e-400", "0.0000000000000001", "123456789012345678901234567890",
               "2.5e-3", "1E+2", "-999999999999999.5"]
    keywords = ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"]
    for _ in range(300):
        bounds = ", ".join(f'"{k}": {rng.choice(numbers)}' for k in rng.sample(keywords, 2))
        text = f'{{"type": "{rng.choice(["integer", "number"])}", {bounds}}}'
        refusal = automaton.compile(text)
        assert refusal is None or refusal.strip(), text
        if refusal is None and "e-400" not in text and "e400" not in text:  # floats jsonschema cannot hold
            check = validator(json.loads(text))
            for seed in range(3):
                assert check.is_valid(json.loads(automaton.sample(seed, soft=rng.randrange(0, 20)))), text
