"""The WhatsApp Web :class:`~tests.channel_contract.ChannelRig`: the fake account at the
engine boundary (``dshim.testing.fakes.whatsapp_web``), reached over its websocket on
127.0.0.1 (the channel's ``engine_url``).

What the scenarios' platform words mean here: "receiving" is the account connected (the
fake sent ``connected``); "the connection drops" is the socket closing without a close
frame (the channel reconnects, and the fake delivers again every message not yet
acknowledged); "a rejected credential" is an account that is not linked (the fake shows
a QR code instead of connecting); "429s" are ``rate_limited`` answers to sends and edits.
The "credential" that must never reach a log is a message's ``messageSecret`` (WhatsApp's
per-message key, in every event the fake delivers).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from dshim.channels.whatsapp_web import channel as wa_web_channel
from dshim.harness.base import Harness
from dshim.testing.fakes.whatsapp_web import (
    ADA,
    DEFAULT_ACCOUNT,
    FakeWhatsAppWeb,
    message_event,
    open_fake_whatsapp_web,
)
from tests.channel_contract import Answer, RecordingHarness
from tests.rigkit import Bot, Configure, FakeRig, bot_on_fake, im_source, seeded

#: The bot's number and LID users, and the user who writes to it.
BOT_NUMBER = DEFAULT_ACCOUNT.jid.partition("@")[0]
USER = ADA.partition("@")[0]
#: WhatsApp's per-message secret (``messageContextInfo.messageSecret``, base64).
MESSAGE_SECRET = "c2VjcmV0LW9mLXRoZS1tZXNzYWdlLWRvLW5vdC1sb2c9PQ=="
#: Calls that only keep the account (the identity call): everything else answers.
RECEIVING = ("me",)
DEADLINE = 900


def with_secret(event: dict[str, Any]) -> dict[str, Any]:
    """The event with the message secret WhatsApp puts in every message."""
    event["Message"]["messageContextInfo"] = {"messageSecret": MESSAGE_SECRET}
    return event


class WhatsApp_WebRig(FakeRig[FakeWhatsAppWeb]):
    """WhatsApp Web under the shared scenarios (see ``tests/channel_contract.py``)."""

    def __init__(self, extra: dict[str, Any] | None = None) -> None:
        super().__init__(seeded(wa_web_channel, 31), open_fake_whatsapp_web)
        self.extra = extra or {}

    @property
    def secret(self) -> str:
        return MESSAGE_SECRET

    @property
    def bot_author(self) -> tuple[str, str]:
        return BOT_NUMBER, DEFAULT_ACCOUNT.push_name

    def bot_table(self, *, valid_credentials: bool = True) -> dict[str, Any]:
        if not valid_credentials:
            self.fake.paired = False  # the account is not linked: no session to use
        return {"engine_url": self.fake.url, **self.extra}

    def connected(self) -> bool:
        live = self.fake.live
        return live is not None and live.ready

    def source(self, kind: str) -> str:
        return im_source("whatsapp_web", kind, USER, "Ada")

    async def user_dm(self, text: str, *, reply_to: str | None = None) -> str:
        if reply_to is None:
            return await self.fake.inject(with_secret(message_event(text)))
        quoted = self.fake.text_of(reply_to)
        event = message_event(
            text,
            quoted_id=reply_to,
            quoted_participant=DEFAULT_ACCOUNT.jid,
            quoted_message={"conversation": quoted},
        )
        return await self.fake.inject(with_secret(event))

    async def user_group(self, text: str, *, mention: bool) -> str:
        if mention:
            event = message_event(
                f"@{BOT_NUMBER} {text}", group=True, mentions=[DEFAULT_ACCOUNT.jid]
            )
        else:
            event = message_event(text, group=True)
        return await self.fake.inject(with_secret(event))

    def dm_answers(self) -> list[Answer]:
        fake = self.fake
        out = []
        for sent in fake.sent:
            if sent.chat != ADA:
                continue
            shown = [sent.text, *(e.text for e in fake.edits if e.message_id == sent.id)]
            out.append(Answer(sent.id, fake.text_of(sent.id), tuple(shown)))
        return out

    def calls_besides_receiving(self) -> list[str]:
        return [c.op for c in self.fake.calls if c.op not in RECEIVING]

    def identity_calls(self) -> int:
        return len(self.fake.connections)

    def rate_limit_answers(self, count: int, retry_after: float) -> None:
        self.fake.fail_next("send", count, status=429, retry_after=retry_after)
        self.fake.fail_next("edit", count, status=429, retry_after=retry_after)


def echo_of(content: str, kind: str = "direct", reply: str | None = None) -> str:
    """What the echo harness answers a message of the test user."""
    source = im_source("whatsapp_web", kind, USER, "Ada")
    return "\n\n".join([source, *([reply] if reply else []), content])


@asynccontextmanager
async def whatsapp_web_bed(
    tmp_path: Path,
    *,
    harness: Harness | None = None,
    configure: Configure[FakeWhatsAppWeb] = None,
    ready: bool = True,
    deadline: float = DEADLINE,
    extra: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[Bot, FakeWhatsAppWeb]]:
    """One bot against a fresh fake account, within ``deadline``; the block starts once
    the account is connected (unless ``ready`` is False)."""

    def table(fake: FakeWhatsAppWeb) -> dict[str, Any]:
        return {
            "name": "wa",
            "channel": "whatsapp_web",
            "engine_url": fake.url,
            **(extra or {}),
        }

    def connected(fake: FakeWhatsAppWeb) -> bool:
        return fake.live is not None and fake.live.ready

    async with bot_on_fake(
        open_fake_whatsapp_web,
        table,
        seeded(wa_web_channel, 31),
        tmp_path,
        harness=harness or RecordingHarness(),
        deadline=deadline,
        ready=connected if ready else None,
        configure=configure,
    ) as (bot, fake):
        yield bot, fake
