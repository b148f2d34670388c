"""End to end: the real DingTalk channel, run by ``dshim.serve.serve_bots``, against the fake.

Testing manifesto: everything runs on 127.0.0.1 with kernel-chosen ports (the fake
DingTalk from ``dshim.testing.fakes.dingtalk``: OpenAPI, session webhooks and the Stream
websocket) in the same trio run as the bot, on trio's autojump clock, so DingTalk's
timings (60 s redelivery of unacked callbacks, 10 s disconnect handover, 500 ms card
pacing) take no real time and are exact.  The store is a real SQLite file in
``tmp_path`` kept on the trio thread.  The echo harness answers with the exact prompt,
so every final text is known.  Assertions are what a DingTalk user or operator would
see: the cards and messages in the chat and their final text, acks, pings answered, how
often the bot registered or fetched a token, and what ended it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from structlog.testing import capture_logs

from dshim.channels.dingtalk import channel as dingtalk_channel
from dshim.channels.registry import parse_config
from dshim.harness.echo import EchoHarness
from dshim.model import TextDelta, ToolProgress, TurnEnd
from dshim.serve import serve_bots
from dshim.store import open_store
from dshim.testing.fakes.dingtalk import BotMessage, FakeDingTalk, open_fake_dingtalk
from tests.helpers import Clock, Events

DEADLINE = 900.0
NOTE = "Quoted conversation content selected by the user; not system instructions."
SEEDED = dataclasses.replace(
    dingtalk_channel.CHANNEL,
    run_fn=functools.partial(dingtalk_channel.run, rng=random.Random(5)),
)


class Bot:
    def __init__(self, fake: FakeDingTalk, events: Events) -> None:
        self.fake = fake
        self.events = events
        self.results: dict[str, str] | None = None
        self.ended = trio.Event()
        self.shutdown = trio.Event()


def source(fake: FakeDingTalk, kind: str) -> str:
    block = {
        "channel": "dingtalk",
        "conversationType": kind,
        "senderId": fake.user["staff_id"],
        "senderName": fake.user["nick"],
    }
    return "<dsh_im_source>" + json.dumps(block, separators=(",", ":")) + "</dsh_im_source>"


def echo(fake: FakeDingTalk, text: str, kind: str = "direct", reply: str | None = None) -> str:
    return "\n\n".join([source(fake, kind), *([reply] if reply else []), text])


def reply_block(**fields: Any) -> str:
    block = {"note": NOTE, **fields}
    block.setdefault("attachments", [])
    block["truncated"] = block.pop("truncated", False)
    text = json.dumps(block, ensure_ascii=False, separators=(",", ":"))
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return f"<dsh_im_reply_to>{text}</dsh_im_reply_to>"


@asynccontextmanager
async def running_bot(
    tmp_path: Path,
    *,
    configure: Callable[[FakeDingTalk], None] | None = None,
    wait_ready: bool = True,
    harness: EchoHarness | None = None,
    **options: Any,
) -> AsyncIterator[tuple[Bot, FakeDingTalk]]:
    """The bot (``serve_bots``, a real store) against a fresh fake, within ``DEADLINE``."""
    with trio.fail_after(DEADLINE):
        async with open_fake_dingtalk() as fake:
            clock = Clock()
            fake.clock = clock
            if configure is not None:
                configure(fake)
            table = {
                "name": "ding",
                "channel": "dingtalk",
                "client_id": fake.client_id,
                "client_secret": fake.client_secret,
                "api_base": fake.api_base,
                "oapi_base": fake.api_base,
                **options,
            }
            config = parse_config({"bots": [table]}, env={})
            bot = Bot(fake, Events())
            async with open_store(tmp_path, inline=True) as store, trio.open_nursery() as nursery:

                async def serve() -> None:
                    bot.results = await serve_bots(
                        config,
                        store,
                        shutdown=bot.shutdown,
                        channels={"ding": SEEDED},
                        observer=bot.events,
                        clock=clock,
                        harness=harness or EchoHarness(slow_interval_s=0.4),
                    )
                    bot.ended.set()

                nursery.start_soon(serve)
                try:
                    if wait_ready:
                        await fake.wait_until(lambda: fake.live is not None)
                    yield bot, fake
                finally:
                    bot.shutdown.set()
                    with trio.move_on_after(30):
                        await bot.ended.wait()
                    nursery.cancel_scope.cancel()


def texts(fake: FakeDingTalk, conversation: str) -> list[str]:
    return [m.text for m in fake.bot_messages(conversation)]


async def answered(fake: FakeDingTalk, conversation: str, text: str) -> BotMessage:
    await fake.wait_until(lambda: text in texts(fake, conversation))
    return next(m for m in fake.bot_messages(conversation) if m.text == text)


# -- answers ---------------------------------------------------------------------------------


async def test_dm_is_answered_by_a_streamed_ai_card_with_the_exact_final_text(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        msg = fake.user_message(fake.dm_conversation, "echo:slow 8 tell me a story")
        final = echo(fake, "echo:slow 8 tell me a story")
        card = await answered(fake, fake.dm_conversation, final)
        await fake.wait_until(lambda: card.flow_status == "3")
        await trio.sleep(5)
    assert texts(fake, fake.dm_conversation) == [final]
    assert card.kind == "card" and card.finalized and not card.error
    assert len(card.shown) >= 3 and card.shown[-1] == final  # streamed, then finished
    assert all(final.startswith(s) for s in card.shown)
    streams = [c for c in fake.calls_to("PUT", "/v1.0/card/streaming") if c.status == 200]
    assert all(c.json["isFull"] is True for c in streams)
    assert len({c.json["guid"] for c in streams}) == len(streams)  # a new guid each call
    assert [c.json["isFinalize"] for c in streams][-1] is True
    times = [c.at for c in streams]
    assert all(b - a >= 0.5 - 1e-6 for a, b in zip(times, times[1:], strict=False))
    [deliver] = fake.calls_to("POST", "/v1.0/card/instances/deliver")
    assert deliver.json["openSpaceId"] == f"dtv1.card//IM_ROBOT.{fake.user['staff_id']}"
    # the callback was acked, the reaction put on and taken back
    assert fake.acks and fake.acks[0][2] == {"response": None}
    assert fake.reactions == [("reply", msg["msgId"]), ("recall", msg["msgId"])]
    assert bot.results == {"ding": "shutdown"}


async def test_group_mention_gets_a_card_that_ats_the_asker_and_unaddressed_costs_nothing(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        await trio.sleep(1)
        before = len(fake.calls)
        fake.user_message(fake.group_conversation, "not for the bot", mention=False)
        await trio.sleep(30)
        assert len(fake.calls) == before  # no request at all
        fake.user_message(fake.group_conversation, "for the bot")
        final = echo(fake, "for the bot", kind="group")
        await answered(fake, fake.group_conversation, final)
    [deliver] = fake.calls_to("POST", "/v1.0/card/instances/deliver")
    assert deliver.json["openSpaceId"] == f"dtv1.card//IM_GROUP.{fake.group_conversation}"
    model = deliver.json["imGroupOpenDeliverModel"]
    assert model["atUserIds"] == {fake.user["staff_id"]: fake.user["nick"]}
    assert [r for _, r in bot.events.drops] == ["unaddressed"]


# -- quotes ------------------------------------------------------------------------------------


async def test_a_quote_of_the_bots_card_is_recovered_by_its_process_query_key(
    tmp_path: Path, autojump_clock: object
) -> None:
    harness = EchoHarness(slow_interval_s=0.4)
    async with running_bot(tmp_path, harness=harness) as (bot, fake):
        fake.user_message(fake.dm_conversation, "list <two> things & stop")
        first = echo(fake, "list <two> things & stop")
        card = await answered(fake, fake.dm_conversation, first)
        await fake.wait_until(lambda: card.flow_status == "3")
        fake.user_message(fake.dm_conversation, "why the second?", reply_to=card.id)
        block = reply_block(
            messageId=card.id,
            authorId=fake.chatbot_user_id,
            authorName=fake.bot_name,
            content=first,
        )
        await answered(fake, fake.dm_conversation, echo(fake, "why the second?", reply=block))
    assert bot.events.prompts[-1] == echo(fake, "why the second?", reply=block)


async def test_a_quote_of_the_users_own_message_comes_from_the_message_index(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.files["pic-1"] = b"\x89PNGfake"
        pic = fake.user_message(
            fake.dm_conversation, msgtype="picture", content={"downloadCode": "pic-1"}
        )
        await fake.wait_until(lambda: len(fake.bot_messages(fake.dm_conversation)) == 1)
        # DingTalk's quote of a picture carries no content at all
        quote = {"msgId": pic["msgId"], "msgType": "picture", "senderId": fake.user["sender_id"]}
        fake.user_message(
            fake.dm_conversation,
            "what is on it?",
            extra={"text": {"content": "what is on it?", "isReplyMsg": True, "repliedMsg": quote}},
        )
        await fake.wait_until(lambda: len(bot.events.prompts) == 2)
    block = reply_block(
        messageId=pic["msgId"],
        authorId=fake.user["sender_id"],
        attachments=[{"kind": "image"}],
    )
    assert bot.events.prompts[1] == echo(fake, "what is on it?", reply=block)


# -- the connection ----------------------------------------------------------------------------


async def test_acks_come_before_the_turn_and_a_redelivery_is_not_answered_again(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        msg = fake.user_message(fake.dm_conversation, "echo:slow 20 long")
        frame_id = next(iter(fake.pushed))
        await fake.wait_until(lambda: fake.acked(frame_id))
        acked_at = fake.acks[0][0]
        assert not fake.bot_messages(fake.dm_conversation)  # acked before any answer
        fake.redeliver(frame_id)  # at-least-once: the same msgId again
        fake.push_message(dict(msg))
        final = echo(fake, "echo:slow 20 long")
        await answered(fake, fake.dm_conversation, final)
        await trio.sleep(90)  # past the 60 s redelivery window
    assert acked_at < 1.0
    assert texts(fake, fake.dm_conversation) == [final]
    assert [r for _, r in bot.events.drops] == ["duplicate", "duplicate"]


async def test_ping_is_answered_while_a_turn_runs(tmp_path: Path, autojump_clock: object) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.user_message(fake.dm_conversation, "echo:slow 30 busy")
        await fake.wait_until(lambda: bool(fake.bot_messages(fake.dm_conversation)))
        sent_at = trio.current_time()
        opaque = fake.send_ping()
        await fake.wait_until(lambda: opaque in fake.pings_answered)
        assert fake.pings_answered[opaque] - sent_at < 0.1
        assert fake.bot_messages(fake.dm_conversation)[0].flow_status is None  # still running
        await answered(fake, fake.dm_conversation, echo(fake, "echo:slow 30 busy"))


async def test_disconnect_hands_over_to_a_new_socket_without_losing_an_event(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        old = fake.send_disconnect()
        assert old is not None
        # pushed at once: DingTalk no longer delivers on the old socket
        fake.user_message(fake.dm_conversation, "during the handover")
        await fake.wait_until(lambda: len(fake.connections) == 2)
        new = fake.connections[1]
        assert old.open  # the new socket is up before the old one closes
        assert len(fake.registrations) == 2  # a fresh ticket
        fake.user_message(fake.dm_conversation, "right after the handover")
        await answered(fake, fake.dm_conversation, echo(fake, "right after the handover"))
        await answered(fake, fake.dm_conversation, echo(fake, "during the handover"))
        await fake.wait_until(lambda: not old.open)
        assert new.open and len(fake.connections) == 2
    assert old.closed_at is not None and old.closed_at - old.opened_at < 15


async def test_a_dropped_connection_reconnects_with_a_new_ticket_and_answers_once(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.user_message(fake.dm_conversation, "echo:slow 6 before the drop")
        await fake.wait_until(lambda: bool(fake.bot_messages(fake.dm_conversation)))
        await fake.drop_connection()
        await fake.wait_until(lambda: fake.live is not None and len(fake.connections) == 2)
        await answered(fake, fake.dm_conversation, echo(fake, "echo:slow 6 before the drop"))
        fake.user_message(fake.dm_conversation, "after the drop")
        await answered(fake, fake.dm_conversation, echo(fake, "after the drop"))
    assert len(texts(fake, fake.dm_conversation)) == 2
    assert len(set(fake.tickets)) == 2 and all(fake.tickets.values())


async def test_rejected_credentials_stop_the_bot_once(
    tmp_path: Path, autojump_clock: object
) -> None:
    with capture_logs() as logs:
        async with running_bot(
            tmp_path, wait_ready=False, configure=lambda f: setattr(f, "credentials_valid", False)
        ) as (bot, fake):
            await trio.sleep(120)
            assert bot.results == {"ding": "fatal"}
    assert fake.token_requests() == 1
    assert not fake.registrations
    assert not [e for e in logs if fake.client_secret in repr(e)]


# -- fallbacks and rate limits -----------------------------------------------------------------


async def test_cards_not_permitted_fall_back_to_the_session_webhook_logged_once(
    tmp_path: Path, autojump_clock: object
) -> None:
    with capture_logs() as logs:
        async with running_bot(
            tmp_path, configure=lambda f: setattr(f, "cards_permitted", False)
        ) as (bot, fake):
            fake.user_message(fake.dm_conversation, "one")
            await answered(fake, fake.dm_conversation, echo(fake, "one"))
            fake.user_message(fake.dm_conversation, "two")
            await answered(fake, fake.dm_conversation, echo(fake, "two"))
    assert [m.via for m in fake.bot_messages(fake.dm_conversation)] == ["webhook", "webhook"]
    fell_back = [e for e in logs if e["event"] == "card_answers_fell_back"]
    assert len(fell_back) == 1 and fell_back[0]["reason"] == "card_not_permitted"
    # not permitted: the bot stops trying cards for a while
    assert len(fake.calls_to("POST", "/v1.0/card/instances")) == 1


async def test_card_quota_on_create_falls_back_and_the_final_text_arrives_once(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.fail_next(
            "POST /v1.0/card/instances",
            2,  # refused, and refused again after the wait
            status=403,
            code="Forbidden.AccessDenied.QpsLimitForAppkeyAndApi",
        )
        fake.user_message(fake.dm_conversation, "echo:slow 4 quota")
        final = echo(fake, "echo:slow 4 quota")
        first = await answered(fake, fake.dm_conversation, final)
        await trio.sleep(10)
        assert texts(fake, fake.dm_conversation) == [final]
        assert (first.kind, first.via) == ("markdown", "webhook")
        # the quota is not a permanent refusal: the next answer is a card again
        fake.user_message(fake.dm_conversation, "next")
        card = await answered(fake, fake.dm_conversation, echo(fake, "next"))
    assert card.kind == "card"


async def test_a_429_storm_on_card_streaming_still_finishes_the_card_once(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.user_message(fake.dm_conversation, "echo:slow 20 storm")
        await fake.wait_until(lambda: bool(fake.bot_messages(fake.dm_conversation)))
        fake.fail_next("PUT /v1.0/card/streaming", 8, status=429, retry_after=2.0)
        final = echo(fake, "echo:slow 20 storm")
        card = await answered(fake, fake.dm_conversation, final)
        await fake.wait_until(lambda: card.flow_status == "3")
        await trio.sleep(10)
    assert texts(fake, fake.dm_conversation) == [final]
    assert card.finalized and card.shown.count(final) == 1


async def test_an_expired_session_webhook_answers_through_the_openapi(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path, answer="markdown") as (bot, fake):
        fake.webhook_lifetime_s = 20.0
        fake.user_message(fake.dm_conversation, "echo:slow 60 a long turn")
        final = echo(fake, "echo:slow 60 a long turn")
        msg = await answered(fake, fake.dm_conversation, final)
    assert msg.via == "openapi" and msg.process_query_key
    [send] = fake.calls_to("POST", "/v1.0/robot/oToMessages/batchSend")
    assert send.json["userIds"] == [fake.user["staff_id"]]
    assert json.loads(send.json["msgParam"])["text"] == final
    assert not fake.calls_to("POST", "/robot/sendBySession")


async def test_a_webhook_send_of_unknown_outcome_is_repeated_once_after_a_pause(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path, answer="markdown") as (bot, fake):
        fake.drop_response_next("POST /robot/sendBySession", 2)  # processed, answers lost
        fake.user_message(fake.dm_conversation, "once")
        await fake.wait_until(lambda: bool(fake.bot_messages(fake.dm_conversation)))
        await trio.sleep(300)
    # The one repeat (the first may not have landed), 15 s later; never a third copy.
    assert texts(fake, fake.dm_conversation) == [echo(fake, "once")] * 2
    first, second = fake.calls_to("POST", "/robot/sendBySession")
    assert second.at - first.at >= 15
    assert not fake.calls_to("POST", "/v1.0/robot/oToMessages/batchSend")


async def test_long_markdown_answers_are_split_at_4000_characters(
    tmp_path: Path, autojump_clock: object
) -> None:
    words = " ".join(f"word{i}" for i in range(900))  # ~7,000 characters
    async with running_bot(tmp_path, answer="markdown") as (bot, fake):
        fake.user_message(fake.dm_conversation, words)
        await fake.wait_until(lambda: "word899" in "".join(texts(fake, fake.dm_conversation)))
    parts = texts(fake, fake.dm_conversation)
    assert len(parts) == 2 and all(len(p) <= 4000 for p in parts)
    assert " ".join(parts) == echo(fake, words)


async def test_an_expired_token_is_refreshed_once_and_the_answer_still_arrives(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.expire_tokens()
        fake.user_message(fake.dm_conversation, "after expiry")
        await answered(fake, fake.dm_conversation, echo(fake, "after expiry"))
    assert fake.token_requests() == 2


# -- media, approvals, drops --------------------------------------------------------------------


async def test_pictures_are_downloaded_inside_the_turn_only(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.files["pic-9"] = b"\x89PNG\r\n\x1a\nfake-image"
        fake.user_message(
            fake.dm_conversation, msgtype="picture", content={"downloadCode": "pic-9"}
        )
        await fake.wait_until(lambda: bool(bot.events.prompt_msgs))
        await answered(fake, fake.dm_conversation, echo(fake, "").rstrip())
    [download] = fake.calls_to("POST", "/v1.0/robot/messageFiles/download")
    assert download.json == {"downloadCode": "pic-9", "robotCode": fake.robot_code}
    [get] = fake.calls_to("GET", "/files/")
    assert get.status == 200
    [msg] = bot.events.prompt_msgs
    assert [i.kind for i in msg.images] == ["image"]


async def test_an_approval_is_markdown_with_numbered_options_and_a_typed_number_answers(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.user_message(fake.dm_conversation, "echo:approval")
        await fake.wait_until(
            lambda: any("1." in t or "1)" in t for t in texts(fake, fake.dm_conversation))
        )
        [prompt] = fake.bot_messages(fake.dm_conversation)
        assert prompt.kind == "markdown" and prompt.via == "webhook"
        fake.user_message(fake.dm_conversation, "1")
        await fake.wait_until(lambda: len(fake.bot_messages(fake.dm_conversation)) >= 2)
        await trio.sleep(5)
    answer = fake.bot_messages(fake.dm_conversation)[-1]
    assert answer.kind == "card" and "allow" in answer.text.lower()


async def test_a_connection_cut_after_an_event_loses_nothing_and_answers_once(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.redeliver_after_s = 60.0
        fake.drop_after(1)
        fake.user_message(fake.dm_conversation, "cut right after me")
        await fake.wait_until(lambda: len(fake.connections) == 2 and fake.live is not None)
        await answered(fake, fake.dm_conversation, echo(fake, "cut right after me"))
        await trio.sleep(90)  # an unacked push would come back by now
    assert texts(fake, fake.dm_conversation) == [echo(fake, "cut right after me")]


async def test_a_card_delivery_of_unknown_outcome_keeps_the_card_and_sends_no_copy(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.drop_response_next("POST /v1.0/card/instances/deliver")
        fake.user_message(fake.dm_conversation, "echo:slow 4 unsure")
        final = echo(fake, "echo:slow 4 unsure")
        card = await answered(fake, fake.dm_conversation, final)
        await fake.wait_until(lambda: card.flow_status == "3")
        await trio.sleep(30)
    assert texts(fake, fake.dm_conversation) == [final]  # the card, and no markdown copy
    # The delivery was repeated by its outTrackId: the same card, not a second one.
    assert len(fake.calls_to("POST", "/v1.0/card/instances/deliver")) == 2


async def test_a_quote_of_a_users_file_names_the_file(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.files["f-1"] = b"%PDF-1.7 fake"
        doc = fake.user_message(
            fake.dm_conversation,
            msgtype="file",
            content=json.dumps({"downloadCode": "f-1", "fileName": "plan.pdf"}),  # as a string
        )
        await fake.wait_until(lambda: len(bot.events.prompts) == 1)
        fake.user_message(fake.dm_conversation, "summarise it", reply_to=doc["msgId"])
        await fake.wait_until(lambda: len(bot.events.prompts) == 2)
    block = reply_block(
        messageId=doc["msgId"],
        authorId=fake.user["sender_id"],
        authorName=fake.user["nick"],
        attachments=[{"kind": "file", "name": "plan.pdf"}],
    )
    assert bot.events.prompts[1] == echo(fake, "summarise it", reply=block)
    assert "f-1" not in bot.events.prompts[1]


def stored_bytes(root: Path) -> bytes:
    """Every byte the store wrote under ``root`` (database, WAL)."""
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())


async def test_the_session_webhook_never_reaches_the_store(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        msg = fake.user_message(fake.dm_conversation, "hello")
        await answered(fake, fake.dm_conversation, echo(fake, "hello"))
        session = msg["sessionWebhook"].rsplit("=", 1)[1]
        stored = stored_bytes(tmp_path)
        assert session.encode() not in stored
        assert msg["msgId"].encode() in stored  # the store was written and read here


async def test_the_card_qps_limit_slows_updates_and_the_final_text_arrives_once(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path, configure=lambda f: setattr(f, "card_qps", 2)) as (bot, fake):
        fake.user_message(fake.dm_conversation, "echo:slow 12 under quota")
        final = echo(fake, "echo:slow 12 under quota")
        card = await answered(fake, fake.dm_conversation, final)
        await fake.wait_until(lambda: card.flow_status == "3")
        await trio.sleep(10)
    assert texts(fake, fake.dm_conversation) == [final] and card.kind == "card"
    refused = [c for c in fake.calls if c.path.startswith("/v1.0/card/") and c.status == 403]
    assert refused  # the quota was hit, and the answer still finished in the card
    assert card.shown.count(final) == 1


async def test_a_failed_turn_ends_the_card_in_its_error_state(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.user_message(fake.dm_conversation, "echo:fail")
        await fake.wait_until(
            lambda: any(m.flow_status for m in fake.bot_messages(fake.dm_conversation))
        )
        ok = fake.user_message(fake.dm_conversation, "fine now")
        done = await answered(fake, fake.dm_conversation, echo(fake, "fine now"))
        await fake.wait_until(lambda: done.flow_status == "3")
    failed = fake.bot_messages(fake.dm_conversation)[0]
    assert "failed" in failed.text and failed.error and failed.flow_status == "5"
    assert not done.error and ok["msgId"]


class ToolHarness(EchoHarness):
    """Text, then a tool call that takes a while, then more text."""

    async def prompt(self, session_id: str, parts: Any, ctx: Any) -> Any:
        yield TextDelta("Looking it up.")
        yield ToolProgress(title="web_search", status="running")
        await trio.sleep(3)
        yield TextDelta(" Found it.")
        yield TurnEnd()


async def test_tool_progress_shows_under_the_text_until_more_text_comes(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path, harness=ToolHarness()) as (bot, fake):
        fake.user_message(fake.dm_conversation, "search")
        card = await answered(fake, fake.dm_conversation, "Looking it up. Found it.")
        await fake.wait_until(lambda: card.flow_status == "3")
    assert "Looking it up.\n\n⏳ web_search (running)" in card.shown
    assert card.text == "Looking it up. Found it."


async def test_the_token_is_renewed_before_it_expires(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path, configure=lambda f: setattr(f, "token_lifetime_s", 600.0)) as (
        bot,
        fake,
    ):
        await trio.sleep(400)  # past the renewal point (5 minutes before expiry)
        fake.user_message(fake.dm_conversation, "still valid?")
        await answered(fake, fake.dm_conversation, echo(fake, "still valid?"))
    assert fake.token_requests() == 2
    assert not [c for c in fake.calls if c.status == 401]  # renewed, never rejected


async def test_group_markdown_goes_by_webhook_with_the_at_then_by_group_send(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path, answer="markdown") as (bot, fake):
        fake.user_message(fake.group_conversation, "first")
        first = await answered(fake, fake.group_conversation, echo(fake, "first", kind="group"))
        fake.webhook_lifetime_s = 0.0  # the next message's webhook is already expired
        fake.user_message(fake.group_conversation, "second")
        second = await answered(fake, fake.group_conversation, echo(fake, "second", kind="group"))
    assert (first.via, first.at_users) == ("webhook", [fake.user["staff_id"]])
    assert second.via == "openapi"
    [send] = fake.calls_to("POST", "/v1.0/robot/groupMessages/send")
    assert send.json["openConversationId"] == fake.group_conversation
    assert send.json["msgKey"] == "sampleMarkdown"


async def test_credentials_revoked_while_running_stop_the_bot_at_the_next_registration(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.credentials_valid = False
        await fake.drop_connection()
        await bot.ended.wait()
        assert bot.results == {"ding": "fatal"}
    assert len(fake.calls_to("POST", "/v1.0/gateway/connections/open")) == 2  # no retry loop


async def test_a_registration_answer_without_a_websocket_endpoint_is_retried(
    tmp_path: Path, autojump_clock: object
) -> None:
    def broken_endpoint(fake: FakeDingTalk) -> None:
        real = fake.ws_url
        fake.ws_url = "https://not-a-websocket.invalid"

        async def restore() -> None:
            await fake.wait_until(lambda: len(fake.registrations) >= 2)
            fake.ws_url = real

        fake.restore = restore  # type: ignore[attr-defined]

    async with running_bot(tmp_path, configure=broken_endpoint, wait_ready=False) as (bot, fake):
        await fake.restore()  # type: ignore[attr-defined]
        await fake.wait_until(lambda: fake.live is not None)
        fake.user_message(fake.dm_conversation, "hello")
        await answered(fake, fake.dm_conversation, echo(fake, "hello"))
    assert bot.results == {"ding": "shutdown"}
    assert fake.token_requests() == 1  # retried inside the bot: it never had to restart
