"""The WhatsApp :class:`~tests.channel_contract.ChannelRig`: the fake Cloud API on 127.0.0.1,
and dshim's own HTTP endpoint (with a bearer token the webhook does not need) receiving
the fake's signed webhook POSTs.

What the scenarios' platform words mean here: "receiving" is the webhook route being
mounted (there is no connection); "the connection drops" is a POST whose answer was lost
after dshim accepted it, so Meta delivers the same body again; "429s" are Graph's
throughput error 130429 on sends (Cloud API messages cannot be edited: the answer is one
final message after the typing indicator).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from dshim.channels.base import BotHost
from dshim.channels.registry import parse_config
from dshim.channels.whatsapp import channel as wa_channel
from dshim.http.app import Endpoint
from dshim.store import open_store
from dshim.store.base import Store
from dshim.testing.fakes.whatsapp import (
    TEST_APP_SECRET,
    TEST_TOKEN,
    TEST_VERIFY_TOKEN,
    FakeWhatsApp,
    User,
    open_fake_whatsapp,
)
from tests import rigkit
from tests.channel_contract import BOT, Answer, RecordingHarness
from tests.helpers import Clock
from tests.rigkit import EndpointHost, FakeRig, im_source, serving

ENDPOINT_TOKEN = "endpoint-bearer-5c2e9a7d41f3b8"
GROUP_ID = "120363025246125486"


#: dshim's HTTP endpoint on 127.0.0.1:0 with the bearer token: (endpoint, its base URL).
open_endpoint = functools.partial(rigkit.open_endpoint, ENDPOINT_TOKEN)


async def mounted(fake: FakeWhatsApp) -> None:
    """Wait until the bot's webhook route answers the verification GET (it is mounted)."""
    assert fake.http is not None
    query = f"hub.mode=subscribe&hub.verify_token={TEST_VERIFY_TOKEN}&hub.challenge=up"
    while True:
        if (await fake.http.get(f"{fake.webhook_url}?{query}")).status_code == 200:
            return
        await trio.sleep(0.5)


def bot_table(fake: FakeWhatsApp, **keys: Any) -> dict[str, Any]:
    """The ``[[bots]]`` keys pointing at the fake (``keys`` add or replace some)."""
    return {
        "phone_number_id": fake.phone_number_id,
        "access_token": TEST_TOKEN,
        "app_secret": TEST_APP_SECRET,
        "verify_token": TEST_VERIFY_TOKEN,
        "api_base": fake.url,
        **keys,
    }


def source(user: User, kind: str = "direct") -> str:
    """The ``<dsh_im_source>`` block of a WhatsApp user."""
    return im_source("whatsapp", kind, user.key, user.name)


