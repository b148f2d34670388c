"""The WhatsApp Web engine over the wire (``channels/whatsapp_web/wire.py``) against the
fake account (``testing/fakes/whatsapp_web.py``): what the channel can rely on of both.

Testing manifesto: real websockets on 127.0.0.1, kernel ports; the real clock with short
intervals wherever sockets carry the timing (the QR rotation), the autojump clock where
only trio's own timers count (a call's deadline, the wait for a connection); every test
under a hard ``trio.fail_after`` (and conftest's deadline).  Absence (no ack yet) is
shown by a later call's answer: one socket, frames handled in order, so an ack sent
before that call would have been seen first.  A contract test keeps :class:`WireEngine`,
:class:`NeonizeEngine` and the :class:`WaEngine` protocol the same interface.
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio

from dshim.channels.whatsapp_web.engine import (
    Account,
    Connected,
    ConnectFailed,
    Disconnected,
    EngineEvent,
    Incoming,
    KeepAliveLost,
    LoggedOut,
    NeonizeEngine,
    Paired,
    QrCode,
    Quote,
    Replaced,
    WaEngine,
)
from dshim.channels.whatsapp_web.wire import CALL_DEADLINE_S, CONNECTION_WAIT_S, WireEngine
from dshim.errors import (
    ChannelError,
    ConfigError,
    NotFound,
    RateLimited,
    TransportError,
)
from dshim.testing.fakes.whatsapp_web import (
    ADA,
    DEFAULT_ACCOUNT,
    GROUP,
    OPS,
    FakeWhatsAppWeb,
    message_event,
    open_fake_whatsapp_web,
)

LIMIT_S = 15.0


@dataclass
class Rig:
    """One WireEngine with its connect loop and its events collected."""

    engine: WireEngine
    seen: list[EngineEvent] = field(default_factory=list)
    #: How each connect ended: None (returned) or the exception.
    ends: list[BaseException | None] = field(default_factory=list)
    _changed: trio.Event = field(default_factory=trio.Event)
    _taken: int = 0

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def collect(self) -> None:
        async for event in self.engine.events():
            self.seen.append(event)
            self._wake()

    async def connect(self) -> None:
        try:
            await self.engine.connect()
        except TransportError as exc:
            self.ends.append(exc)
        else:
            self.ends.append(None)
        self._wake()

    async def wait_for(self, kind: type[Any], *, after: int = 0) -> Any:
        """The first event of ``kind`` at index >= ``after``."""
        while True:
            for event in self.seen[after:]:
                if isinstance(event, kind):
                    return event
            await self._changed.wait()

    async def next_incoming(self) -> Incoming:
        """The next message not handed out yet by this method."""
        while True:
            found = [e for e in self.seen if isinstance(e, Incoming)]
            if len(found) > self._taken:
                self._taken += 1
                return found[self._taken - 1]
            await self._changed.wait()

    async def wait_ends(self, n: int) -> None:
        while len(self.ends) < n:
            await self._changed.wait()


@asynccontextmanager
async def rig_for(fake: FakeWhatsAppWeb, *, connect: bool = True) -> AsyncIterator[Rig]:
    rig = Rig(WireEngine(fake.url))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rig.collect)
        if connect:
            nursery.start_soon(rig.connect)
        yield rig
        with trio.move_on_after(2):
            await rig.engine.disconnect()  # a clean end, not a cancelled one
        rig.engine.close()
        nursery.cancel_scope.cancel()


async def reconnect(rig: Rig, nursery: trio.Nursery) -> int:
    """Connect again; the index in ``rig.seen`` from which the new connection's events are."""
    mark = len(rig.seen)
    nursery.start_soon(rig.connect)
    await rig.wait_for(Connected, after=mark)
    return mark


def raw_of(event: dict[str, Any]) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode()


# --- connecting ---------------------------------------------------------------------------


async def test_connect_gives_connected_and_me_and_disconnect_ends_it_cleanly() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake, rig_for(fake) as rig:
            await rig.wait_for(Connected)
            assert await rig.engine.me() == DEFAULT_ACCOUNT
            await rig.engine.disconnect()
            await rig.wait_ends(1)
            assert rig.ends == [None]
            assert [c.op for c in fake.calls] == ["me", "disconnect"]
            assert fake.live is None


