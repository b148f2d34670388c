"""The local HTTP endpoint as clients see it: routes, errors, the token, the login form,
websocket ``Origin`` checks and shutdown.

Every test serves a real :class:`~dshim.http.app.Endpoint` with hypercorn's trio worker
on 127.0.0.1, port 0, and talks to it with httpx, trio-websocket or a raw socket (for
requests httpx will not send).  Real clock; the conftest deadline bounds each test.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import httpx
import pytest
import trio
from structlog.testing import capture_logs
from trio_websocket import ConnectionClosed

from dshim.http.app import Endpoint
from dshim.http.server import serve_endpoint
from dshim.http.types import HttpRequest, HttpResponse, WebSocket
from tests.http_client import open_ws, port_of, raw_request, upgrade

TOKEN = "s3cret-endpoint-token-0123456789"


@asynccontextmanager
async def serving(endpoint: Endpoint, listen: str = "127.0.0.1:0") -> AsyncIterator[str]:
    """Serve ``endpoint``; yields its base URL (``http://127.0.0.1:PORT``)."""
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve_endpoint, endpoint, listen, shutdown=shutdown))
        try:
            yield binds[0]
        finally:
            shutdown.set()


async def echo_socket(ws: WebSocket) -> None:
    while True:
        await ws.send("echo:" + str(await ws.receive()))


async def hook(request: HttpRequest) -> HttpResponse:
    body = {
        "method": request.method,
        "path": request.path,
        "query": request.query,
        "body": request.body.decode(),
    }
    return HttpResponse(200, json.dumps(body).encode())


def endpoint_with_mounts(**kw: object) -> Endpoint:
    endpoint = Endpoint(**kw)  # type: ignore[arg-type]
    endpoint.mount("wa", "", hook)
    endpoint.mount("wa", "status", hook)
    endpoint.mount_websocket("web", "ws", echo_socket)
    endpoint.mount("web", "", hook)
    endpoint.root_bot = "web"
    return endpoint


def assert_json_error(resp: httpx.Response, status: int, code: str) -> dict[str, str]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert body["error"] == code and body["message"]
    assert "Traceback" not in resp.text and len(resp.content) < 300
    return body  # type: ignore[no-any-return]


# --- routes and errors ----------------------------------------------------------------------


async def test_healthz_answers_ok_and_head_too() -> None:
    async with serving(Endpoint()) as base, httpx.AsyncClient(base_url=base) as http:
        resp = await http.get("/healthz")
        assert (resp.status_code, resp.text) == (200, "ok")
        head = await http.head("/healthz")
        assert head.status_code == 200 and head.content == b""


async def test_unknown_paths_and_bots_are_404_json() -> None:
    async with serving(endpoint_with_mounts()) as base, httpx.AsyncClient(base_url=base) as http:
        assert_json_error(await http.get("/hooks/nobody/x"), 404, "not_found")
        assert_json_error(await http.post("/hooks/nobody", content=b"{}"), 404, "not_found")
        assert_json_error(await http.get("/hooks/"), 404, "not_found")
        assert_json_error(await http.get("/hooks/wa/unmounted"), 404, "not_found")
        assert_json_error(await http.get("/no/such/page"), 404, "not_found")  # root bot: no mount
    async with serving(Endpoint()) as base, httpx.AsyncClient(base_url=base) as http:
        assert_json_error(await http.get("/"), 404, "not_found")  # no web chat bot at all


async def test_wrong_method_is_405_json_naming_the_allowed_ones() -> None:
    async with serving(Endpoint()) as base, httpx.AsyncClient(base_url=base) as http:
        resp = await http.post("/healthz", content=b"x")
        assert_json_error(resp, 405, "method_not_allowed")
        assert resp.headers["allow"] == "GET, HEAD"
        assert_json_error(await http.delete("/healthz"), 405, "method_not_allowed")


async def test_mounts_get_the_request_relative_to_the_bot() -> None:
    async with serving(endpoint_with_mounts()) as base, httpx.AsyncClient(base_url=base) as http:
        resp = await http.post("/hooks/wa/status?hub.mode=subscribe", content=b"payload")
        assert resp.json() == {
            "method": "POST",
            "path": "/status",
            "query": "hub.mode=subscribe",
            "body": "payload",
        }
        assert (await http.get("/hooks/wa")).json()["path"] == "/"  # a program: the mount
        page = await http.get("/hooks/wa?x=1", headers={"accept": "text/html,*/*"})
        assert (page.status_code, page.headers["location"]) == (308, "/hooks/wa/?x=1")
        # The web chat bot's mounts are at the root too.
        assert (await http.get("/")).json()["path"] == "/"
        assert (await http.get("/hooks/web/")).json()["path"] == "/"