class WhatsAppRig(FakeRig[FakeWhatsApp]):
    """WhatsApp under the shared scenarios (see ``tests/channel_contract.py``)."""

    secret = TEST_TOKEN
    #: Cloud API messages cannot be edited: one final message, no intermediate text.
    streams_by_edits = False

    def __init__(self) -> None:
        super().__init__(dataclasses.replace(wa_channel.CHANNEL, run_fn=self._run), self._world)
        self.endpoint: Endpoint | None = None
        self.ada: User | None = None
        self._last_body = b""

    async def _run(
        self, host: BotHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        assert self.endpoint is not None
        await wa_channel.run(EndpointHost(host, self.endpoint), task_status=task_status)

    @property
    def bot_author(self) -> tuple[str, str]:
        return self.fake.phone_number_id, self.fake.verified_name

    @asynccontextmanager
    async def _world(self) -> AsyncIterator[FakeWhatsApp]:
        async with open_fake_whatsapp(clock=Clock()) as fake, open_endpoint() as (endpoint, url):
            self.endpoint = endpoint
            fake.webhook_url = f"{url}/hooks/{BOT}"
            self.ada = fake.user("16505551234", "Ada Lovelace")
            yield fake

    def bot_table(self, *, valid_credentials: bool = True) -> dict[str, Any]:
        if valid_credentials:
            return bot_table(self.fake)
        return bot_table(self.fake, access_token="EAAG-not-a-token-meta-knows")

    async def receiving(self) -> None:
        # Webhooks need no connection: the bot receives once its route is mounted.
        await mounted(self.fake)

    def source(self, kind: str) -> str:
        assert self.ada is not None
        return source(self.ada, kind)

    async def _send(self, msg: dict[str, Any]) -> str:
        self._last_body = self.fake.body([msg])
        await self.fake.deliver(self._last_body)
        return str(msg["id"])

    async def user_dm(self, text: str, *, reply_to: str | None = None) -> str:
        assert self.ada is not None
        return await self._send(self.fake.user_message(self.ada, text, reply_to=reply_to))

    async def user_group(self, text: str, *, mention: bool) -> str:
        assert self.ada is not None
        body = f"@{self.fake.display_phone_number} {text}" if mention else text
        return await self._send(self.fake.user_message(self.ada, body, group_id=GROUP_ID))

    def dm_answers(self) -> list[Answer]:
        assert self.ada is not None
        return [Answer(s.id, s.text, (s.text,)) for s in self.fake.to_user(self.ada.key)]

    def calls_besides_receiving(self) -> list[str]:
        return [c.op for c in self.fake.calls]

    def identity_calls(self) -> int:
        return len(self.fake.calls_to("phone"))

    async def drop_connection(self) -> None:
        # The answer to the last POST was lost: Meta delivers the same body again.
        if self._last_body:
            await self.fake.deliver(self._last_body)

    def rate_limit_answers(self, count: int, retry_after: float) -> None:
        self.fake.fail_next("send", count, status=400, code=130429)


# --- the e2e bed ----------------------------------------------------------------------------

E2E_BOT = "wa"


def echo_of(user: User, content: str, reply: str | None = None) -> str:
    """What the echo harness answers: the prompt's text parts joined by a blank line."""
    return "\n\n".join([source(user), *([reply] if reply else []), content])


class WhatsAppBed:
    """The fake Cloud API with Ada, dshim's endpoint receiving its webhooks, and a real
    store; :meth:`serving` runs the bot ``wa`` on them."""

    def __init__(
        self, fake: FakeWhatsApp, endpoint: Endpoint, store: Store, harness: RecordingHarness
    ) -> None:
        self.fake = fake
        self.endpoint = endpoint
        self.store = store
        self.harness = harness
        #: How the last run ended (empty while it runs).
        self.results: dict[str, str] = {}
        self._ada: User | None = None

    @property
    def ada(self) -> User:
        """Ada Lovelace, +1 650 555 1234 (known to the fake from the first use on)."""
        if self._ada is None:
            self._ada = self.fake.user("16505551234", "Ada Lovelace")
        return self._ada

    def texts_to(self, user: User) -> list[str]:
        """What the bot sent to a user, oldest first."""
        return [s.text for s in self.fake.to_user(user.key)]

    async def say(self, text: str | None = None, user: User | None = None, **options: Any) -> Any:
        """A user (Ada) writes to the bot; returns the message."""
        msg = self.fake.user_message(user or self.ada, text, **options)
        await self.fake.send_messages(msg)
        return msg

    @asynccontextmanager
    async def serving(self, *, grace_s: float = 5.0, metrics: Any = None) -> AsyncIterator[None]:
        """Run the bot through serve_bots, with its secrets from the environment, until its
        webhook is mounted; leaving the block shuts it down gracefully."""

        async def run(host: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            await wa_channel.run(EndpointHost(host, self.endpoint), task_status=task_status)

        secrets = {"access_token": "${WA_TOKEN}", "app_secret": "${WA_SECRET}"}
        table = bot_table(self.fake, **secrets, verify_token="${WA_VERIFY}")
        config = parse_config(
            {
                "dshim": {"shutdown_grace_s": grace_s},
                "bots": [{"name": E2E_BOT, "channel": "whatsapp", **table}],
            },
            env={
                "WA_TOKEN": TEST_TOKEN,
                "WA_SECRET": TEST_APP_SECRET,
                "WA_VERIFY": TEST_VERIFY_TOKEN,
            },
        )
        channel = dataclasses.replace(wa_channel.CHANNEL, run_fn=run)
        async with serving(
            config,
            self.store,
            grace_s=grace_s,
            channels={E2E_BOT: channel},
            clock=Clock(),
            harness=self.harness,
            metrics=metrics,
        ) as started:
            self.results = started.results
            await mounted(self.fake)
            yield


@asynccontextmanager
async def whatsapp_bed(
    data_dir: Path,
    *,
    serve: bool = True,
    grace_s: float = 5.0,
    metrics: Any = None,
    **fake_options: Any,
) -> AsyncIterator[tuple[WhatsAppBed, FakeWhatsApp]]:
    """The fake, dshim's endpoint and a store in ``data_dir`` for one e2e test, with the
    bot serving (unless ``serve`` is False): the bed and (for brevity) its fake."""
    async with (
        open_fake_whatsapp(clock=Clock(), **fake_options) as fake,
        open_endpoint() as (endpoint, url),
        open_store(data_dir, inline=True) as store,
    ):
        fake.webhook_url = f"{url}/hooks/{E2E_BOT}"
        bed = WhatsAppBed(fake, endpoint, store, RecordingHarness())
        if not serve:
            yield bed, fake
            return
        async with bed.serving(grace_s=grace_s, metrics=metrics):
            yield bed, fake