async def test_a_socket_that_cannot_be_opened_is_a_transport_error_with_nothing_sent() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake:
            url = fake.url
        with pytest.raises(TransportError) as caught:
            await WireEngine(url).connect()  # the fake is gone: refused
        assert caught.value.request_sent is False
        async with open_fake_whatsapp_web() as fake:
            fake.fail_next("connect", status=503)
            with pytest.raises(TransportError) as rejected:
                await WireEngine(fake.url).connect()
            assert rejected.value.request_sent is False and rejected.value.status == 503
            fake.drop_next("connect")
            with pytest.raises(TransportError) as dropped:
                await WireEngine(fake.url).connect()  # opened, then lost
            assert dropped.value.request_sent is True


def test_an_engine_url_must_be_a_websocket_url() -> None:
    with pytest.raises(ConfigError):
        WireEngine("http://127.0.0.1:1/")


async def test_calls_without_a_connection_fail_fast_with_nothing_sent(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(60):
        engine = WireEngine("ws://127.0.0.1:9")
        started = trio.current_time()
        for call in (
            engine.me(),
            engine.send(ADA, "hi"),
            engine.presence(ADA, composing=True),
            engine.pair_phone("4915112345678"),
        ):
            with pytest.raises(TransportError) as caught:
                await call
            assert caught.value.request_sent is False and caught.value.status is None
        elapsed = trio.current_time() - started
        assert elapsed == pytest.approx(4 * CONNECTION_WAIT_S)
        await engine.disconnect()  # nothing to end: returns at once


async def test_a_call_waits_briefly_for_the_connection_being_made() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake, rig_for(fake, connect=False) as rig:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(rig.connect)
                assert await rig.engine.me() == DEFAULT_ACCOUNT  # sent once it is up
                await rig.engine.disconnect()


# --- messages and acks --------------------------------------------------------------------


async def test_a_message_is_acked_only_once_the_channel_took_it() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake, rig_for(fake) as rig:
            await rig.wait_for(Connected)
            event = message_event("hello there")
            mid = await fake.inject(event)
            incoming = await rig.next_incoming()
            assert incoming.raw == raw_of(event)  # byte for byte what NeonizeEngine gives
            assert json.loads(incoming.raw)["Info"]["ID"] == mid
            await rig.engine.me()  # answered after any ack the client had sent
            assert fake.acked == [] and fake.unacked == [mid]
            incoming.taken.set()
            await fake.wait_acked(mid)
            assert fake.unacked == []


async def test_unacked_messages_come_again_in_order_after_a_drop_and_acked_ones_never() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake, rig_for(fake) as rig:
            await rig.wait_for(Connected)
            first = await fake.inject(message_event("one"))
            second = await fake.inject(message_event("two"))
            third = await fake.inject(message_event("three"))
            took = await rig.next_incoming()
            took.taken.set()
            await fake.wait_acked(first)
            for _ in (second, third):
                await rig.next_incoming()  # seen, never taken
            await fake.drop_connection()
            await rig.wait_ends(1)
            assert isinstance(rig.ends[0], TransportError)  # lost mid-way: reconnect
            async with trio.open_nursery() as nursery:
                mark = await reconnect(rig, nursery)
                again = [await rig.next_incoming(), await rig.next_incoming()]
                assert [json.loads(i.raw)["Info"]["ID"] for i in again] == [second, third]
                assert all(rig.seen.index(i) > mark for i in again)
                for incoming in again:
                    incoming.taken.set()
                await fake.wait_until(lambda: not fake.unacked)
                assert fake.acked[0] == first and sorted(fake.acked) == sorted(
                    [first, second, third]
                )
                assert [d[0] for d in fake.deliveries] == [first, second, third, second, third]
                await rig.engine.disconnect()


async def test_a_message_injected_while_offline_arrives_at_the_next_connect() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake:
            mid = await fake.inject(message_event("while you were away"))
            async with rig_for(fake) as rig:
                incoming = await rig.next_incoming()
                connected = await rig.wait_for(Connected)
                assert rig.seen.index(connected) < rig.seen.index(incoming)
                incoming.taken.set()
                await fake.wait_acked(mid)


async def test_a_burst_larger_than_every_buffer_arrives_whole_and_in_order() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake, rig_for(fake) as rig:
            await rig.wait_for(Connected)
            ids = [await fake.inject(message_event(f"message {i}")) for i in range(600)]
            got = [await rig.next_incoming() for _ in ids]
            assert [json.loads(i.raw)["Info"]["ID"] for i in got] == ids
            assert await rig.engine.me() == DEFAULT_ACCOUNT  # answers still get through
            for incoming in got:
                incoming.taken.set()
            await fake.wait_until(lambda: len(fake.acked) == len(ids))


async def test_close_ends_the_events_and_lets_a_waiting_message_go_unacked() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake:
            engine = WireEngine(fake.url)
            got: list[EngineEvent] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.connect)

                async def read() -> None:
                    async for event in engine.events():
                        got.append(event)

                nursery.start_soon(read)
                mid = await fake.inject(message_event("hi"))
                await fake.wait_until(lambda: bool(fake.deliveries))
                await engine.me()  # the message frame came before this answer
                engine.close()
                incoming = next(e for e in got if isinstance(e, Incoming))
                incoming.taken.set()  # too late: released, never acked
                await engine.me()
                assert fake.acked == [] and fake.unacked == [mid]
                await engine.disconnect()
            # events() ended by itself (the nursery closed without cancelling it)


