"""The web chat under test: dshim serving it on 127.0.0.1 port 0, and a scripted tab.

:func:`serving` runs what ``dshim serve`` runs for a web chat bot — the real SQLite store,
the local HTTP endpoint (hypercorn on port 0) and ``serve_bots`` with the echo harness.
The tab is the product's scripted client, :mod:`dshim.testing.fakes.webchat` (the
README's frames, the page's reconnect rule, every frame recorded with its time), so tests
assert what a user would see; :class:`ChatClient` only adds the tests' shorthands.
:class:`WebchatRig` plugs both into the shared channel scenarios
(``tests/channel_contract.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from dshim.channels.base import BotHost
from dshim.channels.registry import parse_config
from dshim.channels.webchat import channel as webchat_channel
from dshim.harness.base import Harness
from dshim.http.app import Endpoint
from dshim.http.server import serve_endpoint
from dshim.serve import serve_bots
from dshim.store import open_store
from dshim.store.base import Store
from dshim.testing.fakes.webchat import (
    FrameRefused,
    WebchatClient,
    open_webchat_client,
    send_frame,
)
from tests.channel_contract import BOT, Answer, quote_block
from tests.rigkit import EndpointHost, FakeRig, im_source, open_endpoint


def source_block(kind: str = "direct", user: str = "u-ann", name: str = "Ann") -> str:
    """The ``<dsh_im_source>`` block of a web chat user."""
    return im_source("webchat", kind, user, name)


#: The exact ``<dsh_im_reply_to>`` block with these fields (keys in the fixed order).
reply_block = quote_block


def bot_quote(message_id: str, content: str, bot: str = "web") -> str:
    """The reply block of a quote of the bot's answer."""
    return reply_block(messageId=message_id, authorId=f"bot:{bot}", authorName=bot, content=content)


# --- the scripted tab ------------------------------------------------------------------------


