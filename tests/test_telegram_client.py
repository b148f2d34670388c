"""The Bot API client over ``httpx.MockTransport``: request shapes and error mapping.

Each test answers requests with a canned Bot API response and checks what the caller of
the client sees.  The token sits in the URL path, so every error message is also checked
for it.  No network, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio

from dshim.channels.telegram.client import POLL_READ_MARGIN_S, USER_AGENT, BotApiClient
from dshim.channels.telegram.protocol import ChatMigrated
from dshim.channels.telegram.render import TelegramOutbound, TelegramTransport
from dshim.errors import (
    AuthError,
    ChannelError,
    Conflict,
    NotFound,
    PermissionDenied,
    RateLimited,
    RemoteProtocolError,
    TransportError,
)
from dshim.model import ReplyTarget
from dshim.net.http import open_http
from dshim.testing.fakes.telegram import BOT_USERNAME, TEST_TOKEN, open_fake_telegram

TOKEN = "123456:TEST-token-for-dshim-tests-only"
SECRET_PART = TOKEN.split(":", 1)[1]
Handler = Callable[[httpx.Request], httpx.Response]


def client_for(handler: Handler, seen: list[httpx.Request] | None = None) -> BotApiClient:
    def record(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        return handler(request)

    http = httpx.AsyncClient(
        transport=httpx.MockTransport(record), base_url="https://tg.invalid/base"
    )
    return BotApiClient(http, TOKEN)


def answer(status: int, body: Any) -> Handler:
    def handle(request: httpx.Request) -> httpx.Response:
        if isinstance(body, bytes):
            return httpx.Response(status, content=body)
        return httpx.Response(status, json=body)

    return handle


def error(status: int, description: str, **parameters: Any) -> Handler:
    body: dict[str, Any] = {"ok": False, "error_code": status, "description": description}
    if parameters:
        body["parameters"] = parameters
    return answer(status, body)


async def test_requests_go_to_the_method_url_as_json() -> None:
    seen: list[httpx.Request] = []
    client = client_for(answer(200, {"ok": True, "result": {"message_id": 7, "date": 1}}), seen)
    sent = await client.send_message(
        {
            "chat_id": -100,
            "text": "hi",
            "reply_parameters": {"message_id": 3, "allow_sending_without_reply": True},
        }
    )
    assert sent.message_id == 7
    req = seen[0]
    assert req.method == "POST"
    assert req.url.path == f"/base/bot{TOKEN}/sendMessage"
    assert json.loads(req.content) == {
        "chat_id": -100,
        "text": "hi",
        "reply_parameters": {"message_id": 3, "allow_sending_without_reply": True},
    }


async def test_get_updates_returns_raw_updates_and_waits_longer_than_the_poll() -> None:
    seen: list[httpx.Request] = []
    updates = [
        {"update_id": 1, "message": {"message_id": 1}},
        {"update_id": 2, "edited_message": {}},
    ]
    client = client_for(answer(200, {"ok": True, "result": updates}), seen)
    raws = await client.get_updates(
        {"timeout": 25, "offset": 1, "limit": 100, "allowed_updates": ["message"]}
    )
    assert [json.loads(r) for r in raws] == updates
    read_timeout = seen[0].extensions["timeout"]["read"]
    assert read_timeout >= 25 + POLL_READ_MARGIN_S > 25


async def test_edit_that_changes_nothing_is_a_success() -> None:
    client = client_for(
        error(
            400,
            "Bad Request: message is not modified: specified new message content and reply markup are exactly the same as a current content and reply markup of the message",
        )
    )
    await client.edit_message_text(1, 2, "same text")  # does not raise


@pytest.mark.parametrize(
    ("handler", "kind"),
    [
        (error(429, "Too Many Requests: retry after 5", retry_after=5), RateLimited),
        (error(401, "Unauthorized"), AuthError),
        (error(404, "Not Found"), AuthError),
        (
            error(
                409,
                "Conflict: terminated by other getUpdates request; make sure that only one bot instance is running",
            ),
            Conflict,
        ),
        (error(403, "Forbidden: bot was blocked by the user"), PermissionDenied),
        (error(400, "Bad Request: message to edit not found"), NotFound),
        (error(400, "Bad Request: message to be replied not found"), NotFound),
        (
            error(
                400,
                "Bad Request: group chat was upgraded to a supergroup chat",
                migrate_to_chat_id=-1002,
            ),
            ChatMigrated,
        ),
        (error(500, "Internal Server Error"), TransportError),
        (answer(502, b"<html><body>502 Bad Gateway</body></html>"), TransportError),
        (answer(200, b"<html>not the Bot API</html>"), RemoteProtocolError),
        (answer(200, {"ok": True}), RemoteProtocolError),
        (answer(200, {"ok": True, "result": "unexpected"}), RemoteProtocolError),
    ],
)
async def test_error_mapping_and_no_token_in_messages(
    handler: Handler, kind: type[ChannelError]
) -> None:
    client = client_for(handler)
    with pytest.raises(kind) as info:
        await client.send_message({"chat_id": 1, "text": "x"})
    assert "sendMessage" in str(info.value)
    assert TOKEN not in str(info.value) and SECRET_PART not in str(info.value)


async def test_rate_limit_retry_after_reaches_the_caller() -> None:
    client = client_for(error(429, "Too Many Requests: retry after 17", retry_after=17))
    with pytest.raises(RateLimited) as info:
        await client.edit_message_text(1, 2, "x")
    assert info.value.retry_after == 17


async def test_repr_does_not_show_the_token() -> None:
    client = client_for(answer(200, {}))
    assert SECRET_PART not in repr(client)


async def test_file_download_within_the_limit() -> None:
    data = b"\x89PNG\r\n\x1a\n" + b"x" * 100

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/getFile"):
            return httpx.Response(
                200,
                json={
                    "ok": True,
                    "result": {
                        "file_id": "f",
                        "file_size": len(data),
                        "file_path": "photos/file_1.png",
                    },
                },
            )
        assert request.url.path == f"/base/file/bot{TOKEN}/photos/file_1.png"
        return httpx.Response(200, content=data)

    fetch = client_for(handle).fetcher("f", len(data))
    assert await fetch(1000) == data


async def test_file_download_stops_after_the_limit() -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/getFile"):
            return httpx.Response(
                200, json={"ok": True, "result": {"file_id": "f", "file_path": "documents/big.bin"}}
            )
        return httpx.Response(200, content=b"y" * 10_000)

    with pytest.raises(ChannelError, match="over the 100 byte limit"):
        await client_for(handle, seen).fetch_file("f", 100)
    assert len(seen) == 2  # getFile, then the download it stopped


async def test_file_declared_too_large_is_not_downloaded() -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            json={
                "ok": True,
                "result": {
                    "file_id": "f",
                    "file_size": 10_000_000,
                    "file_path": "documents/big.bin",
                },
            },
        )

    with pytest.raises(ChannelError, match="over the 100 byte limit"):
        await client_for(handle, seen).fetch_file("f", 100)
    assert [r.url.path.rsplit("/", 1)[-1] for r in seen] == ["getFile"]


async def test_expired_file_link_is_an_error_without_the_token() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/getFile"):
            return httpx.Response(
                200, json={"ok": True, "result": {"file_id": "f", "file_path": "documents/x.bin"}}
            )
        return httpx.Response(
            404, json={"ok": False, "error_code": 404, "description": "Not Found"}
        )

    with pytest.raises(ChannelError) as info:
        await client_for(handle).fetch_file("f", 100)
    assert TOKEN not in str(info.value)


async def test_calls_are_cancellable() -> None:
    async def never(request: httpx.Request) -> httpx.Response:
        await trio.sleep_forever()
        raise AssertionError

    http = httpx.AsyncClient(transport=httpx.MockTransport(never), base_url="https://tg.invalid")
    client = BotApiClient(http, TOKEN)
    with trio.move_on_after(0.05) as scope:
        await client.get_me()
    assert scope.cancelled_caught


# --- issue 9 --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "sent"),
    [
        (httpx.ConnectError("Connection refused"), False),
        (httpx.ConnectTimeout("connect timed out"), False),
        (httpx.PoolTimeout("no free connection"), False),
        (httpx.ReadTimeout("read timed out"), True),
        (httpx.WriteTimeout("write timed out"), False),  # never reached Telegram whole
        (httpx.WriteError("broken pipe"), False),
        (httpx.RemoteProtocolError("Server disconnected without sending a response."), True),
        (httpx.ReadError("connection reset"), True),
    ],
)
async def test_a_failed_send_says_whether_it_can_have_reached_telegram(
    exc: Exception, sent: bool
) -> None:
    """Telegram has no idempotency key: only a send that never left may be repeated freely."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        raise exc

    client = client_for(handle, seen)
    with pytest.raises(TransportError) as info:
        await client.send_message({"chat_id": 1, "text": "x"})
    assert info.value.request_sent is sent
    assert len(seen) == 1  # the client never repeats a send on its own
    assert TOKEN not in str(info.value) and SECRET_PART not in str(info.value)


