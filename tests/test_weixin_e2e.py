"""End to end: ``dshim serve``'s own code path against the fake iLink API.

Testing manifesto: the bot runs through :func:`dshim.serve.serve_bots` -- supervisor,
channel, client, pipeline, SQLite store, renderer -- against
:mod:`dshim.testing.fakes.weixin` on 127.0.0.1, port 0, with the echo harness, on trio's
autojump clock, with a hard virtual deadline.  Assertions are about what the chat shows
and what the agent receives.
"""

from __future__ import annotations

from pathlib import Path

import trio
from structlog.testing import capture_logs

from dshim.channels.weixin.render import CUT_NOTICE
from dshim.model import ImagePart
from dshim.testing.fakes.weixin import TEST_TOKEN, USER, BotMessage
from tests.channel_contract import RecordingHarness, quote_block
from tests.rig_weixin import (
    BOT,
    DEADLINE,
    World,
    echo_of,
    texts,
    weixin_bed,
)


async def test_dm_is_answered_once_with_the_exact_text_and_typing(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with weixin_bed(tmp_path) as w:
        w.fake.user_message("echo:slow 12 tell me a story")
        expected = echo_of("echo:slow 12 tell me a story")
        await w.fake.wait_until(lambda: expected in texts(w.fake))
        await trio.sleep(10)
    assert texts(w.fake) == [expected]
    statuses = [s for _, s in w.fake.typing]
    assert statuses.count(1) >= 2 and statuses[-1] == 2
    send_at = w.fake.calls_to("sendmessage")[0].at
    assert w.fake.calls_to("sendtyping")[-1].at <= send_at


# --- quotes ---------------------------------------------------------------------------------


async def _answered(w: World, text: str) -> BotMessage:
    w.fake.user_message(text)
    expected = echo_of(text)
    await w.fake.wait_until(lambda: expected in texts(w.fake))
    return next(b for b in w.fake.bot_messages if b.text == expected)


async def test_quote_of_the_bots_answer_shell_is_recovered_from_the_index_by_id(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    harness = RecordingHarness()
    async with weixin_bed(tmp_path, harness=harness) as w:
        answer = await _answered(w, "list <two> things & stop")
        await trio.sleep(5)
        w.fake.user_message("why the second one?", quote=w.fake.quote_of(answer.server_id))
        await w.fake.wait_until(lambda: len(w.fake.bot_messages) == 2)
    block = quote_block(
        messageId=str(answer.server_id),
        authorId=w.fake.bot_id,
        authorName=BOT,
        content=echo_of("list <two> things & stop"),
    )
    assert harness.texts()[1] == echo_of("why the second one?", reply_block=block)


async def test_a_shell_without_id_is_recovered_by_its_time(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    harness = RecordingHarness()
    async with weixin_bed(tmp_path, harness=harness) as w:
        w.fake.shell_svr_id = False
        answer = await _answered(w, "first answer")
        await trio.sleep(120)
        await _answered(w, "second answer")  # another answer, two minutes later
        await trio.sleep(5)
        w.fake.user_message("about the first", quote=w.fake.quote_of(answer.server_id))
        await w.fake.wait_until(lambda: len(w.fake.bot_messages) == 3)
    block = quote_block(authorId=w.fake.bot_id, authorName=BOT, content=echo_of("first answer"))
    assert harness.texts()[2] == echo_of("about the first", reply_block=block)
    assert '"messageId"' not in harness.texts()[2]  # the shell carried no id


async def test_an_id_only_quote_of_the_users_own_message_gives_its_text_and_author(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    harness = RecordingHarness()
    async with weixin_bed(tmp_path, harness=harness) as w:
        mine = w.fake.user_message("/new")
        await w.fake.wait_until(lambda: len(w.fake.bot_messages) == 1)
        await trio.sleep(2)
        quote = w.fake.quote_of(mine["message_id"], id_only=True)
        w.fake.user_message("what did I mean?", quote=quote)
        await w.fake.wait_until(lambda: len(harness.prompts) == 1)
        await trio.sleep(5)
    block = quote_block(messageId=str(mine["message_id"]), authorId=USER, content="/new")
    # The quoted /new is content: the only prompt is the question, with the block.
    assert harness.texts() == [echo_of("what did I mean?", reply_block=block)]


async def test_an_unrecoverable_shell_is_not_delivered(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    harness = RecordingHarness()
    async with weixin_bed(tmp_path, harness=harness) as w:
        w.fake.user_message("huh?", quote={"svr_id": 1234, "message_item": {"type": 8}})
        w.fake.user_message("hmm", quote={"svr_id": 1235, "message_item": {"type": 77}})
        await w.fake.wait_until(lambda: len(w.fake.bot_messages) == 2)
    assert (
        '"messageId":"1234","attachments":[],"unavailableReason":"not-delivered"'
        in harness.texts()[0]
    )
    assert (
        '"messageId":"1235","attachments":[],"unavailableReason":"unsupported"'
        in harness.texts()[1]
    )


# --- receiving ------------------------------------------------------------------------------


async def test_a_redelivered_message_is_answered_once(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with weixin_bed(tmp_path, deadline=DEADLINE + 3600) as w:
        first = w.fake.user_message("only once")
        await w.fake.wait_until(lambda: len(w.fake.bot_messages) == 1)
        await trio.sleep(50 * 60)  # iLink redelivers up to ~50 minutes later
        w.fake.redeliver(first)
        w.fake.user_message("next")
        await w.fake.wait_until(lambda: len(w.fake.bot_messages) == 2)
        await trio.sleep(10)
    assert texts(w.fake) == [echo_of("only once"), echo_of("next")]


async def test_group_messages_and_own_echoes_cost_no_call(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with weixin_bed(tmp_path) as w:
        before = len(w.fake.calls_except("getupdates"))
        w.fake.user_message("hello group", group_id="123@chatroom")
        mine = w.fake.user_message("mine")
        w.fake.redeliver(mine | {"message_id": mine["message_id"] + 1, "message_type": 2})
        await trio.sleep(60)
        assert len(w.fake.calls_except("getupdates")) > before  # "mine" was answered
        calls = [c.op for c in w.fake.calls_except("getupdates")[before:]]
    assert calls.count("sendmessage") == 1


async def test_an_image_is_downloaded_and_decrypted_inside_the_turn(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    harness = RecordingHarness()
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
    async with weixin_bed(tmp_path, harness=harness) as w:
        param, key = w.fake.add_media(png)
        image = {
            "type": 2,
            "image_item": {"aeskey": key, "media": {"encrypt_query_param": param}},
        }
        w.fake.user_message(items=[image])
        await w.fake.wait_until(lambda: len(harness.prompts) == 1)
        await trio.sleep(5)
    [img] = [p for p in harness.prompts[0] if isinstance(p, ImagePart)]
    assert img.data == png and img.mime == "image/png"
    assert len(w.fake.calls_to("cdn/download")) == 1


async def test_server_errors_back_off_2_s_then_30_s(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with weixin_bed(tmp_path) as w:
        w.fake.drop_polls()
        w.fake.fail_next("getupdates", 4, status=502)
        await w.fake.wait_until(lambda: len(w.fake.calls_to("getupdates")) >= 6)
        w.fake.user_message("still here")
        await w.fake.wait_until(lambda: len(w.fake.bot_messages) == 1)
    polls = w.fake.calls_to("getupdates")
    gaps = [round(b.at - a.at) for a, b in zip(polls[0:5], polls[1:6], strict=True)]
    assert gaps == [2, 2, 30, 30, 30]  # the dropped poll, then four 502s


# --- sending --------------------------------------------------------------------------------


async def test_minus_2_on_send_is_retried_once_after_3_s(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with weixin_bed(tmp_path) as w:
        w.fake.fail_next("sendmessage", 1, ret=-2)
        await _answered(w, "retry me")
        sends = w.fake.calls_to("sendmessage")
        assert [c.ret for c in sends] == [-2, 0]
        assert sends[1].at - sends[0].at >= 3
        ids = [c.body["msg"]["client_id"] for c in sends]
        assert ids[0] != ids[1]  # every send has a fresh client_id
        with capture_logs() as logs:
            w.fake.fail_next("sendmessage", 5, ret=-2)
            w.fake.user_message("refused")
            await w.fake.wait_until(lambda: len(w.fake.calls_to("sendmessage")) == 4)
            await trio.sleep(60)
    assert len(w.fake.calls_to("sendmessage")) == 4  # one retry, never a loop
    assert texts(w.fake) == [echo_of("retry me")]
    assert [e["reason"] for e in logs if e["event"] == "reply_undelivered"] == ["ReplyRefused"]


async def test_a_long_answer_is_split_into_at_most_8_messages(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    words = " ".join(f"word{i}" for i in range(9000))
    async with weixin_bed(tmp_path) as w:
        w.fake.user_message(words)
        await w.fake.wait_until(lambda: len(w.fake.bot_messages) == 8)
        await trio.sleep(30)
    sent = texts(w.fake)
    assert len(sent) == 8 and all(len(t) <= 4000 for t in sent)
    assert sent[-1].endswith(CUT_NOTICE)
    assert " ".join(sent[:7]).startswith(echo_of("word0")[: -len("word0")])


async def test_the_context_token_survives_a_restart(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with weixin_bed(tmp_path, serve=False) as w:
        async with w.bot(grace_s=1.0):
            w.fake.user_message("echo:slow 60 cut short")
            await w.fake.wait_until(lambda: len(w.fake.calls_to("sendtyping")) >= 1)
        assert w.fake.bot_messages == []  # stopped before anything was sent
        polls = len(w.fake.calls_to("getupdates"))
        async with w.bot(poll=False):
            await w.fake.wait_until(lambda: len(w.fake.bot_messages) == 1)
            # No new message came: the stored cursor and context token were used.
            assert all(
                not c.body.get("get_updates_buf") == ""
                for c in w.fake.calls_to("getupdates")[polls:]
            )
    assert texts(w.fake) == [echo_of("echo:slow 60 cut short")]


async def test_an_expired_session_stops_the_bot_and_names_the_login_command(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with capture_logs() as logs:
        async with weixin_bed(tmp_path, serve=False) as w:
            w.fake.expire()
            async with w.bot(poll=False) as run:
                await trio.sleep(300)
                assert run.results == {BOT: "fatal"}
            assert len(w.fake.calls_to("msg/notifystart")) == 1
            w.fake.expired = False
            async with w.bot() as run:
                w.fake.expire()
                w.fake.drop_polls()
                await trio.sleep(300)
                assert run.results == {BOT: "fatal"}
    assert len(w.fake.calls_to("getupdates")) == 2  # no retry loop after -14
    fatal = [e for e in logs if e["event"] == "bot_stopped_fatal"]
    assert len(fatal) == 2 and all("dshim login wx" in repr(e) for e in fatal)
    assert not [e for e in logs if TEST_TOKEN in repr(e)]


async def test_a_client_timeout_is_an_empty_batch_and_minus_2_backs_off(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with capture_logs() as logs:
        async with weixin_bed(tmp_path) as w:
            w.fake.window_ms = 120_000  # the server holds longer than the client waits
            w.fake.drop_polls()
            await w.fake.wait_until(lambda: len(w.fake.calls_to("getupdates")) >= 4)
            quiet = w.fake.calls_to("getupdates")
            w.fake.window_ms = 35_000
            w.fake.fail_next("getupdates", 1, ret=-2)
            w.fake.drop_polls()
            w.fake.user_message("after the quiet")
            await w.fake.wait_until(lambda: len(w.fake.bot_messages) == 1)
    # Polls 2 and 3 ended by the client's read timeout (45 s) and were asked again at once
    # with the same cursor: a quiet chat, not a failure.
    assert round(quiet[3].at - quiet[2].at) == 45
    assert quiet[2].body["get_updates_buf"] == quiet[3].body["get_updates_buf"]
    failed = [e["error"] for e in logs if e["event"] == "poll_failed"]
    assert len(failed) == 3 and "ret -2" in failed[2]  # two dropped polls, then the -2


async def test_a_server_without_notifystart_still_runs_the_bot(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with weixin_bed(tmp_path, serve=False) as w:
        w.fake.fail_next("msg/notifystart", 1, status=404)
        async with w.bot():
            await _answered(w, "no notifystart here")
    assert len(w.fake.calls_to("msg/notifystart")) == 1


# --- context tokens -------------------------------------------------------------------------

#: A sequence number above every later message's (a backlog or redelivered message).
HIGH_SEQ = 1_000_000


def _sends(w: World) -> list[tuple[int | None, str]]:
    """Each ``sendmessage``: its ``ret`` and the context token it carried."""
    return [(c.ret, c.body["msg"]["context_token"]) for c in w.fake.calls_to("sendmessage")]


def _backlog_ms(w: World) -> int:
    """A time far beyond the backlog limit (600 s)."""
    return int((w.clock() - 3600) * 1000)


async def test_messages_the_pipeline_drops_never_replace_the_context_token(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with capture_logs() as logs:
        async with weixin_bed(tmp_path) as w:
            first = w.fake.user_message("hello")
            await w.fake.wait_until(lambda: len(w.fake.bot_messages) == 1)
            # Each with a higher seq than any later message and a token iLink refuses.
            w.fake.user_message(
                "from the backlog", seq=HIGH_SEQ, sent_ms=_backlog_ms(w), revoked=True
            )
            w.fake.redeliver(first | {"seq": HIGH_SEQ + 1, "context_token": "ctx-never-issued"})
            w.fake.user_message(items=[{"type": 1, "text_item": {"text": " "}}], seq=HIGH_SEQ + 2)
            w.fake.revoke(w.fake.log[-1]["context_token"])
            await trio.sleep(10)
            after = w.fake.user_message("after the drops")
            await w.fake.wait_until(lambda: len(w.fake.calls_to("sendmessage")) >= 2)
            await trio.sleep(30)
    # One page: steps 1-4 judge all three before the store's one transaction finds the
    # duplicate, so the duplicate is logged last.
    dropped = [e["reason"] for e in logs if e["event"] == "event_dropped"]
    assert sorted(dropped) == ["duplicate", "ignored", "stale"]
    assert texts(w.fake) == [echo_of("hello"), echo_of("after the drops")]
    assert _sends(w) == [(0, first["context_token"]), (0, after["context_token"])]


async def test_a_stale_message_does_not_poison_the_context_token_across_a_restart(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with weixin_bed(tmp_path, serve=False) as w:
        async with w.bot():
            first = await _answered(w, "before the restart")
            w.fake.user_message(
                "from the backlog", seq=HIGH_SEQ, sent_ms=_backlog_ms(w), revoked=True
            )
            await trio.sleep(10)
        async with w.bot():
            after = w.fake.user_message("after the restart")
            await w.fake.wait_until(lambda: len(w.fake.calls_to("sendmessage")) >= 2)
            await trio.sleep(30)
    assert first.text == echo_of("before the restart")
    assert texts(w.fake) == [echo_of("before the restart"), echo_of("after the restart")]
    assert _sends(w)[1] == (0, after["context_token"])


async def test_a_denied_message_does_not_poison_the_context_token_for_later(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    allowlist = {"mode": "allowlist", "users": ["someone-else@im.wechat"]}
    with capture_logs() as logs:
        async with weixin_bed(tmp_path, serve=False) as w:
            async with w.bot():
                await _answered(w, "hello")
            async with w.bot(access=allowlist):
                w.fake.user_message("while not allowed", seq=HIGH_SEQ, revoked=True)
                await trio.sleep(10)
            async with w.bot():  # allowed again
                back = w.fake.user_message("allowed again")
                await w.fake.wait_until(lambda: len(w.fake.calls_to("sendmessage")) >= 2)
                await trio.sleep(30)
    assert [e["reason"] for e in logs if e["event"] == "event_dropped"] == ["denied"]
    assert texts(w.fake) == [echo_of("hello"), echo_of("allowed again")]
    assert _sends(w)[1] == (0, back["context_token"])


async def test_a_refused_token_falls_back_once_to_the_last_one_that_worked(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with weixin_bed(tmp_path) as w:
        first = w.fake.user_message("first")
        await w.fake.wait_until(lambda: len(w.fake.bot_messages) == 1)
        good = first["context_token"]
        # The server already refuses the next message's own token.
        second = w.fake.user_message("second", revoked=True)
        await trio.sleep(60)
        assert _sends(w) == [(0, good), (-2, second["context_token"]), (0, good)]
        # Both refused: one fallback, never a loop.
        w.fake.revoke(good)
        with capture_logs() as logs:
            third = w.fake.user_message("third", revoked=True)
            await w.fake.wait_until(lambda: len(w.fake.calls_to("sendmessage")) >= 5)
            await trio.sleep(60)
    assert _sends(w)[3:] == [(-2, third["context_token"]), (-2, good)]
    assert texts(w.fake) == [echo_of("first"), echo_of("second")]
    assert [e["reason"] for e in logs if e["event"] == "reply_undelivered"] == ["ReplyRefused"]
    assert not [e for e in logs if good in repr(e) or third["context_token"] in repr(e)]
