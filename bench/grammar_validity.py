"""Issue 43's acceptance on sampled replies: N replies (temperature 1.0) to each of five schemas pydantic
writes for models that use its constrained types (ge/le/gt/lt, constr(pattern=…), datetime, date, UUID,
EmailStr, conlist(min_length, max_length), nested models), each masked by the grammar guest and then parsed
by the pydantic model itself (`model_validate_json`: what the OpenAI SDK's `parse` and LangChain's
`with_structured_output` do with a reply). The default model, native weights, on the CPU.

    python bench/grammar_validity.py [--replies 100] [--threads 2] [--max-tokens 200]

Prints per schema the replies, how many pydantic refused (and why, the first few) and how many did not
finish within --max-tokens (IncompleteJSON: a reply the guest could not close); writes
bench/results/grammar_validity_cpu.json. Needs pydantic and email-validator (EmailStr).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
import uuid
from pathlib import Path
from typing import Annotated

import torch
from pydantic import BaseModel, EmailStr, Field, ValidationError, conlist, constr
from smoke import results, shrink

from floe.actor import IncompleteJSON, grammar_actor, send_json
from floe.engine import Engine, SamplingParams
from floe.model import load_checkpoint

OUT = Path(__file__).parent / "results" / "grammar_validity_cpu.json"


class Booking(BaseModel):
    guests: Annotated[int, Field(ge=1, le=8)]
    arrival: datetime.date
    nights: Annotated[int, Field(gt=0, lt=30)]
    room: constr(pattern=r"^[A-D][0-9]{3}$")


class User(BaseModel):
    id: uuid.UUID
    email: EmailStr
    age: Annotated[int, Field(ge=13, le=120)]
    tags: conlist(constr(max_length=12), min_length=1, max_length=3)


class Item(BaseModel):
    sku: constr(pattern=r"^[A-Z]{2}-[0-9]{4}$")
    quantity: Annotated[int, Field(ge=1, le=99)]
    price: Annotated[float, Field(ge=0, le=10000)]


class Order(BaseModel):
    order_id: constr(pattern=r"^ORD-[0-9]{6}$")
    placed_at: datetime.datetime
    items: conlist(Item, min_length=1, max_length=4)


class Event(BaseModel):
    title: constr(min_length=1, max_length=60)
    starts: datetime.datetime
    capacity: Annotated[int, Field(gt=0, le=500)]
    organisers: conlist(EmailStr, min_length=1, max_length=2)


class Device(BaseModel):
    id: uuid.UUID
    firmware: constr(pattern=r"^v[0-9]+\.[0-9]+$")


class Reading(BaseModel):
    temperature: Annotated[float, Field(ge=-50, le=150)]
    at: datetime.datetime


class Sensor(BaseModel):
    device: Device
    readings: conlist(Reading, min_length=1, max_length=3)


MODELS = {
    "booking": (Booking, "Book a room for two guests arriving on the 3rd of March 2025 for four nights."),
    "user": (User, "Make up a user profile for a new member of a cycling club."),
    "order": (Order, "Record an order for two items placed yesterday afternoon."),
    "event": (Event, "Describe a small conference about rivers next spring."),
    "sensor": (Sensor, "Report two temperature readings from a greenhouse sensor."),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replies", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=200)
    args = shrink(ap.parse_args(), replies=1, max_tokens=32)
    torch.set_num_threads(args.threads)
    engine = Engine(load_checkpoint(), max_seq_len=2048, weights="native", n_slots=1)
    result = {"model": engine.checkpoint.name, "replies": args.replies, "max_tokens": args.max_tokens,
              "temperature": 1.0, "schemas": {}}
    for name, (model, prompt) in MODELS.items():
        schema, t0 = model.model_json_schema(), time.perf_counter()
        refused, unfinished, reasons = 0, 0, []
        with grammar_actor(engine, seed=1) as actor:
            for _ in range(args.replies):
                try:
                    reply = send_json(actor, prompt, schema, fresh=True, max_tokens=args.max_tokens,
                                      params=SamplingParams(temperature=1.0))
                except IncompleteJSON:
                    unfinished += 1
                    continue
                try:
                    model.model_validate_json(reply.text)
                except ValidationError as e:
                    refused += 1
                    if len(reasons) < 3:
                        reasons.append(f"{reply.text[:160]!r}: {e.errors()[0]['msg']}")
        result["schemas"][name] = {"replies": args.replies, "refused_by_pydantic": refused,
                                   "unfinished": unfinished, "reasons": reasons,
                                   "seconds": time.perf_counter() - t0}
        print(f"{name:8} {args.replies} replies: {refused} refused by pydantic, {unfinished} unfinished "
              f"within {args.max_tokens} tokens ({time.perf_counter() - t0:.0f} s)"
              + "".join(f"\n    {r}" for r in reasons), flush=True)
    out = results(OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