async def test_an_oversized_body_is_413_json_before_it_is_read() -> None:
    endpoint = endpoint_with_mounts(max_body=1000)
    async with serving(endpoint) as base:
        # Declared too large: refused at once, without waiting for the (unsent) body.
        status, headers, body = await raw_request(
            base,
            b"POST /hooks/wa HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000000\r\n\r\n",
        )
        assert status == 413 and json.loads(body)["error"] == "too_large"
        assert headers["content-type"].startswith("application/json")
        # Chunked, no length: refused once it grows past the limit.
        chunk = b"x" * 1500
        status, _, body = await raw_request(
            base,
            b"POST /hooks/wa HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            + f"{len(chunk):x}\r\n".encode()
            + chunk
            + b"\r\n0\r\n\r\n",
        )
        assert status == 413 and json.loads(body)["error"] == "too_large"
        async with httpx.AsyncClient(base_url=base) as http:  # at the limit: served
            assert (await http.post("/hooks/wa", content=b"y" * 1000)).status_code == 200


async def test_a_handler_that_crashes_answers_500_without_a_traceback() -> None:
    async def broken(request: HttpRequest) -> HttpResponse:
        raise KeyError("internal detail")

    endpoint = Endpoint()
    endpoint.mount("wa", "", broken)
    with capture_logs() as logs:
        async with serving(endpoint) as base, httpx.AsyncClient(base_url=base) as http:
            resp = await http.post("/hooks/wa", content=b"{}")
            assert_json_error(resp, 500, "internal")
            assert "internal detail" not in resp.text
            assert (await http.get("/healthz")).status_code == 200  # still serving
    assert any(e["event"] == "http_handler_failed" for e in logs)


# --- the token ---------------------------------------------------------------------------------


async def test_with_a_token_every_route_but_healthz_needs_it() -> None:
    endpoint = endpoint_with_mounts(token=TOKEN)
    async with serving(endpoint) as base, httpx.AsyncClient(base_url=base) as http:
        assert (await http.get("/healthz")).text == "ok"
        for method, path in [
            ("POST", "/hooks/wa"),
            ("GET", "/"),
            ("GET", "/no/such/page"),  # unknown paths too: nothing is revealed
            ("GET", "/hooks/nobody/x"),
        ]:
            resp = await http.request(method, path)
            assert_json_error(resp, 401, "unauthorized")
            assert resp.headers["www-authenticate"].startswith("Bearer")
            wrong = await http.request(
                method, path, headers={"Authorization": "Bearer not-the-token"}
            )
            assert_json_error(wrong, 401, "unauthorized")
            basic = await http.request(method, path, headers={"Authorization": f"Basic {TOKEN}"})
            assert basic.status_code == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert (await http.post("/hooks/wa", headers=auth)).status_code == 200
        assert (await http.get("/", headers=auth)).json()["path"] == "/"
        assert_json_error(await http.get("/no/such/page/x", headers=auth), 404, "not_found")
        assert (
            await http.get("/", headers={"authorization": f"bearer {TOKEN}"})
        ).status_code == 200


async def test_a_public_mount_is_reachable_without_the_token_and_others_are_not() -> None:
    # A platform webhook (WhatsApp) cannot send the token: it checks a signature itself.
    endpoint = Endpoint(token=TOKEN)
    endpoint.mount("wa", "", hook, public=True)
    endpoint.mount("wa", "status", hook)
    endpoint.mount("other", "", hook)
    raw = b'{"entry":[{"id":"1"}]}  \r\n'  # not re-serialized
    async with serving(endpoint) as base, httpx.AsyncClient(base_url=base) as http:
        for path in ("/hooks/wa", "/hooks/wa/"):  # no trailing path reaches the "" mount
            resp = await http.post(path, content=raw)
            assert resp.status_code == 200, resp.text
            assert resp.json()["path"] == "/"
        html = {"accept": "text/html,*/*"}  # a webhook is not a page: never redirected
        got = await http.get("/hooks/wa?hub.mode=subscribe&hub.challenge=42", headers=html)
        assert (
            got.status_code == 200 and got.json()["query"] == "hub.mode=subscribe&hub.challenge=42"
        )
        for path in ("/hooks/wa/status", "/hooks/other", "/hooks/nobody"):
            assert_json_error(await http.post(path, content=raw), 401, "unauthorized")
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert (await http.post("/hooks/wa/status", headers=auth)).status_code == 200
        # Over the public mounts' 1 MiB: refused from the declared length, before reading.
        status, _, body = await raw_request(
            base, b"POST /hooks/wa HTTP/1.1\r\nHost: x\r\nContent-Length: 1048577\r\n\r\n"
        )
        assert status == 413 and json.loads(body)["error"] == "too_large"
        # The same route mounted again without public=True needs the token again.
        endpoint.mount("wa", "", hook)
        assert_json_error(await http.post("/hooks/wa", content=raw), 401, "unauthorized")


