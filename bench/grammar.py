"""What structured output costs: decode tokens/s with the grammar guest against the chat guest (its peer:
the same engine, prompt and reply length, no grammar), and the one-time costs (the vocabulary read
once per actor, each schema's compile and first masks, and a 200-property schema of issue 43's keywords
checked as floe serve checks a request's: compiled by a grammar actor without a KV slot).

    python bench/grammar.py [--repeats 3] [--threads 2] [--validity 100]

--validity N: also draws N sampled replies (temperature 1, top-p 0.95) to each schema's prompt and counts
those that do not validate (the tests draw 8; this is the full count, ~20 minutes on 2 cores).

Prints a table; writes bench/results/grammar_cpu.json. Figures are medians over repeats, the two guests
run alternately so that a change in the machine's load hits both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from smoke import SMOKE, results, shrink

from floe.actor import Actor, grammar_actor, send_json
from floe.actor.grammar import SchemaCheck, builtin_guest, instructed
from floe.engine import Engine, SamplingParams
from floe.model import load_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from test_grammar import PROMPTS, SCHEMAS, replies, valid  # noqa: E402  (the tests' five schemas)

OUT = Path(__file__).parent / "results" / "grammar_cpu.json"
# Issue 43's keywords as pydantic writes them (ge/le/gt, constr(pattern=…), UUID, EmailStr, date,
# conlist(min_length, max_length)): the bench's sixth schema.
KEYWORDS = {"type": "object", "properties": {
    "id": {"type": "string", "format": "uuid"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "email": {"type": "string", "format": "email"}, "born": {"type": "string", "format": "date"},
    "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}},
    "required": ["id", "age", "score", "email", "born", "code", "tags"]}


def wide_schema_check_ms(engine: Engine, properties: int = 200, repeats: int = 7) -> dict:
    """ms to check (compile) a schema of `properties` properties of issue 43's keywords (KEYWORDS' in
    turn), and an empty object's (the check's fixed part: the guest's state restored), median of
    `repeats` after one warm-up."""
    kinds = list(KEYWORDS["properties"].values())
    wide = {"type": "object", "properties": {f"p{i}": kinds[i % len(kinds)] for i in range(properties)},
            "required": [f"p{i}" for i in range(0, properties, 2)]}
    check = SchemaCheck(engine, builtin_guest("grammar"))
    out = {}
    for name, schema in (("empty", {"type": "object"}), (f"{properties} properties", wide)):
        assert check.refusal(schema, 4096) is None, name
        seconds = []
        for _ in range(repeats):
            t = time.perf_counter()
            check.refusal(schema, 4096)
            seconds.append(time.perf_counter() - t)
        out[name] = 1e3 * statistics.median(seconds)
    return out


def ms_per_token(stats) -> float:
    """Decode time per token (first streamed token to last), ms."""
    return 1e3 / stats.decode_tokens_per_s if stats.decode_tokens_per_s else float("nan")


def guest_ms_per_token(stats) -> float:
    """Time outside the engine (guest and host ABI) per generated token, ms."""
    return 1e3 * stats.outside_engine_s / max(1, stats.generated_tokens)


def walks(reply) -> int:
    line = next((line for line in reversed(reply.logs) if "mask walks" in line), "")
    return int(line.split("mask walks ")[1].split(",")[0]) if line else -1


def one_schema(engine: Engine, actor: Actor, name: str, schema: dict | None, repeats: int,
               max_tokens: int) -> dict:
    prompt = PROMPTS.get(name, "Make a customer record." if schema is KEYWORDS else "Describe your day.")
    started = time.perf_counter()
    cold = send_json(actor, prompt, schema, fresh=True, max_tokens=max_tokens).reply
    cold_s = time.perf_counter() - started
    grammar, chat, guest_grammar, guest_chat, tokens = [], [], [], [], []
    for _ in range(repeats):
        warm = send_json(actor, prompt, schema, fresh=True, max_tokens=max_tokens).reply
        n = warm.stats.generated_tokens
        with Actor(engine) as peer:  # the same user text, as many tokens, no grammar
            plain = peer.send(instructed(prompt, schema), max_tokens=n)
        grammar.append(ms_per_token(warm.stats))
        chat.append(ms_per_token(plain.stats))
        guest_grammar.append(guest_ms_per_token(warm.stats))
        guest_chat.append(guest_ms_per_token(plain.stats))
        tokens.append((n, plain.stats.generated_tokens))
        warm_s = warm.stats.wall_s
    g, c = statistics.median(grammar), statistics.median(chat)
    return {"schema": name, "tokens": tokens, "grammar_ms_per_token": round(g, 2),
            "chat_ms_per_token": round(c, 2),
            "slowdown_pct": round(100 * (g / c - 1), 1),
            "guest_ms_per_token": {"grammar": round(statistics.median(guest_grammar), 3),
                                   "chat": round(statistics.median(guest_chat), 3)},
            "first_reply_s": round(cold_s, 3), "warm_reply_s": round(warm_s, 3),
            "first_reply_mask_walks": walks(cold), "warm_reply_mask_walks": walks(warm)}


def vocabulary_read_s(engine: Engine) -> dict:
    """A fresh actor's first message (reads the vocabulary) against its second (does not), ms."""
    times = []
    with grammar_actor(engine) as actor:
        for _ in range(2):
            started = time.perf_counter()
            send_json(actor, "Yes or no?", {"type": "boolean"}, fresh=True, max_tokens=4)
            times.append(time.perf_counter() - started)
    return {"first_message_s": round(times[0], 3), "second_message_s": round(times[1], 3),
            "vocabulary_read_s": round(times[0] - times[1], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--validity", type=int, default=0, metavar="N",
                    help="sampled replies per schema to validate (0: none)")
    ap.add_argument("--max-tokens", type=int, default=160, help="a reply's most tokens")
    args = shrink(ap.parse_args(), repeats=1, max_tokens=64, validity=min(ap.parse_args().validity, 1))
    torch.set_num_threads(args.threads)
    engine = Engine(load_checkpoint(), max_seq_len=2048, weights="native", n_slots=2)
    result = {"model": engine.checkpoint.name, "weights": engine.weights, "kernel": engine.native_kernel,
              "threads": args.threads, "vocabulary": vocabulary_read_s(engine), "schemas": []}
    with grammar_actor(engine) as actor:
        schemas = [*SCHEMAS.items(), ("new keywords", KEYWORDS), ("plain JSON", None)]
        for name, schema in schemas[:1] + schemas[-1:] if SMOKE else schemas:
            result["schemas"].append(one_schema(engine, actor, name, schema, args.repeats, args.max_tokens))
    print(f"{engine.checkpoint.name}, {engine.weights} weights ({engine.native_kernel}), "
          f"{args.threads} threads; vocabulary read once per actor: "
          f"{result['vocabulary']['vocabulary_read_s'] * 1e3:.0f} ms")
    print(f"{'schema':16} {'tokens':>7} {'chat ms/tok':>12} {'grammar ms/tok':>15} {'slower':>7} "
          f"{'guest ms/tok':>13} {'1st reply s':>12} {'warm s':>7} {'walks 1st/warm':>15}")
    for r in result["schemas"]:
        print(f"{r['schema']:16} {r['tokens'][0][0]:>7} {r['chat_ms_per_token']:>12.2f} "
              f"{r['grammar_ms_per_token']:>15.2f} {r['slowdown_pct']:>6.1f}% "
              f"{r['guest_ms_per_token']['grammar']:>6.3f}/{r['guest_ms_per_token']['chat']:<6.3f} "
              f"{r['first_reply_s']:>12.3f} {r['warm_reply_s']:>7.3f} "
              f"{r['first_reply_mask_walks']:>7}/{r['warm_reply_mask_walks']:<7}")
    result["schema_check_ms"] = checked = wide_schema_check_ms(engine, 20 if SMOKE else 200)
    print("a schema checked as floe serve checks a request's (ms, median): "
          + ", ".join(f"{name} {ms:.2f}" for name, ms in checked.items()))
    if args.validity:
        result["validity"] = {}
        for name, schema in SCHEMAS.items():
            values = replies(engine, name, args.validity, SamplingParams(temperature=1.0, top_p=0.95),
                             seed=100)
            invalid = [v for v in values if not valid(v, schema)]
            result["validity"][name] = {"replies": len(values), "invalid": len(invalid)}
            print(f"{name:16} {len(values)} sampled replies, {len(invalid)} invalid", flush=True)
    out = results(OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