# --- calls --------------------------------------------------------------------------------


async def test_send_edit_presence_and_mark_read_are_recorded_with_their_arguments() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake, rig_for(fake) as rig:
            await rig.wait_for(Connected)
            engine = rig.engine
            plain = await engine.send(ADA, "first")
            quote = Quote("3EB0AAAABBBBCCCCDDDD", ADA, {"conversation": "the question"})
            quoted = await engine.send(GROUP, "an answer", quote=quote)
            assert re.fullmatch(r"3EB0[0-9A-F]{16}", plain) and plain != quoted
            await engine.edit(GROUP, quoted, "an answer, edited")
            await engine.presence(ADA, composing=True)
            await engine.presence(ADA, composing=False)
            await engine.mark_read(GROUP, ADA, ["3EB0X1", "3EB0X2"], timestamp=1_796_000_000)
            assert [(s.id, s.chat, s.text, s.quote) for s in fake.sent] == [
                (plain, ADA, "first", None),
                (
                    quoted,
                    GROUP,
                    "an answer",
                    {
                        "stanza_id": "3EB0AAAABBBBCCCCDDDD",
                        "participant": ADA,
                        "message": {"conversation": "the question"},
                    },
                ),
            ]
            assert fake.text_of(quoted) == "an answer, edited"
            assert fake.text_of(plain) == "first"
            assert fake.answers(GROUP) == ["an answer, edited"]
            assert [(e.chat, e.message_id, e.text) for e in fake.edits] == [
                (GROUP, quoted, "an answer, edited")
            ]
            assert [(p.chat, p.composing) for p in fake.presences] == [(ADA, True), (ADA, False)]
            [read] = fake.reads
            assert (read.chat, read.sender, read.ids, read.timestamp) == (
                GROUP,
                ADA,
                ("3EB0X1", "3EB0X2"),
                1_796_000_000,
            )
            assert [c.op for c in fake.calls] == [
                "send",
                "send",
                "edit",
                "presence",
                "presence",
                "mark_read",
            ]
            with pytest.raises(NotFound):
                await engine.edit(ADA, "3EB0NOTOURS0000000000", "x")


@pytest.mark.parametrize(
    ("fault", "error", "check"),
    [
        ({"status": 404}, NotFound, lambda e: e.status == 404),
        ({"status": 429, "retry_after": 7.5}, RateLimited, lambda e: e.retry_after == 7.5),
        (
            {"status": 503},
            TransportError,
            lambda e: e.status == 503 and not e.outcome_unknown,
        ),
        ({"status": 403, "kind": "refused"}, ChannelError, lambda e: e.status == 403),
        ({"kind": "unknown"}, TransportError, lambda e: e.outcome_unknown),
    ],
)
async def test_error_answers_map_to_dshim_errors_and_nothing_is_sent(
    fault: dict[str, Any], error: type[ChannelError], check: Any
) -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake, rig_for(fake) as rig:
            await rig.wait_for(Connected)
            fake.fail_next("send", **fault)
            with pytest.raises(error) as caught:
                await rig.engine.send(ADA, "hi")
            assert type(caught.value) is error and check(caught.value)
            assert fake.sent == []
            await rig.engine.send(ADA, "again")  # one shot only
            assert len(fake.sent) == 1


