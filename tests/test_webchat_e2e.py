"""The web chat's websocket protocol end to end, as a script (or the page) speaks it.

Testing manifesto: dshim runs as ``dshim serve`` runs it — the real SQLite store, the
local HTTP endpoint (hypercorn) on 127.0.0.1 port 0, ``serve_bots`` with one web chat bot
and the echo harness, which answers with exactly the prompt it got — and a scripted tab
(trio-websocket, :class:`tests.rig_webchat.ChatClient`) speaks the README's frames.  The
clock is trio's autojump clock; every test has the conftest's hard deadline.  Assertions
are about the frames a user's page gets and the prompt the agent gets.
"""

from __future__ import annotations

import json
import re
import socket
import urllib.parse
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import httpx
import trio

from dshim.channels.webchat.protocol import MAX_FRAME_BYTES
from dshim.model import FilePart, ImagePart, TextPart
from dshim.pipeline.runtime import BUSY_TEXT
from tests.channel_contract import RecordingHarness
from tests.rig_webchat import ChatClient, bot_quote, reply_block, serving, source_block

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(40))
MIB = 1024 * 1024


def echo(text: str, *, kind: str = "direct", quote: str | None = None, **who: str) -> str:
    return "\n\n".join([source_block(kind, **who), *([quote] if quote else []), text])


def bot_message_frames(client: ChatClient, message_id: str) -> list[dict[str, Any]]:
    return [f for f in client.frames if f.get("type") == "message" and f["id"] == message_id]


async def answered(client: ChatClient, conversation: str, count: int) -> list[str]:
    """Wait for ``count`` final answers of the bot; returns their texts."""
    await client.wait_until(
        lambda: sum(1 for s in client.in_conversation(conversation, bot=True) if s.final) >= count
    )
    await trio.sleep(3)  # whatever else would come
    return [s.text for s in client.in_conversation(conversation, bot=True)]


