"""End to end: the real Discord channel, run by ``dshim.serve.serve_bots``, against the fake.

Testing manifesto: everything runs on 127.0.0.1 with kernel-chosen ports (the fake
Discord from ``dshim.testing.fakes.discord``: REST + gateway websocket), a real SQLite
store in ``tmp_path`` and the echo harness (it answers with the exact prompt, so the
final text of every answer is known).  Timing is real but short: heartbeats every few
hundred milliseconds and shrunk reconnect waits.  Every test has a hard deadline, so a
hang fails instead of stalling the run.  Assertions are about what a Discord user or
operator would see: the messages in the channel, the answers' final text, how many
times the bot identified, resumed or fetched a message.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from structlog.testing import capture_logs

from dshim.channels.discord.channel import DiscordChannel
from dshim.channels.discord.client import RestClient, open_http_client, run_gateway
from dshim.channels.discord.protocol import Dispatch, GatewayProtocol, GatewayTuning
from dshim.config import parse_config
from dshim.harness.echo import EchoHarness
from dshim.serve import serve_bots
from dshim.store import open_store
from dshim.testing.fakes.discord import FakeDiscord, open_fake_discord
from tests.helpers import Events

DEADLINE = 20.0
HEARTBEAT_MS = 300
TUNING = GatewayTuning(
    backoff_s=(0.0, 0.05, 0.1),
    invalid_session_wait_s=(0.2, 0.3),
    identify_window_s=0.1,
)


class Bot:
    """A running bot: its fake, the observer, and how it ended."""

    def __init__(self, fake: FakeDiscord, events: Events) -> None:
        self.fake = fake
        self.events = events
        self.results: dict[str, str] | None = None
        self.ended = trio.Event()
        self.shutdown = trio.Event()


def source(sender: dict[str, Any], kind: str, name: str | None = None) -> str:
    block = {
        "channel": "discord",
        "conversationType": kind,
        "senderId": sender["id"],
        "senderName": name or sender.get("global_name") or sender["username"],
    }
    return "<dsh_im_source>" + json.dumps(block, separators=(",", ":")) + "</dsh_im_source>"


@asynccontextmanager
async def running_bot(
    tmp_path: Path, *, fake_kw: dict[str, Any] | None = None, **options: Any
) -> AsyncIterator[Bot]:
    async with open_fake_discord(heartbeat_interval_ms=HEARTBEAT_MS, **(fake_kw or {})) as fake:
        fake.identify_window_s = 0.1
        config = parse_config(
            {
                "bots": [
                    {
                        "name": "disco",
                        "channel": "discord",
                        "token": fake.token,
                        "api_base": fake.api_base,
                        "gateway_url": fake.gateway_url,
                        **options,
                    }
                ]
            },
            env={},
        )
        channel = DiscordChannel(tuning=TUNING, rng=random.Random(7))
        events = Events()
        bot = Bot(fake, events)
        async with open_store(tmp_path) as store, trio.open_nursery() as nursery:

            async def serve() -> None:
                bot.results = await serve_bots(
                    config,
                    store,
                    shutdown=bot.shutdown,
                    channels={"disco": channel},
                    observer=events,
                    harness=EchoHarness(slow_interval_s=0.4),
                )
                bot.ended.set()

            nursery.start_soon(serve)
            try:
                yield bot
            finally:
                bot.shutdown.set()
                with trio.move_on_after(5):
                    await bot.ended.wait()
                nursery.cancel_scope.cancel()


async def ready(bot: Bot, count: int = 1) -> None:
    await bot.fake.wait_until(lambda: bot.fake.ready_count >= count)


async def answered(fake: FakeDiscord, channel: str, text: str) -> None:
    await fake.wait_until(lambda: any(m["content"] == text for m in fake.bot_messages(channel)))


def answers(fake: FakeDiscord, channel: str) -> list[str]:
    return [m["content"] for m in fake.bot_messages(channel)]


# -- streaming ------------------------------------------------------------------------------


async def test_streamed_answer_replies_edits_and_ends_with_the_exact_text(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with running_bot(tmp_path) as bot:
            fake = bot.fake
            await ready(bot)
            msg = await fake.user_message(fake.dm_channel, "echo:slow 8 tell me a story")
            final = source(fake.user, "direct") + "\n\necho:slow 8 tell me a story"
            await answered(fake, fake.dm_channel, final)
            await trio.sleep(0.3)
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
    patches = [c for c in fake.calls_to("PATCH") if c.status == 200]
    assert all(p.json["allowed_mentions"] == {"parse": [], "replied_user": False} for p in patches)
    times = [create.at] + [p.at for p in patches]
    assert all(b - a >= 0.8 for a, b in zip(times, times[1:], strict=False))  # <= 1 edit/s
    assert fake.calls_to("POST", f"/channels/{fake.dm_channel}/typing")  # typing first
    # shutdown ended the session cleanly
    assert (fake.connections[-1].closed_by, fake.connections[-1].closed_code) == ("client", 1000)


async def test_long_answer_is_split_into_follow_ups(tmp_path: Path) -> None:
    words = " ".join(f"word{i}" for i in range(600))  # ~4,800 characters
    with trio.fail_after(DEADLINE):
        async with running_bot(tmp_path) as bot:
            fake = bot.fake
            await ready(bot)
            msg = await fake.user_message(fake.dm_channel, words)
            await fake.wait_until(lambda: "word599" in "".join(answers(fake, fake.dm_channel)))
    parts = fake.bot_messages(fake.dm_channel)
    assert len(parts) == 3 and all(len(p["content"]) <= 2000 for p in parts)
    assert " ".join(p["content"] for p in parts) == source(fake.user, "direct") + "\n\n" + words
    assert parts[0]["message_reference"]["message_id"] == msg["id"]
    assert all("message_reference" not in p for p in parts[1:])


async def test_a_429_storm_on_edits_still_delivers_the_final_text_once(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with running_bot(tmp_path) as bot:
            fake = bot.fake
            await ready(bot)
            fake.rate_limit(method="PATCH", count=4, retry_after=0.3)
            fake.rate_limit(method="PATCH", count=1, retry_after=0.2, is_global=True)
            await fake.user_message(fake.dm_channel, "echo:slow 8 storm")
            final = source(fake.user, "direct") + "\n\necho:slow 8 storm"
            await answered(fake, fake.dm_channel, final)
            await trio.sleep(0.5)
    assert answers(fake, fake.dm_channel) == [final]
    limited = [c for c in fake.calls if c.status == 429]
    assert len(limited) == 5
    delivered_final = [
        c for c in fake.calls if c.status == 200 and (c.json or {}).get("content") == final
    ]
    assert len(delivered_final) == 1


# -- connection faults ----------------------------------------------------------------------


async def test_connection_dropped_mid_turn_resumes_and_answers_once(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with running_bot(tmp_path) as bot:
            fake = bot.fake
            await ready(bot)
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
            await trio.sleep(0.5)
    assert sorted(answers(fake, fake.dm_channel)) == sorted([first, second])
    assert len(fake.identifies) == 1
    [resume] = fake.resumes
    assert resume["path"] == "/resume"  # resume_gateway_url from READY
    assert resume["seq"] is not None and resume["seq"] >= 3
    assert fake.connections[0].closed_by == "drop"
    assert "duplicate" in [r for _, r in bot.events.drops]


async def test_replayed_events_after_a_resume_are_not_answered_twice(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with running_bot(tmp_path) as bot:
            fake = bot.fake
            await ready(bot)
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
            await trio.sleep(0.5)
    assert answers(fake, fake.dm_channel) == expected
    assert len(fake.identifies) == 1 and len(fake.resumes) == 3
    assert [r for _, r in bot.events.drops].count("duplicate") >= 15


async def test_zombie_connection_is_detected_within_two_heartbeat_intervals(tmp_path: Path) -> None:
    interval = HEARTBEAT_MS / 1000
    with trio.fail_after(DEADLINE):
        async with running_bot(tmp_path) as bot:
            fake = bot.fake
            fake.heartbeat_timeout_factor = None
            await ready(bot)
            await fake.wait_until(lambda: len(fake.heartbeats) >= 1)
            fake.ack_heartbeats = False
            stopped = trio.current_time()
            await fake.wait_until(lambda: len(fake.connections) >= 2)
            fake.ack_heartbeats = True
            await fake.wait_until(lambda: fake.resumed_count >= 1)
            await fake.user_message(fake.dm_channel, "still there?")
            await answered(fake, fake.dm_channel, source(fake.user, "direct") + "\n\nstill there?")
    first = fake.connections[0]
    assert first.closed_by == "client" and first.closed_code not in (1000, 1001)
    assert first.closed_at is not None
    assert first.closed_at - stopped <= 2 * interval + 0.1  # the client hung up on it
    assert len(fake.identifies) == 1 and fake.resumes[0]["path"] == "/resume"


async def test_invalid_session_not_resumable_identifies_afresh(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with running_bot(tmp_path) as bot:
            fake = bot.fake
            await ready(bot)
            sent_at = trio.current_time()
            await fake.send_invalid_session(False)
            await ready(bot, 2)
            waited = trio.current_time() - sent_at
            await fake.user_message(fake.dm_channel, "new session")
            await answered(fake, fake.dm_channel, source(fake.user, "direct") + "\n\nnew session")
    assert len(fake.identifies) == 2 and fake.resumes == []
    assert fake.identifies[1]["path"] == "/"  # the Get Gateway URL, not the resume URL
    assert waited >= 0.2  # the configured 1-5 s wait, shrunk for tests
    assert fake.connections[0].closed_code == 1000


async def test_close_4004_stops_the_bot_without_a_reconnect_loop(tmp_path: Path) -> None:
    with capture_logs() as logs, trio.fail_after(DEADLINE):
        async with running_bot(tmp_path, fake_kw={}) as bot:
            bot.fake.close_on_identify = 4004
            await bot.ended.wait()
            await trio.sleep(0.5)  # a reconnect would show up here
    assert bot.results == {"disco": "fatal"}
    assert len(bot.fake.connections) == 1 and len(bot.fake.identifies) == 1
    fatal = [e for e in logs if e["event"] == "bot_stopped_fatal"]
    assert fatal and "4004" in fatal[0]["error"] and "token" in fatal[0]["error"]


async def test_disallowed_intents_close_4014_is_fatal_with_a_hint(tmp_path: Path) -> None:
    with capture_logs() as logs, trio.fail_after(DEADLINE):
        async with running_bot(tmp_path) as bot:
            bot.fake.message_content_enabled = False
            await bot.ended.wait()
    assert bot.results == {"disco": "fatal"} and len(bot.fake.identifies) == 1
    [fatal] = [e for e in logs if e["event"] == "bot_stopped_fatal"]
    assert "Message Content intent" in fatal["error"]


async def test_rest_401_stops_the_bot(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with running_bot(tmp_path) as bot:
            fake = bot.fake
            await ready(bot)
            fake.token = "rotated-token"  # REST now answers 401
            await fake.user_message(fake.dm_channel, "hello?")
            await bot.ended.wait()
    assert bot.results == {"disco": "fatal"}


async def test_malformed_frames_are_dropped_and_the_bot_keeps_answering(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with running_bot(tmp_path) as bot:
            fake = bot.fake
            await ready(bot)
            conn = fake.live
            assert conn is not None
            conn.push("text", "this is not json")
            conn.push("text", '{"op":0,"t":"MESSAGE_CREATE","s":77,"d":{"id":"1"}}')
            conn.push("text", '{"op":123,"d":null}')
            await fake.user_message(fake.dm_channel, "still alive")
            await answered(fake, fake.dm_channel, source(fake.user, "direct") + "\n\nstill alive")
    assert len(fake.connections) == 1
    assert ("", "malformed") in bot.events.drops


# -- quoted messages ------------------------------------------------------------------------


async def test_lookups_only_for_addressed_new_allowed_messages(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with running_bot(tmp_path, access={"mode": "allowlist", "users": ["1"]}) as bot:
            fake = bot.fake
            bob = fake.make_user("bob")
            await ready(bot)
            target = fake.message(fake.dm_channel, "the original", author=bob)
            # denied sender (not on the allowlist) quoting with a bare reference
            await fake.user_message(
                fake.dm_channel, "from bob", author=bob, reply_to=target, reference="bare"
            )
            # unaddressed guild message with a bare reference
            gtarget = fake.message(fake.text_channel, "guild original", author=bob)
            await fake.user_message(
                fake.text_channel, "no mention", reply_to=gtarget, reference="bare"
            )
            await fake.wait_until(lambda: len(bot.events.drops) >= 2)
            await trio.sleep(0.3)
    assert fake.calls_to("GET", "/channels/") == []
    assert sorted(r for _, r in bot.events.drops) == ["denied", "unaddressed"]


async def test_quote_lookup_runs_once_and_reaches_the_agent(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with running_bot(tmp_path) as bot:
            fake = bot.fake
            await ready(bot)
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
            await trio.sleep(0.3)
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


async def test_token_never_reaches_a_log_record(tmp_path: Path) -> None:
    with capture_logs() as logs, trio.fail_after(DEADLINE):
        async with running_bot(tmp_path) as bot:
            fake = bot.fake
            await ready(bot)
            await fake.drop_connection()
            await fake.wait_until(lambda: fake.resumed_count >= 1)
            await fake.user_message(fake.dm_channel, "hi")
            await answered(fake, fake.dm_channel, source(fake.user, "direct") + "\n\nhi")
            token = fake.token
    assert logs and all(token not in repr(e) for e in logs)


async def test_no_identify_when_the_daily_budget_is_used_up(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with running_bot(tmp_path, fake_kw={}) as bot:
            fake = bot.fake
            fake.identify_remaining = 0
            await fake.wait_until(lambda: bool(fake.calls_to("GET", "/gateway/bot")))
            await trio.sleep(1.0)
            assert fake.connections == [] and fake.identifies == []
            assert not bot.ended.is_set()  # waiting for the reset, not failing


async def test_a_slow_pipeline_keeps_the_heartbeat_without_a_false_zombie() -> None:
    interval = 0.2
    with trio.fail_after(DEADLINE):
        async with open_fake_discord(heartbeat_interval_ms=interval * 1000) as fake:
            fake.heartbeat_timeout_factor = 1.5  # the fake closes a silent client
            async with open_http_client() as http:
                rest = RestClient(http, token=fake.token, api_base=fake.api_base)
                gw = GatewayProtocol(token=fake.token, random=lambda: 0.5)
                got: list[str] = []
                beats_while_blocked: list[int] = []

                async def slow(dispatch: Dispatch) -> None:
                    got.append(json.loads(bytes(dispatch.d))["content"])
                    if len(got) == 1:
                        before = len(fake.heartbeats)
                        await trio.sleep(6 * interval)  # the pipeline is busy
                        beats_while_blocked.append(len(fake.heartbeats) - before)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(
                        functools.partial(
                            run_gateway,
                            gw,
                            rest,
                            slow,
                            wanted={"MESSAGE_CREATE"},
                            on_connected=lambda c: None,
                        )
                    )
                    await fake.wait_until(lambda: fake.ready_count >= 1)
                    for text in ("one", "two", "three"):
                        await fake.user_message(fake.dm_channel, text)
                    await fake.wait_until(lambda: len(got) == 3)
                    nursery.cancel_scope.cancel()
    assert got == ["one", "two", "three"]
    assert len(fake.connections) == 1  # no zombie verdict, no server timeout
    assert beats_while_blocked[0] >= 4
