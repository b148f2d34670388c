"""``/metrics`` as Prometheus scrapes it: the counters match what happened.

A Telegram bot runs through :func:`dshim.serve.serve_process` (the endpoint on 127.0.0.1,
port 0, the supervisor, the channel, the pipeline, a real SQLite store inline) against the
fake Bot API, with the echo harness, on trio's autojump clock.  The exposition is read
over HTTP and parsed with ``prometheus_client``'s own parser.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from dshim.channels.discord.client import RestClient
from dshim.channels.registry import parse_config
from dshim.errors import NotFound, TransportError
from dshim.metrics import NO_METRICS, ProcessMetrics
from dshim.net import http as kit_http
from dshim.serve import Running, serve_process
from dshim.store import open_store
from dshim.testing.fakes.telegram import TEST_TOKEN, FakeTelegram, open_fake_telegram
from tests.helpers import Clock, open_rig

ADA = FakeTelegram.user(42, "Ada", "Lovelace", "ada")
BOB = FakeTelegram.user(43, "Bob")
OTHER_BOT = FakeTelegram.user(77, "Helper", username="helper_bot", is_bot=True)
GROUP_ID = -1001234567890
DEADLINE = 900


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(http: httpx.AsyncClient) -> Samples:
    resp = await http.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=")
    out: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def by_label(samples: Samples, name: str, label: str, **fixed: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (sample, labels), v in samples.items():
        d = dict(labels)
        if sample == name and all(d.get(k) == x for k, x in fixed.items()):
            out[d[label]] = v
    return out


@asynccontextmanager
async def telegram_served(
    tmp_path: Path, **options: Any
) -> AsyncIterator[tuple[FakeTelegram, httpx.AsyncClient, Running]]:
    clock = Clock()
    async with (
        open_fake_telegram(clock=clock) as fake,
        open_store(tmp_path, inline=True) as store,
    ):
        cfg = parse_config(
            {
                "http": {"listen": "127.0.0.1:0"},
                "bots": [
                    {
                        "name": "tg",
                        "channel": "telegram",
                        "token": "${T}",
                        "api_base": fake.url,
                        **options,
                    }
                ],
            },
            env={"T": TEST_TOKEN},
        )
        shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            running: Running = await nursery.start(
                partial(serve_process, cfg, store, shutdown=shutdown, clock=clock)
            )
            assert running.url is not None
            async with httpx.AsyncClient(base_url=running.url) as http:
                await fake.wait_until(
                    lambda: any(c.status == 0 for c in fake.calls_to("getUpdates"))
                )
                try:
                    yield fake, http, running
                finally:
                    shutdown.set()


async def answered(fake: FakeTelegram, chat_id: int, n: int) -> None:
    """Wait until the bot's ``n``-th message in the chat is final (no edit for a while)."""
    await fake.wait_until(lambda: len(fake.bot_messages(chat_id)) >= n)
    await trio.sleep(5)  # streaming edits are paced 1/s: let the last one land