async def test_a_message_is_accepted_then_answered_by_streamed_frames_with_one_final(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with (
        serving(tmp_path, harness=RecordingHarness()) as s,
        ChatClient(s.ws_url).running() as ann,
    ):
        history = await ann.join("c1")
        assert history == {"type": "history", "conversation": "c1", "messages": []}
        mid = await ann.send("c1", "echo:slow 6 tell me a story")
        assert mid == "u-ann/k1"
        [accepted] = [f for f in ann.frames if f["type"] == "accepted"]
        assert accepted == {"type": "accepted", "client_id": "k1", "id": mid, "conversation": "c1"}
        [mine] = [f for f in ann.frames if f["type"] == "message" and f["id"] == mid]
        assert mine["author"] == {"id": "u-ann", "name": "Ann", "bot": False}
        assert (mine["text"], mine["final"], mine["client_id"]) == (
            "echo:slow 6 tell me a story",
            True,
            "k1",
        )
        expected = echo("echo:slow 6 tell me a story")
        assert await answered(ann, "c1", 1) == [expected]
    [answer] = ann.in_conversation("c1", bot=True)
    frames = bot_message_frames(ann, answer.id)
    assert len(frames) >= 4  # the text so far, several times, then the final one
    assert [f["final"] for f in frames] == [False] * (len(frames) - 1) + [True]
    assert frames[-1]["text"] == expected
    assert all(expected.startswith(f["text"]) for f in frames)
    assert {f["reply_to"] for f in frames} == {mid}
    assert frames[0]["author"] == {"id": "bot:web", "name": "web", "bot": True}
    typing = [i for i, f in enumerate(ann.frames) if f["type"] == "typing"]
    assert typing and typing[0] < ann.frames.index(frames[0])


async def test_quotes_are_built_from_dshims_own_log(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    harness = RecordingHarness()
    async with serving(tmp_path, harness=harness) as s, ChatClient(s.ws_url).running() as ann:
        await ann.join("c1")
        await ann.join("c2")
        first = await ann.send("c1", "the <first> & only", files=[("cat.png", "image/png", PNG)])
        [answer_text] = await answered(ann, "c1", 1)
        [answer] = ann.in_conversation("c1", bot=True)
        elsewhere = await ann.send("c2", "in another chat")
        await answered(ann, "c2", 1)

        # The user's own message: author, content and attachment names from the log.
        await ann.send("c1", "what did I say?", reply_to=first)
        # The bot's answer.
        await ann.send("c1", "and you?", reply_to=answer.id)
        # An id the log does not know here: a made-up one, and one of another chat.
        await ann.send("c1", "this?", reply_to="u-ann/nope")
        await ann.send("c1", "that?", reply_to=elsewhere)
        # After /new the earlier answer is still known.
        await ann.send("c1", "/new")
        await ann.send("c1", "still there?", reply_to=answer.id)
        await answered(ann, "c1", 7)
    quoted_user = reply_block(
        messageId=first,
        authorId="u-ann",
        authorName="Ann",
        content="the <first> & only",
        attachments=[{"kind": "image", "name": "cat.png"}],
    )
    quoted_bot = bot_quote(answer.id, answer_text)
    texts = harness.texts()
    assert texts[2:] == [
        echo("what did I say?", quote=quoted_user),
        echo("and you?", quote=quoted_bot),
        echo("this?", quote=reply_block(messageId="u-ann/nope", unavailableReason="not-found")),
        echo("that?", quote=reply_block(messageId=elsewhere, unavailableReason="not-found")),
        echo("still there?", quote=quoted_bot),
    ]


async def test_a_resend_with_the_same_client_id_is_accepted_again_and_not_answered_twice(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with serving(tmp_path) as s, ChatClient(s.ws_url).running() as ann:
        await ann.join("c1")
        mid = await ann.send("c1", "only once", client_id="same")
        await answered(ann, "c1", 1)
        await ann.drop(resend_last=True)  # reconnect and send it again
        await ann.wait_until(lambda: sum(f["type"] == "accepted" for f in ann.frames) == 2)
        again = await ann.send("c1", "only once", client_id="same")
        assert again == mid
        await trio.sleep(10)
        bob = ChatClient(s.ws_url, user=("u-bob", "Bob"))
        async with bob.running():
            history = await bob.join("c1")
    assert [f["id"] for f in ann.frames if f["type"] == "accepted"] == [mid] * 3
    assert ann.bot_texts("c1") == [echo("only once")]
    assert [(m["id"], m["author"]["bot"]) for m in history["messages"]] == [
        (mid, False),
        (ann.in_conversation("c1", bot=True)[0].id, True),
    ]


async def test_bad_frames_get_an_error_and_the_socket_and_bot_stay_up(tmp_path: Path) -> None:
    # The real clock: with a 28 MiB frame in flight both ends wait on the socket, and the
    # autojump clock could jump straight to the test's deadline meanwhile.
    async with serving(tmp_path) as s, ChatClient(s.ws_url).running() as ann:
        await ann.send_raw("{this is not json")
        await ann.send_raw(json.dumps({"type": "subscribe", "conversation": "c1"}))
        await ann.send_raw(b"\x00binary")
        await ann.send_raw(json.dumps({"type": "send", "client_id": "k0", "conversation": "c1"}))
        await ann.send_raw(
            json.dumps({"type": "join", "conversation": "has space", "user": {"id": "u"}})
        )
        # Over the frame limit in UTF-8, under the endpoint's cap in characters: refused
        # by the web chat, which keeps the socket.
        huge = json.dumps({"type": "send", "client_id": "kx", "conversation": "c1", "text": "x"})
        await ann.send_raw(huge.replace('"x"', '"' + "é" * (MAX_FRAME_BYTES // 2 + 10) + '"'))
        await ann.wait_until(lambda: len(ann.errors) == 6)
        assert [(e["code"], e.get("client_id")) for e in ann.errors] == [
            ("bad_json", None),
            ("unknown_type", None),
            ("bad_frame", None),
            ("not_joined", "k0"),
            ("bad_frame", None),
            ("too_large", None),
        ]
        assert all(e["message"] for e in ann.errors)
        assert ann.connections == 1
        await ann.join("c1")
        await ann.send("c1", "still here?")
        assert await answered(ann, "c1", 1) == [echo("still here?")]
        assert s.results == {}  # the bot is still running


async def test_attachments_reach_the_agent_as_parts_and_over_the_limit_is_refused(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    harness = RecordingHarness()
    async with serving(tmp_path, harness=harness) as s, ChatClient(s.ws_url).running() as ann:
        await ann.join("c1")
        files = [("cat.png", "image/png", PNG), ("notes.txt", "text/plain", b"some notes")]
        await ann.send("c1", "look", files=files)
        await answered(ann, "c1", 1)
        big = PNG + b"\0" * (5 * MIB)
        cid = await ann.send("c1", "too big", files=[("big.png", "image/png", big)], wait=False)
        await ann.wait_until(lambda: any(e.get("client_id") == cid for e in ann.errors))
        await trio.sleep(5)
    [parts] = harness.prompts
    assert [p for p in parts if isinstance(p, ImagePart)] == [
        ImagePart(mime="image/png", data=PNG, name="cat.png")
    ]
    saved = tmp_path / "files" / "web" / "c1" / "u-ann-k1-e937310d9096_1_notes.txt"
    assert [p for p in parts if isinstance(p, FilePart)] == [
        FilePart(name="notes.txt", path=str(saved), size=10, mime="text/plain", data=b"some notes")
    ]
    assert saved.read_bytes() == b"some notes"
    files = json.dumps(
        [
            {
                "name": "notes.txt",
                "kind": "file",
                "mediaType": "text/plain",
                "size": 10,
                "path": str(saved),
            }
        ],
        separators=(",", ":"),
    )
    assert [p.text for p in parts if isinstance(p, TextPart)] == [
        source_block(),
        "look",
        "[attached file: notes.txt, text/plain, 10 bytes]\nsome notes",
        f"<dsh_im_files>{files}</dsh_im_files>",
    ]
    [mine] = [m for m in ann.in_conversation("c1", bot=False)]
    assert mine.files == [
        {"kind": "image", "name": "cat.png"},
        {"kind": "file", "name": "notes.txt"},
    ]
    [error] = ann.errors
    assert error["code"] == "attachment_too_large"
    assert error["message"] == "big.png is 5.0 MiB: an image can be at most 5.0 MiB"
    assert cid not in ann.accepted and len(harness.prompts) == 1


async def test_a_room_answers_only_when_addressed_and_every_tab_sees_it(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    harness = RecordingHarness()
    async with serving(tmp_path, harness=harness) as s:
        ann = ChatClient(s.ws_url, user=("u-ann", "Ann"))
        bob = ChatClient(s.ws_url, user=("u-bob", "Bob"))
        async with ann.running(), bob.running():
            await ann.join("room-lab", "room")
            await bob.join("room-lab", "room")
            await ann.join("dm-ann")  # Ann's direct chat: Bob never sees it
            await bob.send("room-lab", "just chatting")
            await ann.wait_until(lambda: len(ann.in_conversation("room-lab")) == 1)
            await trio.sleep(10)
            assert ann.bot_frames("room-lab") == [] and harness.prompts == []
            await bob.send("room-lab", "@web what is this room?")
            await ann.wait_until(lambda: len(ann.bot_texts("room-lab")) == 1)
            await bob.wait_until(lambda: len(bob.bot_texts("room-lab")) == 1)
            await ann.send("dm-ann", "private")
            await answered(ann, "dm-ann", 1)
    room = echo("what is this room?", kind="group", user="u-bob", name="Bob")
    assert harness.texts() == [room, echo("private")]
    assert ann.bot_texts("room-lab") == bob.bot_texts("room-lab") == [room]
    assert [s.text for s in ann.in_conversation("room-lab", bot=False)] == [
        "just chatting",
        "@web what is this room?",
    ]
    assert not [f for f in bob.frames if f.get("conversation") == "dm-ann"]


async def test_approvals_have_buttons_typed_answers_still_work_and_only_the_starter_answers(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with serving(tmp_path) as s:
        ann = ChatClient(s.ws_url, user=("u-ann", "Ann"))
        bob = ChatClient(s.ws_url, user=("u-bob", "Bob"))
        async with ann.running(), bob.running():
            await ann.join("room-lab", "room")
            await bob.join("room-lab", "room")
            await ann.send("room-lab", "@web echo:approval")
            await bob.wait_until(lambda: len(bob.interactions) == 1)
            [request] = bob.interactions.values()
            assert (request["kind"], request["conversation"]) == ("approval", "room-lab")
            assert request["options"] == [
                {"id": "allow_once", "label": "Allow once"},
                {"id": "allow_always", "label": "Allow always"},
                {"id": "reject_once", "label": "Reject"},
            ]
            assert "1. Allow once" not in request["prompt"]
            [shown] = [
                m for m in ann.in_conversation("room-lab", bot=True) if m.id == request["id"]
            ]
            assert "1. Allow once\n2. Allow always\n3. Reject" in shown.text
            # Bob presses a button of Ann's request: refused, still pending.
            await bob.answer("room-lab", request["id"], "allow_always")
            await ann.wait_until(lambda: any("Only Ann" in t for t in ann.bot_texts("room-lab")))
            assert request["id"] not in ann.closed_interactions
            # A page that reloads now gets the buttons with the history.
            carol = ChatClient(s.ws_url, user=("u-carol", "Carol"))
            async with carol.running():
                await carol.join("room-lab", "room")
                await carol.wait_until(lambda: request["id"] in carol.interactions)
            await ann.answer("room-lab", request["id"], "allow_always")
            await ann.wait_until(lambda: request["id"] in ann.closed_interactions)
            await ann.wait_until(
                lambda: "Approval decision: allow_always" in ann.bot_texts("room-lab")
            )
            # Typed answers work as on any channel; a button of a closed request is refused.
            await ann.send("room-lab", "@web echo:approval")
            await ann.wait_until(lambda: len(ann.interactions) == 2)
            await ann.send("room-lab", "@web no")
            await ann.wait_until(
                lambda: "Approval decision: reject_once" in ann.bot_texts("room-lab")
            )
            await ann.answer("room-lab", request["id"], "allow_once")
            await ann.wait_until(lambda: any(e["code"] == "not_found" for e in ann.errors))
    assert ann.closed_interactions == set(ann.interactions)


async def test_stop_commands_and_the_busy_notice(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with serving(tmp_path, bot={"lanes": {"max_queue": 1}}) as s:
        async with ChatClient(s.ws_url).running() as ann:
            await ann.join("c1")
            await ann.send("c1", "echo:slow 30 a long story")
            await ann.wait_until(lambda: len(ann.in_conversation("c1", bot=True)) == 1)
            await trio.sleep(1.5)  # the agent has been at it for a while: the bound applies
            await ann.send("c1", "queued")
            await ann.send("c1", "one too many")
            await ann.wait_until(lambda: BUSY_TEXT in ann.bot_texts("c1"))
            await ann.send("c1", "/stop")
            await ann.wait_until(lambda: echo("queued") in ann.bot_texts("c1"))
            await ann.send("c1", "/help")
            await answered(ann, "c1", 4)
    texts = ann.bot_texts("c1")
    assert texts[0].endswith("\n\n⏹ Stopped.") and echo("echo:slow").startswith(texts[0][:5])
    assert texts[1:3] == [BUSY_TEXT, echo("queued")]
    assert texts[3].startswith("Commands:\n/new")
    assert all(s.final for s in ann.in_conversation("c1", bot=True))


async def test_history_after_a_restart_and_the_page_reconnects_by_itself(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    port = free_port()
    ann = ChatClient(f"ws://127.0.0.1:{port}/ws")
    async with ann.running():
        async with serving(tmp_path, listen=f"127.0.0.1:{port}"):
            await ann.join("c1")
            mid = await ann.send("c1", "remember me")
            [answer_text] = await answered(ann, "c1", 1)
            [answer] = ann.in_conversation("c1", bot=True)
            await ann.send("c1", "quoting you", reply_to=answer.id)
            await answered(ann, "c1", 2)
        before = ann.connections
        await trio.sleep(5)  # dshim is down; the tab keeps trying
        assert ann.ws is None and ann.connections == before
        mark = len(ann.frames)
        async with serving(tmp_path, listen=f"127.0.0.1:{port}"):
            history = await ann.next_frame("history", after=mark)
            await ann.send("c1", "after the restart")
            await answered(ann, "c1", 3)
    quote = bot_quote(answer.id, answer_text)
    messages = history["messages"]
    assert [(m["author"]["bot"], m["text"], m["final"]) for m in messages] == [
        (False, "remember me", True),
        (True, answer_text, True),
        (False, "quoting you", True),
        (True, echo("quoting you", quote=quote), True),
    ]
    assert messages[0]["id"] == mid and messages[2]["reply_to"] == answer.id
    assert messages[3]["reply_to"] == messages[2]["id"]
    assert ann.bot_texts("c1")[-1] == echo("after the restart")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_the_page_is_served_at_the_root_and_under_hooks(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with serving(tmp_path) as s, httpx.AsyncClient(base_url=s.url) as http:
        root = await http.get("/")
        hooks = await http.get("/hooks/web/")
        js = await http.get("/app.js")
        css = await http.get("/hooks/web/app.css")
        post = await http.post("/", content=b"x")
        missing = await http.get("/hooks/web/nothing-here")
    assert root.status_code == hooks.status_code == 200
    assert root.content == hooks.content and b'<script src="app.js">' in root.content
    assert root.headers["content-type"] == "text/html; charset=utf-8"
    csp = root.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert root.headers["x-content-type-options"] == "nosniff"
    assert js.headers["content-type"].startswith("text/javascript") and b"WebSocket" in js.content
    assert css.headers["content-type"].startswith("text/css")
    assert post.status_code == 405 and post.json()["error"] == "method_not_allowed"
    assert missing.status_code == 404 and missing.json()["error"] == "not_found"


async def test_the_page_has_its_own_icon_so_the_browser_asks_for_no_favicon_ico(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with serving(tmp_path) as s, httpx.AsyncClient(base_url=s.url) as http:
        page = await http.get("/")
    [href] = re.findall(rb'<link rel="icon" type="image/svg\+xml" href="([^"]+)">', page.content)
    # Inline (no request, nothing to serve under /hooks/<bot>/ too), allowed by the CSP.
    prefix = b"data:image/svg+xml,"
    assert href.startswith(prefix)
    assert "data:" in page.headers["content-security-policy"].split("img-src", 1)[1].split(";")[0]
    svg = ElementTree.fromstring(urllib.parse.unquote(href[len(prefix) :].decode("ascii")))
    assert svg.tag == "{http://www.w3.org/2000/svg}svg" and svg.get("viewBox") == "0 0 32 32"
    assert len(href) < 1024


async def test_the_socket_under_hooks_is_the_same_chat(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with serving(tmp_path) as s:
        hooks = ChatClient(s.url.replace("http://", "ws://") + "/hooks/web/ws")
        root = ChatClient(s.ws_url, user=("u-bob", "Bob"))
        async with hooks.running(), root.running():
            await hooks.join("c1")
            await root.join("c1")
            await hooks.send("c1", "hi from under /hooks")
            await root.wait_until(lambda: len(root.bot_texts("c1")) == 1)
    assert root.bot_texts("c1") == [echo("hi from under /hooks")]


async def test_a_frame_over_the_cap_closes_the_socket_as_it_is_read_and_the_tab_comes_back(
    tmp_path: Path,
) -> None:
    # The endpoint stops reading a message at its 28 MiB cap (1009) instead of reading it
    # whole first; the tab reconnects by itself and chats on.
    async with serving(tmp_path) as s, ChatClient(s.ws_url).running() as ann:
        await ann.join("c1")
        frame = json.dumps({"type": "send", "client_id": "k1", "conversation": "c1", "text": "x"})
        await ann.send_raw(frame.replace('"x"', '"' + "x" * (45 * 1024 * 1024) + '"'))
        await ann.wait_until(lambda: ann.connections == 2 and ann.connected)
        assert ann.close_codes == [1009] and ann.errors == []
        await ann.send("c1", "still here?")
        assert await answered(ann, "c1", 1) == [echo("still here?")]


async def test_a_burst_from_several_tabs_is_taken_together_in_order_each_once(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: Any
) -> None:
    """Events that wait for the reader together are taken as one batch (one log write,
    ``accept_many``): each is accepted once, a resend in the burst is not answered twice,
    and every conversation keeps its order."""
    from trio_websocket import open_websocket_url

    from dshim.pipeline.runtime import BotRuntime

    batches: list[int] = []
    accept_many = BotRuntime.accept_many

    async def counting(self: BotRuntime, events: Any) -> Any:
        batches.append(len(events))
        return await accept_many(self, events)

    monkeypatch.setattr(BotRuntime, "accept_many", counting)
    n = 12
    async with serving(tmp_path) as s:
        frames: dict[str, list[dict[str, Any]]] = {}

        async def tab(user: str) -> None:
            got = frames.setdefault(user, [])
            conversation = f"c-{user}"
            async with open_websocket_url(s.ws_url) as ws:
                who = {"id": user, "name": user}
                await ws.send_message(
                    json.dumps(
                        {
                            "type": "join",
                            "conversation": conversation,
                            "kind": "direct",
                            "user": who,
                        }
                    )
                )
                assert json.loads(await ws.get_message())["type"] == "history"
                for i in [*range(n), n - 1]:  # the last one twice, as a resend
                    send = {"type": "send", "client_id": f"k{i}", "conversation": conversation}
                    await ws.send_message(
                        json.dumps({**send, "text": f"m{i}", "reply_to": None, "files": []})
                    )
                while (
                    sum(
                        1
                        for f in got
                        if f["type"] == "message" and f["author"]["bot"] and f["final"]
                    )
                    < n
                ):
                    got.append(json.loads(await ws.get_message()))
                await trio.sleep(3)  # a second answer would come by now
                with trio.move_on_after(1):
                    while True:
                        got.append(json.loads(await ws.get_message()))

        async with trio.open_nursery() as nursery:
            for user in ("u-ann", "u-bob", "u-cy"):
                nursery.start_soon(tab, user)
    assert any(size > 1 for size in batches)  # some events were taken together
    for user, got in frames.items():
        accepted = [f["id"] for f in got if f["type"] == "accepted"]
        assert accepted == [f"{user}/k{i}" for i in [*range(n), n - 1]]
        answers = [
            f["text"] for f in got if f["type"] == "message" and f["author"]["bot"] and f["final"]
        ]
        assert [a.rpartition("\n\n")[2] for a in answers] == [f"m{i}" for i in range(n)]
