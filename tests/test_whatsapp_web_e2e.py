"""End to end: ``dshim serve``'s own code path against the fake WhatsApp Web account.

Testing manifesto: the bot runs through :func:`dshim.serve.serve_bots` -- supervisor,
channel, the wire engine, pipeline, SQLite store, renderer -- against
:mod:`dshim.testing.fakes.whatsapp_web` on 127.0.0.1 (a websocket at the engine
boundary), with the echo harness, on trio's autojump clock, with a hard virtual
deadline.  Assertions are about what the chat shows, what the account did (read
receipts, presence, edits) and what the agent receives.  The shared scenarios
(``tests/channel_contract.py``) hold the streamed answer, the quote block, the dropped
connection, the 429 storm, the restart and the bad credential; these add what is
WhatsApp Web's own.
"""

from __future__ import annotations

import base64
from pathlib import Path

import trio
from structlog.testing import capture_logs

from dshim.channels.whatsapp_web.render import LIMITS, MAX_TEXT
from dshim.model import ImagePart
from dshim.testing.fakes.whatsapp_web import (
    ADA,
    DEFAULT_ACCOUNT,
    GROUP,
    FakeWhatsAppWeb,
    message_event,
)
from tests.channel_contract import RecordingHarness, quote_block
from tests.rig_whatsapp_web import BOT_NUMBER, echo_of, whatsapp_web_bed

NOW_MS = 1_796_000_000_000


def answers(fake: FakeWhatsAppWeb, chat: str = ADA) -> list[str]:
    return fake.answers(chat)


