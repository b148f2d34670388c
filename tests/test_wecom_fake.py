"""The fake WeCom itself, spoken to with a raw websocket client: what a channel (or an
outside client program) can rely on it to enforce."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import WebSocketConnection

from dshim.channels.wecom import media
from dshim.net.ws import open_client_websocket
from dshim.testing.fakes.wecom import FakeWecom, open_fake_wecom


async def send(ws: WebSocketConnection, cmd: str, req_id: str, body: Any = None) -> None:
    frame: dict[str, Any] = {"cmd": cmd, "headers": {"req_id": req_id}}
    if body is not None:
        frame["body"] = body
    await ws.send_message(json.dumps(frame))


async def recv(ws: WebSocketConnection) -> dict[str, Any]:
    data = await ws.get_message()
    out: dict[str, Any] = json.loads(data)
    return out


async def subscribe(ws: WebSocketConnection, fake: FakeWecom, secret: str | None = None) -> int:
    await send(
        ws,
        "aibot_subscribe",
        "aibot_subscribe_1_a",
        {"bot_id": fake.bot_id, "secret": secret or fake.secret},
    )
    ack = await recv(ws)
    assert ack["headers"]["req_id"] == "aibot_subscribe_1_a"
    return int(ack["errcode"])


def stream(sid: str, content: str, finish: bool = False) -> dict[str, Any]:
    return {"msgtype": "stream", "stream": {"id": sid, "finish": finish, "content": content}}


async def test_subscribe_ping_and_a_rejected_secret(autojump_clock: trio.abc.Clock) -> None:
    async with open_fake_wecom() as fake:
        async with open_client_websocket(fake.ws_url) as (ws, _):
            assert await subscribe(ws, fake, "wrong") != 0
        async with open_client_websocket(fake.ws_url) as (ws, _):
            assert await subscribe(ws, fake) == 0
            await send(ws, "ping", "ping_1_b")
            assert (await recv(ws))["errcode"] == 0
    assert [ok for _, ok in fake.subscribes] == [False, True]


async def test_stream_rules(autojump_clock: trio.abc.Clock) -> None:
    async with open_fake_wecom() as fake:
        fake.stream_lifetime_s = 360.0
        async with open_client_websocket(fake.ws_url) as (ws, _):
            assert await subscribe(ws, fake) == 0
            rid = await fake.callback("aibot_msg_callback", fake.body("text", text="hi"))
            assert (await recv(ws))["cmd"] == "aibot_msg_callback"
            codes = []
            for body in (stream("s", "1"), stream("s", "123"), stream("s", "x" * 20_481)):
                await send(ws, "aibot_respond_msg", rid, body)
                codes.append((await recv(ws))["errcode"])
            await trio.sleep(361)
            await send(ws, "aibot_respond_msg", rid, stream("s", "late"))
            codes.append((await recv(ws))["errcode"])
            await send(ws, "aibot_respond_msg", "aibot_msg_callback_unknown", stream("t", "x"))
            codes.append((await recv(ws))["errcode"])
    assert codes[:2] == [0, 0] and codes[2] != 0
    assert codes[3:] == [846608, 846605]
    assert fake.streams["s"].contents == ["1", "123"]


async def test_a_frame_before_the_previous_ack_fails_the_test(
    autojump_clock: trio.abc.Clock,
) -> None:
    with pytest.raises(AssertionError, match="before the previous ack"):
        async with open_fake_wecom() as fake:
            fake.ack_delay_s = 1.0
            async with open_client_websocket(fake.ws_url) as (ws, _):
                assert await subscribe(ws, fake) == 0
                rid = await fake.callback("aibot_msg_callback", fake.body("text", text="hi"))
                await recv(ws)
                await send(ws, "aibot_respond_msg", rid, stream("s", "1"))
                await send(ws, "aibot_respond_msg", rid, stream("s", "2"))
                await trio.sleep(2)


async def test_a_new_subscribe_evicts_the_old_connection(autojump_clock: trio.abc.Clock) -> None:
    async with open_fake_wecom() as fake:
        async with open_client_websocket(fake.ws_url) as (old, _):
            assert await subscribe(old, fake) == 0
            async with open_client_websocket(fake.ws_url) as (new, _):
                assert await subscribe(new, fake) == 0
                evicted = await recv(old)
                assert evicted["body"]["event"]["eventtype"] == "disconnected_event"
    assert fake.connections[0].closed_by == "server"


async def test_media_is_encrypted_and_expires(autojump_clock: trio.abc.Clock) -> None:
    async with open_fake_wecom() as fake:
        item = fake.add_media(b"x" * 100, name="a.txt")
        async with httpx.AsyncClient() as http:
            got = await http.get(item["url"])
            assert got.status_code == 200 and len(got.content) == 128
            assert media.decrypt(got.content, media.media_key(item["aeskey"])) == b"x" * 100
            await trio.sleep(301)
            assert (await http.get(item["url"])).status_code == 403
