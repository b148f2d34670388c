"""Substitute mode on Feishu / Lark: the mention mapping (table tests), and end to end
against the fake -- each answer under its own trigger (thread: ``reply_in_thread``,
quote: a reply without it, plain after eviction), the asker mentioned with ``<at>``,
a restart between triggers, no latch for a later normal turn, the operators' control
card and its buttons, targets given by email / union_id resolved at start-up.

Testing manifesto as in ``tests/test_feishu_e2e.py``: the fake on 127.0.0.1 port 0,
``serve_bots``' code path, a real SQLite store in ``tmp_path``, trio's autojump clock.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from structlog.testing import capture_logs

from dshim.channels.feishu import channel as feishu_channel
from dshim.channels.feishu.protocol import ControlPress, EventMapper
from dshim.channels.registry import parse_config
from dshim.harness.echo import EchoHarness
from dshim.model import InboundMessage, Mention
from dshim.pipeline.substitute import ANCHORS_PER_SESSION
from dshim.serve import serve_bots
from dshim.store import open_store
from dshim.store.base import Store
from dshim.testing.fakes.feishu import BotMessage, FakeFeishu, open_fake_feishu
from tests.helpers import Events

DEADLINE = 900.0
BOT = "ou_bot000000000000000000000000001"
OLGA = {
    "open_id": "ou_olga0000000000000000000000001",
    "union_id": "on_olga000000000000000000000001",
    "user_id": "u_olga",
    "name": "Olga",
}
OSCAR = {"open_id": "ou_oscar000000000000000000000001", "name": "Oscar"}
SUBSTITUTE = {
    "enabled": True,
    "targets": [{"name": "Olga (on call)", "open_id": OLGA["open_id"]}],
}
ACCESS = {"operators": [OSCAR["open_id"], "ou_user00000000000000000000000002"]}
PREFIX_NOTE = (
    "The user mentioned the person below, not you. Answer on their behalf and say openly"
    " that you are answering for them."
)
SEEDED = dataclasses.replace(
    feishu_channel.CHANNEL, run_fn=functools.partial(feishu_channel.run, rng=random.Random(5))
)
CREATE = "POST /open-apis/im/v1/messages"
REPLY = "POST /open-apis/im/v1/messages/{message_id}/reply"


# --- the mapping, table-tested -------------------------------------------------------------


def event(message: dict[str, Any]) -> bytes:
    base = {"message_id": "om_1", "chat_id": "oc_g", "chat_type": "group"}
    env = {
        "schema": "2.0",
        "header": {"event_id": "e1", "event_type": "im.message.receive_v1", "create_time": "1"},
        "event": {
            "sender": {"sender_id": {"open_id": "ou_ada"}, "sender_type": "user"},
            "message": {**base, **message},
        },
    }
    return json.dumps(env).encode()


def mapped(message: dict[str, Any]) -> InboundMessage:
    item = EventMapper(bot_open_id=BOT, app_id="cli_x").decode(event(message))
    assert isinstance(item, InboundMessage), item
    return item


def mention(key: str, ident: Any, name: str, id_type: str | None = None) -> dict[str, Any]:
    out = {"key": key, "id": ident, "name": name}
    if id_type is not None:
        out["id_type"] = id_type
    return out


OLGA_IDS = {"open_id": OLGA["open_id"], "union_id": OLGA["union_id"], "user_id": "u_olga"}


@pytest.mark.parametrize(
    ("mentions", "text", "expected", "content", "mentioned"),
    [
        (  # every id kind the event gives, the name, the text as content shows it
            [mention("@_user_1", OLGA_IDS, "Olga")],
            "is prod down? @_user_1",
            [Mention(ids=OLGA_IDS, name="Olga", text="@Olga")],
            "is prod down? @Olga",
            False,
        ),
        (  # the bot is no person mentioned, but "mentioned"; text order, not list order
            [
                mention("@_user_2", {"open_id": "ou_bob"}, "Bob"),
                mention("@_user_1", {"open_id": BOT}, "dshim"),
                mention("@_user_3", {"open_id": "ou_cy", "user_id": None}, "Cy"),
            ],
            "@_user_1 @_user_3 and @_user_2",
            [
                Mention(ids={"open_id": "ou_cy"}, name="Cy", text="@Cy"),
                Mention(ids={"open_id": "ou_bob"}, name="Bob", text="@Bob"),
            ],
            "@Cy and @Bob",
            True,
        ),
        (  # a bare string id is typed by id_type (default open_id)
            [
                mention("@_user_1", "u_olga", "Olga", id_type="user_id"),
                mention("@_user_2", "ou_x", "X"),
            ],
            "@_user_1 @_user_2",
            [
                Mention(ids={"user_id": "u_olga"}, name="Olga", text="@Olga"),
                Mention(ids={"open_id": "ou_x"}, name="X", text="@X"),
            ],
            "@Olga @X",
            False,
        ),
        ([], "@_all hello", [], "@all hello", False),  # @all is nobody
    ],
)
def test_text_mentions_map_to_people_in_text_order(
    mentions: list[dict[str, Any]],
    text: str,
    expected: list[Mention],
    content: str,
    mentioned: bool,
) -> None:
    msg = mapped(
        {"message_type": "text", "content": json.dumps({"text": text}), "mentions": mentions}
    )
    assert msg.mentions == expected
    assert msg.content == content
    assert msg.mentioned is mentioned


def test_post_at_nodes_are_people_and_their_user_id_is_an_open_id() -> None:
    post = {
        "title": "",
        "content": [
            [
                {"tag": "at", "user_id": "ou_olga_inline", "user_name": "Olga"},
                {"tag": "text", "text": " can you check "},
                {"tag": "at", "user_id": "@_user_1", "user_name": "Bob"},
                {"tag": "at", "user_id": "u_tenant_id", "user_name": "T"},  # not an open_id
                {"tag": "at", "user_id": "all", "user_name": "all"},
            ]
        ],
    }
    msg = mapped(
        {
            "message_type": "post",
            "content": json.dumps(post),
            "mentions": [mention("@_user_1", {"open_id": "ou_bob", "union_id": "on_b"}, "Bob")],
        }
    )
    assert msg.mentions == [
        Mention(ids={"open_id": "ou_olga_inline"}, name="Olga", text="@Olga"),  # never user_id
        Mention(ids={"open_id": "ou_bob", "union_id": "on_b"}, name="Bob", text="@Bob"),
    ]
    assert msg.content.startswith("@Olga can you check @Bob")


def test_quoted_and_forwarded_content_contributes_no_mentions() -> None:
    # A reply: the quoted message's mentions are not in the event (only its id).
    reply = mapped(
        {"message_type": "text", "content": json.dumps({"text": "see above"}), "parent_id": "om_0"}
    )
    assert reply.mentions == [] and reply.reply_to is not None
    forward = mapped(
        {
            "message_type": "merge_forward",
            "content": json.dumps({"text": "@_user_1"}),
            "mentions": [mention("@_user_1", {"open_id": OLGA["open_id"]}, "Olga")],
        }
    )
    assert forward.mentions == []
    card = mapped(
        {
            "message_type": "interactive",
            "content": json.dumps({"elements": [[{"tag": "text", "text": "@_user_1 hi"}]]}),
            "mentions": [mention("@_user_1", {"open_id": OLGA["open_id"]}, "Olga")],
        }
    )
    assert card.mentions == []


def test_a_control_button_press_is_no_message() -> None:
    env = {
        "schema": "2.0",
        "header": {"event_id": "e2", "event_type": "card.action.trigger", "create_time": "1"},
        "event": {
            "operator": {"open_id": "ou_oscar"},
            "token": "c-1",
            "action": {
                "tag": "button",
                "value": {"dshim": 1, "control": "disable", "chat": "oc_g", "thread": ""},
            },
            "context": {"open_message_id": "om_card", "open_chat_id": "oc_dm"},
        },
    }
    raw = json.dumps(env).encode()
    mapper = EventMapper(bot_open_id=BOT, app_id="cli_x")
    assert mapper.decode(raw) == ControlPress("disable", "oc_g", None, "ou_oscar", "om_card")
    assert mapper.decode_raw(raw).reason == "ignored"  # type: ignore[union-attr]


# --- end to end ----------------------------------------------------------------------------


class Running:
    def __init__(self, harness: EchoHarness) -> None:
        self.harness = harness
        self.events = Events()
        self.shutdown = trio.Event()
        self.ended = trio.Event()
        self.scope = trio.CancelScope()


@asynccontextmanager
async def world(
    tmp_path: Path, configure: Callable[[FakeFeishu], None] | None = None
) -> AsyncIterator[tuple[FakeFeishu, Store]]:
    with trio.fail_after(DEADLINE):
        async with open_fake_feishu() as fake, open_store(tmp_path, inline=True) as store:
            if configure is not None:
                configure(fake)
            yield fake, store


@asynccontextmanager
async def serving(fake: FakeFeishu, store: Store, **options: Any) -> AsyncIterator[Running]:
    """The bot under ``serve_bots``; ``run.scope.cancel()`` inside is a crash."""
    table = {
        "name": "fs",
        "channel": "feishu",
        "app_id": fake.app_id,
        "app_secret": fake.app_secret,
        "api_base": fake.api_base,
        "substitute": SUBSTITUTE,
        "access": ACCESS,
        **options,
    }
    config = parse_config({"bots": [table]}, env={})
    run = Running(EchoHarness(slow_interval_s=0.5))
    before = len(fake.connections)
    async with trio.open_nursery() as nursery:

        async def serve() -> None:
            with run.scope:
                await serve_bots(
                    config,
                    store,
                    shutdown=run.shutdown,
                    channels={"fs": SEEDED},
                    observer=run.events,
                    harness=run.harness,
                )
            run.ended.set()

        nursery.start_soon(serve)
        await fake.wait_until(
            lambda: len(fake.connections) > before and fake.live is not None and fake.live.pings > 0
        )
        try:
            yield run
        finally:
            run.shutdown.set()
            with trio.move_on_after(30):
                await run.ended.wait()
            nursery.cancel_scope.cancel()


def group_answers(fake: FakeFeishu) -> list[BotMessage]:
    return fake.bot_messages(fake.group_chat)


def block(
    target: tuple[str, str] = (OLGA["open_id"], "Olga (on call)"),
    mentioned: dict[str, str] | None = None,
) -> str:
    """The exact ``<dsh_im_substitute>`` block: the target (id, name) as configured or
    resolved, the mention as the event shows it."""
    seen = mentioned or OLGA
    sub = {
        "note": PREFIX_NOTE,
        "target": {"id": target[0], "name": target[1]},
        "disclosure": "prefix",
        "mentionedAs": {"id": seen["open_id"], "name": seen["name"]},
    }
    return "<dsh_im_substitute>" + json.dumps(sub, separators=(",", ":")) + "</dsh_im_substitute>"


BOB = {"open_id": "ou_user00000000000000000000000002", "name": "Bob"}


@pytest.mark.parametrize("mode", ["thread", "quote"])
async def test_each_answer_lands_under_its_own_trigger_while_earlier_ones_run(
    tmp_path: Path, autojump_clock: object, mode: str
) -> None:
    async with world(tmp_path) as (fake, store):
        options = {"substitute": {**SUBSTITUTE, "reply_mode": mode}}
        async with serving(fake, store, **options):
            chat = fake.group_chat
            a = await fake.user_message(chat, "echo:slow 6 is the deploy done {0}", people=[OLGA])
            await fake.wait_until(
                lambda: bool(fake.calls_to("POST /open-apis/im/v1/messages/{message_id}/reactions"))
            )
            b = await fake.user_message(chat, "{0} can I merge?", sender=BOB, people=[OLGA])
            c = await fake.user_message(chat, "what about staging {0}", people=[OLGA])
            await fake.wait_until(lambda: len(group_answers(fake)) >= 3)
            await trio.sleep(5)
    answers = group_answers(fake)
    assert len(answers) == 3
    by_trigger = {m.parent_id: m for m in answers}
    assert set(by_trigger) == {a["message_id"], b["message_id"], c["message_id"]}
    for trigger, asker in ((a, fake.user), (b, BOB), (c, fake.user)):
        answer = by_trigger[trigger["message_id"]]
        # Thread mode opens a thread under the trigger; quote mode quotes it, no thread.
        assert answer.in_thread is (mode == "thread")
        # The asker is mentioned first, and only them (never the target).
        assert answer.msg_type == "text"
        assert answer.pinged == [asker["open_id"]]
        assert answer.text.startswith(f'<at user_id="{asker["open_id"]}">')
    # One finished text message each, like a person: no card, no edits.
    assert fake.calls_to("POST /open-apis/cardkit/v1/cards") == []
    assert fake.calls_to("PUT /open-apis/im/v1/messages/{message_id}") == []
    # The prompt carries the exact block, after the source block, before the text.
    parts = by_trigger[b["message_id"]].text.split("\n\n")
    assert parts[1] == block()
    assert parts[2] == "@Olga can I merge?"


async def test_a_restart_between_triggers_keeps_each_anchor(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with world(tmp_path) as (fake, store):
        chat = fake.group_chat
        async with serving(fake, store) as run:
            a = await fake.user_message(chat, "echo:slow 40 long one {0}", people=[OLGA])
            b = await fake.user_message(chat, "echo:slow 3 queued {0}", sender=BOB, people=[OLGA])
            await fake.wait_until(lambda: len(fake.acks) == 2)
            await trio.sleep(1)
            run.scope.cancel()  # a crash: A is running, B is queued
        c = await fake.user_message(chat, "and C {0}", people=[OLGA])  # while the bot is down
        async with serving(fake, store):
            await fake.wait_until(
                lambda: (
                    {m.parent_id for m in group_answers(fake)}
                    >= {a["message_id"], b["message_id"], c["message_id"]}
                )
            )
            await trio.sleep(30)
    parents = [m.parent_id for m in group_answers(fake)]  # one answer each, none lost
    assert sorted(parents) == sorted([a["message_id"], b["message_id"], c["message_id"]])
    assert all(m.in_thread for m in group_answers(fake))


async def test_a_normal_mention_after_substitute_turns_streams_as_usual(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with world(tmp_path) as (fake, store):
        async with serving(fake, store):
            await fake.user_message(fake.group_chat, "echo:slow 4 first {0}", people=[OLGA])
            await fake.wait_until(lambda: len(group_answers(fake)) == 1)
            await trio.sleep(3)
            normal = await fake.user_message(
                fake.group_chat, "echo:slow 8 now you", mention_bot=True
            )
            await fake.wait_until(lambda: len(group_answers(fake)) == 2)
            await trio.sleep(10)
    answer = group_answers(fake)[-1]
    assert answer.parent_id == normal["message_id"]
    assert answer.msg_type == "interactive" and answer.card_id is not None  # a streaming card
    assert answer.in_thread is False
    card_updates = "PUT /open-apis/cardkit/v1/cards/{card_id}/elements/{element_id}/content"
    assert len(fake.calls_to(card_updates)) >= 1  # streamed
    assert "<at" not in answer.text  # an ordinary answer mentions nobody


async def test_an_evicted_anchor_falls_back_to_a_plain_message(
    tmp_path: Path, autojump_clock: object
) -> None:
    n = ANCHORS_PER_SESSION + 1
    async with world(tmp_path) as (fake, store):
        async with serving(fake, store, lanes={"max_queue": 64}):
            chat = fake.group_chat
            await fake.user_message(chat, "echo:slow 60 blocker {0}", people=[OLGA])
            await fake.wait_until(lambda: len(fake.acks) == 1)
            first = await fake.user_message(chat, "queued first {0}", people=[OLGA])
            for i in range(n - 1):
                await fake.user_message(chat, f"q{i} {{0}}", sender=BOB, people=[OLGA])
            await fake.wait_until(lambda: len(group_answers(fake)) >= n + 1)
            await trio.sleep(5)
    answers = {m.parent_id: m for m in group_answers(fake)}
    # The queued first trigger's anchor was evicted by 32 newer ones before its turn
    # started: a plain message in the chat (never another turn's anchor), still @asker.
    assert first["message_id"] not in answers
    plain = answers[None]
    assert "queued first" in plain.text and plain.pinged == [fake.user["open_id"]]
    assert not plain.in_thread
    creates = [c for c in fake.calls_to(CREATE) if c.query.get("receive_id_type") == "chat_id"]
    assert [c.json["receive_id"] for c in creates] == [fake.group_chat]
    assert len(answers) == n + 1


async def test_topic_groups_answer_in_the_topic_or_refuse_when_switched_off(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with world(tmp_path) as (fake, store):
        async with serving(fake, store) as run:
            root = await fake.user_message(fake.group_chat, "topic start", mention_bot=True)
            await fake.wait_until(lambda: len(group_answers(fake)) == 1)
            inside = await fake.user_message(
                fake.group_chat, "in the topic {0}", people=[OLGA], topic=root["message_id"]
            )
            await fake.wait_until(lambda: len(group_answers(fake)) == 2)
        [answer] = [m for m in group_answers(fake) if m.parent_id == inside["message_id"]]
        assert answer.in_thread and answer.pinged == [fake.user["open_id"]]
        options = {"substitute": {**SUBSTITUTE, "topic_groups": False}}
        async with serving(fake, store, **options) as run:
            await fake.user_message(
                fake.group_chat, "again {0}", people=[OLGA], topic=root["message_id"]
            )
            await fake.wait_until(lambda: len(fake.acks) == 3)
            await trio.sleep(5)
        assert len(group_answers(fake)) == 2
        assert [r for _, r in run.events.drops] == ["unaddressed"]


def control_cards(fake: FakeFeishu, open_id: str) -> list[BotMessage]:
    chat = fake.dm_chats.get(open_id)
    return [] if chat is None else fake.bot_messages(chat)


def toast_of(fake: FakeFeishu) -> str:
    body = json.loads(fake.acks[-1].payload or b"")
    return str(json.loads(base64.b64decode(body["data"]))["toast"]["content"])


async def test_the_control_card_goes_to_operators_and_its_buttons_stop_or_disable(
    tmp_path: Path, autojump_clock: object
) -> None:
    async with world(tmp_path) as (fake, store):
        async with serving(fake, store) as run:
            chat = fake.group_chat
            await fake.user_message(chat, "is the build green? {0}", sender=BOB, people=[OLGA])
            await fake.wait_until(lambda: bool(control_cards(fake, OSCAR["open_id"])))
            await fake.user_message(chat, "and prod? {0}", people=[OLGA])
            await fake.wait_until(lambda: len(group_answers(fake)) == 2)
            [card] = control_cards(fake, OSCAR["open_id"])
            # Operators Oscar and Bob; Bob asked, so only Oscar is told, once per session.
            assert control_cards(fake, BOB["open_id"]) == []
            assert "is the build green?" in card.text and BOB["open_id"] in card.text
            values = fake.buttons(card.message_id)
            assert [v["control"] for v in values] == ["stop", "disable"]
            assert {v["chat"] for v in values} == {chat}
            # A running answer is stopped by the operator's press.
            await fake.user_message(chat, "echo:slow 40 long {0}", people=[OLGA])
            await fake.wait_until(lambda: len(fake.acks) == 3)
            await trio.sleep(2)
            await fake.click(card.message_id, 0, user=OSCAR)
            await fake.wait_until(lambda: len(fake.acks) == 4)
            assert toast_of(fake) == "Stopped the answer."
            await fake.wait_until(
                lambda: "Stopped the answer." in fake.bot_msgs[card.message_id].text
            )
            # Anyone else is refused.
            await fake.click(card.message_id, 1, user=fake.user)
            await fake.wait_until(lambda: len(fake.acks) == 5)
            assert toast_of(fake).startswith("Only the bot's operators")
            # "Stop answering for me here" turns substitute mode off in that chat.
            await fake.click(card.message_id, 1, user=OSCAR)
            await fake.wait_until(lambda: len(fake.acks) == 6)
            assert toast_of(fake).startswith("Substitute mode is off")
            await fake.user_message(chat, "still there? {0}", people=[OLGA])
            await fake.wait_until(lambda: len(fake.acks) == 7)
            await trio.sleep(5)
            assert not any("still there" in m.text for m in group_answers(fake))
            assert fake.buttons(card.message_id) != []  # the notice keeps its buttons
    assert "unaddressed" in [r for _, r in run.events.drops]
    dms = [c for c in fake.calls_to(CREATE) if c.query.get("receive_id_type") == "open_id"]
    assert [c.json["receive_id"] for c in dms] == [OSCAR["open_id"]]


# --- targets by email / union_id -------------------------------------------------------------

PAT = {"open_id": "ou_pat00000000000000000000000001", "union_id": "on_pat", "name": "Pat"}
BATCH = "POST /open-apis/contact/v3/users/batch_get_id"
PROFILE = "GET /open-apis/contact/v3/users/{user_id}"


def directory(fake: FakeFeishu) -> None:
    fake.contacts[OLGA["open_id"]] = {
        "open_id": OLGA["open_id"],
        "union_id": OLGA["union_id"],
        "name": "Olga Petrova",
        "email": "Olga@Example.com",
        "avatar": {"avatar_72": "https://example.invalid/olga72.png"},
    }
    fake.contacts[PAT["open_id"]] = {**PAT}


async def test_targets_by_email_and_union_id_resolve_to_open_ids_before_the_start(
    tmp_path: Path, autojump_clock: object
) -> None:
    targets = [
        {"email": "olga@example.com"},
        {"union_id": "on_pat", "name": "Pat (ops)"},
        {"email": "ghost@example.com", "name": "Ghost"},
    ]
    only_open_id = [{"open_id": OLGA["open_id"], "name": "Olga"}]  # mentions by open_id only
    with capture_logs() as logs:
        async with world(tmp_path, directory) as (fake, store):
            options = {"substitute": {"enabled": True, "targets": targets}}
            async with serving(fake, store, **options):
                await fake.user_message(fake.group_chat, "{0} help?", people=only_open_id)
                await fake.user_message(
                    fake.group_chat,
                    "{0} and you?",
                    people=[{"open_id": PAT["open_id"], "name": "P"}],
                )
                await fake.wait_until(lambda: len(group_answers(fake)) == 2)
    first, second = (m.text.split("\n\n")[1] for m in group_answers(fake))
    # The resolved open_id is the target's id; the profile names an unnamed target.
    assert first == block((OLGA["open_id"], "Olga Petrova"), only_open_id[0])
    assert second == block((PAT["open_id"], "Pat (ops)"), {"open_id": PAT["open_id"], "name": "P"})
    # Resolved with one batch call and the profiles, all before the long connection.
    [batch] = fake.calls_to(BATCH)
    assert batch.json == {"emails": ["olga@example.com", "ghost@example.com"]}
    assert batch.query == {"user_id_type": "open_id"}
    endpoint = fake.calls_to("POST /callback/ws/endpoint")[0]
    assert all(c.at <= endpoint.at for c in fake.calls_to(PROFILE) + [batch])
    dropped = [e for e in logs if e["event"] == "substitute_target_unresolved"]
    assert [(e["target"], e["reason"], e["dropped"]) for e in dropped] == [
        ("Ghost", "unresolvable", True)
    ]


async def test_a_failed_lookup_at_start_up_is_resolve_failed_and_never_fatal(
    tmp_path: Path, autojump_clock: object
) -> None:
    def broken(fake: FakeFeishu) -> None:
        directory(fake)
        fake.batch_get_id_error = (500, 40003)
        fake.contact_errors["on_pat"] = (500, 40003)

    targets = [{"email": "olga@example.com", "name": "Olga"}, {"union_id": "on_pat"}]
    with capture_logs() as logs:
        async with world(tmp_path, broken) as (fake, store):
            options = {"substitute": {"enabled": True, "targets": targets}}
            async with serving(fake, store, **options):
                # The union_id target still matches a mention by its union_id.
                await fake.user_message(fake.group_chat, "{0} hi", people=[PAT])
                await fake.wait_until(lambda: len(group_answers(fake)) == 1)
    reasons = [
        (e["target"], e["reason"], e["dropped"])
        for e in logs
        if e["event"] == "substitute_target_unresolved"
    ]
    assert reasons == [("Olga", "resolve_failed", True), ("on_pat", "resolve_failed", False)]
    assert '"target":{"id":"on_pat"}' in group_answers(fake)[0].text


async def test_definite_profile_outcomes_are_cached_and_transient_ones_never(
    autojump_clock: object,
) -> None:
    from dshim.channels.feishu.client import USER_AGENT, RestClient
    from dshim.channels.feishu.contact import Directory
    from dshim.net.http import open_http

    async with open_fake_feishu() as fake:
        directory(fake)
        fake.contact_errors["ou_gone"] = (403, 99992361)
        fake.contact_errors["ou_flaky"] = (500, 40003)
        async with open_http(fake.api_base, user_agent=USER_AGENT, timeout=5.0) as http:
            rest = RestClient(
                http,
                app_id=fake.app_id,
                app_secret=fake.app_secret,
                api_base=fake.api_base,
                on_new_token=lambda _: None,
            )
            found = Directory(rest)
            outcomes = [(await found.profile(uid)).outcome for uid in ["ou_gone"] * 2]
            ok = [await found.profile(OLGA["open_id"]) for _ in range(2)]
            flaky = [(await found.profile("ou_flaky")).outcome for _ in range(2)]
            del fake.contact_errors["ou_flaky"]
            fake.contacts["ou_flaky"] = {"open_id": "ou_flaky", "name": "Back"}
            recovered = await found.profile("ou_flaky")
    assert outcomes == ["cross_app", "cross_app"]  # a 403 carrying 99992361: definite
    assert ok[0] == ok[1] and ok[0].name == "Olga Petrova"
    assert ok[0].avatar_url == "https://example.invalid/olga72.png"
    assert flaky == ["error", "error"] and recovered.outcome == "ok"
    paths = [c.path.rsplit("/", 1)[1] for c in fake.calls_to(PROFILE)]
    assert paths == ["ou_gone", OLGA["open_id"], "ou_flaky", "ou_flaky", "ou_flaky"]


async def test_a_typed_open_id_of_another_app_is_a_warning_at_start(
    tmp_path: Path, autojump_clock: object
) -> None:
    xapp = "ou_xapp0000000000000000000000001"

    def other_app(fake: FakeFeishu) -> None:
        directory(fake)
        fake.contact_errors[xapp] = (403, 99992361)

    targets = [{"open_id": OLGA["open_id"]}, {"name": "Xavier", "open_id": xapp}]
    with capture_logs() as logs:
        async with world(tmp_path, other_app) as (fake, store):
            options = {"substitute": {"enabled": True, "targets": targets}}
            async with serving(fake, store, **options):
                await fake.user_message(fake.group_chat, "{0} help?", people=[OLGA])
                await fake.wait_until(lambda: len(group_answers(fake)) == 1)
    warned = [e for e in logs if e["log_level"] == "warning" and "substitute" in e["event"]]
    assert [(e["event"], e["bot"], e["key"], e["target"]) for e in warned] == [
        ("substitute_target_cross_app", "fs", "substitute.targets[1].open_id", "Xavier")
    ]
    assert fake.app_secret not in repr(logs) and not any(t in repr(logs) for t in fake.tokens)
    # Checked before the long connection opened; the other target still answers.
    endpoint = fake.calls_to("POST /callback/ws/endpoint")[0]
    assert all(c.at <= endpoint.at for c in fake.calls_to(PROFILE))
    assert '"target":{"id":"' + OLGA["open_id"] in group_answers(fake)[0].text