async def test_a_dm_is_read_quoted_typed_and_streamed_by_paced_edits(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_web_bed(tmp_path) as (_, fake):
        mid = await fake.inject(message_event("echo:slow 12 tell me a story"))
        expected = echo_of("echo:slow 12 tell me a story")
        await fake.wait_until(lambda: expected in answers(fake))
        await trio.sleep(5)
    [sent] = fake.sent
    assert fake.text_of(sent.id) == expected
    # A reply: the user's message quoted with its sender and a snapshot of it.
    assert sent.quote == {
        "stanza_id": mid,
        "participant": ADA,
        "message": {"conversation": "echo:slow 12 tell me a story"},
    }
    # Blue ticks first, then "typing..." until the first text, "paused" at the end.
    [read] = fake.reads
    assert (read.chat, read.sender, read.ids) == (ADA, ADA, (mid,))
    assert read.at <= fake.presences[0].at
    composing = [p for p in fake.presences if p.composing]
    assert composing and composing[0].at <= sent.at
    assert fake.presences[-1].composing is False
    # Edits at most every 2 s, each a prefix of the answer, the final text once.
    edits = [e for e in fake.edits if e.message_id == sent.id]
    shown = [sent.text, *(e.text for e in edits)]
    assert len(shown) >= 3 and shown.count(expected) == 1 and shown[-1] == expected
    times = [sent.at, *(e.at for e in edits)]
    assert all(b - a >= 2.0 - 1e-6 for a, b in zip(times, times[1:], strict=False))


async def test_a_long_answer_stops_editing_at_twenty_and_splits_quoting_only_once(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    words = " ".join(f"word{i:04d}" for i in range(700))  # ~6,300 characters
    async with whatsapp_web_bed(tmp_path) as (_, fake):
        await fake.inject(message_event(f"echo:slow 80 {words}"))
        expected = echo_of(f"echo:slow 80 {words}")
        await fake.wait_until(lambda: "".join(answers(fake)).endswith(expected[-200:]))
        await trio.sleep(10)
    assert len(expected) > MAX_TEXT
    texts = answers(fake)
    assert texts == LIMITS.split(expected)
    assert [s.quote is not None for s in fake.sent] == [True] + [False] * (len(texts) - 1)
    assert len(fake.edits) <= 20


async def test_a_quote_of_an_image_reaches_the_agent_with_its_caption_and_kind(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    harness = RecordingHarness()
    async with whatsapp_web_bed(tmp_path, harness=harness) as (_, fake):
        event = message_event(
            "what does it say?",
            quoted_id="3EB0AAAA111122223333",
            quoted_participant="4915100000042@s.whatsapp.net",
            quoted_message={"imageMessage": {"caption": "the receipt", "mimetype": "image/jpeg"}},
        )
        await fake.inject(event)
        await fake.wait_until(lambda: len(answers(fake)) == 1)
    block = quote_block(
        messageId="3EB0AAAA111122223333",
        authorId="4915100000042",
        content="the receipt",
        attachments=[{"kind": "image"}],
    )
    assert harness.texts() == [echo_of("what does it say?", reply=block)]


async def test_an_image_is_downloaded_inside_the_turn(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    harness = RecordingHarness()
    png = base64.b64decode(
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
    )
    async with whatsapp_web_bed(tmp_path, harness=harness) as (_, fake):
        event = message_event(
            "what is this?", image=True, mimetype="image/png", file_length=len(png)
        )
        mid = event["Info"]["ID"]
        fake.add_media(mid, png)
        await fake.inject(event)
        await fake.wait_until(lambda: len(answers(fake)) == 1)
    [download] = fake.ops("download")
    assert download.args["field"] == "imageMessage"
    images = [p for p in harness.prompts[0] if isinstance(p, ImagePart)]
    assert [i.data for i in images] == [png]


async def test_group_messages_address_the_bot_by_mention_or_reply_only(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_web_bed(tmp_path) as (_, fake):
        await fake.inject(message_event("just chatting", group=True))
        await fake.inject(
            message_event(f"@{BOT_NUMBER} status?", group=True, mentions=[DEFAULT_ACCOUNT.jid])
        )
        await fake.wait_until(lambda: len(answers(fake, GROUP)) == 1)
        [first] = fake.sent
        await fake.inject(
            message_event(
                "and the rest?",
                group=True,
                quoted_id=first.id,
                quoted_participant=DEFAULT_ACCOUNT.lid,  # newer groups: the bot's LID
                quoted_message={"conversation": "..."},
            )
        )
        await fake.wait_until(lambda: len(answers(fake, GROUP)) == 2)
        await trio.sleep(5)
    assert [
        t.endswith(e)
        for t, e in zip(answers(fake, GROUP), ["status?", "and the rest?"], strict=True)
    ] == [True, True]


async def test_logged_out_from_the_phone_stops_the_bot_once_saying_to_log_in_again(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with capture_logs() as logs:
        async with whatsapp_web_bed(tmp_path) as (bot, fake):
            await fake.inject(message_event("hello"))
            await fake.wait_until(lambda: len(answers(fake)) == 1)
            await fake.log_out()
            with trio.fail_after(60):
                await bot.ended.wait()
            await trio.sleep(120)  # no reconnect loop
    assert bot.results == {"wa": "fatal"}
    [stopped] = [e for e in logs if e["event"] == "bot_stopped_fatal"]
    assert "logged this device out" in stopped["error"]
    assert "dshim login wa" in stopped["error"]
    assert len(fake.connections) == 1


async def test_another_client_taking_the_session_stops_the_bot_for_good(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with capture_logs() as logs:
        async with whatsapp_web_bed(tmp_path) as (bot, fake):
            await fake.replace()
            with trio.fail_after(60):
                await bot.ended.wait()
            await trio.sleep(120)
    assert bot.results == {"wa": "fatal"}
    [stopped] = [e for e in logs if e["event"] == "bot_stopped_fatal"]
    assert "another client connected with this WhatsApp session" in stopped["error"]
    assert len(fake.connections) == 1


async def test_a_temporary_ban_stops_the_bot_with_whatsapps_reason(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with capture_logs() as logs:
        async with whatsapp_web_bed(
            tmp_path,
            ready=False,
            configure=lambda f: f.refuse_connects("TEMP_BANNED", "SENT_TOO_MANY_SAME_MESSAGE"),
        ) as (bot, fake):
            with trio.fail_after(60):
                await bot.ended.wait()
    assert bot.results == {"wa": "fatal"}
    [stopped] = [e for e in logs if e["event"] == "bot_stopped_fatal"]
    assert "banned the account temporarily" in stopped["error"]
    assert "SENT_TOO_MANY_SAME_MESSAGE" in stopped["error"]


async def test_connects_that_fail_are_retried_with_backoff_until_the_bot_starts(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    def refuse(fake: FakeWhatsAppWeb) -> None:
        fake.fail_next("connect", 3, status=503)

    started = trio.current_time()
    with capture_logs() as logs:
        async with whatsapp_web_bed(tmp_path, configure=refuse) as (_, fake):
            await fake.inject(message_event("are you there?"))
            await fake.wait_until(lambda: len(answers(fake)) == 1)
    waits = [e["retry_in_s"] for e in logs if e["event"] == "connection_lost"]
    assert len(waits) == 3 and waits[0] < waits[1] < waits[2]  # 1, 2, 4 s with jitter
    assert fake.connections[0].opened_at - started >= sum(waits) - 0.01
    assert answers(fake) == [echo_of("are you there?")]


async def test_a_burst_across_dropped_connections_is_answered_once_each(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_web_bed(tmp_path) as (_, fake):
        for i in range(6):
            await fake.inject(
                message_event(f"message {i}", sender=f"491700000{i:03d}@s.whatsapp.net")
            )
            if i % 2 == 1:
                await fake.drop_connection()
        await fake.wait_until(
            lambda: all(fake.answers(f"491700000{i:03d}@s.whatsapp.net") for i in range(6))
        )
        await trio.sleep(30)
    for i in range(6):
        assert len(fake.answers(f"491700000{i:03d}@s.whatsapp.net")) == 1
    assert fake.unacked == []
    assert len(fake.connections) >= 2


async def test_an_edit_never_starts_a_turn_and_own_messages_are_not_prompts(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_web_bed(tmp_path) as (bot, fake):
        mid = await fake.inject(message_event("first version"))
        await fake.wait_until(lambda: len(answers(fake)) == 1)
        edit = message_event(
            None,
            message_id="3EB0EEEE000011112222",
        )
        edit["Info"]["Edit"] = "1"
        edit["Message"] = {
            "protocolMessage": {
                "key": {"ID": mid},
                "type": "MESSAGE_EDIT",
                "editedMessage": {"conversation": "second version"},
            }
        }
        await fake.inject(edit)
        await fake.inject(message_event("typed on the phone", from_me=True))
        await fake.wait_acked("3EB0EEEE000011112222")
        await trio.sleep(10)
    assert answers(fake) == [echo_of("first version")]
    assert sorted(bot.drop_reasons()) == ["echo", "ignored"]  # the phone's own; the edit
