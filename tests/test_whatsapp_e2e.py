"""End to end: ``dshim serve``'s own code path against the fake Cloud API.

Testing manifesto: the bot runs through :func:`dshim.serve.serve_bots` -- supervisor,
channel, client, pipeline, SQLite store, renderer -- against
:mod:`dshim.testing.fakes.whatsapp` on 127.0.0.1, port 0, with the echo harness; dshim's
own HTTP endpoint (with a bearer token the webhook must not need) serves the webhook on
127.0.0.1, port 0, and the fake POSTs signed bodies to it like Meta.  Nothing reaches
the internet.  Every test runs on trio's autojump clock (pacing, backoffs and typing
refreshes take no real time) under the conftest's hard deadline.  Assertions are about
what the user's phone shows, what the agent receives and what the operator reads.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import trio
from structlog.testing import capture_logs

from dshim.channels.registry import parse_config
from dshim.channels.whatsapp.channel import CHANNEL
from dshim.errors import StoreError
from dshim.metrics import ProcessMetrics
from dshim.model import ImagePart, TextPart
from dshim.serve import serve_bots
from dshim.testing.fakes.whatsapp import (
    TEST_APP_SECRET,
    TEST_TOKEN,
    TEST_VERIFY_TOKEN,
    FakeWhatsApp,
)
from tests.channel_contract import quote_block as reply_block
from tests.helpers import Clock
from tests.rig_whatsapp import E2E_BOT as BOT
from tests.rig_whatsapp import GROUP_ID as GROUP
from tests.rig_whatsapp import bot_table, echo_of, whatsapp_bed
from tests.store_proxy import StoreProxy

# --- receiving -------------------------------------------------------------------------------


async def test_a_direct_message_is_read_typed_and_answered_as_a_contextual_reply(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path) as (bot, fake):
        ada = bot.ada
        msg = fake.user_message(ada, "What is the capital of France?")
        assert await fake.send_messages(msg) == 200
        expected = echo_of(ada, "What is the capital of France?")
        await fake.wait_until(lambda: bot.texts_to(ada) == [expected])
        await trio.sleep(5)
    [sent] = fake.to_user(ada.key)
    assert sent.reply_to == msg["id"] and sent.text == expected
    [send] = fake.calls_to("send")
    assert send.body["text"] == {"body": expected, "preview_url": False}
    assert send.body["to"] == "16505551234" and send.body["recipient_type"] == "individual"
    typing = fake.calls_to("typing")
    assert typing and typing[0].at <= send.at
    assert typing[0].body["typing_indicator"] == {"type": "text"}
    assert fake.read[0] == msg["id"]


async def test_signature_table_only_meta_signed_raw_bodies_are_taken(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path) as (bot, fake):
        ada = bot.ada
        body = fake.body([fake.user_message(ada, "signed by meta")])
        wrong = FakeWhatsApp(app_secret="not-the-app-secret").signature(body)
        reserialized = json.dumps(json.loads(body), indent=1).encode()
        with capture_logs() as logs:
            assert await fake.post(body, signature=wrong) == 401
            assert await fake.post(reserialized, signature=fake.signature(body)) == 401
            assert await fake.post(body, signature=None) == 401
            assert await fake.post(body, signature="sha1=" + fake.signature(body)[7:]) == 401
            await trio.sleep(10)
            assert fake.calls_to("send", "typing") == []  # nothing else happened
            assert await fake.post(body) == 200
            assert await fake.post(body) == 200  # Meta's replay of a valid body: deduplicated
            expected = echo_of(ada, "signed by meta")
            await fake.wait_until(lambda: expected in bot.texts_to(ada))
            await trio.sleep(20)
    assert bot.texts_to(ada) == [expected]
    assert len(bot.harness.prompts) == 1
    refused = [e for e in logs if e["event"] == "webhook_refused"]
    assert len(refused) == 4
    assert not [e for e in logs if TEST_APP_SECRET in repr(e) or TEST_TOKEN in repr(e)]


async def test_verification_get_echoes_the_challenge_only_for_the_verify_token(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path) as (bot, fake):
        http = bot.fake.http
        assert http is not None
        url = bot.fake.webhook_url
        ok = await http.get(
            url,
            params={
                "hub.mode": "subscribe",
                "hub.verify_token": TEST_VERIFY_TOKEN,
                "hub.challenge": "1158201444",
            },
        )
        assert ok.status_code == 200 and ok.text == "1158201444"
        assert ok.headers["content-type"].startswith("text/plain")
        for params in (
            {"hub.mode": "subscribe", "hub.verify_token": "guess", "hub.challenge": "1"},
            {
                "hub.mode": "unsubscribe",
                "hub.verify_token": TEST_VERIFY_TOKEN,
                "hub.challenge": "1",
            },
            {"hub.verify_token": TEST_VERIFY_TOKEN, "hub.challenge": "1"},
        ):
            assert (await http.get(url, params=params)).status_code == 403


async def test_a_body_with_two_messages_and_a_status_answers_both_in_order(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path) as (bot, fake):
        ada = bot.ada
        bob = fake.user("447700900123", "Bob")
        first = fake.user_message(ada, "first")
        second = fake.user_message(bob, "second")
        await fake.send_messages(first)
        await fake.wait_until(lambda: len(bot.texts_to(ada)) == 1)
        status = fake.status_update(fake.to_user(ada.key)[0], "read")
        assert (
            await fake.deliver(fake.body([fake.user_message(ada, "third"), second], [status]))
            == 200
        )
        await fake.wait_until(lambda: len(bot.texts_to(ada)) == 2 and len(bot.texts_to(bob)) == 1)
        await trio.sleep(10)
    assert bot.texts_to(bob) == [echo_of(bob, "second")]
    assert bot.texts_to(ada)[1] == echo_of(ada, "third")
    assert len(bot.harness.prompts) == 3


async def test_reaction_edit_and_system_messages_are_not_prompts(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path) as (bot, fake):
        ada = bot.ada
        msg = await bot.say("hi")
        await fake.wait_until(lambda: len(bot.texts_to(ada)) == 1)
        others = [
            fake.user_message(
                ada, type="reaction", reaction={"message_id": msg["id"], "emoji": "👍"}
            ),
            fake.user_message(
                ada,
                type="edit",
                edit={
                    "original_message_id": msg["id"],
                    "message": {"type": "text", "text": {"body": "/new"}},
                },
            ),
            fake.user_message(ada, type="system", system={"body": "changed number"}),
            fake.user_message(ada, type="unsupported", errors=[{"code": 131051}]),
        ]
        assert await fake.deliver(fake.body(others)) == 200
        await trio.sleep(30)
    assert len(bot.harness.prompts) == 1 and len(bot.texts_to(ada)) == 1


async def test_a_bsuid_only_user_is_keyed_and_answered_by_bsuid(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path) as (bot, fake):
        ana = fake.user(None, "Ana", bsuid="US.13491208655302741918")
        await bot.say("hola", ana)
        expected = echo_of(ana, "hola")
        await fake.wait_until(lambda: bot.texts_to(ana) == [expected])
    [send] = fake.calls_to("send")
    assert send.body["recipient"] == "US.13491208655302741918" and "to" not in send.body
    assert '"senderId":"US.13491208655302741918"' in expected


async def test_an_image_with_caption_is_downloaded_in_the_turn_with_the_bearer(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64
    async with whatsapp_bed(tmp_path) as (bot, fake):
        ada = bot.ada
        media_id = fake.add_media(png, mime="image/png")
        image = {
            "id": media_id,
            "mime_type": "image/png",
            "sha256": hashlib.sha256(png).hexdigest(),
            "caption": "what is this?",
        }
        await bot.say(type="image", image=image)
        await fake.wait_until(lambda: len(bot.texts_to(ada)) == 1)
    [parts] = bot.harness.prompts
    images = [p for p in parts if isinstance(p, ImagePart)]
    assert len(images) == 1 and images[0].data == png
    assert [p.text for p in parts if isinstance(p, TextPart)][-1] == "what is this?"
    assert [c.op for c in fake.calls if c.op in ("media", "download")] == ["media", "download"]


# --- acknowledging --------------------------------------------------------------------------


async def test_a_body_refused_while_the_bot_is_down_is_answered_once_after_meta_retries(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path, serve=False) as (bot, fake):
        ada = bot.ada
        async with bot.serving():
            await bot.say("before")
            await fake.wait_until(lambda: len(bot.texts_to(ada)) == 1)
        # The bot is down (its route still mounted): Meta gets 503 and retries.
        body = fake.body([fake.user_message(ada, "while down")])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fake.deliver, body)
            await fake.wait_until(lambda: len(fake.deliveries) >= 3)
            assert {status for status, _ in fake.deliveries[1:]} == {503}
            async with bot.serving():
                expected = echo_of(ada, "while down")
                await fake.wait_until(lambda: expected in bot.texts_to(ada))
                await trio.sleep(30)
        assert fake.deliveries[-1][0] == 200
        assert bot.texts_to(ada).count(expected) == 1


# --- sending ----------------------------------------------------------------------------------


async def test_a_long_answer_is_split_and_paced_within_the_pair_rate(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    paragraph = "word " * 700  # ~3,500 characters
    text = "\n\n".join([paragraph.strip()] * 3)
    async with whatsapp_bed(tmp_path, pair_interval_s=6.0) as (bot, fake):
        ada = bot.ada
        msg = await bot.say(text)
        await fake.wait_until(lambda: len(bot.texts_to(ada)) >= 3)
        await trio.sleep(30)
    sent = fake.to_user(ada.key)
    assert len(sent) == 3  # the source block and 3 paragraphs of ~3,500 characters
    assert "\n\n".join(s.text for s in sent) == echo_of(ada, text)
    assert all(len(s.text) <= 4096 for s in sent)
    assert sent[0].reply_to == msg["id"] and all(s.reply_to is None for s in sent[1:])
    gaps = [b.at - a.at for a, b in zip(sent, sent[1:], strict=False)]
    assert all(g >= 6.0 for g in gaps), gaps
    assert all(c.status == 200 for c in fake.calls_to("send"))  # never one 131056


async def test_throttling_errors_back_off_and_deliver_once(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path) as (bot, fake):
        ada = bot.ada
        fake.fail_next("send", 3, status=400, code=131056)
        await bot.say("busy")
        await fake.wait_until(lambda: len(bot.texts_to(ada)) == 1)
        await trio.sleep(60)
    sends = fake.calls_to("send")
    assert [c.status for c in sends] == [400, 400, 400, 200]
    gaps = [b.at - a.at for a, b in zip(sends, sends[1:], strict=False)]
    # Backoff 2, 4, 8 s, but never two sends to one user within the pair rate's 6 s.
    assert gaps == pytest.approx([6.0, 6.0, 8.0], abs=0.5)
    assert bot.texts_to(ada) == [echo_of(ada, "busy")]


async def test_a_send_whose_answer_is_lost_is_not_repeated_in_a_loop(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path) as (bot, fake):
        ada = bot.ada
        fake.lose_response_next("send", 5)
        await bot.say("once please")
        await fake.wait_until(lambda: len(bot.texts_to(ada)) >= 1)
        await trio.sleep(120)
    assert len(bot.texts_to(ada)) <= 2


async def test_outside_the_24_hour_window_delivery_ends_at_once_logged_and_counted(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    metrics = ProcessMetrics()
    with capture_logs() as logs:
        async with whatsapp_bed(tmp_path, metrics=metrics) as (bot, fake):
            ada = bot.ada
            fake.fail_next("send", 1, status=400, code=131047)
            await bot.say("late")
            await fake.wait_until(lambda: len(fake.calls_to("send")) == 1)
            await trio.sleep(120)
            assert len(fake.calls_to("send")) == 1  # no retry, no notice that fails again
            # The user writes again: the window is open, answers flow again.
            await bot.say("again")
            await fake.wait_until(lambda: echo_of(ada, "again") in bot.texts_to(ada))
    refused = [e for e in logs if e["event"] == "delivery_refused"]
    assert len(refused) == 1 and refused[0]["code"] == 131047 and refused[0]["refused_total"] == 1
    assert "24-hour window" in refused[0]["reason"]
    body = metrics.render()[0].decode()
    assert (
        'dshim_platform_requests_total{bot="wa",method="delivery_refused",status="131047"} 1.0'
        in body
    )


async def test_a_failed_status_is_logged_counted_and_marks_the_answer_undelivered(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    metrics = ProcessMetrics()
    with capture_logs() as logs:
        async with whatsapp_bed(tmp_path, metrics=metrics) as (bot, fake):
            ada = bot.ada
            await bot.say("hello")
            await fake.wait_until(lambda: len(bot.texts_to(ada)) == 1)
            await trio.sleep(5)
            [sent] = fake.to_user(ada.key)
            failed = fake.status_update(sent, "failed", code=131047)
            assert await fake.deliver(fake.body(statuses=[failed])) == 200
            await trio.sleep(5)
            entries = await bot.store.list_outbound(BOT, ada.key, now=Clock()())
    [event] = [e for e in logs if e["event"] == "delivery_failed"]
    assert event["code"] == 131047 and event["message_id"] == sent.id and event["indexed"]
    assert [e.state for e in entries if sent.id in e.message_ids] == ["undelivered"]
    assert len(bot.harness.prompts) == 1  # a status is never a prompt
    body = metrics.render()[0].decode()
    assert (
        'dshim_platform_requests_total{bot="wa",method="delivery_failed",status="131047"} 1.0'
        in body
    )


async def test_an_expired_token_on_a_send_stops_the_bot_as_fatal(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path) as (bot, fake):
        ada = bot.ada
        fake.expire_token()
        await fake.post(fake.body([fake.user_message(ada, "hello")]))
        await trio.sleep(120)
        assert bot.results == {BOT: "fatal"}
        assert len(fake.calls_to("phone")) == 1  # not restarted


# --- quotes -------------------------------------------------------------------------------------


async def test_quotes_are_answered_from_the_message_index(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path) as (bot, fake):
        ada = bot.ada
        mine = await bot.say("my <first> & only")
        await fake.wait_until(lambda: len(bot.texts_to(ada)) == 1)
        await trio.sleep(7)
        [answer] = fake.to_user(ada.key)
        await bot.say("about mine", reply_to=mine["id"])
        await fake.wait_until(lambda: len(bot.harness.prompts) == 2)
        await bot.say("about yours", reply_to=answer.id)
        await fake.wait_until(lambda: len(bot.harness.prompts) == 3)
        await fake.send_messages(
            fake.user_message(ada, "about what?", reply_to="wamid.UNKNOWN", reply_from=ada.wa_id)
        )
        await fake.wait_until(lambda: len(bot.harness.prompts) == 4)
        gone = await bot.say("deleted soon")
        await fake.wait_until(lambda: len(bot.harness.prompts) == 5)
        await bot.say(type="revoke", revoke={"original_message_id": gone["id"]})
        await bot.say("about that", reply_to=gone["id"])
        await fake.wait_until(lambda: len(bot.harness.prompts) == 6)
        await bot.say("/new", forwarded=True)
        await trio.sleep(20)
    blocks = [
        [p.text for p in parts if isinstance(p, TextPart)][1] for parts in bot.harness.prompts
    ]
    assert blocks[1] == reply_block(
        messageId=mine["id"],
        authorId=ada.key,
        authorName="Ada Lovelace",
        content="my <first> & only",
    )
    assert blocks[2] == reply_block(
        messageId=answer.id,
        authorId=fake.phone_number_id,
        authorName=fake.verified_name,
        content=answer.text,
    )
    assert blocks[3] == reply_block(messageId="wamid.UNKNOWN", unavailableReason="not-delivered"), (
        blocks[3]
    )
    assert blocks[5] == reply_block(messageId=gone["id"], unavailableReason="deleted")
    # A forwarded "/new" is content, not a command: it is a prompt, and not a quote.
    assert len(bot.harness.prompts) == 7
    assert "<dsh_im_reply_to>" not in bot.harness.texts()[6]


async def test_in_a_group_a_reply_to_one_of_the_bots_messages_is_answered_without_a_mention(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path) as (bot, fake):
        ada = bot.ada
        bob = fake.user("447700900123", "Bob")
        first = fake.user_message(
            ada, f"@{fake.display_phone_number} plan the trip", group_id=GROUP
        )
        await fake.send_messages(first)
        await fake.wait_until(lambda: len(fake.to_user(GROUP)) == 1)
        [answer] = fake.to_user(GROUP)
        # context.from is the business number: Meta's shape of a reply to the bot.
        by_from = fake.user_message(ada, "and day two?", reply_to=answer.id, group_id=GROUP)
        assert by_from["context"]["from"] == fake.display_phone_number
        await fake.send_messages(by_from)
        await fake.wait_until(lambda: len(fake.to_user(GROUP)) == 2)
        # Without a usable context.from, the id is found among the bot's answers.
        by_id = fake.user_message(bob, "and the budget?", reply_to=answer.id, group_id=GROUP)
        del by_id["context"]["from"]
        await fake.send_messages(by_id)
        await fake.wait_until(lambda: len(fake.to_user(GROUP)) == 3)
        # A reply to a person's message is their conversation, not the bot's.
        other = fake.user_message(bob, "sounds good", reply_to=first["id"], group_id=GROUP)
        await fake.send_messages(other)
        await trio.sleep(30)
    sends = fake.to_user(GROUP)
    assert len(sends) == 3 and len(bot.harness.prompts) == 3
    assert [s.reply_to for s in sends] == [first["id"], by_from["id"], by_id["id"]]
    assert bot.harness.texts()[1].endswith("\n\nand day two?")
    assert bot.harness.texts()[2].endswith("\n\nand the budget?")
    quoted = reply_block(
        messageId=answer.id,
        authorId=fake.phone_number_id,
        authorName=fake.verified_name,
        content=answer.text,
    )
    assert quoted in bot.harness.texts()[1] and quoted in bot.harness.texts()[2]


async def test_a_group_reply_to_the_bot_waiting_in_the_inbox_is_answered_after_a_restart(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path, serve=False) as (bot, fake):
        ada = bot.ada
        mention = f"@{fake.display_phone_number}"
        async with bot.serving(grace_s=2.0):
            await bot.say(f"{mention} hi", group_id=GROUP)
            await fake.wait_until(lambda: len(fake.to_user(GROUP)) == 1)
            [answer] = fake.to_user(GROUP)
            await fake.send_messages(
                fake.user_message(ada, f"{mention} echo:slow 400", group_id=GROUP)
            )
            await fake.wait_until(lambda: len(bot.harness.prompts) == 2)
            # Queued behind the slow turn when dshim stops; only the index says it is ours.
            waiting = fake.user_message(ada, "and then?", reply_to=answer.id, group_id=GROUP)
            del waiting["context"]["from"]
            await fake.send_messages(waiting)
            await trio.sleep(1)
        async with bot.serving():
            await fake.wait_until(lambda: any(s.reply_to == waiting["id"] for s in fake.sent))
    assert bot.harness.texts()[-1].endswith("\n\nand then?")


# --- approvals and questions ----------------------------------------------------------------


async def test_an_approval_is_shown_with_reply_buttons_and_a_press_answers_it(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path) as (bot, fake):
        ada = bot.ada
        ask = await bot.say("echo:approval")
        await fake.wait_until(lambda: any(s.type == "interactive" for s in fake.sent))
        [request] = [s for s in fake.sent if s.type == "interactive"]
        assert request.reply_to == ask["id"]
        assert request.interactive is not None and request.interactive["type"] == "button"
        buttons = request.interactive["action"]["buttons"]
        assert [b["reply"]["title"] for b in buttons] == ["Allow once", "Allow always", "Reject"]
        assert "The agent asks for permission" in request.text
        press = fake.user_message(
            ada,
            type="interactive",
            context={"from": fake.display_phone_number, "id": request.id},
            interactive={
                "type": "button_reply",
                "button_reply": {"id": buttons[1]["reply"]["id"], "title": "Allow always"},
            },
        )
        await fake.send_messages(press)
        await fake.wait_until(
            lambda: any("Approval decision: allow_always" in t for t in bot.texts_to(ada))
        )
    assert any(t.startswith("✅ Approved: Allow always") for t in bot.texts_to(ada))


async def test_a_question_answered_by_typing_works_like_everywhere(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path) as (bot, fake):
        ada = bot.ada
        await bot.say("echo:question")
        await fake.wait_until(lambda: any(s.type == "interactive" for s in fake.sent))
        await bot.say("1")
        await fake.wait_until(lambda: len(bot.texts_to(ada)) >= 3)
        await trio.sleep(20)
    texts = bot.texts_to(ada)
    assert [s.type for s in fake.sent] == ["interactive", "text", "text"]
    assert texts[0].startswith("❓ echo: which colour?")
    assert texts[1:] == ["Answer sent: Red.", "Answer: Red"]


async def test_typing_is_refreshed_every_20_s_until_the_answer_is_sent(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path) as (bot, fake):
        ada = bot.ada
        msg = await bot.say("echo:slow 100 think long")
        await fake.wait_until(lambda: len(bot.texts_to(ada)) == 1)
        await trio.sleep(60)
    [send] = fake.calls_to("send")
    typing = [c.at for c in fake.calls_to("typing")]
    assert all(c.body["message_id"] == msg["id"] for c in fake.calls_to("typing"))
    assert all(t <= send.at for t in typing)  # never after the answer
    gaps = [b - a for a, b in zip(typing, typing[1:], strict=False)]
    assert len(typing) >= 3 and all(g == pytest.approx(20.0, abs=0.5) for g in gaps), gaps
    assert send.at - typing[-1] <= 20.5


async def test_a_crash_before_acceptance_is_answered_once_after_meta_retries(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path, serve=False) as (bot, fake):
        ada = bot.ada
        bot.store = store = StoreProxy(bot.store)  # type: ignore[assignment]
        store.fail["accept"] = StoreError("disk I/O error")
        async with bot.serving():
            body = fake.body([fake.user_message(ada, "does this survive?")])
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fake.deliver, body)
                await fake.wait_until(lambda: len(fake.deliveries) >= 1)
                del store.fail["accept"]  # the disk is back
            expected = echo_of(ada, "does this survive?")
            await fake.wait_until(lambda: expected in bot.texts_to(ada))
            await trio.sleep(30)
    assert fake.deliveries[0][0] >= 500  # the crash: no 200, so Meta retried ...
    assert fake.deliveries[-1][0] == 200
    assert bot.texts_to(ada) == [expected]  # ... and it was answered exactly once


async def test_media_whose_sha256_does_not_match_is_not_given_to_the_agent(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path) as (bot, fake):
        ada = bot.ada
        media_id = fake.add_media(b"%PDF-1.7 tampered", mime="application/pdf")
        fake.media_sha256[media_id] = "0" * 64  # what Meta says it should be
        document = {"id": media_id, "mime_type": "application/pdf", "filename": "q3.pdf"}
        await bot.say(type="document", document=document)
        await fake.wait_until(lambda: len(bot.texts_to(ada)) == 1)
    [parts] = bot.harness.prompts
    assert not [p for p in parts if not isinstance(p, TextPart)]
    assert any(
        "q3.pdf" in p.text and "could not be downloaded" in p.text
        for p in parts
        if isinstance(p, TextPart)
    )


async def test_a_signed_body_that_does_not_decode_is_a_malformed_drop_answered_200(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with capture_logs() as logs:
        async with whatsapp_bed(tmp_path) as (bot, fake):
            ada = bot.ada
            for junk in (b"not json at all", b'{"object":"page","entry":[]}', b"[" * 5000):
                assert await fake.post(junk) == 200  # a retry would not fix it
            bad_message = fake.body([fake.user_message(ada, "x") | {"text": {"body": 5}}])
            assert await fake.post(bad_message) == 200
            await bot.say("still here?")
            await fake.wait_until(lambda: echo_of(ada, "still here?") in bot.texts_to(ada))
    drops = [e for e in logs if e["event"] == "event_dropped" and e.get("reason") == "malformed"]
    assert len(drops) == 4
    assert bot.results == {BOT: "shutdown"}
    assert not [e for e in logs if e["event"] == "bot_failed_restarting"]  # never stopped


async def test_a_user_with_bsuid_and_phone_is_keyed_by_bsuid_and_answered_at_the_phone(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path) as (bot, fake):
        ada = fake.user("16505551234", "Ada Lovelace", bsuid="US.13491208655302741918")
        await bot.say("hi", ada)
        expected = echo_of(ada, "hi")
        await fake.wait_until(lambda: bot.texts_to(ada) == [expected])
    assert '"senderId":"US.13491208655302741918"' in expected
    [send] = fake.calls_to("send")
    assert send.body["to"] == "16505551234" and "recipient" not in send.body


async def test_without_the_http_endpoint_the_bot_stops_once_saying_why(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with whatsapp_bed(tmp_path, serve=False) as (bot, fake):
        config = parse_config(
            {"bots": [{"name": BOT, "channel": "whatsapp", **bot_table(fake)}]}, env={}
        )
        with capture_logs() as logs, trio.fail_after(300):
            results = await serve_bots(
                config, bot.store, shutdown=trio.Event(), channels={BOT: CHANNEL}, clock=Clock()
            )
    assert results == {BOT: "fatal"}
    [stopped] = [e for e in logs if e["event"] == "bot_stopped_fatal"]
    assert "HTTP endpoint" in str(stopped)
    assert len(fake.calls_to("phone")) == 1
