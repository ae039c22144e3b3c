"""A reply streamed as token ids (Actor.send's `tokens`, floe.actor.stream): the engine loop makes no
text per token, and what the stream holds is exactly the reply a send() with on_text gives — on_text
called in the loop's thread as the text is made (loop_safe), or handed to the caller's thread (which
makes the text from a TokenStream of the send's own), or no on_text (the text made once at the end)."""

import codecs
import threading
import time

import pytest
from guests_wat import v2_chooser

from floe.actor import Actor, EngineLoop
from floe.actor.stream import TokenStream, reply_bytes
from floe.engine import SamplingParams
from floe.errors import FloeError

GREEDY = SamplingParams(0.0)
PROMPTS = ["Hello there.", "Name a colour.", "What is two plus two?", "Tell me about owls."]


def streamed_text(stream: TokenStream, tokenizer, cuts: int = 3) -> str:
    """The stream's text as a reader makes it: in several increments, one incremental decoder."""
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    items, out, taken = list(stream.items), [], 0
    for end in [len(items) * k // cuts for k in range(1, cuts)] + [len(items)]:
        out.append(utf8.decode(reply_bytes(items[taken:end], tokenizer.reply_bytes)))
        taken = end
    return "".join(out) + utf8.decode(b"", final=True)


def three_ways(engine, guest, message: str, max_tokens: int, monkeypatch, **options) -> tuple[str, list[str]]:
    """The reply's text and on_text's pieces, the same whether on_text is called in the engine loop's
    thread (loop_safe: the text made there, token by token), handed to the caller's thread (its text
    made there from what each step streamed into the send's own TokenStream), or not given (the text
    made once at the end); and the same where the tokenizer's reply bytes are not all worked out
    (Tokenizer.reply_bytes_filled: no TokenStream of the send's own, the text made in the loop's thread)."""
    engine.tokenizer.fill_reply_bytes()
    out = []
    for filled in (True, False):
        if not filled:
            monkeypatch.setattr(type(engine.tokenizer), "reply_bytes_filled", property(lambda self: False))
        for way in ({"loop_safe": True}, {}, None):
            pieces, own = [], []
            with Actor(engine, guest, seed=1) as actor:
                def collect(piece: str, actor=actor, own=own, pieces=pieces) -> None:
                    own.append(actor.abi.tokens_to is not None)
                    pieces.append(piece)

                r = actor.send(message, max_tokens=max_tokens, **options,
                               **({"on_text": collect, **way} if way is not None else {}))
            if way is not None:  # (handed over, every reply's bytes known: the send's own stream)
                assert set(own) == {filled and way == {}}
            out.append((r.text, r.stats.token_ids, r.stats.finish_reason, None if way is None else pieces))
    for other in out:
        assert other[:3] == out[0][:3] and other[3] in (None, out[0][3])
    assert "".join(out[0][3]) == out[0][0]
    return out[0][0], out[0][3]


def test_concurrent_streams_of_ids_hold_exactly_the_replies_text_and_tokens(tiny_engine):
    """Several actors at once through one loop, each streaming ids: each reply (text, tokens, finish)
    equals that actor's reply with on_text, and its stream's items are its tokens, in order."""
    loop = EngineLoop(tiny_engine)
    tiny_engine.tokenizer.fill_reply_bytes()  # (as a server's warm-up: an on_text's send streams ids too)
    expected = []
    for i, prompt in enumerate(PROMPTS):
        ways = []
        for way in ({"loop_safe": True}, {}, None):  # on_text in the loop's thread, handed over, none
            pieces = []
            with Actor(tiny_engine, loop=loop, seed=i) as actor:
                r = actor.send(prompt, max_tokens=24, params=GREEDY,
                               **({"on_text": pieces.append, **way} if way is not None else {}))
            ways.append((r.text, r.stats.token_ids, r.stats.finish_reason, pieces))
            if way is not None:
                assert "".join(pieces) == r.text and len(pieces) > 3  # (a piece a token, not one at the end)
        assert ways[0] == ways[1] and ways[2][:3] == ways[0][:3]
        expected.append(ways[0][:3])
    out = [None] * len(PROMPTS)
    start = threading.Barrier(len(PROMPTS))

    def work(i):
        stream = TokenStream()
        with Actor(tiny_engine, loop=loop, seed=i) as actor:
            start.wait()
            r = actor.send(PROMPTS[i], max_tokens=24, params=GREEDY, tokens=stream)
        out[i] = (r, stream)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for (r, stream), (text, tokens, finish) in zip(out, expected, strict=True):
        assert (r.text, r.stats.token_ids, r.stats.finish_reason) == (text, tokens, finish)
        assert stream.items == tokens and streamed_text(stream, tiny_engine.tokenizer) == text
        assert r.stats.ttft_s > 0  # (its first text's time is kept as a text reply's)


def test_emitted_bytes_and_streamed_tokens_keep_their_order(tiny_engine, monkeypatch):
    """A guest that emits "|" before each token it streams: the stream holds b"|" and each token, in
    order, and its text is the text a send() with on_text gives."""
    guest = v2_chooser(choice=True, stream=True, on_token_first=(
        "(i32.store8 (i32.const 300) (i32.const 124))(drop (call $emit (i32.const 300) (i32.const 1)))"))
    text, pieces = three_ways(tiny_engine, guest, "x", 6, monkeypatch, params=GREEDY)
    assert text.startswith("|") and text.count("|") >= 6
    stream = TokenStream()
    with Actor(tiny_engine, guest, seed=1) as actor:
        r = actor.send("x", max_tokens=6, params=GREEDY, tokens=stream)
    assert r.text == text == "".join(pieces)
    assert stream.items[0::2] == [b"|"] * len(stream.items[0::2])
    assert all(isinstance(t, int) for t in stream.items[1::2])
    assert streamed_text(stream, tiny_engine.tokenizer) == text


def test_a_character_split_across_tokens_and_special_tokens_decode_as_text_does(tiny_engine, monkeypatch):
    """Tokens of single bytes that make "é" only together, then a special token (no reply text):
    the stream's reader and the reply make the same text as on_text does."""
    tok = tiny_engine.tokenizer
    by_bytes = {tok.token_bytes(i): i for i in range(tok.vocab_size)}
    first, second = by_bytes[b"\xc3"], by_bytes[b"\xa9"]
    special = tok.backend.token_to_id("<|im_start|>")
    sequence = [first, second, special, first, second]
    body = "".join(f"(if (i32.eq (global.get $n) (i32.const {k + 1})) (then (return (i32.const {t}))))"
                   for k, t in enumerate(sequence))
    guest = v2_chooser(choice=False, stream=True, counter=True, on_token_first=(
        "(global.set $n (i32.add (global.get $n) (i32.const 1)))" + body + "(return (i32.const -1))"))
    text, pieces = three_ways(tiny_engine, guest, "x", 8, monkeypatch)
    stream = TokenStream()
    with Actor(tiny_engine, guest) as actor:
        r = actor.send("x", max_tokens=8, tokens=stream)
    assert text == r.text == "éé" == "".join(pieces)
    assert stream.items == sequence and streamed_text(stream, tok, cuts=5) == "éé"


def test_a_stopped_stream_ends_its_message_and_the_actor_goes_on(tiny_engine):
    """stop() from another thread (a client that left) ends the message at its next token; a stream
    stopped before its message starts ends it at once; the actor answers its next message."""
    never_stops = v2_chooser(choice=True, stream=True, on_token_first="(return (i32.const 5))")
    with Actor(tiny_engine, never_stops, loop=EngineLoop(tiny_engine)) as actor:
        stream = TokenStream()

        def stop_once_streaming() -> None:  # (not a timer: a fast machine decoded the whole reply first)
            while len(stream.items) < 3:
                time.sleep(0.0005)
            stream.stop()

        stopper = threading.Thread(target=stop_once_streaming, daemon=True)
        stopper.start()
        r = actor.send("x", max_tokens=tiny_engine.max_seq_len - 8, tokens=stream)
        stopper.join(5)
        assert r.stats.finish_reason == "cancelled" and 0 < len(stream.items) < tiny_engine.max_seq_len - 8
        early = TokenStream()
        early.stop()
        r = actor.send("x", max_tokens=50, tokens=early)
        assert r.stats.finish_reason == "cancelled" and len(early.items) <= 1
        assert actor.send("x", max_tokens=3).stats.generated_tokens == 3


def test_a_reply_streams_as_tokens_or_as_text_not_both(tiny_engine):
    with Actor(tiny_engine) as actor:
        with pytest.raises(FloeError, match="no on_text"):
            actor.send("x", max_tokens=2, on_text=print, tokens=TokenStream())


def ids_streamed(engine, monkeypatch, native: bool) -> tuple[list, list[int], EngineLoop]:
    """PROMPTS[:2] streamed as ids through a loop, natively or row by row: each reply's text, tokens,
    stream, counts of streamed tokens and of those with text, budget spent and finish; the tokens
    Python's stream() saw."""
    from floe.actor.abi import HostABI
    from floe.actor.turn import Turn
    from floe.wasm import rows as guest_rows

    streamed, spent = [], []
    with monkeypatch.context() as m:
        stream_fn, settle = HostABI.stream, Turn.settle
        m.setattr(HostABI, "stream", lambda abi, token: (streamed.append(token), stream_fn(abi, token)))
        m.setattr(Turn, "settle", lambda turn: (settle(turn), spent.append(turn.abi.budget.spent)))
        if not native:
            m.setattr(guest_rows, "usable", lambda guests: False)
        loop, out = EngineLoop(engine), []
        for i, prompt in enumerate(PROMPTS[:2]):
            stream = TokenStream()
            with Actor(engine, loop=loop, seed=i) as actor:
                r = actor.send(prompt, max_tokens=20, params=GREEDY, tokens=stream)
            s = r.stats
            out.append((r.text, s.token_ids, stream.items, s.emit_calls, s.emits, spent[-1], s.finish_reason))
            assert 0 < s.started < s.first_text <= s.last_text <= time.perf_counter()
    return out, streamed, loop


def test_ids_taken_natively_count_as_pythons_stream_counts_them(tiny_engine, monkeypatch):
    """The engine loop's native calls take a plain token into the turn's decoded ids and its reply's
    stream without Python (floe.wasm.rows): the reply, its tokens, its stream, the counts of its
    streamed tokens and their text, its budget's charge and its times are those of the row-by-row path,
    and Python's stream() runs only for the tokens that are not plain (the last, at max_tokens)."""
    rows, row_streamed, row_loop = ids_streamed(tiny_engine, monkeypatch, native=False)
    assert row_loop.native_calls == 0 and len(row_streamed) == sum(len(r[1]) for r in rows)
    native, streamed, loop = ids_streamed(tiny_engine, monkeypatch, native=True)
    if loop.native_calls == 0:
        pytest.skip("no native loop here")
    assert native == rows and len(streamed) <= len(rows)  # (each reply's last token, if any)


def test_a_turns_decoded_ids_grow_past_their_room_and_the_row_points_at_the_new_buffer(tiny_engine):
    """Turn.decode (the Python path) past the buffer's room (never reached by the context's bound):
    the ids grow, the row's words name the new buffer and its room, and settle() hands them all over."""
    from floe.actor.turn import Turn
    from floe.wasm.rows import Col

    with Actor(tiny_engine) as actor:
        turn = Turn(actor, max_tokens=2, deadline=time.monotonic() + 60)
        room = len(turn.decoded)
        for token in range(room + 4):
            turn.decode(token)
        row = turn._row
        assert len(turn.decoded) > room and row[Col.DECODED_CAP] == len(turn.decoded)
        assert row[Col.DECODED_AT] == turn.decoded.ctypes.data and row[Col.N_DECODED] == room + 4
        turn.settle()
        assert actor.stats.decoded == list(range(room + 4)) and row[Col.N_DECODED] == 0


def test_a_stop_asked_before_its_turn_arrives_ends_it_while_other_turns_run(tiny_engine, monkeypatch):
    """A client that leaves while its message arrives (after on_message, before the loop has its turn)
    pokes the loop while other turns step, which may look before the turn is there: its arrival is
    looked at too (it ends at once, not at max_tokens)."""
    never_stops = v2_chooser(choice=True, stream=True, on_token_first="(return (i32.const 5))")
    loop = EngineLoop(tiny_engine)
    run = EngineLoop.run

    def leaving(self, actor, *args, **kwargs):
        actor.stop_requested = True  # (pokes the loop)
        time.sleep(0.05)  # the busy turn's steps look now, before this one is in the loop
        return run(self, actor, *args, **kwargs)

    with Actor(tiny_engine, never_stops, loop=loop) as busy, \
            Actor(tiny_engine, never_stops, loop=loop) as late:
        done = threading.Event()

        def keep_busy() -> None:  # (one message after another: the loop steps throughout)
            while not done.is_set():
                busy.send("x", max_tokens=tiny_engine.max_seq_len // 2, tokens=TokenStream())

        thread = threading.Thread(target=keep_busy)
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while loop.steps < 8:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with monkeypatch.context() as m:
                m.setattr(EngineLoop, "run", leaving)
                steps = loop.steps
                r = late.send("x", max_tokens=200, tokens=TokenStream())
            assert r.stats.finish_reason == "cancelled" and r.stats.generated_tokens <= 1
            assert loop.steps > steps  # (the busy turn stepped while this one was arriving)
        finally:
            done.set()
            thread.join()


def test_a_handed_over_reply_comes_piece_by_piece_while_its_turn_runs(tiny_engine):
    """on_text handed over from the send's own TokenStream: the loop wakes the caller at the steps that
    streamed, not only at the turn's end — its first piece comes while most of the reply is still to be
    decoded, a piece a token."""
    tok = tiny_engine.tokenizer
    tok.fill_reply_bytes()
    word = next(i for i in range(256, tok.vocab_size) if tok.reply_bytes(i).isalpha())  # (text of its own)
    streamed_at_first = []
    never_stops = v2_chooser(choice=True, stream=True, on_token_first=f"(return (i32.const {word}))")
    with Actor(tiny_engine, never_stops, loop=EngineLoop(tiny_engine)) as actor:
        def first(piece: str) -> None:
            if not streamed_at_first:
                streamed_at_first.append(int(actor.abi.tokens_to.count[0]))

        r = actor.send("x", max_tokens=200, on_text=first)
    assert r.stats.generated_tokens == 200 and streamed_at_first[0] < 100


def test_reply_bytes_are_worked_out_for_a_loop_with_several_turns_not_for_one(tiny_engine, monkeypatch):
    """A send whose tokenizer has not worked out every token's reply bytes makes its text in the loop's
    thread; where the loop runs other turns meanwhile it has them worked out in a thread of their own
    (floe.actor.reply_text.fill_later), once, for the sends after it; a send alone (`floe run`) does not."""
    import floe.actor.actor as actor_module
    from floe.actor.reply_text import fill_later

    asked = []
    monkeypatch.setattr(type(tiny_engine.tokenizer), "reply_bytes_filled", property(lambda self: False))
    monkeypatch.setattr(actor_module, "fill_later", asked.append)
    loop = EngineLoop(tiny_engine)
    with Actor(tiny_engine, loop=loop) as alone:
        alone.send(PROMPTS[0], max_tokens=4)
    assert asked == []
    never_stops = v2_chooser(choice=True, stream=True, on_token_first="(return (i32.const 5))")
    stream = TokenStream()
    with Actor(tiny_engine, never_stops, loop=loop) as long, Actor(tiny_engine, loop=loop) as second:
        most = tiny_engine.max_seq_len - 8
        t = threading.Thread(target=lambda: long.send("x", max_tokens=most, tokens=stream))
        t.start()
        while len(stream.items) < 2:  # (the long turn runs: stopped below)
            time.sleep(0.001)
        second.send(PROMPTS[1], max_tokens=4)
        stream.stop()
        t.join()
    assert asked == [tiny_engine.tokenizer]
    monkeypatch.undo()
    tokenizer = tiny_engine.tokenizer
    fill_later(tokenizer)  # (a thread of its own; nothing more where it is filled or being filled)
    deadline = time.monotonic() + 10
    while not tokenizer.reply_bytes_filled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tokenizer.reply_bytes_filled
