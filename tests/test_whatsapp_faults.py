"""The fault matrix on WhatsApp (Cloud API): a 10-second outage while 20 users wait.

The bot runs through serve_bots against the fake Graph API with dshim's own endpoint
receiving the fake's signed webhooks (127.0.0.1, autojump clock, real SQLite store, echo
harness; see ``tests/test_whatsapp_e2e.py``).  The fake's ``outage`` makes every call (or
only the sends) fail for 10 s -- answered with a 500, dropped before it is processed, or
processed with its answer lost.  An outage of everything also holds Meta's webhooks: half
of the users write before it, half during it, and theirs arrive once it is over.  What
the users see is counted: every answer arrives exactly once, except that a send whose
answer was lost may show one extra copy; the bot never restarts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from structlog.testing import capture_logs

from dshim.channels.whatsapp.client import GraphClient
from dshim.channels.whatsapp.protocol import Throttled, WindowClosed, graph_error
from dshim.channels.whatsapp.render import WhatsAppOutbound
from dshim.errors import TransportError
from dshim.model import ReplyTarget
from dshim.net.http import open_http
from dshim.pipeline.notices import outcome_of
from dshim.testing.fakes.whatsapp import TEST_TOKEN, FakeWhatsApp, User, open_fake_whatsapp
from tests.fault_matrix import matrix, restarts
from tests.helpers import Clock
from tests.rig_whatsapp import WhatsAppBed, echo_of, whatsapp_bed

DEADLINE = 900.0
SENDS = ("send",)
MATRIX = matrix(SENDS)


def question(user: User) -> str:
    return f"echo:sleep 2 question of {user.name}"


def people(fake: FakeWhatsApp) -> list[User]:
    return [fake.user(f"1650555{i:04d}", f"User {i}") for i in range(20)]


def answered(bot: WhatsAppBed, users: list[User]) -> bool:
    return all(echo_of(u, question(u)) in bot.texts_to(u) for u in users)


async def ask(fake: FakeWhatsApp, users: list[User], nursery: trio.Nursery) -> None:
    for user in users:
        nursery.start_soon(fake.send_messages, fake.user_message(user, question(user)))


@pytest.mark.parametrize(("kind", "ops"), [*MATRIX, ("lost", SENDS)])
async def test_a_ten_second_outage_loses_no_answer(
    tmp_path: Path, autojump_clock: trio.abc.Clock, kind: str, ops: tuple[str, ...]
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with whatsapp_bed(tmp_path) as (bot, fake), trio.open_nursery() as nursery:
            users = people(fake)
            await ask(fake, users[:10], nursery)
            await trio.sleep(0.5)
            fake.outage(10.0, kind, ops)
            await ask(fake, users[10:], nursery)  # held by Meta while everything is down
            await fake.wait_until(lambda: answered(bot, users))
            await trio.sleep(300)  # every retry the bot would make has happened
    for user in users:
        texts = bot.texts_to(user)
        answer = echo_of(user, question(user))
        if kind == "lost":
            assert texts and set(texts) == {answer} and len(texts) <= 2, texts
        else:
            assert texts == [answer]
    assert len(fake.calls_to("send")) > len(users)  # the outage did hit sends
    assert restarts(logs) == []
    assert [e for e in logs if e["event"] == "answer_postponed"] == []


async def test_an_outage_longer_than_the_retries_delivers_from_the_outbox_when_back(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with whatsapp_bed(tmp_path) as (bot, fake):
            ada = fake.user("16505551234", "Ada Lovelace")
            await fake.send_messages(fake.user_message(ada, "echo:sleep 2 are you there?"))
            await trio.sleep(0.5)
            fake.outage(300.0, "500", SENDS)
            await trio.sleep(250)
            assert bot.texts_to(ada) == []  # still down, nothing given up
            await fake.wait_until(lambda: len(bot.texts_to(ada)) >= 1)
            await trio.sleep(120)
    assert bot.texts_to(ada) == [echo_of(ada, "echo:sleep 2 are you there?")]
    assert [e["event"] for e in logs if e["event"] == "answer_postponed"] == ["answer_postponed"]
    assert restarts(logs) == []


@pytest.mark.parametrize(
    ("status", "code", "outcome"),
    [
        (400, 130429, "later"),  # throughput
        (400, 131056, "later"),  # pair rate
        (400, 4, "later"),  # app call limit
        (400, 80007, "later"),  # WABA call limit
        (500, 131000, "later"),  # something went wrong: answered, nothing created
        (503, None, "later"),
        (400, 131047, "refused"),  # the 24-hour window is closed
    ],
)
def test_graph_errors_say_whether_the_message_can_be_sent_later(
    status: int, code: int | None, outcome: str
) -> None:
    body = (
        b'{"error":{"message":"x","code":%d}}' % code
        if code is not None
        else b"Service Unavailable"
    )
    exc = graph_error("send message", status, body)
    assert outcome_of(exc) == outcome
    if code == 131047:
        assert isinstance(exc, WindowClosed)
    elif code in (130429, 131056, 4, 80007):
        assert isinstance(exc, Throttled) and not exc.request_sent


async def test_the_transport_probes_graph_with_the_phone_number() -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_whatsapp(clock=Clock()) as fake:
            async with open_http(fake.url, user_agent="test") as http:
                client = GraphClient(http, TEST_TOKEN, fake.phone_number_id)
                outbound = WhatsAppOutbound(client, clock=Clock())
                transport = outbound.transport(
                    ReplyTarget(conversation_id="16505551234", conversation_type="direct")
                )
                await transport.reachable()
                assert [c.op for c in fake.calls] == ["phone"]
                fake.outage(5.0, "500")
                with pytest.raises(TransportError):
                    await transport.reachable()