async def test_a_dropped_call_is_of_unknown_outcome_and_not_performed() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake, rig_for(fake) as rig:
            await rig.wait_for(Connected)
            fake.drop_next("send")
            with pytest.raises(TransportError) as caught:
                await rig.engine.send(ADA, "hi")
            assert caught.value.outcome_unknown
            assert fake.sent == []
            await rig.wait_ends(1)
            assert isinstance(rig.ends[0], TransportError)


async def test_a_lost_answer_is_of_unknown_outcome_and_the_send_was_performed() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake, rig_for(fake) as rig:
            await rig.wait_for(Connected)
            fake.lose_next("send")
            with pytest.raises(TransportError) as caught:
                await rig.engine.send(ADA, "hi")
            assert caught.value.outcome_unknown
            assert [s.text for s in fake.sent] == ["hi"]
            await rig.wait_ends(1)
            assert isinstance(rig.ends[0], TransportError)
            async with trio.open_nursery() as nursery:
                await reconnect(rig, nursery)
                fake.outage(60, "lost", ops=("presence",))
                with pytest.raises(TransportError) as lost:
                    await rig.engine.presence(ADA, composing=True)
                assert lost.value.outcome_unknown and len(fake.presences) == 1


async def test_a_call_past_its_deadline_is_of_unknown_outcome(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(120):
        async with open_fake_whatsapp_web() as fake, rig_for(fake) as rig:
            await rig.wait_for(Connected)
            fake.slow_next("send", CALL_DEADLINE_S + 10)
            started = trio.current_time()
            with pytest.raises(TransportError) as caught:
                await rig.engine.send(ADA, "slow")
            assert caught.value.outcome_unknown
            assert trio.current_time() - started == pytest.approx(CALL_DEADLINE_S, abs=0.5)
            await fake.wait_until(lambda: bool(fake.sent))  # it was carried out after all
            await rig.engine.disconnect()


async def test_download_answers_the_media_of_a_message() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake, rig_for(fake) as rig:
            await rig.wait_for(Connected)
            picture = bytes(range(256)) * 40
            mid = await fake.inject(message_event("look", image=True))
            fake.add_media(mid, picture)
            incoming = await rig.next_incoming()
            assert await rig.engine.download(incoming.raw, "imageMessage") == picture
            with pytest.raises(ChannelError, match="no documentMessage"):
                await rig.engine.download(incoming.raw, "documentMessage")
            other = await fake.inject(message_event("gone", document="report.pdf"))
            raw = (await rig.next_incoming()).raw
            assert json.loads(raw)["Info"]["ID"] == other
            with pytest.raises(NotFound):
                await rig.engine.download(raw, "documentMessage")
            fake.fail_next("download", status=503)
            with pytest.raises(TransportError):
                await rig.engine.download(incoming.raw, "imageMessage")


# --- the session's life -------------------------------------------------------------------


async def test_logged_out_from_the_phone_ends_the_connection_and_unpairs() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake, rig_for(fake) as rig:
            fake.qr_interval_s = 0.05
            await rig.wait_for(Connected)
            await fake.log_out("MAIN_DEVICE_GONE")
            out = await rig.wait_for(LoggedOut)
            assert out == LoggedOut(reason="MAIN_DEVICE_GONE", on_connect=False)
            await rig.wait_ends(1)
            assert rig.ends == [None]  # ended by WhatsApp: connect returns
            async with trio.open_nursery() as nursery:
                mark = len(rig.seen)
                nursery.start_soon(rig.connect)
                await rig.wait_for(QrCode, after=mark)
                assert await rig.engine.me() is None
                await rig.engine.disconnect()


async def test_logged_out_while_offline_is_said_at_the_next_connect() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake:
            await fake.log_out()
            async with rig_for(fake) as rig:
                assert await rig.wait_for(LoggedOut) == LoggedOut("LOGGED_OUT", on_connect=True)
                await rig.wait_ends(1)
                assert rig.ends == [None]


async def test_logout_unlinks_and_ends_the_connection() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake, rig_for(fake) as rig:
            await rig.wait_for(Connected)
            await rig.engine.logout()
            await rig.wait_ends(1)
            assert rig.ends == [None] and not fake.paired and fake.logouts == 1


async def test_replaced_by_another_client() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake, rig_for(fake) as rig:
            await rig.wait_for(Connected)
            await fake.replace()
            await rig.wait_for(Replaced)
            await rig.wait_ends(1)
            assert rig.ends == [None]
            async with trio.open_nursery() as nursery:
                await reconnect(rig, nursery)
                async with rig_for(fake) as second:  # the same keys, elsewhere
                    await second.wait_for(Connected)
                    await rig.wait_for(Replaced, after=2)
                    await rig.wait_ends(2)
                    assert rig.ends == [None, None]
                    await second.engine.disconnect()


async def test_other_lifecycle_events_pass_through() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web() as fake, rig_for(fake) as rig:
            await rig.wait_for(Connected)
            fake.push("keepalive_lost", errors=3)
            fake.push("disconnected")
            assert await rig.wait_for(KeepAliveLost) == KeepAliveLost(3)
            await rig.wait_for(Disconnected)
            fake.refuse_connects("TEMP_BANNED", "code 101")
            await fake.drop_connection()
            await rig.wait_ends(1)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(rig.connect)
                failed = await rig.wait_for(ConnectFailed)
                assert failed == ConnectFailed("TEMP_BANNED", "code 101")
                await rig.wait_ends(2)


async def test_an_unpaired_account_rotates_qr_codes_until_scanned() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web(paired=False) as fake:
            fake.qr_interval_s = 0.05
            async with rig_for(fake) as rig:
                while sum(isinstance(e, QrCode) for e in rig.seen) < 3:
                    await rig.wait_for(QrCode, after=len(rig.seen))
                codes = [e.code for e in rig.seen if isinstance(e, QrCode)]
                assert len(set(codes)) == len(codes) and all(c.startswith("2@") for c in codes)
                assert await rig.engine.me() is None
                mid = await fake.inject(message_event("waiting"))
                await fake.scan()
                assert await rig.wait_for(Paired) == Paired(
                    jid=DEFAULT_ACCOUNT.jid, name=DEFAULT_ACCOUNT.push_name
                )
                await rig.wait_for(Connected)
                incoming = await rig.next_incoming()
                assert json.loads(incoming.raw)["Info"]["ID"] == mid
                assert await rig.engine.me() == DEFAULT_ACCOUNT
                shown = len(fake.qr_codes)
                await rig.engine.send(ADA, "logged in")  # time passes, no new code
                assert len(fake.qr_codes) == shown


async def test_pair_phone_hands_out_a_code_while_unpaired() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web(paired=False) as fake, rig_for(fake) as rig:
            await rig.wait_for(QrCode)
            code = await rig.engine.pair_phone("4915112345678")
            assert re.fullmatch(r"[A-Z0-9]{4}-[A-Z0-9]{4}", code)
            assert fake.pair_phones == ["4915112345678"]
            with pytest.raises(TransportError) as not_in:
                await rig.engine.send(ADA, "too early")
            assert not not_in.value.outcome_unknown  # certainly not sent
            await fake.scan()
            await rig.wait_for(Connected)
            with pytest.raises(ChannelError, match="already paired"):
                await rig.engine.pair_phone("4915112345678")


# --- message_event builds what neonize would ------------------------------------------------


def test_message_event_is_what_message_to_dict_of_a_neonize_event_gives() -> None:
    from dshim.channels.whatsapp_web.engine import load_neonize

    pb = load_neonize("neonize.proto.Neonize_pb2")  # the test extra installs neonize
    from google.protobuf.json_format import MessageToDict, ParseDict

    events = [
        message_event("hi", timestamp=1_796_000_000_000),
        message_event(
            "@bot look",
            group=True,
            mentions=[DEFAULT_ACCOUNT.jid],
            quoted_id="3EB0AAAABBBBCCCCDDDD",
            quoted_participant=DEFAULT_ACCOUNT.lid,
            quoted_message={"conversation": "earlier"},
            forwarded=True,
        ),
        message_event("a caption", image=True),
        message_event(None, document="report.pdf"),
        message_event("mine", from_me=True, extended=True),
    ]
    for event in events:
        parsed = ParseDict(event, pb.Message())  # no unknown field
        assert MessageToDict(parsed, preserving_proto_field_name=True) == event


def test_message_event_maps_to_the_message_the_channel_expects() -> None:
    from dshim.channels.whatsapp_web.protocol import BotIdentity, map_event
    from dshim.model import InboundMessage, Skip

    me = BotIdentity(DEFAULT_ACCOUNT.jid, DEFAULT_ACCOUNT.lid, "dshim bot")

    def mapped(event: dict[str, Any]) -> InboundMessage:
        msg = map_event(raw_of(event), bot_id="bot:wa", me=me)
        assert isinstance(msg, InboundMessage), msg
        return msg

    direct = mapped(message_event("hello", message_id="3EB0C0FFEE"))
    assert (direct.content, direct.addressed, direct.message_id) == ("hello", True, "3EB0C0FFEE")
    assert not mapped(message_event("chatter", group=True)).addressed
    mention = mapped(message_event("@bot hi", group=True, mentions=[DEFAULT_ACCOUNT.lid]))
    assert mention.addressed
    reply = mapped(
        message_event(
            "and?",
            group=True,
            quoted_id="3EB0ANSWER",
            quoted_participant=DEFAULT_ACCOUNT.jid,
            quoted_message={"conversation": "an answer"},
        )
    )
    assert reply.addressed and reply.reply_to is not None
    assert reply.reply_to.message_id == "3EB0ANSWER"
    assert mapped(message_event("pic", image=True)).content == "pic"
    doc = mapped(message_event(None, document="report.pdf"))
    assert [f.name for f in doc.files] == ["report.pdf"]
    assert mapped(message_event("fwd", forwarded=True)).forwarded
    assert isinstance(map_event(raw_of(message_event("x", from_me=True)), bot_id="b", me=me), Skip)


# --- the fake as a process and the contract -----------------------------------------------


async def test_the_fake_runs_as_a_process_and_a_wire_engine_connects_to_it() -> None:
    with trio.fail_after(30):
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "dshim.testing.fakes.whatsapp_web", "--port", "0", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        try:
            assert proc.stdout is not None
            out = b""
            while not out.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(4096)
                assert chunk, out
                out += chunk
            url = json.loads(out)["engine_url"]
            assert url.startswith("ws://127.0.0.1:") and not url.endswith(":0")
            engine = WireEngine(url)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.connect)
                assert await engine.me() == Account(
                    DEFAULT_ACCOUNT.jid, DEFAULT_ACCOUNT.lid, DEFAULT_ACCOUNT.push_name
                )
                await engine.disconnect()
            proc.send_signal(2)
            assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