async def test_a_public_mount_gets_the_raw_body_bytes_unchanged() -> None:
    seen: list[bytes] = []

    async def keep(request: HttpRequest) -> HttpResponse:
        seen.append(request.body)
        return HttpResponse(200, b"ok", "text/plain")

    endpoint = Endpoint(token=TOKEN)
    endpoint.mount("wa", "", keep, public=True)
    raw = b'{ "b" : 1,\n  "a":"\\u00e9" }\xfe'
    async with serving(endpoint) as base, httpx.AsyncClient(base_url=base) as http:
        assert (await http.post("/hooks/wa", content=raw)).status_code == 200
    assert seen == [raw]


async def test_the_login_form_sets_a_cookie_that_works_like_the_header() -> None:
    endpoint = endpoint_with_mounts(token=TOKEN)
    with capture_logs() as logs:
        async with serving(endpoint) as base, httpx.AsyncClient(base_url=base) as http:
            # A browser opening the page is sent to the form, and back after signing in.
            page = await http.get("/?c=1", headers={"Accept": "text/html,*/*"})
            assert page.status_code == 303
            assert page.headers["location"] == "/login?next=%2F%3Fc%3D1"
            form = await http.get(page.headers["location"])
            assert form.status_code == 200 and form.headers["content-type"].startswith("text/html")
            assert '<form id="login" method="post" action="/login">' in form.text
            assert 'value="/?c=1"' in form.text and TOKEN not in form.text

            wrong = await http.post("/login", data={"token": "guess", "next": "/"})
            assert_json_error(wrong, 401, "unauthorized")
            assert "set-cookie" not in wrong.headers

            ok = await http.post("/login", data={"token": TOKEN, "next": "/?c=1"})
            assert ok.status_code == 303 and ok.headers["location"] == "/?c=1"
            cookie = ok.headers["set-cookie"]
            attributes = {a.strip().split("=")[0].lower() for a in cookie.split(";")[1:]}
            assert {"httponly", "samesite", "path"} <= attributes
            assert "SameSite=Strict" in cookie and "Path=/" in cookie
            assert TOKEN not in cookie
            # httpx keeps the cookie like a browser: the page and the hooks open now.
            assert (await http.get("/")).json()["path"] == "/"
            assert (await http.post("/hooks/wa", content=b"x")).status_code == 200

            name, _, value = cookie.split(";")[0].partition("=")
            tampered = {"Cookie": f"{name}={value[:-1]}{'0' if value[-1] != '0' else '1'}"}
            async with httpx.AsyncClient(base_url=base) as fresh:
                assert (await fresh.get("/", headers=tampered)).status_code == 401
                assert (
                    await fresh.get("/", headers={"Cookie": f"{name}={TOKEN}"})
                ).status_code == 401
    assert all(TOKEN not in json.dumps(e, default=str) for e in logs)


@pytest.mark.parametrize(
    ("content", "headers", "status"),
    [
        (b"next=%2F", {"content-type": "application/x-www-form-urlencoded"}, 400),  # no token
        (b"token=", {"content-type": "application/x-www-form-urlencoded"}, 400),
        (b"token=a&token=b", {"content-type": "application/x-www-form-urlencoded"}, 400),
        (b"token=\xff\xfe", {"content-type": "application/x-www-form-urlencoded"}, 400),
        (json.dumps({"token": TOKEN}).encode(), {"content-type": "application/json"}, 400),
        (b"&&&===", {"content-type": "application/x-www-form-urlencoded"}, 400),
    ],
)
async def test_a_malformed_login_is_a_4xx_json_error(
    content: bytes, headers: dict[str, str], status: int
) -> None:
    async with serving(Endpoint(token=TOKEN)) as base, httpx.AsyncClient(base_url=base) as http:
        resp = await http.post("/login", content=content, headers=headers)
        assert_json_error(resp, status, "bad_request")
        assert "set-cookie" not in resp.headers
        assert_json_error(await http.put("/login"), 405, "method_not_allowed")