class ChatClient(WebchatClient):
    """The scripted tab of :mod:`dshim.testing.fakes.webchat` with the tests' shorthands:
    ``user=(id, name)`` and ``send``/``answer`` returning the id (``wait=False``: the
    client_id at once; a refused answer: ``""``, the error is in :attr:`errors`).  Its
    reconnect backoff is seeded, so virtual timings repeat."""

    def __init__(
        self,
        url: str,
        *,
        user: tuple[str, str] = ("u-ann", "Ann"),
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(url, user=user[0], name=user[1], headers=headers, rng=random.Random(7))

    async def send(  # type: ignore[override]
        self,
        conversation: str,
        text: str,
        *,
        reply_to: str | None = None,
        files: Sequence[tuple[str, str, bytes]] = (),
        client_id: str | None = None,
        wait: bool = True,
    ) -> str:
        if not wait:
            frame = send_frame(
                client_id or self.next_client_id(),
                conversation,
                text,
                reply_to=reply_to,
                files=files,
            )
            return await self.submit(frame)
        accepted = await super().send(
            conversation, text, reply_to=reply_to, files=files, client_id=client_id
        )
        return str(accepted["id"])

    async def answer(  # type: ignore[override]
        self, conversation: str, interaction: str, option: str
    ) -> str:
        try:
            return str((await super().answer(conversation, interaction, option))["id"])
        except FrameRefused:
            return ""


# --- dshim serving the web chat ----------------------------------------------------------------


@dataclass
class Served:
    url: str
    store: Store
    endpoint: Endpoint
    results: dict[str, str]

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://", 1) + "/ws"


@asynccontextmanager
async def serving(
    data_dir: Path,
    *,
    harness: Harness | None = None,
    bot: dict[str, Any] | None = None,
    listen: str = "127.0.0.1:0",
    grace_s: float = 10.0,
    inline: bool = True,
    token: str | None = None,
) -> AsyncIterator[Served]:
    """``dshim serve`` with one web chat bot ``web`` (the root bot) on ``listen``
    (with ``token``, the endpoint requires it: the page signs in through the login form)."""
    table = {"name": "web", "channel": "webchat", **(bot or {})}
    config = parse_config({"dshim": {"shutdown_grace_s": grace_s}, "bots": [table]}, env={})
    endpoint = Endpoint(token=token)
    endpoint.root_bot = table["name"]
    results: dict[str, str] = {}
    async with open_store(data_dir, inline=inline) as store, trio.open_nursery() as nursery:
        stop_http = trio.Event()
        binds = await nursery.start(
            functools.partial(serve_endpoint, endpoint, listen, shutdown=stop_http)
        )
        shutdown = trio.Event()
        done = trio.Event()

        async def bots(task_status: trio.TaskStatus[None]) -> None:
            results.update(
                await serve_bots(
                    config,
                    store,
                    shutdown=shutdown,
                    harness=harness,
                    endpoint=endpoint,
                    task_status=task_status,
                )
            )
            done.set()

        await nursery.start(bots)
        try:
            yield Served(binds[0], store, endpoint, results)
        finally:
            shutdown.set()
            with trio.move_on_after(grace_s + 30):
                await done.wait()
            stop_http.set()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


# --- the shared scenarios ------------------------------------------------------------------------

DM = "dm-1"
ROOM = "room-1"
SECRET = "wc-bearer-3f9a1c7e5b2d4a68"


class WebchatRig(FakeRig[WebchatClient]):
    """The web chat under the shared scenarios (see ``tests/channel_contract.py``).

    What the scenarios' platform words mean here: the "fake platform" is the endpoint and
    one scripted tab (user ``u-ann``, "Ann") that has joined a direct conversation and a
    room; a "platform call" is a frame about the bot's own messages (``message`` from the
    bot, ``typing``, ``interaction``) — ``accepted`` and the tab's own message shown back
    are the transport; the "credential" is the endpoint's bearer token the tab sends with
    the upgrade (it must never be logged); a "rejected credential" is a bot that cannot
    mount its page ([http] disabled); "the connection drops" is the tab's socket dropping,
    after which it reconnects and sends its last message again; "429s" are a tab that
    stops reading for that long.
    """

    def __init__(self) -> None:
        super().__init__(dataclasses.replace(webchat_channel.CHANNEL, run_fn=self._run), self._tab)
        self.endpoint: Endpoint | None = None
        self.url = ""
        self.runs = 0
        self._no_endpoint = False

    async def _run(
        self, host: BotHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        self.runs += 1
        endpoint = None if self._no_endpoint else self.endpoint
        await webchat_channel.run(EndpointHost(host, endpoint), task_status=task_status)

    @property
    def tab(self) -> WebchatClient:
        return self.fake

    @property
    def secret(self) -> str:
        return SECRET

    @property
    def bot_author(self) -> tuple[str, str]:
        return f"bot:{BOT}", BOT

    @asynccontextmanager
    async def _tab(self) -> AsyncIterator[WebchatClient]:
        async with open_endpoint() as (self.endpoint, url):
            self.url = url.replace("http://", "ws://", 1) + f"/hooks/{BOT}/ws"
            async with open_webchat_client(
                self.url,
                user="u-ann",
                name="Ann",
                token=SECRET,
                headers=[(b"cookie", f"dshim_token={SECRET}".encode())],
                conversations={DM: "direct", ROOM: "room"},
                rng=random.Random(7),
            ) as client:
                yield client

    def bot_table(self, *, valid_credentials: bool = True) -> dict[str, Any]:
        self._no_endpoint = not valid_credentials
        return {}

    async def receiving(self) -> None:
        tab = self.tab
        await tab.wait_until(
            lambda: (
                tab.ws is not None
                and sum(1 for f in tab.frames if f.get("type") == "history") >= 2 * tab.connections
            )
        )

    def source(self, kind: str) -> str:
        return source_block(kind)

    async def user_dm(self, text: str, *, reply_to: str | None = None) -> str:
        return str((await self.tab.send(DM, text, reply_to=reply_to))["id"])

    async def user_group(self, text: str, *, mention: bool) -> str:
        return str((await self.tab.send(ROOM, f"@{BOT} {text}" if mention else text))["id"])

    def dm_answers(self) -> list[Answer]:
        return [Answer(s.id, s.text, tuple(s.texts)) for s in self.tab.bot_messages(DM)]

    def calls_besides_receiving(self) -> list[str]:
        return [f"{f['type']} {f.get('id', '')}" for f in self.tab.bot_frames(ROOM)]

    def identity_calls(self) -> int:
        return self.runs

    async def drop_connection(self) -> None:
        await self.tab.drop()

    def rate_limit_answers(self, count: int, retry_after: float) -> None:
        self.tab.stall(count * retry_after)