def _interface(cls: type) -> dict[str, tuple[bool, list[str]]]:
    """Public methods: whether async, and their parameter names."""
    out: dict[str, tuple[bool, list[str]]] = {}
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_"):
            continue
        params = list(inspect.signature(fn).parameters)
        is_async = inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)
        out[name] = (is_async and not inspect.isasyncgenfunction(fn), params)
    return out


def test_wire_engine_neonize_engine_and_the_protocol_offer_the_same_calls() -> None:
    protocol = _interface(WaEngine)
    assert {n for n, (a, _) in protocol.items() if a} >= {"connect", "send", "download"}
    assert _interface(WireEngine) == protocol
    assert _interface(NeonizeEngine) == protocol
    # The fake answers every call but connect (the socket itself).
    assert {n for n, (a, _) in protocol.items() if a} - {"connect"} == OPS


async def test_every_call_goes_over_the_wire_with_its_parameter_names() -> None:
    with trio.fail_after(LIMIT_S):
        async with open_fake_whatsapp_web(paired=False) as fake, rig_for(fake) as rig:
            engine = rig.engine
            await rig.wait_for(QrCode)
            await engine.me()
            await engine.pair_phone("4915112345678")
            await fake.scan()
            await fake.wait_connected()
            mid = await fake.inject(message_event("pic", image=True))
            fake.add_media(mid, b"jpeg")
            raw = (await rig.next_incoming()).raw
            await engine.send(ADA, "hi", quote=None)
            await engine.edit(ADA, fake.sent[0].id, "hi!")
            await engine.presence(ADA, composing=True)
            await engine.mark_read(ADA, ADA, [mid], timestamp=1)
            await engine.download(raw, "imageMessage")
            await engine.disconnect()
            await rig.wait_ends(1)
            async with trio.open_nursery() as nursery:
                await reconnect(rig, nursery)
                await engine.logout()
                await rig.wait_ends(2)
        params = {
            name: [p for p in inspect.signature(getattr(WaEngine, name)).parameters if p != "self"]
            for name in OPS
        }
        assert {c.op for c in fake.calls} == OPS
        for call in fake.calls:
            assert list(call.args) == params[call.op], call.op