async def test_without_the_token_no_large_body_is_read() -> None:
    async with serving(Endpoint(token=TOKEN)) as base, httpx.AsyncClient(base_url=base) as http:
        big = b"token=" + b"x" * 20_000
        resp = await http.post(
            "/login", content=big, headers={"content-type": "application/x-www-form-urlencoded"}
        )
        assert_json_error(resp, 413, "too_large")
        # Elsewhere the token is checked before the body is: 401, never 413.
        assert_json_error(await http.post("/hooks/wa", content=b"x" * 20_000), 401, "unauthorized")


async def test_login_never_redirects_off_the_endpoint() -> None:
    async with serving(Endpoint(token=TOKEN)) as base, httpx.AsyncClient(base_url=base) as http:
        for target in ("//evil.example/", "https://evil.example/", "\\\\evil", "javascript:x"):
            resp = await http.post("/login", data={"token": TOKEN, "next": target})
            assert resp.status_code == 303 and resp.headers["location"] == "/"


async def test_without_a_token_there_is_no_login_form() -> None:
    async with serving(Endpoint()) as base, httpx.AsyncClient(base_url=base) as http:
        assert_json_error(await http.get("/login"), 404, "not_found")


# --- websockets ----------------------------------------------------------------------------------


async def test_websocket_origin_must_be_the_endpoint_itself() -> None:
    endpoint = endpoint_with_mounts(token=TOKEN)
    async with serving(endpoint) as base:
        port = port_of(base)
        auth = (b"authorization", f"Bearer {TOKEN}".encode())
        for origin in (
            "http://evil.example",
            f"http://evil.example:{port}",
            f"http://127.0.0.1:{port + 1}",
            f"https://127.0.0.1:{port}",
            "null",
        ):
            status, body = await upgrade(
                base, "/ws", f"Origin: {origin}", f"Authorization: Bearer {TOKEN}"
            )
            assert status == 403, origin
            assert json.loads(body)["error"] == "forbidden"
        for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
            async with open_ws(base, "/ws", [(b"origin", origin.encode()), auth]) as ws:
                await ws.send_message("hi")
                assert await ws.get_message() == "echo:hi"


async def test_websocket_needs_the_token_or_the_cookie() -> None:
    endpoint = endpoint_with_mounts(token=TOKEN)
    async with serving(endpoint) as base, httpx.AsyncClient(base_url=base) as http:
        port = port_of(base)
        origin = (b"origin", f"http://127.0.0.1:{port}".encode())
        for path in ("/ws", "/hooks/web/ws"):
            status, body = await upgrade(base, path, f"Origin: http://127.0.0.1:{port}")
            assert status == 401 and json.loads(body)["error"] == "unauthorized"
        # A program (no Origin) with the bearer token.
        async with open_ws(base, "/ws", [(b"authorization", f"Bearer {TOKEN}".encode())]) as ws:
            await ws.send_message("program")
            assert await ws.get_message() == "echo:program"
        # A page after the login form: the cookie goes with the upgrade.
        login = await http.post("/login", data={"token": TOKEN})
        cookie = login.headers["set-cookie"].split(";")[0].encode()
        async with open_ws(base, "/ws", [origin, (b"cookie", cookie)]) as ws:
            await ws.send_message("page")
            assert await ws.get_message() == "echo:page"


async def test_websocket_without_origin_is_a_program_and_allowed_without_a_token() -> None:
    async with serving(endpoint_with_mounts()) as base:
        async with open_ws(base, "/ws") as ws:
            await ws.send_message("x")
            assert await ws.get_message() == "echo:x"
        status, body = await upgrade(base, "/nothing-here")
        assert status == 404 and json.loads(body)["error"] == "not_found"


async def test_shutdown_closes_open_websockets_and_the_server_stops() -> None:
    endpoint = endpoint_with_mounts()
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(serve_endpoint, endpoint, "127.0.0.1:0", shutdown=shutdown)
        )
        async with open_ws(binds[0], "/ws") as ws:
            await ws.send_message("x")
            assert await ws.get_message() == "echo:x"
            assert endpoint.open_sockets == 1
            t0 = trio.current_time()
            shutdown.set()
            with pytest.raises(ConnectionClosed) as info:
                await ws.get_message()
            assert info.value.reason.code == 1001
    assert trio.current_time() - t0 < 3  # the server ended promptly (the nursery exited)
    assert endpoint.open_sockets == 0