async def test_a_server_error_after_a_send_is_an_unknown_outcome() -> None:
    client = client_for(error(502, "Bad Gateway"))
    with pytest.raises(TransportError) as info:
        await client.send_message({"chat_id": 1, "text": "x"})
    assert info.value.request_sent is True


def file_answers(download: httpx.Response) -> Handler:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/getFile"):
            return httpx.Response(
                200,
                json={"ok": True, "result": {"file_id": "f", "file_path": "photos/file_9.jpg"}},
            )
        return download

    return handle


@pytest.mark.parametrize(
    "handler",
    [
        # The download link expired or the file is gone.
        file_answers(
            httpx.Response(404, json={"ok": False, "error_code": 404, "description": "Not Found"})
        ),
        file_answers(httpx.Response(404, content=b"")),
        # getFile itself refuses: too big for the Bot API, a wrong or expired file_id.
        error(400, "Bad Request: file is too big"),
        error(400, "Bad Request: wrong file_id or the file is temporarily unavailable"),
        error(400, "Bad Request: invalid file_id"),
        error(404, "Not Found"),
    ],
)
async def test_an_unavailable_file_is_not_reported_as_a_bad_token(handler: Handler) -> None:
    with pytest.raises(ChannelError) as info:
        await client_for(handler).fetch_file("f", 10_000)
    assert not isinstance(info.value, AuthError)
    assert isinstance(info.value, NotFound)
    assert "token" not in str(info.value)
    assert TOKEN not in str(info.value) and SECRET_PART not in str(info.value)


async def test_the_transport_sends_once_when_the_answer_is_lost() -> None:
    """The processed-but-unanswered send surfaces as an unknown outcome, never retried here."""
    async with open_fake_telegram() as fake, open_http(fake.url, user_agent=USER_AGENT) as http:
        fake.private_chat(fake.user(42))
        outbound = TelegramOutbound(
            BotApiClient(http, TEST_TOKEN), clock=lambda: 0.0, username=BOT_USERNAME
        )
        transport = TelegramTransport(outbound, ReplyTarget(conversation_id="42"))
        fake.lose_response_next("sendMessage")
        with pytest.raises(TransportError) as info:
            await transport.send("hello", reply=True)
        assert info.value.request_sent is True
        assert len(fake.calls_to("sendMessage")) == 1
        assert [m.text for m in fake.bot_messages(42)] == ["hello"]  # it did arrive
        fake.drop_next("sendMessage")  # refused before it was performed: not sent
        with pytest.raises(TransportError):
            await transport.send("again", reply=True)
        assert len(fake.calls_to("sendMessage")) == 2
