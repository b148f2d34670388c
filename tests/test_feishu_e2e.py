"""End to end: the real Feishu channel, run by ``dshim.serve.serve_bots``, against the fake.

Testing manifesto: everything runs on 127.0.0.1 with kernel-chosen ports (the fake Feishu
from ``dshim.testing.fakes.feishu``: Open API + the pbbp2 long connection) in the same
trio run as the bot, on trio's autojump clock, so Feishu's timings (3 s ack deadline,
PingInterval, 300 ms card updates) take no real time and are exact.  The store is a real
SQLite file in ``tmp_path`` kept on the trio thread.  The echo harness answers with the
exact prompt it received, so every final text is known.  Assertions are what a Feishu
user or operator sees: the chat's messages and their final text, the acks the platform
got, the requests the bot made.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import trio
from structlog.testing import capture_logs

from dshim.testing.fakes.feishu import FakeFeishu
from tests.channel_contract import quote_block
from tests.rig_feishu import CARD_CONTENT, REPLY, running_bot, source

GET = "GET /open-apis/im/v1/messages/{message_id}"
SETTINGS = "PATCH /open-apis/cardkit/v1/cards/{card_id}/settings"
CARD_CREATE = "POST /open-apis/cardkit/v1/cards"
EDIT = "PUT /open-apis/im/v1/messages/{message_id}"


def texts(fake: FakeFeishu, chat: str) -> list[str]:
    return [b.text for b in fake.bot_messages(chat)]


async def answered(fake: FakeFeishu, chat: str, text: str) -> None:
    await fake.wait_until(lambda: text in texts(fake, chat))


# -- receiving -----------------------------------------------------------------------------


async def test_every_event_is_acked_with_its_frame_echoed(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        await fake.user_message(fake.dm_chat, "hello")
        await answered(fake, fake.dm_chat, source(fake) + "\n\nhello")
        await trio.sleep(10)
    [ack] = fake.acks
    assert ack.header("type") == "event" and ack.header("instance_id") == "inst-1"
    assert ack.header("biz_rt") is not None and int(ack.header("biz_rt") or "x") >= 0
    assert json.loads(ack.payload or b"") == {"code": 200}
    assert all(p.acked for p in fake.pushed.values())
    assert len(fake.pushed) == 1  # acked in time: never re-pushed


async def test_fragmented_event_and_redelivery_give_one_answer(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path, configure={"fragments": 3}) as (bot, fake):
        await fake.user_message(fake.dm_chat, "in three pieces")
        expected = source(fake) + "\n\nin three pieces"
        await answered(fake, fake.dm_chat, expected)
        await fake.redeliver_with_new_id(next(iter(fake.pushed)))
        await fake.wait_until(lambda: len(fake.acks) == 2)
        await trio.sleep(10)
    assert texts(fake, fake.dm_chat) == [expected]
    assert [r for _, r in bot.events.drops] == ["duplicate"]


async def test_malformed_event_is_dropped_and_the_bot_keeps_running(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        await fake.push_event(
            {
                "schema": "2.0",
                "header": {"event_type": "im.message.receive_v1"},
                "event": {"message": 5},
            }
        )
        fake.push_frame(b"\xff\x00garbage")
        await fake.user_message(fake.dm_chat, "still here?")
        await answered(fake, fake.dm_chat, source(fake) + "\n\nstill here?")
    assert "malformed" in [r for _, r in bot.events.drops]
    assert bot.results is None or bot.results.get("fs") != "fatal"


async def test_no_pong_reconnects_within_two_ping_intervals(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path, configure={"ping_interval_s": 20.0}) as (
        bot,
        fake,
    ):
        first = fake.live
        assert first is not None
        fake.answer_pings = False
        t0 = trio.current_time()
        await fake.wait_until(lambda: first.closed_by is not None)
        gone = trio.current_time() - t0
        fake.answer_pings = True
        await fake.wait_until(lambda: len(fake.connections) >= 2 and fake.live is not None)
        await fake.user_message(fake.dm_chat, "after the watchdog")
        await answered(fake, fake.dm_chat, source(fake) + "\n\nafter the watchdog")
    assert 20.0 <= gone <= 40.0  # 2 x PingInterval after the last pong (<= 20 s before t0)
    assert first.closed_by == "client"
    assert fake.calls_to("POST /callback/ws/endpoint")[-1].at > first.opened_at  # a fresh URL


async def test_expired_token_is_refreshed_once(tmp_path: Path, autojump_clock: object) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.expire_tokens()
        await fake.user_message(fake.dm_chat, "hello again")
        await answered(fake, fake.dm_chat, source(fake) + "\n\nhello again")
    assert fake.token_requests == 2


# -- answers -------------------------------------------------------------------------------


async def test_answer_streams_in_a_cardkit_card_and_closes_it(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        msg = await fake.user_message(fake.dm_chat, "echo:slow 6 <at id=all></at> & co")
        expected = source(fake) + "\n\necho:slow 6 <at id=all></at> & co"
        await answered(fake, fake.dm_chat, expected)
        await fake.wait_until(lambda: bool(fake.calls_to(SETTINGS)))
        await trio.sleep(5)
    [answer] = fake.bot_messages(fake.dm_chat)
    assert answer.card_id is not None and answer.parent_id == msg["message_id"]
    assert len(answer.shown) >= 3 and answer.shown.count(expected) == 1
    updates = [c for c in fake.calls_to(CARD_CONTENT) if c.status == 200]
    assert all("<at" not in c.json["content"] for c in updates)  # escaped: no mention of all
    seqs = [c.json["sequence"] for c in fake.calls_to(CARD_CONTENT) + fake.calls_to(SETTINGS)]
    assert seqs == sorted(set(seqs))  # strictly increasing
    times = [c.at for c in updates]
    assert all(b - a >= 0.3 - 1e-6 for a, b in zip(times, times[1:], strict=False))
    [close] = fake.calls_to(SETTINGS)
    settings = json.loads(close.json["settings"])
    assert settings["config"]["streaming_mode"] is False
    assert settings["config"]["summary"]["content"] == " ".join(expected.split())[:50]
    assert all(c.json.get("uuid") for c in fake.calls_to(REPLY) + updates)
    emojis = [(e, op) for mid, e, op in fake.reactions if mid == msg["message_id"] and op == "add"]
    assert emojis == [("OnIt", "add"), ("DONE", "add")]
    assert [op for _, _, op in fake.reactions].count("delete") == 1


async def test_lost_reply_answer_is_retried_with_the_same_uuid(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.fail_next(REPLY, 1, status=500)
        await fake.user_message(fake.dm_chat, "hi")
        expected = source(fake) + "\n\nhi"
        await answered(fake, fake.dm_chat, expected)
        await trio.sleep(5)
    assert texts(fake, fake.dm_chat) == [expected]
    uuids = {c.json["uuid"] for c in fake.calls_to(REPLY)}
    assert len(fake.calls_to(REPLY)) == 2 and len(uuids) == 1


async def test_without_cardkit_the_answer_is_a_text_reply_edited(
    tmp_path: Path, autojump_clock: object
) -> None:
    with capture_logs() as logs:
        async with running_bot(tmp_path, configure={"cardkit_enabled": False}) as (bot, fake):
            await fake.user_message(fake.dm_chat, "echo:slow 6 first")
            first = source(fake) + "\n\necho:slow 6 first"
            await answered(fake, fake.dm_chat, first)
            await fake.user_message(fake.dm_chat, "second")
            await answered(fake, fake.dm_chat, source(fake) + "\n\nsecond")
    answers = fake.bot_messages(fake.dm_chat)
    assert [a.msg_type for a in answers] == ["text", "text"]
    assert answers[0].text == first and len(answers[0].shown) >= 2
    assert [e["event"] for e in logs].count("cardkit_disabled") == 1


async def test_text_fallback_after_twenty_edits_sends_the_final_text_anew(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path, configure={"cardkit_enabled": False}) as (
        bot,
        fake,
    ):
        await fake.user_message(fake.dm_chat, "echo:slow 60 many edits")
        expected = source(fake) + "\n\necho:slow 60 many edits"
        await answered(fake, fake.dm_chat, expected)
    answers = fake.bot_messages(fake.dm_chat)
    assert all(a.edits <= 20 for a in answers)
    assert answers[-1].text == expected
    assert [c for c in fake.calls_to(EDIT) if c.code == 230072] == []


# -- quotes --------------------------------------------------------------------------------


async def test_group_quote_is_looked_up_once_in_this_chat(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        quoted = await fake.user_message(
            fake.group_chat, "Meeting moved to Friday.", sender=fake.other_user
        )
        await fake.user_message(
            fake.group_chat, "what did this say?", mention_bot=True, reply_to=quoted["message_id"]
        )
        block = quote_block(
            messageId=quoted["message_id"],
            authorId=fake.other_user["open_id"],
            content="Meeting moved to Friday.",
        )
        expected = source(fake, "group") + "\n\n" + block + "\n\nwhat did this say?"
        await answered(fake, fake.group_chat, expected)
    [get] = fake.calls_to(GET)
    assert get.query == {"user_id_type": "open_id", "card_msg_content_type": "raw_card_content"}
    assert [r for _, r in bot.events.drops] == ["unaddressed"]  # the quoted message itself


async def test_quote_lookup_denied_is_permission_denied(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        quoted = await fake.user_message(fake.group_chat, "secret", sender=fake.other_user)
        fake.lookup_denied.add(quoted["message_id"])
        await fake.user_message(
            fake.group_chat, "and?", mention_bot=True, reply_to=quoted["message_id"]
        )
        block = quote_block(messageId=quoted["message_id"], unavailableReason="permission-denied")
        await answered(fake, fake.group_chat, source(fake, "group") + "\n\n" + block + "\n\nand?")


async def test_quote_from_another_chat_is_not_found(tmp_path: Path, autojump_clock: object) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        elsewhere = await fake.user_message(fake.group_chat, "group only", sender=fake.other_user)
        await fake.user_message(fake.dm_chat, "this?", reply_to=elsewhere["message_id"])
        block = quote_block(messageId=elsewhere["message_id"], unavailableReason="not-found")
        await answered(fake, fake.dm_chat, source(fake) + "\n\n" + block + "\n\nthis?")


async def test_quote_of_a_streaming_card_comes_from_the_index(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        await fake.user_message(fake.dm_chat, "first answer")
        first = source(fake) + "\n\nfirst answer"
        await answered(fake, fake.dm_chat, first)
        await trio.sleep(3)
        [card] = fake.bot_messages(fake.dm_chat)
        await fake.user_message(fake.dm_chat, "and that?", reply_to=card.message_id)
        block = quote_block(
            messageId=card.message_id,
            authorId=fake.bot_open_id,
            authorName=fake.bot_name,
            content=first,
        )
        await answered(fake, fake.dm_chat, source(fake) + "\n\n" + block + "\n\nand that?")
    assert fake.calls_to(GET) == []


async def test_topic_reply_is_thread_context_and_answers_in_the_topic(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        root = await fake.user_message(fake.group_chat, "topic start", mention_bot=True)
        await fake.wait_until(lambda: len(fake.bot_messages(fake.group_chat)) == 1)
        await fake.user_message(
            fake.group_chat, "in the topic", mention_bot=True, topic=root["message_id"]
        )
        await answered(fake, fake.group_chat, source(fake, "group") + "\n\nin the topic")
    assert fake.calls_to(GET) == []
    replies = fake.calls_to(REPLY)
    assert replies[-1].json.get("reply_in_thread") is True


@pytest.mark.parametrize("starter_thread_id", [True, False])
async def test_a_topic_group_topic_is_one_conversation(
    tmp_path: Path, autojump_clock: object, starter_thread_id: bool
) -> None:
    async with running_bot(tmp_path, configure={"starter_thread_ids": starter_thread_id}) as (
        bot,
        fake,
    ):
        chat = fake.topic_chat  # a native topic group: each top-level message is a topic
        starter = await fake.user_message(chat, "echo:slow 20 plan it", mention_bot=True)
        await fake.wait_until(lambda: len(fake.bot_messages(chat)) == 1)
        # A reply in the topic while the first answer still runs: the same lane, so it waits.
        reply = await fake.user_message(
            chat, "and the rollback?", mention_bot=True, topic=starter["message_id"]
        )
        await answered(fake, chat, source(fake, "group") + "\n\nand the rollback?")
        first = next(b for b in fake.bot_messages(chat) if b.parent_id == starter["message_id"])
        second = next(b for b in fake.bot_messages(chat) if b.parent_id == reply["message_id"])
    assert first.text == source(fake, "group") + "\n\necho:slow 20 plan it"
    assert first.in_thread and second.in_thread  # both answers in the topic
    assert len(bot.harness.sessions) == 2 and len(set(bot.harness.sessions)) == 1
    assert fake.calls_to(GET) == []  # the topic's root is context, not a quote
    # One lane: the reply's answer started only once the first one was closed.
    [second_reply] = [c for c in fake.calls_to(REPLY) if reply["message_id"] in c.path]
    assert second_reply.at >= fake.calls_to(SETTINGS)[0].at


# -- recall --------------------------------------------------------------------------------


async def test_recalled_prompts_are_dropped_or_stopped(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        running = await fake.user_message(fake.dm_chat, "echo:slow 40 long one")
        queued = await fake.user_message(fake.dm_chat, "queued one")
        await fake.wait_until(lambda: len(fake.bot_messages(fake.dm_chat)) == 1)
        await fake.recall(queued["message_id"])
        await fake.recall(running["message_id"])
        await fake.wait_until(lambda: any("⏹ Stopped." in t for t in texts(fake, fake.dm_chat)))
        await fake.user_message(fake.dm_chat, "next")
        await answered(fake, fake.dm_chat, source(fake) + "\n\nnext")
        await trio.sleep(10)
    all_texts = texts(fake, fake.dm_chat)
    assert len(all_texts) == 2  # the stopped answer (told once) and "next"
    assert not any("queued one" in t for t in all_texts)
    assert len(fake.acks) == 5  # two messages, two recalls, one more message


# -- approvals -----------------------------------------------------------------------------


async def test_approval_by_card_button(tmp_path: Path, autojump_clock: object) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        await fake.user_message(fake.dm_chat, "echo:approval")
        await fake.wait_until(
            lambda: any(fake.buttons(b.message_id) for b in fake.bot_messages(fake.dm_chat))
        )
        card = next(b for b in fake.bot_messages(fake.dm_chat) if fake.buttons(b.message_id))
        labels = [v["answer"] for v in fake.buttons(card.message_id)]
        await fake.click(card.message_id, 0)
        await fake.wait_until(
            lambda: any("allow" in t.lower() for t in texts(fake, fake.dm_chat) if t != card.text)
        )
        await fake.wait_until(lambda: "Answered" in fake.bot_messages(fake.dm_chat)[0].text)
    assert len(labels) == 3
    click_ack = fake.acks[-1]
    body = json.loads(click_ack.payload or b"")
    assert body["code"] == 200 and "toast" in json.loads(base64.b64decode(body["data"]))
    assert fake.buttons(card.message_id) == []  # the decided card has no buttons any more


# -- more ----------------------------------------------------------------------------------


async def test_long_answer_continues_in_follow_up_messages(
    tmp_path: Path, autojump_clock: object
) -> None:
    words = " ".join(f"word{i}" for i in range(5000))  # ~44,000 characters
    async with running_bot(tmp_path) as (bot, fake):
        await fake.user_message(fake.dm_chat, words)
        await fake.wait_until(lambda: "word4999" in "".join(texts(fake, fake.dm_chat)))
        await trio.sleep(5)
    parts = fake.bot_messages(fake.dm_chat)
    assert len(parts) == 2 and all(len(p.text) <= 28_000 for p in parts)
    assert parts[0].card_id is not None and parts[1].msg_type == "text"
    assert " ".join(p.text for p in parts) == source(fake) + "\n\n" + words


async def test_images_are_downloaded_inside_the_turn_only(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        await fake.user_message(fake.group_chat, msg_type="image", content={"image_key": "img_x"})
        await trio.sleep(10)  # unaddressed in the group: nothing is fetched
        assert (
            fake.calls_to("GET /open-apis/im/v1/messages/{message_id}/resources/{file_key}") == []
        )
        sent = await fake.user_message(
            fake.dm_chat, msg_type="image", content={"image_key": "img_y"}
        )
        await fake.wait_until(lambda: len(fake.bot_messages(fake.dm_chat)) == 1)
    [download] = fake.calls_to("GET /open-apis/im/v1/messages/{message_id}/resources/{file_key}")
    assert download.path.endswith(f"/{sent['message_id']}/resources/img_y")
    assert download.query == {"type": "image"} and download.status == 200


async def test_token_is_renewed_before_its_last_30_minutes(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path, deadline=9000.0) as (bot, fake):
        await fake.user_message(fake.dm_chat, "one")
        await answered(fake, fake.dm_chat, source(fake) + "\n\none")
        await trio.sleep(7200 - 1800 + 60)  # past the renewal point, before expiry
        await fake.user_message(fake.dm_chat, "two")
        await answered(fake, fake.dm_chat, source(fake) + "\n\ntwo")
    assert fake.token_requests == 2
    assert [c for c in fake.calls if c.code == 99991663] == []  # never used an old token


async def test_in_a_group_only_the_starter_can_approve_by_button(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        await fake.user_message(fake.group_chat, "echo:approval", mention_bot=True)
        await fake.wait_until(
            lambda: any(fake.buttons(b.message_id) for b in fake.bot_messages(fake.group_chat))
        )
        card = next(b for b in fake.bot_messages(fake.group_chat) if fake.buttons(b.message_id))
        await fake.click(card.message_id, 0, user=fake.other_user)
        await trio.sleep(5)
        assert fake.buttons(card.message_id)  # still waiting: Bob did not start the turn
        await fake.click(card.message_id, 2)
        await fake.wait_until(lambda: not fake.buttons(card.message_id))
        await fake.wait_until(lambda: len(fake.bot_messages(fake.group_chat)) >= 2)
        await trio.sleep(5)
    answer = [b for b in fake.bot_messages(fake.group_chat) if b.message_id != card.message_id]
    assert any("reject" in b.text.lower() for b in answer)


async def test_connection_secrets_never_reach_the_logs(
    tmp_path: Path, autojump_clock: object
) -> None:
    with capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            await fake.user_message(fake.dm_chat, "hello")
            await answered(fake, fake.dm_chat, source(fake) + "\n\nhello")
            await fake.drop_connection()
            await fake.wait_until(lambda: len(fake.connections) == 2 and fake.live is not None)
    urls = [c for c in fake.calls if c.path == "/callback/ws/endpoint"]
    assert len(urls) == 2
    dumped = repr(logs)
    assert "ticket=" not in dumped and "access_key" not in dumped
    assert not any(t in dumped for t in fake.tokens)


async def test_sequence_violation_is_retried_with_a_higher_sequence(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.fail_next(CARD_CONTENT, 2, status=400, code=300317)
        await fake.user_message(fake.dm_chat, "echo:slow 4 ordered")
        expected = source(fake) + "\n\necho:slow 4 ordered"
        await answered(fake, fake.dm_chat, expected)
        await trio.sleep(5)
    [answer] = fake.bot_messages(fake.dm_chat)  # still one card, no second message
    assert answer.text == expected
    refused = [c for c in fake.calls_to(CARD_CONTENT) if c.code == 300317]
    assert len(refused) == 2


async def test_server_close_reconnects_and_too_many_connections_is_fatal(
    tmp_path: Path, autojump_clock: object
) -> None:
    with capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            await fake.close_connection(1000, "server restart")
            await fake.wait_until(lambda: len(fake.connections) == 2 and fake.live is not None)
            await fake.user_message(fake.dm_chat, "after the close")
            await answered(fake, fake.dm_chat, source(fake) + "\n\nafter the close")
            fake.max_connections = 0
            await fake.drop_connection()
            await bot.ended.wait()
            await trio.sleep(120)
    assert bot.results == {"fs": "fatal"}
    assert fake.rejected == 1  # one refusal, no retry loop
    assert [e["event"] for e in logs].count("bot_stopped_fatal") == 1


async def test_a_global_rate_limit_delays_but_delivers_once(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.global_rate_limit = 6
        await fake.user_message(fake.dm_chat, "echo:slow 6 limited")
        expected = source(fake) + "\n\necho:slow 6 limited"
        await answered(fake, fake.dm_chat, expected)
        await trio.sleep(10)
    assert texts(fake, fake.dm_chat) == [expected]
    assert len([c for c in fake.calls if c.status == 429]) == 6


async def test_sends_whose_answer_is_lost_are_never_duplicated(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.lose_response_next("POST /open-apis/cardkit/v1/cards")
        fake.lose_response_next(REPLY)
        fake.lose_response_next(CARD_CONTENT, 2)
        await fake.user_message(fake.dm_chat, "echo:slow 6 lost answers")
        expected = source(fake) + "\n\necho:slow 6 lost answers"
        await answered(fake, fake.dm_chat, expected)
        await trio.sleep(10)
    assert texts(fake, fake.dm_chat) == [expected]  # one card, though a reply was repeated
    assert len({c.json["uuid"] for c in fake.calls_to(REPLY)}) == 1  # repeats, one uuid
    assert len(fake.calls_to(REPLY)) >= 2
    # The create whose answer was lost left an entity the bot never knew of: never sent.
    orphan, sent = fake.cards.values()
    assert (orphan["sent"], sent["sent"]) == (False, True)


async def test_approval_card_whose_answer_is_lost_is_shown_once(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        await fake.user_message(fake.dm_chat, "warm up")
        await answered(fake, fake.dm_chat, source(fake) + "\n\nwarm up")
        fake.lose_response_next(REPLY)
        await fake.user_message(fake.dm_chat, "echo:approval")
        await fake.wait_until(
            lambda: any(fake.buttons(b.message_id) for b in fake.bot_messages(fake.dm_chat))
        )
        card = next(b for b in fake.bot_messages(fake.dm_chat) if fake.buttons(b.message_id))
        await fake.wait_until(lambda: len(fake.calls_to(REPLY)) >= 3)  # the repeat came back
        await fake.click(card.message_id, 0)
        await fake.wait_until(lambda: not fake.buttons(card.message_id))
        await trio.sleep(5)
    cards = [b for b in fake.bot_messages(fake.dm_chat) if b.msg_type == "interactive"]
    assert sum("Answered" in b.text for b in cards) == 1  # one approval card, no text copy
    assert not any("1." in b.text and "allow" in b.text.lower() for b in cards if b is not card)


async def test_a_slow_reaction_does_not_hold_up_the_answer(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.slow_next("POST /open-apis/im/v1/messages/{message_id}/reactions", 60.0)
        t0 = trio.current_time()
        await fake.user_message(fake.dm_chat, "quick")
        await answered(fake, fake.dm_chat, source(fake) + "\n\nquick")
        took = trio.current_time() - t0
    assert took < 5.0


async def test_a_lost_reply_streams_into_the_card_it_delivered(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.lose_response_next(REPLY)
        await fake.user_message(fake.dm_chat, "echo:slow 6 one card")
        expected = source(fake) + "\n\necho:slow 6 one card"
        await answered(fake, fake.dm_chat, expected)
        await trio.sleep(10)
    [answer] = fake.bot_messages(fake.dm_chat)
    assert answer.text == expected  # the card the chat shows got every update
    [create] = fake.calls_to(CARD_CREATE)  # the repeated reply reused the card entity
    assert create.status == 200 and sorted(create.json) == ["data", "type"]
    assert list(fake.cards) == [answer.card_id]
    assert {c.path.split("/")[5] for c in fake.calls_to(CARD_CONTENT)} == {answer.card_id}
