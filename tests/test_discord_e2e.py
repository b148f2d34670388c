"""End to end: the real Discord channel, run by ``dshim.serve.serve_bots``, against the fake.

Testing manifesto: everything runs on 127.0.0.1 with kernel-chosen ports (the fake
Discord from ``dshim.testing.fakes.discord``: REST + gateway websocket) in the same trio
run as the bot, on trio's autojump clock: Discord's real timings (41.25 s heartbeats, 1-5 s
invalid-session waits, 5 s identify spacing, 1 s edit pacing) take no real time and are
exact, so timing assertions are equalities and bounds, not hopes.  The store is a real
SQLite file in ``tmp_path``, kept on the trio thread (``inline``) so that the clock only
jumps when everything waits.  The echo harness answers with the exact prompt, so the final
text of every answer is known.  Knobs of the fake that decide how the bot starts are set
before it starts (``configure``).  Assertions are about what a Discord user or operator
would see: the messages in the channel and their final text, how many times the bot
identified, resumed or fetched a message, and what ended it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
from structlog.testing import capture_logs

from dshim.channels.discord.client import USER_AGENT, RestClient, run_gateway
from dshim.channels.discord.protocol import Dispatch, GatewayProtocol
from dshim.harness.base import TurnContext
from dshim.harness.echo import EchoHarness
from dshim.model import PromptPart
from dshim.net.http import open_http
from dshim.prompt import prompt_text
from dshim.testing.fakes.discord import FakeDiscord, open_fake_discord
from tests.rig_discord import CREATE, DEADLINE, EDIT, Bot, running_bot, source

HEARTBEAT_S = 41.25


class SessionsHarness(EchoHarness):
    """The echo harness, remembering the session of every prompt: (session id, text)."""

    def __init__(self) -> None:
        super().__init__(slow_interval_s=0.4)
        self.turns: list[tuple[str, str]] = []

    def prompt(self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext) -> Any:
        self.turns.append((session_id, prompt_text(parts)))
        return super().prompt(session_id, parts, ctx)


async def ready(bot: Bot, count: int = 1) -> None:
    await bot.fake.wait_until(lambda: bot.fake.ready_count >= count)


async def answered(fake: FakeDiscord, channel: str, text: str) -> None:
    await fake.wait_until(lambda: any(m["content"] == text for m in fake.bot_messages(channel)))


def answers(fake: FakeDiscord, channel: str) -> list[str]:
    return [m["content"] for m in fake.bot_messages(channel)]


# -- streaming ------------------------------------------------------------------------------


async def test_streamed_answer_replies_edits_and_ends_with_the_exact_text(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        msg = await fake.user_message(fake.dm_channel, "echo:slow 8 tell me a story")
        final = source(fake.user, "direct") + "\n\necho:slow 8 tell me a story"
        await answered(fake, fake.dm_channel, final)
        await trio.sleep(5)  # nothing more happens to a finished answer
    [answer] = fake.bot_messages(fake.dm_channel)
    assert answer["content"] == final
    history = fake.edits[answer["id"]]
    assert len(history) >= 3 and history[-1] == final  # shown while written, then finished
    assert all(final.startswith(h) for h in history)  # every edit is a prefix of the answer
    [create] = fake.calls_to("POST", f"/channels/{fake.dm_channel}/messages")
    assert create.json["message_reference"] == {
        "message_id": msg["id"],
        "fail_if_not_exists": False,
    }
    assert create.json["allowed_mentions"] == {"parse": [], "replied_user": False}
    assert create.json["enforce_nonce"] is True and create.json["nonce"]
    patches = [c for c in fake.calls_to("PATCH") if c.status == 200]
    assert len(patches) == len(history) - 1
    assert all(p.json["allowed_mentions"] == {"parse": [], "replied_user": False} for p in patches)
    times = [create.at] + [p.at for p in patches]
    assert all(b - a >= 1.0 - 1e-6 for a, b in zip(times, times[1:], strict=False))  # <= 1/s
    # The agent's text came at once: no typing call was spent before the first message.
    assert fake.calls_to("POST", f"/channels/{fake.dm_channel}/typing") == []
    # shutdown ended the session cleanly
    assert (fake.connections[-1].closed_by, fake.connections[-1].closed_code) == ("client", 1000)


async def test_typing_shows_when_the_agent_is_slow_and_is_renewed_every_8_seconds(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        t0 = trio.current_time()
        await fake.user_message(fake.dm_channel, "echo:sleep 12 think first")
        await fake.wait_until(lambda: len(fake.bot_messages(fake.dm_channel)) == 1)
    typing = [c.at - t0 for c in fake.calls_to("POST", f"/channels/{fake.dm_channel}/typing")]
    [create] = fake.calls_to("POST", f"/channels/{fake.dm_channel}/messages")
    # After 1 s of silence, then every 8 s (Discord shows it for 10 s) until the answer.
    assert typing == [pytest.approx(1.0, abs=0.2), pytest.approx(9.0, abs=0.2)]
    assert typing[-1] < create.at - t0


async def test_long_answer_is_split_into_follow_ups(tmp_path: Path, autojump_clock: object) -> None:
    words = " ".join(f"word{i}" for i in range(600))  # ~4,800 characters
    async with running_bot(tmp_path) as (bot, fake):
        msg = await fake.user_message(fake.dm_channel, words)
        await fake.wait_until(lambda: "word599" in "".join(answers(fake, fake.dm_channel)))
    parts = fake.bot_messages(fake.dm_channel)
    assert len(parts) == 3 and all(len(p["content"]) <= 2000 for p in parts)
    assert " ".join(p["content"] for p in parts) == source(fake.user, "direct") + "\n\n" + words
    assert parts[0]["message_reference"]["message_id"] == msg["id"]
    assert all("message_reference" not in p for p in parts[1:])


async def test_a_429_storm_on_edits_still_delivers_the_final_text_once(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.rate_limit(method="PATCH", count=4, retry_after=3.0)
        fake.fail_next(EDIT, 1, status=429, retry_after=2.0, is_global=True)
        await fake.user_message(fake.dm_channel, "echo:slow 8 storm")
        final = source(fake.user, "direct") + "\n\necho:slow 8 storm"
        await answered(fake, fake.dm_channel, final)
        await trio.sleep(10)
    assert answers(fake, fake.dm_channel) == [final]
    limited = [c for c in fake.calls if c.status == 429]
    assert len(limited) == 5
    delivered_final = [
        c for c in fake.calls if c.status == 200 and (c.json or {}).get("content") == final
    ]
    assert len(delivered_final) == 1
    # every retry waited for what Discord asked
    for hit in limited:
        after = [c for c in fake.calls if c.at > hit.at and c.method == "PATCH"]
        assert after and after[0].at - hit.at >= 2.0 - 1e-6


async def test_a_create_whose_response_is_lost_is_not_posted_twice(
    tmp_path: Path, autojump_clock: object
) -> None:
    # The create is processed but its answer never arrives: the retry carries the same
    # nonce (enforce_nonce), Discord returns the message it already has.
    async with running_bot(tmp_path) as (bot, fake):
        fake.drop_response_next(CREATE)
        await fake.user_message(fake.dm_channel, "once please")
        final = source(fake.user, "direct") + "\n\nonce please"
        await answered(fake, fake.dm_channel, final)
        await trio.sleep(10)
    assert answers(fake, fake.dm_channel) == [final]
    creates = fake.calls_to("POST", f"/channels/{fake.dm_channel}/messages")
    assert len(creates) == 2 and creates[0].json["nonce"] == creates[1].json["nonce"]


# -- connection faults ----------------------------------------------------------------------


async def test_connection_dropped_mid_turn_resumes_and_answers_once(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.replay_on_resume = 10  # the resumed socket re-sends what we already had
        fake.drop_after(1)  # drop right after delivering this message
        await fake.user_message(fake.dm_channel, "echo:slow 5 during a drop")
        await fake.wait_until(lambda: fake.resumed_count >= 1)
        # a message sent while resumed is answered too
        await fake.user_message(fake.dm_channel, "after the resume")
        first = source(fake.user, "direct") + "\n\necho:slow 5 during a drop"
        second = source(fake.user, "direct") + "\n\nafter the resume"
        await answered(fake, fake.dm_channel, first)
        await answered(fake, fake.dm_channel, second)
        await trio.sleep(5)
    assert sorted(answers(fake, fake.dm_channel)) == sorted([first, second])
    assert len(fake.identifies) == 1
    [resume] = fake.resumes
    assert resume["path"] == "/resume"  # resume_gateway_url from READY
    assert resume["seq"] is not None and resume["seq"] >= 3
    assert resume["at"] - fake.connections[0].closed_at <= 1.0  # resumed at once
    assert "duplicate" in bot.drop_reasons()


async def test_replayed_events_after_a_resume_are_not_answered_twice(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.replay_on_resume = 50
        texts = [f"message {i}" for i in range(5)]
        for text in texts:
            await fake.user_message(fake.dm_channel, text)
        expected = [source(fake.user, "direct") + "\n\n" + t for t in texts]
        await fake.wait_until(lambda: len(fake.bot_messages(fake.dm_channel)) >= 5)
        await fake.drop_connection()
        await fake.wait_until(lambda: fake.resumed_count >= 1)
        await fake.send_reconnect()  # op 7: close and resume again, replaying again
        await fake.wait_until(lambda: fake.resumed_count >= 2)
        await fake.send_invalid_session(True)  # op 9 d=true: resume again
        await fake.wait_until(lambda: fake.resumed_count >= 3)
        await trio.sleep(5)
    assert answers(fake, fake.dm_channel) == expected
    assert len(fake.identifies) == 1 and len(fake.resumes) == 3
    assert bot.drop_reasons().count("duplicate") >= 15
    # op 7 and op 9 closes keep the session: never 1000/1001
    assert [c.closed_code for c in fake.connections[1:3]] == [4000, 4000]


async def test_zombie_connection_is_detected_within_two_heartbeat_intervals(
    tmp_path: Path, autojump_clock: object
) -> None:
    def configure(fake: FakeDiscord) -> None:
        fake.heartbeat_timeout_factor = None  # only the client may notice

    async with running_bot(tmp_path, configure=configure) as (bot, fake):
        await fake.wait_until(lambda: len(fake.heartbeats) >= 1)
        fake.ack_heartbeats = False
        stopped = trio.current_time()
        await fake.wait_until(lambda: len(fake.connections) >= 2)
        fake.ack_heartbeats = True
        await fake.wait_until(lambda: fake.resumed_count >= 1)
        await fake.user_message(fake.dm_channel, "still there?")
        await answered(fake, fake.dm_channel, source(fake.user, "direct") + "\n\nstill there?")
    first = fake.connections[0]
    assert first.closed_by == "client" and first.closed_code == 4000  # resumable
    assert first.closed_at is not None
    # the first unanswered beat goes out within one interval; the next one finds no ACK
    assert HEARTBEAT_S <= first.closed_at - stopped <= 2 * HEARTBEAT_S
    assert len(fake.identifies) == 1 and fake.resumes[0]["path"] == "/resume"


async def test_invalid_session_not_resumable_identifies_afresh(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        sent_at = trio.current_time()
        await fake.send_invalid_session(False)
        await ready(bot, 2)
        waited = fake.identifies[1]["at"] - sent_at
        await fake.user_message(fake.dm_channel, "new session")
        await answered(fake, fake.dm_channel, source(fake.user, "direct") + "\n\nnew session")
    assert len(fake.identifies) == 2 and fake.resumes == []
    assert fake.identifies[1]["path"] == "/"  # the Get Gateway URL, not the resume URL
    assert 1.0 <= waited <= 5.0 + 0.1  # Discord's 1-5 s before identifying again
    assert fake.identifies[1]["at"] - fake.identifies[0]["at"] >= 5.0  # identify spacing
    assert fake.connections[0].closed_code == 1000


async def test_close_4004_stops_the_bot_without_a_reconnect_loop(
    tmp_path: Path, autojump_clock: object
) -> None:
    with capture_logs() as logs:
        async with running_bot(
            tmp_path, configure={"close_on_identify": 4004}, wait_ready=False
        ) as (bot, _):
            await bot.ended.wait()
    assert bot.results == {"disco": "fatal"}
    assert len(bot.fake.connections) == 1 and len(bot.fake.identifies) == 1
    fatal = [e for e in logs if e["event"] == "bot_stopped_fatal"]
    assert fatal and "4004" in fatal[0]["error"] and "token" in fatal[0]["error"]


async def test_disallowed_intents_close_4014_names_the_portal_switch_and_the_setting(
    tmp_path: Path, autojump_clock: object
) -> None:
    with capture_logs() as logs:
        async with running_bot(
            tmp_path, configure={"message_content_enabled": False}, wait_ready=False
        ) as (bot, _):
            await bot.ended.wait()
    assert bot.results == {"disco": "fatal"} and len(bot.fake.identifies) == 1
    [fatal] = [e for e in logs if e["event"] == "bot_stopped_fatal"]
    assert "Privileged Gateway Intents -> Message Content Intent" in fatal["error"]
    assert "message_content = false" in fatal["error"]


async def test_message_content_false_does_not_ask_for_the_intent(
    tmp_path: Path, autojump_clock: object
) -> None:
    # issue 9 #16: with the portal switch off, the bot still runs (DMs and mentions).
    async with running_bot(
        tmp_path, configure={"message_content_enabled": False}, message_content=False
    ) as (bot, fake):
        await fake.user_message(fake.dm_channel, "hello without the intent")
        final = source(fake.user, "direct") + "\n\nhello without the intent"
        await answered(fake, fake.dm_channel, final)
    [identify] = fake.identifies
    assert identify["intents"] == 1 | 512 | 4096


async def test_rest_401_stops_the_bot(tmp_path: Path, autojump_clock: object) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        fake.token = "rotated-token"  # REST now answers 401
        await fake.user_message(fake.dm_channel, "hello?")
        await bot.ended.wait()
    assert bot.results == {"disco": "fatal"}
    assert [c.status for c in fake.calls if c.path != "/users/@me"][-1] == 401


async def test_transient_failures_at_start_are_retried_inside_run(
    tmp_path: Path, autojump_clock: object
) -> None:
    # GET /users/@me and GET /gateway/bot fail with 503 / a dropped connection first: the
    # channel backs off and tries again itself; the supervisor never sees a failure.
    def configure(fake: FakeDiscord) -> None:
        fake.fail_next("GET /users/@me", 2, status=503)
        fake.drop_next("GET /gateway/bot", 2)

    with capture_logs() as logs:
        async with running_bot(tmp_path, configure=configure, gateway_override=False) as (
            bot,
            fake,
        ):
            await fake.user_message(fake.dm_channel, "up?")
            await answered(fake, fake.dm_channel, source(fake.user, "direct") + "\n\nup?")
    me = fake.calls_to("GET", "/users/@me")
    assert [c.status for c in me] == [503, 503, 200]
    assert me[1].at - me[0].at >= 1.0 and me[2].at - me[1].at >= 1.0  # backed off
    assert [c.status for c in fake.calls_to("GET", "/gateway/bot")] == [0, 0, 200]
    events = [e["event"] for e in logs]
    assert events.count("bot_started") == 1
    assert "bot_failed_restarting" not in events


async def test_a_bad_token_at_start_is_fatal_without_a_retry(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path, token="not-the-right-token", wait_ready=False) as (bot, _):
        await bot.ended.wait()
    assert bot.results == {"disco": "fatal"}
    assert [c.status for c in bot.fake.calls] == [401] and bot.fake.connections == []


async def test_malformed_frames_are_dropped_and_the_bot_keeps_answering(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        conn = fake.live
        assert conn is not None
        conn.push("text", "this is not json")
        conn.push("text", '{"op":0,"t":"MESSAGE_CREATE","s":77,"d":{"id":"1"}}')
        conn.push("text", '{"op":123,"d":null}')
        # issue 9 #2: a frame nested 1,000 deep raised RecursionError in receive()
        deep = "[" * 1000 + "]" * 1000
        conn.push("text", '{"op":0,"t":"MESSAGE_CREATE","s":78,"d":' + deep + "}")
        conn.push("text", '{"op":0,"t":"MESSAGE_CREATE","s":79,"d":{"a":' + deep + "}}")
        await fake.user_message(fake.dm_channel, "still alive")
        await answered(fake, fake.dm_channel, source(fake.user, "direct") + "\n\nstill alive")
    assert len(fake.connections) == 1 and len(fake.identifies) == 1
    assert ("", "malformed") in bot.events.drops


# -- what is a turn, and who is addressed -----------------------------------------------------


async def test_the_messages_of_a_thread_share_one_conversation_and_session(
    tmp_path: Path, autojump_clock: object
) -> None:
    harness = SessionsHarness()
    async with running_bot(tmp_path, harness=harness) as (bot, fake):
        post = await fake.forum_post("arm64", "why does the build fail?", mention_bot=True)
        await fake.wait_until(lambda: len(fake.bot_messages(post["id"])) == 1)
        await fake.user_message(post["id"], "and on x86?", mention_bot=True)
        await fake.wait_until(lambda: len(fake.bot_messages(post["id"])) == 2)
        thread = fake.thread_channel
        await fake.user_message(thread, "the release plan?", mention_bot=True)
        await fake.wait_until(lambda: len(fake.bot_messages(thread)) == 1)
        await fake.user_message(thread, "who owns the changelog?", mention_bot=True)
        await fake.wait_until(lambda: len(fake.bot_messages(thread)) == 2)
    starter, follow_up, in_thread, later = (session for session, _ in harness.turns)
    assert follow_up == starter  # the post's starter and its reply: one session
    assert later == in_thread != starter  # one session per thread
    lanes = [m.lane_key for m in bot.events.prompt_msgs]
    assert lanes == [(post["id"], post["id"])] * 2 + [(thread, thread)] * 2


async def test_a_mention_of_the_bots_role_is_answered(
    tmp_path: Path, autojump_clock: object
) -> None:
    # issue 9 #14: the mention picker inserts <@&role> of the bot's managed role.
    async with running_bot(tmp_path) as (bot, fake):
        await fake.user_message(fake.text_channel, "not us", mention_role=fake.other_role)
        msg = await fake.user_message(fake.text_channel, "what is 2+2?", mention_role=fake.bot_role)
        final = source(fake.user, "group", "Ada Lovelace") + "\n\nwhat is 2+2?"
        await answered(fake, fake.text_channel, final)
    [answer] = fake.bot_messages(fake.text_channel)
    assert answer["message_reference"]["message_id"] == msg["id"]
    assert bot.drop_reasons() == ["unaddressed"]


async def test_a_forward_is_read_as_the_forwarders_message(
    tmp_path: Path, autojump_clock: object
) -> None:
    # issue 9 #6: the snapshot's text is the content; no quote block; the sender is the
    # person who forwarded it.
    async with running_bot(tmp_path) as (bot, fake):
        bob = fake.make_user("bob", global_name="Bob")
        original = fake.message(fake.text_channel, "The build is green.", author=bob)
        await fake.user_message(fake.dm_channel, "", forward=original)
        final = source(fake.user, "direct") + "\n\nThe build is green."
        await answered(fake, fake.dm_channel, final)
    [prompt] = bot.events.prompts
    assert "dsh_im_reply_to" not in prompt and prompt == final
    [msg] = bot.events.prompt_msgs
    assert msg.forwarded is True and msg.sender_id == fake.user["id"]
    assert fake.calls_to("GET", "/channels/") == []  # no lookup of the original


async def test_a_sticker_alone_in_a_dm_is_not_a_turn(
    tmp_path: Path, autojump_clock: object
) -> None:
    # issue 9 #15: it started a turn with an empty prompt.
    async with running_bot(tmp_path) as (bot, fake):
        await fake.user_message(fake.dm_channel, "", stickers=["Wave"])
        await fake.user_message(fake.dm_channel, "and now text")
        await answered(fake, fake.dm_channel, source(fake.user, "direct") + "\n\nand now text")
        await trio.sleep(5)
    assert len(fake.bot_messages(fake.dm_channel)) == 1 and len(bot.events.prompts) == 1
    assert "ignored" in bot.drop_reasons()


# -- quoted messages ------------------------------------------------------------------------


async def test_lookups_only_for_addressed_new_allowed_messages(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path, access={"mode": "allowlist", "users": ["1"]}) as (bot, fake):
        bob = fake.make_user("bob")
        target = fake.message(fake.dm_channel, "the original", author=bob)
        # denied sender (not on the allowlist) quoting with a bare reference
        await fake.user_message(
            fake.dm_channel, "from bob", author=bob, reply_to=target, reference="bare"
        )
        # unaddressed guild message with a bare reference
        gtarget = fake.message(fake.text_channel, "guild original", author=bob)
        await fake.user_message(fake.text_channel, "no mention", reply_to=gtarget, reference="bare")
        await fake.wait_until(lambda: len(bot.events.drops) >= 2)
        await trio.sleep(5)
    assert fake.calls_to("GET", "/channels/") == []
    assert sorted(bot.drop_reasons()) == ["denied", "unaddressed"]


async def test_quote_lookup_runs_once_and_reaches_the_agent(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        bob = fake.make_user("bob", global_name="Bob")
        target = fake.message(
            fake.text_channel, "Meeting moved to Friday.", author=bob, nick="Bobby"
        )
        fake.replay_on_resume = 10
        msg = await fake.user_message(
            fake.text_channel,
            "what did he say?",
            mention_bot=True,
            reply_to=target,
            reference="bare",
        )
        await fake.wait_until(lambda: len(fake.bot_messages(fake.text_channel)) >= 1)
        await fake.drop_connection()  # the resume replays the message
        await fake.wait_until(lambda: fake.resumed_count >= 1)
        gone = fake.message(fake.text_channel, "soon deleted", author=bob)
        fake.delete_message(gone["id"])
        await fake.user_message(
            fake.text_channel,
            "and this?",
            mention_bot=True,
            reply_to=gone["id"],
            reference="bare",
        )
        fake.forbidden[fake.other_channel] = 50013
        secret = fake.message(fake.other_channel, "hidden", author=bob)
        await fake.user_message(
            fake.other_channel, "and here?", mention_bot=True, reply_to=secret, reference="bare"
        )
        await fake.wait_until(
            lambda: (
                len(fake.bot_messages(fake.text_channel)) >= 2
                and len(fake.bot_messages(fake.other_channel)) >= 1
            )
        )
        await trio.sleep(5)
    gets = fake.calls_to("GET", "/channels/")
    assert sorted(c.path for c in gets) == sorted(  # two channels: two lanes, any order
        [
            f"/channels/{fake.text_channel}/messages/{target['id']}",
            f"/channels/{fake.text_channel}/messages/{gone['id']}",
            f"/channels/{fake.other_channel}/messages/{secret['id']}",
        ]
    )
    [first] = [p for p in bot.events.prompts if p.endswith("what did he say?")]
    [second] = [p for p in bot.events.prompts if p.endswith("and this?")]
    [third] = [p for p in bot.events.prompts if p.endswith("and here?")]
    assert '"authorName":"Bob"' in first and '"content":"Meeting moved to Friday."' in first
    assert first.endswith("\n\nwhat did he say?")
    assert '"unavailableReason":"not-found"' in second
    assert '"unavailableReason":"permission-denied"' in third
    assert len(fake.bot_messages(fake.text_channel)) == 2
    # no Read Message History in the other channel: answered, but not as a reply
    [plain] = fake.bot_messages(fake.other_channel)
    assert "message_reference" not in plain and plain["content"].endswith("and here?")
    assert msg["id"] in [
        m["message_reference"]["message_id"] for m in fake.bot_messages(fake.text_channel)
    ]


async def test_a_quote_whose_id_is_not_a_snowflake_is_never_looked_up(
    tmp_path: Path, autojump_clock: object
) -> None:
    # issue 9 #4: a message_reference.message_id of any length reached the lookup URL.
    async with running_bot(tmp_path) as (bot, fake):
        bogus = "9" * 5000
        await fake.user_message(
            fake.dm_channel, "what about that?", reply_to=bogus, reference="bare"
        )
        await fake.wait_until(lambda: bool(bot.events.prompts))
    [prompt] = bot.events.prompts
    assert '"unavailableReason":"not-found"' in prompt and bogus not in prompt
    assert fake.calls_to("GET", "/channels/") == []


async def test_token_never_reaches_a_log_record(tmp_path: Path, autojump_clock: object) -> None:
    with capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            await fake.drop_connection()
            await fake.wait_until(lambda: fake.resumed_count >= 1)
            await fake.user_message(fake.dm_channel, "hi")
            await answered(fake, fake.dm_channel, source(fake.user, "direct") + "\n\nhi")
            token = fake.token
    events = [e["event"] for e in logs]
    assert {"frame_sent", "ws_connected", "ws_resumed"} <= set(events)  # identify, resume
    assert all(token not in repr(e) for e in logs)


async def test_no_identify_when_the_daily_budget_is_used_up(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with running_bot(
        tmp_path,
        configure={"identify_remaining": 0, "identify_reset_after_ms": 3_600_000},
        wait_ready=False,
        deadline=7200,
    ) as (
        bot,
        fake,
    ):
        await fake.wait_until(lambda: bool(fake.calls_to("GET", "/gateway/bot")))
        await trio.sleep(3000)
        assert fake.connections == [] and fake.identifies == []
        assert not bot.ended.is_set()  # waiting for the reset, not failing
        fake.identify_remaining = 5
        await ready(bot)  # after the reset: the budget is read again, then identify
    t0 = fake.calls_to("GET", "/gateway/bot")[0].at
    assert fake.identifies[0]["at"] - t0 >= 3600.0
    assert len(fake.calls_to("GET", "/gateway/bot")) == 2


async def test_a_slow_pipeline_keeps_the_heartbeat_without_a_false_zombie(
    autojump_clock: object,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_discord() as fake:
            fake.heartbeat_timeout_factor = 1.5  # the fake closes a silent client
            async with open_http(user_agent=USER_AGENT) as http:
                rest = RestClient(http, token=fake.token, api_base=fake.api_base)
                gw = GatewayProtocol(token=fake.token, random=lambda: 0.5)
                got: list[str] = []
                beats_while_blocked: list[int] = []

                async def slow(dispatch: Dispatch) -> None:
                    got.append(json.loads(bytes(dispatch.d))["content"])
                    if len(got) == 1:
                        before = len(fake.heartbeats)
                        await trio.sleep(6 * HEARTBEAT_S)  # the pipeline is busy
                        beats_while_blocked.append(len(fake.heartbeats) - before)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run_gateway, gw, rest, slow)
                    await fake.wait_until(lambda: fake.ready_count >= 1)
                    for text in ("one", "two", "three"):
                        await fake.user_message(fake.dm_channel, text)
                    await fake.wait_until(lambda: len(got) == 3)
                    nursery.cancel_scope.cancel()
    assert got == ["one", "two", "three"]
    assert len(fake.connections) == 1  # no zombie verdict, no server timeout
    assert beats_while_blocked == [6]
