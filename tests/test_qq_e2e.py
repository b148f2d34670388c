"""End to end: the real QQ channel, run by ``serve_bots``, against the fake QQ.

See ``tests/rig_qq.py`` for the testing manifesto (127.0.0.1, autojump clock, real
SQLite store, echo harness).
"""

from __future__ import annotations

from pathlib import Path

import trio
from structlog.testing import capture_logs

from dshim.channels.qq.render import TOO_LONG_NOTICE, WINDOW_NOTICE, WORKING_TEXT
from dshim.harness.echo import EchoHarness
from dshim.pipeline.runtime import INTERRUPTED_TEXT
from dshim.testing.fakes.qq import FakeQQ, open_fake_qq
from tests.channel_contract import reply_to_block
from tests.rig_qq import echo, running_bot, source, texts

GROUP_SEND = "POST /v2/groups/{group_openid}/messages"
STREAM = "POST /v2/users/{openid}/stream_messages"


async def test_a_direct_message_is_answered_by_a_closed_native_stream(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        d = await fake.c2c_message("echo:slow 6 tell me a story")
        expected = echo(fake, "echo:slow 6 tell me a story")
        await fake.wait_until(lambda: expected in texts(fake, fake.c2c_conversation))
        await trio.sleep(5)
    [answer] = fake.bot_messages(fake.c2c_conversation)
    assert answer.stream and answer.done
    assert answer.content == expected
    assert len(answer.shown) >= 3 and answer.shown.count(expected) == 1
    assert all(expected.startswith(t) for t in answer.shown)
    assert answer.msg_id == d["id"] and answer.seq == 1
    # the answer quotes the user's message by its msg_idx (never by its id)
    assert answer.reference == fake.inbound[d["id"]].msg_idx
    chunks = [c for c in fake.calls if c.path.endswith("/stream_messages")]
    gaps = [b.at - a.at for a, b in zip(chunks, chunks[1:], strict=False)]
    assert min(gaps) >= 0.7 - 1e-9
    assert [c.json["index"] for c in chunks] == list(range(len(chunks)))
    assert chunks[-1].json["input_state"] == 10
    assert all(c.json["msg_seq"] == 1 and c.json["msg_id"] == d["id"] for c in chunks)


# --- groups: passive replies, the working reply, the 5-minute cut ----------------------------


async def test_a_group_answer_quotes_the_user_and_needs_no_working_reply(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        d = await fake.group_message("what is 2+2?")
        expected = echo(fake, "what is 2+2?", "group")
        await fake.wait_until(lambda: expected in texts(fake, fake.group_conversation))
        await trio.sleep(30)
    [answer] = fake.bot_messages(fake.group_conversation)
    assert (answer.msg_id, answer.seq, answer.stream) == (d["id"], 1, False)
    assert answer.reference == fake.inbound[d["id"]].msg_idx
    assert answer.msg_type == 0 and answer.content == expected  # group answers are text


async def test_a_slow_group_answer_gets_a_working_reply_first(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    harness = EchoHarness(slow_interval_s=4.0)
    async with running_bot(tmp_path, harness=harness) as (bot, fake):
        d = await fake.group_message("echo:slow 5 think hard")
        t0 = trio.current_time()
        expected = echo(fake, "echo:slow 5 think hard", "group")
        await fake.wait_until(lambda: expected in texts(fake, fake.group_conversation))
    working, answer = fake.bot_messages(fake.group_conversation)
    assert working.content == WORKING_TEXT and 10.0 <= working.at - t0 < 11.0
    assert working.reference == fake.inbound[d["id"]].msg_idx and answer.reference is None
    assert (working.seq, answer.seq) == (1, 2)


async def test_the_group_window_cut_sends_what_exists_with_the_notice_in_exactly_5_replies(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    long_text = " ".join(f"word{i:05d}" for i in range(1400))  # ~14,000 characters
    harness = EchoHarness(slow_interval_s=40.0)  # 9 pieces: 320 s, beyond the window
    async with running_bot(tmp_path, harness=harness) as (bot, fake):
        d = await fake.group_message(f"echo:slow 9 {long_text}")
        t0 = trio.current_time()
        await fake.wait_until(lambda: len(fake.bot_messages(fake.group_conversation)) == 5)
        cut_at = trio.current_time() - t0
        await trio.sleep(400)  # the agent ends at 320 s: nothing more may be sent
        assert bot.store is not None
        binding = await bot.store.get_binding("qqbot", fake.group_conversation, "")
        assert binding is not None
        rows = await bot.store.transcript_page(binding.session_id, before_id=None, limit=10)
    msgs = fake.bot_messages(fake.group_conversation)
    assert [x.seq for x in msgs] == [1, 2, 3, 4, 5] and msgs[0].content == WORKING_TEXT
    assert 269.0 <= cut_at < 275.0  # 4.5 min (the platform time has whole seconds)
    assert msgs[-1].content.endswith(WINDOW_NOTICE)
    assert all(len(x.content) <= 2000 for x in msgs)
    shown = " ".join(x.content for x in msgs[1:])
    assert "word00000" in shown and "word01399" not in shown
    assert len([c for c in fake.sends() if c.status == 200]) == 5
    assert all(c.at - t0 < 276.0 for c in fake.sends())  # no attempt after the cut
    [answer] = [r for r in rows if r.role == "assistant"]
    assert answer.text.endswith("word01399")  # the transcript keeps the whole answer
    assert all(x.msg_id == d["id"] for x in msgs)


async def test_a_c2c_answer_longer_than_four_replies_is_cut_with_a_notice(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    long_text = "\n\n".join(f"paragraph {i}: " + "y" * 1200 for i in range(9))
    async with running_bot(tmp_path) as (bot, fake):
        await fake.c2c_message(long_text)
        await fake.wait_until(
            lambda: sum(1 for x in fake.bot_messages(fake.c2c_conversation) if x.done) == 4
        )
        await trio.sleep(30)
    msgs = fake.bot_messages(fake.c2c_conversation)
    assert len(msgs) == 4 and [x.seq for x in msgs] == [1, 2, 3, 4]
    assert all(x.done for x in msgs) and msgs[-1].content.endswith(TOO_LONG_NOTICE)
    assert [c.status for c in fake.sends()].count(400) == 0


# --- exactly once -------------------------------------------------------------------------------


async def test_a_retry_after_a_lost_answer_reuses_msg_seq_and_shows_one_message(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            fake.drop_response_next(GROUP_SEND)  # delivered, but the bot never hears back
            await fake.group_message("once please")
            expected = echo(fake, "once please", "group")
            await fake.wait_until(lambda: len(fake.sends()) >= 2)
            await trio.sleep(30)
    assert [e["failed"] for e in logs if e["event"] == "turn_finished"] == [False]
    assert texts(fake, fake.group_conversation) == [expected]
    first, retry = fake.sends()[:2]
    assert first.json["msg_seq"] == retry.json["msg_seq"] == 1
    assert (first.status, retry.status, retry.code) == (200, 400, 40054005)
    assert len(fake.sends()) == 2


async def test_a_rate_limited_group_send_is_retried_with_the_same_seq(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.rate_limit(GROUP_SEND, 3, retry_after=2.0)
        await fake.group_message("storm")
        expected = echo(fake, "storm", "group")
        await fake.wait_until(lambda: expected in texts(fake, fake.group_conversation))
        await trio.sleep(20)
    assert texts(fake, fake.group_conversation) == [expected]
    sends = fake.sends()
    assert [c.status for c in sends] == [429, 429, 429, 200]
    assert {c.json["msg_seq"] for c in sends} == {1}
    assert sends[-1].at - sends[0].at >= 6.0


async def test_an_expired_window_ends_delivery_with_a_log_line_not_a_loop(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            fake.fail_next(GROUP_SEND, 1, status=400, code=304027)
            await fake.group_message("too late")
            await fake.wait_until(lambda: len(fake.sends()) >= 1)
            await trio.sleep(60)
    assert len(fake.sends()) == 1 and not fake.bot_messages(fake.group_conversation)
    assert [e["event"] for e in logs].count("reply_window_expired") == 1


async def test_pending_audit_counts_as_sent(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    with capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            fake.fail_next(GROUP_SEND, 1, status=200, code=304023, description="pending audit")
            await fake.group_message("audited")
            await fake.wait_until(lambda: len(fake.sends()) >= 1)
            await trio.sleep(60)
    assert len(fake.sends()) == 1
    assert [e["failed"] for e in logs if e["event"] == "turn_finished"] == [False]


async def test_the_same_event_twice_is_answered_once(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        d = fake.c2c_payload("only once")
        await fake.dispatch("C2C_MESSAGE_CREATE", d)
        await fake.dispatch("C2C_MESSAGE_CREATE", d)
        expected = echo(fake, "only once")
        await fake.wait_until(lambda: expected in texts(fake, fake.c2c_conversation))
        await trio.sleep(20)
    assert texts(fake, fake.c2c_conversation) == [expected]
    assert bot.events.prompts == [expected]
    assert [r for _, r in bot.events.drops] == ["duplicate"]


# --- C2C streams are always closed ---------------------------------------------------------


async def test_stop_closes_the_stream(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        await fake.c2c_message("echo:slow 40 a long story")
        await fake.wait_until(lambda: bool(fake.bot_messages(fake.c2c_conversation)))
        await trio.sleep(3)
        await fake.c2c_message("/stop")
        await fake.wait_until(lambda: all(x.done for x in fake.bot_messages(fake.c2c_conversation)))
        await trio.sleep(10)
    streams = [x for x in fake.bot_messages(fake.c2c_conversation) if x.stream]
    assert streams and all(x.done for x in streams)
    assert "a long story" not in streams[0].content  # cut short


async def test_a_failing_stream_is_still_closed(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        await fake.c2c_message("echo:slow 10 it breaks")
        await fake.wait_until(lambda: bool(fake.bot_messages(fake.c2c_conversation)))
        fake.fail_next(STREAM, 2, status=400, code=12345)  # refused: not retryable
        await fake.wait_until(lambda: all(x.done for x in fake.bot_messages(fake.c2c_conversation)))
        await trio.sleep(20)
    [msg] = fake.bot_messages(fake.c2c_conversation)
    assert msg.done and msg.content != echo(fake, "echo:slow 10 it breaks")
    closing = [c for c in fake.sends() if c.status == 200][-1]
    assert closing.json["input_state"] == 10 and closing.json["stream_msg_id"] == msg.id


async def test_shutdown_mid_answer_closes_the_stream(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path, **{}) as (bot, fake):
        await fake.c2c_message("echo:slow 60 never ends")
        await fake.wait_until(lambda: len(fake.bot_messages(fake.c2c_conversation)) == 1)
        await trio.sleep(2)
    [msg] = fake.bot_messages(fake.c2c_conversation)
    assert msg.done


async def test_markdown_refused_falls_back_to_text(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path, configure={"markdown_allowed": False}) as (bot, fake):
        await fake.c2c_message("plain please")
        one, two = echo(fake, "plain please"), echo(fake, "and here", "group")
        await fake.wait_until(lambda: one in texts(fake, fake.c2c_conversation))
        await fake.group_message("and here")
        await fake.wait_until(lambda: two in texts(fake, fake.group_conversation))
    refused = [c for c in fake.sends() if c.code == 50056]
    assert len(refused) == 1  # learned once, for the bot's life
    assert fake.bot_messages(fake.group_conversation)[0].msg_type == 0


async def test_a_group_that_rejects_the_quote_gets_the_answer_without(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path, configure={"reject_group_reference": True}) as (bot, fake):
        await fake.group_message("quote me")
        expected = echo(fake, "quote me", "group")
        await fake.wait_until(lambda: expected in texts(fake, fake.group_conversation))
    [msg] = fake.bot_messages(fake.group_conversation)
    assert msg.reference is None and msg.seq == 1


# --- the connection ---------------------------------------------------------------------------


async def test_periodic_forced_closes_resume_without_losing_or_repeating_events(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(
        tmp_path, configure={"force_close_every_s": 60.0, "replay_on_resume": 2}
    ) as (bot, fake):
        sent = []
        for i in range(6):
            sent.append(f"message {i}")
            await fake.c2c_message(f"message {i}")
            await trio.sleep(35)
        expected = [echo(fake, t) for t in sent]
        await fake.wait_until(
            lambda: all(e in texts(fake, fake.c2c_conversation) for e in expected)
        )
        await trio.sleep(30)
    assert texts(fake, fake.c2c_conversation) == expected
    assert len(fake.identifies) == 1 and fake.resumed_count >= 3
    assert bot.events.prompts == expected


async def test_a_drop_mid_turn_resumes_and_the_answer_arrives_once(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.replay_on_resume = 5
        await fake.c2c_message("echo:slow 8 through the drop")
        await fake.wait_until(lambda: bool(fake.bot_messages(fake.c2c_conversation)))
        await fake.drop_connection()
        await fake.c2c_message("while away")  # waits in the session, replayed on resume
        expected = [echo(fake, "echo:slow 8 through the drop"), echo(fake, "while away")]
        await fake.wait_until(
            lambda: all(e in texts(fake, fake.c2c_conversation) for e in expected)
        )
        await trio.sleep(20)
    assert texts(fake, fake.c2c_conversation) == expected
    assert fake.resumed_count == 1 and len(fake.identifies) == 1


async def test_a_rejected_token_on_the_gateway_is_renewed_once(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        calls = len(fake.token_calls)
        fake.expire_tokens()
        await fake.close_gateway(4004, "invalid token")
        await fake.wait_until(lambda: fake.ready_count == 2)
        await fake.c2c_message("still here")
        expected = echo(fake, "still here")
        await fake.wait_until(lambda: expected in texts(fake, fake.c2c_conversation))
    assert len(fake.token_calls) == calls + 1
    assert fake.identifies[-1]["token_ok"]
    assert bot.results is not None and bot.results.get("qqbot") != "fatal"


async def test_a_rejected_api_token_is_renewed_once(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        calls = len(fake.token_calls)
        fake.expire_tokens()  # the next send answers 401
        await fake.c2c_message("after expiry")
        expected = echo(fake, "after expiry")
        await fake.wait_until(lambda: expected in texts(fake, fake.c2c_conversation))
    assert len(fake.token_calls) == calls + 1
    assert [c.status for c in fake.sends()][0] == 401


async def test_the_token_is_renewed_in_its_last_two_minutes(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path, configure={"token_lifetime_s": 600.0}) as (bot, fake):
        first = fake.token_calls[0]
        await trio.sleep(600 - 150)
        await fake.c2c_message("early")
        await fake.wait_until(lambda: bool(fake.bot_messages(fake.c2c_conversation)))
        assert len(fake.token_calls) == 1  # not yet: 150 s left
        await trio.sleep(60)
        await fake.c2c_message("late")
        await fake.wait_until(lambda: len(fake.bot_messages(fake.c2c_conversation)) == 2)
    assert len(fake.token_calls) == 2
    assert 60.0 <= first + 600 - fake.token_calls[1] <= 120.0
    assert all(c.status != 401 for c in fake.calls)


async def test_intents_that_are_not_approved_stop_the_bot_once(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with capture_logs() as logs:
        async with running_bot(
            tmp_path, configure={"approved_intents": 1 << 25}, wait_ready=False
        ) as (bot, fake):
            await bot.ended.wait()
    assert bot.results == {"qqbot": "fatal"}
    assert len(fake.identifies) == 1
    [stopped] = [e for e in logs if e["event"] == "bot_stopped_fatal"]
    assert "4014" in repr(stopped) and "q.qq.com" in repr(stopped)


async def test_configured_intents_are_sent(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    async with running_bot(tmp_path, intents=["group_and_c2c_event"]) as (bot, fake):
        pass
    assert fake.identifies[0]["intents"] == 1 << 25 and fake.identifies[0]["shard"] == [0, 1]


# --- quotes ------------------------------------------------------------------------------------


def block(**fields: object) -> str:
    return reply_to_block(fields)


async def test_a_quote_of_a_users_message_is_resolved_from_the_index(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        first = await fake.c2c_message("remember: the code is 1234")
        await fake.wait_until(lambda: len(fake.bot_messages(fake.c2c_conversation)) == 1)
        idx = fake.inbound[first["id"]].msg_idx
        await fake.c2c_message("what was it?", quote=idx, snapshot=False)
        await fake.wait_until(lambda: len(bot.events.prompts) == 2)
    quoted = block(
        messageId=idx,
        authorId=fake.user_openid,
        content="remember: the code is 1234",
        attachments=[],
        truncated=False,
    )
    assert bot.events.prompts[1] == "\n\n".join([source(fake, "direct"), quoted, "what was it?"])


async def test_a_quote_of_the_bots_answer_gets_its_exact_final_text_over_the_snapshot(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        await fake.c2c_message("echo:slow 4 stream this")
        expected = echo(fake, "echo:slow 4 stream this")
        await fake.wait_until(lambda: expected in texts(fake, fake.c2c_conversation))
        await trio.sleep(2)
        [answer] = fake.bot_messages(fake.c2c_conversation)
        answer.content = "a stale snapshot"  # what msg_elements will carry
        await fake.c2c_message("why?", quote=answer.ref_idx)
        await fake.wait_until(lambda: len(bot.events.prompts) == 2)
    quoted = block(
        messageId=answer.ref_idx,
        authorId=fake.bot_user["id"],
        authorName=fake.bot_user["username"],
        content=expected,
        attachments=[],
        truncated=False,
    )
    assert quoted in bot.events.prompts[1]


async def test_a_quote_known_only_from_msg_elements_and_one_known_from_nothing(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        d = fake.c2c_payload("and this one?")
        d["message_type"] = 103
        d["message_scene"]["ext"].append("ref_msg_idx=TMP_5b0c")
        d["msg_elements"] = [{"message_type": 0, "content": "=== 消息 1 === older text"}]
        await fake.dispatch("C2C_MESSAGE_CREATE", d)
        await fake.c2c_message("and that?", quote="REFIDX_unknown==", snapshot=False)
        await fake.wait_until(lambda: len(bot.events.prompts) == 2)
    assert (
        block(
            messageId="TMP_5b0c",
            content="=== 消息 1 === older text",
            attachments=[],
            truncated=False,
        )
        in bot.events.prompts[0]
    )
    assert (
        block(
            messageId="REFIDX_unknown==",
            attachments=[],
            unavailableReason="not-found",
            truncated=False,
        )
        in bot.events.prompts[1]
    )
    assert not [
        c for c in fake.calls if c.method == "GET" and c.path not in ("/users/@me", "/gateway/bot")
    ]


async def test_the_auth_token_never_reaches_logs_store_or_prompt(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            first = await fake.c2c_message("hello")
            await fake.wait_until(lambda: bool(fake.bot_messages(fake.c2c_conversation)))
            await fake.c2c_message("quote", quote=fake.inbound[first["id"]].msg_idx)
            await fake.wait_until(lambda: len(bot.events.prompts) == 2)
            await fake.c2c_message("echo:slow 20 a long one")
            await fake.wait_until(lambda: len(bot.events.prompts) == 3)
            secrets_mid_turn = _files_containing(tmp_path, (fake.auth_token,))
            await fake.drop_connection()
            await fake.wait_until(lambda: fake.resumed_count == 1)
    assert not secrets_mid_turn  # the durable inbox keeps the frame without it
    secret_values = (fake.auth_token, fake.client_secret, *fake.tokens)
    assert logs and not [e for e in logs if any(s in repr(e) for s in secret_values)]
    assert not any(fake.auth_token in p for p in bot.events.prompts)
    assert not _files_containing(tmp_path, secret_values)


def _files_containing(root: Path, values: tuple[str, ...]) -> list[Path]:
    """Files under ``root`` (the store) holding any of ``values``."""
    found = []
    for path in root.rglob("*"):
        if path.is_file() and any(v.encode() in path.read_bytes() for v in values):
            found.append(path)
    return found


async def test_a_voice_message_reaches_the_agent_as_text_and_audio(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        await fake.c2c_message(
            "",
            attachments=[
                {
                    "content_type": "voice",
                    "url": f"{fake.http_url}/media/v.silk",
                    "voice_wav_url": f"{fake.http_url}/media/v.wav",
                    "filename": "v.silk",
                    "asr_refer_text": "what is the weather",
                }
            ],
        )
        await fake.wait_until(lambda: len(bot.events.prompts) == 1)
    text, _, block = bot.events.prompts[0].rpartition("\n\n")
    assert text.endswith("what is the weather")  # the current text, then the files block
    assert block.startswith('<dsh_im_files>[{"name":"v.silk","kind":"audio",')
    [msg] = bot.events.prompt_msgs
    assert [(f.kind, f.name) for f in msg.files] == [("audio", "v.silk")]
    [download] = [c for c in fake.calls if c.path.startswith("/media/")]
    assert download.path == "/media/v.wav"  # the wav rendition, inside the turn
    assert "authorization" not in download.headers  # CDN downloads carry no token


# --- approvals ----------------------------------------------------------------------------------


async def test_an_approval_is_text_with_numbered_options_answered_by_typing(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        d = await fake.c2c_message("echo:approval")
        await fake.wait_until(lambda: any("1." in t for t in texts(fake, fake.c2c_conversation)))
        [prompt] = fake.bot_messages(fake.c2c_conversation)
        await fake.c2c_message("1")
        await fake.wait_until(
            lambda: any("allow_once" in t for t in texts(fake, fake.c2c_conversation))
        )
        await trio.sleep(10)
    assert "Allow once" in prompt.content and prompt.msg_id == d["id"]
    final = [x for x in fake.bot_messages(fake.c2c_conversation) if "allow_once" in x.content]
    assert [x.msg_id for x in final] == [d["id"]]  # the answer goes under the request
    assert all(c.status == 200 for c in fake.sends())


async def test_a_guild_channel_at_message_is_answered_in_the_channel(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        d = await fake.guild_message("status?")
        await fake.wait_until(lambda: bool(fake.bot_messages(f"channel:{fake.channel_id}")))
    [answer] = fake.bot_messages(f"channel:{fake.channel_id}")
    assert answer.msg_id == d["id"] and answer.content.endswith("\n\nstatus?")
    assert '"senderName":"Ada L"' in answer.content


async def test_without_a_gateway_override_the_url_comes_from_the_api(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    def no_gateway_bot(fake: FakeQQ) -> None:
        fake.fail_next("GET /gateway/bot", 1, status=404, code=404)

    async with running_bot(tmp_path, configure=no_gateway_bot, gateway_url=None) as (bot, fake):
        await fake.c2c_message("found you")
        await fake.wait_until(lambda: bool(fake.bot_messages(fake.c2c_conversation)))
    assert [c.path for c in fake.calls if c.path.startswith("/gateway")] == [
        "/gateway/bot",
        "/gateway",
    ]


async def test_unacknowledged_heartbeats_replace_the_socket_by_resume(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.ack_heartbeats = False
        first = fake.live
        await fake.wait_until(lambda: first is not None and first.closed_by is not None)
        fake.ack_heartbeats = True
        await fake.wait_until(lambda: fake.resumed_count == 1)
        await fake.c2c_message("alive?")
        await fake.wait_until(lambda: bool(fake.bot_messages(fake.c2c_conversation)))
    assert first is not None and (first.closed_by, first.closed_code) == ("client", 4000)
    assert len(fake.identifies) == 1


async def test_a_5xx_on_a_group_send_is_retried_with_the_same_seq(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.fail_next(GROUP_SEND, 2, status=502, code=0)
        await fake.group_message("flaky")
        expected = echo(fake, "flaky", "group")
        await fake.wait_until(lambda: expected in texts(fake, fake.group_conversation))
    assert [c.status for c in fake.sends()] == [502, 502, 200]
    assert {c.json["msg_seq"] for c in fake.sends()} == {1}


async def test_a_stream_endpoint_that_rejects_the_quote_streams_without_it(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path, configure={"reject_stream_reference": True}) as (bot, fake):
        await fake.c2c_message("echo:slow 3 one")
        await fake.wait_until(lambda: bool(fake.bot_messages(fake.c2c_conversation)))
        await fake.c2c_message("two")
        expected = echo(fake, "two")
        await fake.wait_until(lambda: expected in texts(fake, fake.c2c_conversation))
    assert [m.reference for m in fake.bot_messages(fake.c2c_conversation)] == [None, None]
    assert len([c for c in fake.sends() if c.status == 400]) == 1  # learned once


async def test_with_keyboards_an_approval_has_buttons_and_a_press_answers_it(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path, keyboards=True) as (bot, fake):
        d = await fake.c2c_message("echo:approval")
        await fake.wait_until(lambda: bool(fake.bot_messages(fake.c2c_conversation)))
        [request] = fake.bot_messages(fake.c2c_conversation)
        await fake.press(request, "Allow once")
        await fake.wait_until(
            lambda: any("allow_once" in t for t in texts(fake, fake.c2c_conversation))
        )
    assert [b["action"]["data"] for b in request.buttons()] == ["1", "2", "3"]
    assert "1." in request.content and request.msg_id == d["id"] and request.msg_type == 2
    assert [c.status for c in fake.sends()].count(403) == 0


async def test_a_refused_keyboard_falls_back_to_text_for_good(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path, configure={"keyboards_allowed": False}, keyboards=True) as (
        bot,
        fake,
    ):

        def last() -> str:
            shown = texts(fake, fake.c2c_conversation)
            return shown[-1] if shown else ""

        for _ in range(2):
            await fake.c2c_message("echo:approval")
            await fake.wait_until(lambda: "1." in last())
            await fake.c2c_message("3")
            await fake.wait_until(lambda: "Approval decision" in last())
    refused = [c for c in fake.sends() if c.code == 11264]
    assert len(refused) == 1  # learned once
    prompts = [m for m in fake.bot_messages(fake.c2c_conversation) if "1." in m.content]
    assert len(prompts) == 2 and all(m.keyboard is None for m in prompts)
    assert prompts[0].seq == 1  # the refused send gave its msg_seq back


async def test_after_a_restart_mid_answer_the_notice_is_not_swallowed_as_a_duplicate(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with open_fake_qq() as fake:
        async with running_bot(tmp_path, fake=fake, crash=True) as (bot, _):
            await fake.c2c_message("echo:slow 80 a very long answer")
            await fake.wait_until(
                lambda: any(len(m.shown) >= 3 for m in fake.bot_messages(fake.c2c_conversation))
            )
            await trio.sleep(0.2)
        # the process died mid-answer; it starts again on the same store
        async with running_bot(tmp_path, fake=fake) as (bot, _):
            await fake.wait_until(
                lambda: any(INTERRUPTED_TEXT in t for t in texts(fake, fake.c2c_conversation))
            )
            await trio.sleep(10)
    cut, notice = fake.bot_messages(fake.c2c_conversation)
    assert cut.stream and cut.done and cut.seq == 1
    assert notice.content == INTERRUPTED_TEXT and notice.seq == 5  # counted on above the cap
    assert [c.code for c in fake.sends()].count(40054005) == 0