async def test_counters_match_the_events_sent(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with telegram_served(tmp_path) as (fake, http, _):
            dm = fake.private_chat(ADA)
            group = fake.group_chat(GROUP_ID, "Research")
            first = fake.user_message(dm, ADA, "hello")  # accepted, answered: ok
            await answered(fake, ADA["id"], 1)
            fake.add_update({"message": first})  # delivered again: duplicate
            fake.user_message(group, ADA, "talking among ourselves")  # unaddressed
            fake.user_message(group, OTHER_BOT, "@dshim_test_bot beep")  # another bot
            fake.user_message(dm, ADA, "from before the outage", date=int(fake.clock()) - 7200)
            fake.add_update(  # nested past the decoder's depth limit: malformed
                b'{"update_id":%d,"message":%s1%s}' % (fake._next_update_id, b"[" * 100, b"]" * 100)
            )
            answer = fake.bot_messages(ADA["id"])[0].message_id
            fake.user_message(dm, ADA, "what did you mean?", reply_to=answer)  # quote: snapshot
            await answered(fake, ADA["id"], 2)
            fake.user_message(dm, ADA, "echo:fail")  # the agent fails: error
            await answered(fake, ADA["id"], 3)
            fake.user_message(dm, ADA, "echo:slow 20")
            await fake.wait_until(lambda: len(fake.bot_messages(ADA["id"])) >= 4)
            fake.user_message(dm, ADA, "/stop")  # a command (accepted); the turn: stopped
            await trio.sleep(5)

            samples = await scrape(http)
            events = by_label(
                samples, "dshim_events_total", "outcome", bot="tg", channel="telegram"
            )
            assert events == {
                "accepted": 5,  # hello, the quote, echo:fail, echo:slow, /stop
                "duplicate": 1,
                "unaddressed": 1,
                "bot": 1,
                "stale": 1,
                "malformed": 1,
            }
            turns = by_label(samples, "dshim_turns_total", "result", bot="tg")
            assert turns == {"ok": 2, "error": 1, "stopped": 1}
            lookups = by_label(
                samples, "dshim_reply_lookups_total", "result", bot="tg", channel="telegram"
            )
            assert lookups == {"snapshot": 1}
            assert value(samples, "dshim_turn_duration_seconds_count") == 4
            assert value(samples, "dshim_turn_first_delta_seconds_count") == 3  # fail: no text
            assert value(samples, "dshim_turn_duration_seconds_bucket", le="+Inf") == 4
            assert (
                value(samples, "dshim_turn_duration_seconds_sum") >= 1
            )  # the slow one, until /stop
            assert value(samples, "dshim_bot_up", bot="tg") == 1

            # Every answered platform request, by method and status, as the fake saw them —
            # but a typing request cancelled by the answer's end may be answered unseen.
            seen = Counter((c.method, str(c.status)) for c in fake.calls if c.status)
            counted = {
                (dict(labels)["method"], dict(labels)["status"]): v
                for (name, labels), v in samples.items()
                if name == "dshim_platform_requests_total"
            }
            typing = ("sendChatAction", "200")
            assert counted.pop(typing, 0) <= seen.pop(typing, 0)
            assert counted == seen
            assert counted[("getMe", "200")] == 1 and counted[("sendMessage", "200")] >= 4


async def test_a_full_lane_counts_busy_and_the_lane_gauges_follow(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with telegram_served(tmp_path, lanes={"max_queue": 1}) as (fake, http, _):
            dm = fake.private_chat(BOB)
            fake.fail_next("sendChatAction", 1, status=500)
            fake.user_message(dm, BOB, "echo:sleep 2 echo:slow 20")  # typing after 1 s
            await fake.wait_until(lambda: len(fake.bot_messages(BOB["id"])) >= 1)
            fake.user_message(dm, BOB, "queued behind it")
            fake.user_message(dm, BOB, "no room for this one")  # busy
            await fake.wait_until(lambda: len(fake.bot_messages(BOB["id"])) >= 2)
            samples = await scrape(http)
            assert value(samples, "dshim_lanes_active") == 1
            assert value(samples, "dshim_lane_queue_depth") == 1
            assert value(samples, "dshim_turns_total", bot="tg", result="busy") == 1
            assert (
                value(
                    samples,
                    "dshim_platform_requests_total",
                    bot="tg",
                    method="sendChatAction",
                    status="500",
                )
                == 1
            )
            await fake.wait_until(lambda: len(fake.bot_messages(BOB["id"])) >= 3)
            await trio.sleep(15)
            samples = await scrape(http)
            assert value(samples, "dshim_lanes_active") == 0
            assert value(samples, "dshim_lane_queue_depth") == 0
            assert by_label(samples, "dshim_turns_total", "result", bot="tg") == {
                "ok": 2,
                "busy": 1,
            }
            assert (
                value(
                    samples, "dshim_events_total", bot="tg", channel="telegram", outcome="accepted"
                )
                == 3
            )


def test_each_process_has_its_own_registry_and_none_is_global() -> None:
    one, two = ProcessMetrics(), ProcessMetrics()
    one.for_bot("a", "telegram").event("accepted")
    text_one = one.render()[0].decode()
    text_two = two.render()[0].decode()
    assert 'dshim_events_total{bot="a",channel="telegram",outcome="accepted"} 1.0' in text_one
    assert 'bot="a"' not in text_two
    assert not any(name.startswith("dshim_") for name in REGISTRY._names_to_collectors)
    assert "_created" not in text_one  # only the documented series


def test_histogram_buckets_are_cumulative() -> None:
    metrics = ProcessMetrics()
    bot = metrics.for_bot("a", "telegram")
    for seconds in (0.2, 0.7, 3.0, 4000.0):
        bot.turn("ok", first_delta_s=seconds, duration_s=seconds)
    samples = {
        (s.name, s.labels.get("le")): s.value
        for family in text_string_to_metric_families(metrics.render()[0].decode())
        for s in family.samples
    }
    assert samples[("dshim_turn_duration_seconds_bucket", "0.5")] == 1
    assert samples[("dshim_turn_duration_seconds_bucket", "1.0")] == 2
    assert samples[("dshim_turn_duration_seconds_bucket", "5.0")] == 3
    assert samples[("dshim_turn_duration_seconds_bucket", "600.0")] == 3
    assert samples[("dshim_turn_duration_seconds_bucket", "+Inf")] == 4
    assert samples[("dshim_turn_duration_seconds_count", None)] == 4
    assert samples[("dshim_turn_duration_seconds_sum", None)] == 4003.9
    assert samples[("dshim_turns_total", None)] == 4  # labels: bot, result (parsed apart)


async def test_the_pipeline_counts_nothing_by_default(tmp_path: Path) -> None:
    async with open_rig(tmp_path) as rig:
        assert rig.rt.metrics is NO_METRICS
        assert rig.rt.turn_deps.metrics is NO_METRICS


async def test_the_kit_counts_every_platform_request_of_the_bot_it_runs_for() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/down":
            raise httpx.ConnectError("refused", request=request)
        status = 404 if request.url.path == "/gone" else 200
        return httpx.Response(status, content=b"body")

    seen: list[tuple[str, str]] = []
    async with httpx.AsyncClient(
        base_url="http://platform.test", transport=httpx.MockTransport(answer)
    ) as http:
        await kit_http.counted("uncounted", http.get("/ok"))  # no counter set: nothing
        with kit_http.counting_requests(lambda what, status: seen.append((what, status))):
            await kit_http.counted("getMe", http.get("/ok"))
            await kit_http.counted("getFile", http.get("/gone"))
            with pytest.raises(TransportError):
                await kit_http.counted("sendMessage", http.get("/down"))
            assert await kit_http.download_capped(http, "http://platform.test/f", 100) == b"body"
            with pytest.raises(NotFound):
                await kit_http.download_capped(http, "http://platform.test/gone", 100)
            with pytest.raises(TransportError):
                await kit_http.download_capped(http, "http://platform.test/down", 100)
    assert seen == [
        ("getMe", "200"),
        ("getFile", "404"),
        ("sendMessage", "error"),
        ("download", "200"),
        ("download", "404"),
        ("download", "error"),
    ]


async def test_discord_requests_are_counted_by_route_never_by_id() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/users/@me"):
            return httpx.Response(200, json={"id": "1", "username": "dshim", "bot": True})
        return httpx.Response(404, json={"code": 10008, "message": "Unknown Message"})

    seen: list[tuple[str, str]] = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        rest = RestClient(http, token="discord-test-token", api_base="http://discord.test/api")
        with kit_http.counting_requests(lambda what, status: seen.append((what, status))):
            await rest.get_current_user()
            with pytest.raises(NotFound):
                await rest.get_message("111111111111111111", "222222222222222222")
    assert seen == [
        ("GET /users/@me", "200"),
        ("GET /channels/{channel_id}/messages/{message_id}", "404"),
    ]
