"""End to end: the real WeCom channel, run by ``dshim.serve.serve_bots``, against the fake.

Testing manifesto: the fake WeCom long connection (``dshim.testing.fakes.wecom``: the
websocket and the encrypted media server) runs on 127.0.0.1 with kernel-chosen ports in
the same trio run as the bot, on trio's autojump clock, so WeCom's real timings (30 s
pings, 5 s acks, 800 ms stream pacing, 5- and 6-minute stream lifetimes) take no real time
and are exact.  The store is a real SQLite file in ``tmp_path``; the echo harness answers
with the exact prompt, so every final text is known.  Assertions are about what a WeCom
user sees (bubbles, their final text, pushes) and what the operator sees (how the bot
ended, how often it subscribed).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import trio
from structlog.testing import capture_logs

from dshim.channels.wecom.protocol import STREAM_MAX_BYTES, THINKING_MARK
from dshim.channels.wecom.render import split
from dshim.harness.echo import EchoHarness
from dshim.model import FilePart, ImagePart, TextPart
from tests.channel_contract import BOT, RecordingHarness, echo_of, receiving_bot
from tests.rig_wecom import RESPOND, SEND, WecomRig


def read_all(path: Path) -> bytes:
    """Every byte under ``path`` (the store's files, WAL included)."""
    return b"".join(f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file())


def finals(rig: WecomRig) -> list[str]:
    return [a.text for a in rig.dm_answers()]


def png(size: int) -> bytes:
    """A real PNG (the pipeline sniffs the type) of roughly ``size`` bytes."""
    raw = b"".join(b"\x00" + bytes(range(64)) * 3 for _ in range(max(1, size // 200)))
    ihdr = struct.pack(">IIBBBBB", 64, max(1, size // 200), 8, 2, 0, 0, 0)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


async def test_fast_stream_is_sent_one_frame_per_ack(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """A fast stream with slow acks: never a second frame of a req_id before the previous
    ack, at most one frame per 800 ms, one finish frame with the exact text."""
    rig = WecomRig()
    harness = EchoHarness(slow_interval_s=0.05)
    async with receiving_bot(rig, tmp_path, harness=harness):
        rig.fake.ack_delay_s = 0.5
        await rig.user_dm("echo:slow 60 a fast one")
        expected = echo_of(rig, "echo:slow 60 a fast one")
        await rig.wait_until(lambda: expected in finals(rig))
        await trio.sleep(5)
    assert rig.fake.order_violations == []
    frames = rig.fake.frames(RESPOND)
    assert [f.errcode for f in frames] == [0] * len(frames)
    finishes = [f for f in frames if f.body["stream"]["finish"]]
    assert len(finishes) == 1 and finishes[0].body["stream"]["content"] == expected
    assert frames[0].body["stream"]["content"] == THINKING_MARK
    gaps = [b.at - a.at for a, b in zip(frames[1:], frames[2:], strict=False)]
    assert all(g >= 0.5 for g in gaps)  # each waited for the previous ack
    intermediate = [f.at for f in frames[1:] if not f.body["stream"]["finish"]]
    assert all(b - a >= 0.8 - 1e-6 for a, b in zip(intermediate, intermediate[1:], strict=False))
    assert len(frames) < 12  # 60 deltas merged, not 60 frames


async def test_stream_rotates_before_five_minutes(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """An answer that streams for 8 minutes: the first stream is finished before its 6
    minutes run out and the answer continues on a new stream id of the same message."""
    rig = WecomRig()
    harness = EchoHarness(slow_interval_s=12.0)
    async with receiving_bot(rig, tmp_path, harness=harness):
        await rig.user_dm("echo:slow 40 a long story")
        expected = echo_of(rig, "echo:slow 40 a long story")
        await rig.wait_until(
            lambda: (
                len(rig.fake.streams) >= 2 and all(s.finished for s in rig.fake.streams.values())
            )
        )
        await trio.sleep(5)
    streams = sorted(rig.fake.streams.values(), key=lambda s: s.seq)
    assert len(streams) == 2
    assert len({s.req_id for s in streams}) == 1
    frames = rig.fake.frames(RESPOND)
    assert [f.errcode for f in frames] == [0] * len(frames)  # never 846608
    first_frames = [f for f in frames if f.body["stream"]["id"] == streams[0].id]
    assert first_frames[-1].body["stream"]["finish"] is True
    assert first_frames[-1].at - first_frames[0].at <= 300.0 + 1.0
    joined = streams[0].contents[-1] + streams[1].contents[-1]
    assert joined.replace(" ", "").replace("\n", "") == expected.replace(" ", "").replace("\n", "")
    assert finals(rig) == [streams[0].contents[-1], streams[1].contents[-1]]


async def test_overflow_beyond_18000_bytes_is_pushed(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """A 40 KB answer: the stream keeps under 18,000 bytes, the rest arrives as markdown
    pushes to the same chat, in order, nothing lost or repeated."""
    rig = WecomRig()
    text = "\n\n".join(f"段落 {i}: " + "内容" * 300 for i in range(25))
    async with receiving_bot(rig, tmp_path):
        await rig.user_dm(text)
        expected = echo_of(rig, text)
        chunks = split(expected)
        await rig.wait_until(lambda: finals(rig) == chunks)
        await trio.sleep(5)
    assert len(chunks) >= 3
    [stream] = rig.fake.streams.values()
    assert all(len(c.encode()) <= STREAM_MAX_BYTES for c in stream.contents)
    assert [p.content for p in rig.fake.pushes] == chunks[1:]
    assert all(p.chatid == rig.fake.user_id for p in rig.fake.pushes)


@pytest.mark.parametrize("msgid", [True, False], ids=["with-msgid", "without-msgid"])
async def test_disconnected_event_stops_the_bot_without_reconnecting(
    autojump_clock: trio.abc.Clock, tmp_path: Path, msgid: bool
) -> None:
    """Another process takes the bot over: this one stops with a clear error, once, and
    never connects again (which would evict the other one) -- whether or not the event
    carries a ``msgid``: its type alone says what it is."""
    rig = WecomRig()
    with capture_logs() as logs:
        async with receiving_bot(rig, tmp_path) as run:
            await rig.fake.take_over(msgid=msgid)
            await trio.sleep(120)
            assert run.results == {BOT: "fatal"}
    assert len(rig.fake.subscribes) == 1
    assert len(rig.fake.connections) == 1
    fatal = [e for e in logs if e["event"] == "bot_stopped_fatal"]
    assert len(fatal) == 1 and "took it over" in str(fatal[0])


async def test_dead_socket_is_replaced_after_two_unacked_pings(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """The server stops acking pings: after two unanswered pings (30 s apart) the bot
    reconnects and subscribes again; messages are answered on the new socket."""
    rig = WecomRig()
    async with receiving_bot(rig, tmp_path):
        t0 = trio.current_time()
        rig.fake.ack_pings = False
        await rig.wait_until(lambda: len(rig.fake.subscribes) == 2)
        took = trio.current_time() - t0
        rig.fake.ack_pings = True
        await rig.user_dm("still there?")
        await rig.wait_until(lambda: echo_of(rig, "still there?") in finals(rig))
    assert 60.0 <= took <= 100.0
    assert rig.fake.connections[0].closed_by == "client"


async def test_final_text_after_a_dropped_socket_is_pushed_once(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """The socket drops mid-stream: the pending frame fails, the final text arrives by
    aibot_send_msg after the reconnect — exactly once — and no stream finishes with it."""
    rig = WecomRig()
    async with receiving_bot(rig, tmp_path):
        await rig.user_dm("echo:slow 8 cut in the middle")
        await rig.wait_until(lambda: len(rig.dm_answers()) == 1)
        await rig.drop_connection()
        expected = echo_of(rig, "echo:slow 8 cut in the middle")
        await rig.wait_until(lambda: any(p.content == expected for p in rig.fake.pushes))
        await trio.sleep(20)
    assert [p.content for p in rig.fake.pushes] == [expected]
    assert [p.at > rig.fake.connections[1].opened_at for p in rig.fake.pushes] == [True]
    assert not [f for f in rig.fake.frames(RESPOND) if f.body["stream"]["content"] == expected]
    assert finals(rig) == [expected]


async def test_revoked_req_id_delivers_the_rest_by_push(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """846605 (the message's req_id is no longer valid): the answer is pushed, once."""
    rig = WecomRig()
    async with receiving_bot(rig, tmp_path):
        await rig.user_dm("echo:slow 6 revoked")
        await rig.wait_until(lambda: len(rig.fake.frames(RESPOND)) >= 2)
        for req in {f.req_id for f in rig.fake.frames(RESPOND)}:
            rig.fake.revoke(req)
        expected = echo_of(rig, "echo:slow 6 revoked")
        await rig.wait_until(lambda: any(p.content == expected for p in rig.fake.pushes))
        await trio.sleep(10)
    assert [p.content for p in rig.fake.pushes] == [expected]
    assert 846605 in [f.errcode for f in rig.fake.frames(RESPOND)]


async def test_expired_stream_continues_on_a_new_stream(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """A stream that expires early anyway (846608): the answer goes on in a new stream."""
    rig = WecomRig()
    async with receiving_bot(rig, tmp_path):
        rig.fake.stream_lifetime_s = 2.0
        await rig.user_dm("echo:slow 8 expiring")
        expected = echo_of(rig, "echo:slow 8 expiring")
        await rig.wait_until(lambda: any(s.finished for s in rig.fake.streams.values()))
        await trio.sleep(10)
    assert 846608 in [f.errcode for f in rig.fake.frames(RESPOND)]
    shown = "".join(finals(rig))
    assert shown.replace("\n", "").replace(" ", "") == expected.replace("\n", "").replace(" ", "")


async def test_image_and_file_are_downloaded_and_decrypted(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """An image and a file (AES-256-CBC, 32-byte PKCS#7 padding) reach the agent intact;
    a mixed message brings its text and its image."""
    rig = WecomRig()
    harness = RecordingHarness()
    image = png(1000)
    document = b"%PDF-1.4 not really " * 37  # 740 bytes: padded to 768
    async with receiving_bot(rig, tmp_path, harness=harness):
        fake = rig.fake
        await fake.callback(
            "aibot_msg_callback", fake.body("image", extra={"image": fake.add_media(image)})
        )
        await fake.callback(
            "aibot_msg_callback", fake.body("file", extra={"file": fake.add_media(document)})
        )
        mixed = {
            "msg_item": [
                {"msgtype": "text", "text": {"content": "look at this"}},
                {"msgtype": "image", "image": fake.add_media(image)},
            ]
        }
        await fake.callback("aibot_msg_callback", fake.body("mixed", extra={"mixed": mixed}))
        await rig.wait_until(lambda: len(harness.prompts) == 3)
    images = [p for p in harness.prompts[0] if isinstance(p, ImagePart)]
    assert [i.data for i in images] == [image] and images[0].mime == "image/png"
    files = [p for p in harness.prompts[1] if isinstance(p, FilePart)]
    assert [f.data for f in files] == [document]
    assert [p.data for p in harness.prompts[2] if isinstance(p, ImagePart)] == [image]
    assert [p.text for p in harness.prompts[2] if isinstance(p, TextPart)][-1] == "look at this"


async def test_expired_media_url_tells_the_agent(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """A media URL that expired before the turn: the message still reaches the agent,
    with a note that the image could not be downloaded."""
    rig = WecomRig()
    harness = RecordingHarness()
    async with receiving_bot(rig, tmp_path, harness=harness):
        rig.fake.media_ttl_s = 0.0
        media = rig.fake.add_media(png(300))
        await trio.sleep(1)
        await rig.fake.callback(
            "aibot_msg_callback", rig.fake.body("image", extra={"image": media})
        )
        await rig.wait_until(lambda: len(harness.prompts) == 1)
    texts = [p.text for p in harness.prompts[0] if isinstance(p, TextPart)]
    assert not [p for p in harness.prompts[0] if isinstance(p, ImagePart)]
    assert any("could not be downloaded" in t for t in texts)


async def test_welcome_is_sent_within_five_seconds_when_configured(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """enter_chat gets the configured welcome (and nothing reaches the agent)."""
    rig = WecomRig({"welcome": {"text": "你好，我是 dshim。"}})
    harness = RecordingHarness()
    async with receiving_bot(rig, tmp_path, harness=harness):
        await rig.fake.event("enter_chat")
        await rig.wait_until(lambda: bool(rig.fake.welcomes))
        await trio.sleep(5)
    [(chat, text, _)] = rig.fake.welcomes
    assert (chat, text) == (rig.fake.user_id, "你好，我是 dshim。")
    assert harness.prompts == []


async def test_no_welcome_by_default(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    rig = WecomRig()
    async with receiving_bot(rig, tmp_path):
        await rig.fake.event("enter_chat")
        await rig.fake.event("feedback_event")
        await trio.sleep(10)
        await rig.user_dm("hi")
        await rig.wait_until(lambda: echo_of(rig, "hi") in finals(rig))
    assert rig.fake.welcomes == []
    assert not rig.fake.frames("aibot_respond_welcome_msg")


async def test_approval_card_click_decides_and_updates_the_card(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """An approval shows as a button card on the reply's stream; a click updates the card
    within 5 s and answers the approval."""
    rig = WecomRig()
    async with receiving_bot(rig, tmp_path):
        await rig.user_dm("echo:approval")
        await rig.wait_until(lambda: any(s.card for s in rig.fake.streams.values()))
        [card] = [s.card for s in rig.fake.streams.values() if s.card]
        keys = [b["key"] for b in card["button_list"]]
        assert [b["text"] for b in card["button_list"]] == ["Allow once", "Allow always", "Reject"]
        await trio.sleep(1)  # a person reads the card before clicking
        click_at = trio.current_time()
        await rig.fake.click(card["task_id"], keys[1])
        await rig.wait_until(lambda: "Approval decision: allow_always" in finals(rig))
        await trio.sleep(5)
    [(_, updated, at)] = rig.fake.card_updates
    assert at - click_at < 5.0
    assert updated["task_id"] == card["task_id"]
    assert "Allow always" in updated["main_title"]["desc"]


async def test_approval_typed_answer_still_works(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    rig = WecomRig()
    async with receiving_bot(rig, tmp_path):
        await rig.user_dm("echo:approval")
        await rig.wait_until(lambda: any(s.card for s in rig.fake.streams.values()))
        await trio.sleep(1)
        await rig.user_dm("3")
        await rig.wait_until(lambda: "Approval decision: reject_once" in finals(rig))


async def test_group_mention_is_removed(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    """In a group the leading @bot token is not part of what the agent reads; the answer
    streams into the group's message."""
    rig = WecomRig()
    harness = RecordingHarness()
    async with receiving_bot(rig, tmp_path, harness=harness):
        await rig.user_group("what is up", mention=True)
        await rig.wait_until(lambda: len(harness.prompts) == 1)
        await rig.wait_until(lambda: any(s.finished for s in rig.fake.streams.values()))
    texts = [p.text for p in harness.prompts[0] if isinstance(p, TextPart)]
    assert texts[-1] == "what is up"
    assert '"conversationType":"group"' in texts[0]
    [stream] = rig.fake.streams.values()
    assert stream.chatid == rig.fake.group_id


async def test_bad_frames_are_dropped_and_the_bot_keeps_answering(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    rig = WecomRig()
    async with receiving_bot(rig, tmp_path):
        conn = rig.fake.live
        assert conn is not None
        conn.push("frame", {"cmd": "aibot_msg_callback", "headers": {"req_id": "x"}, "body": 5})
        deep: Any = {}
        for _ in range(200):
            deep = {"a": deep}
        conn.push("frame", {"cmd": "aibot_msg_callback", "headers": {"req_id": "y"}, "body": deep})
        conn.push("frame", {"cmd": "something_new", "headers": {"req_id": "z"}})
        await rig.user_dm("after the junk")
        await rig.wait_until(lambda: echo_of(rig, "after the junk") in finals(rig))
    assert len(rig.fake.subscribes) == 1


async def test_redelivered_msgid_is_answered_once(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    rig = WecomRig()
    async with receiving_bot(rig, tmp_path):
        body = await rig.fake.user_message("only once")
        await rig.wait_until(lambda: echo_of(rig, "only once") in finals(rig))
        await rig.fake.callback("aibot_msg_callback", body)
        await trio.sleep(20)
    assert finals(rig) == [echo_of(rig, "only once")]


async def test_push_rate_limit_is_retried_not_lost(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """WeCom's limit errcode on pushes: backed off and retried, the overflow arrives once."""
    rig = WecomRig()
    text = "\n\n".join("word " * 1000 for _ in range(6))
    async with receiving_bot(rig, tmp_path):
        rig.fake.fail_next(SEND, 3, status=45009, description="api freq out of limit")
        await rig.user_dm(text)
        chunks = split(echo_of(rig, text))
        await rig.wait_until(lambda: finals(rig) == chunks)
        await trio.sleep(10)
    assert [p.content for p in rig.fake.pushes] == chunks[1:]
    assert [f.errcode for f in rig.fake.frames(SEND)].count(45009) == 3


async def test_the_durable_inbox_keeps_no_signed_url_or_key(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """While a message with an image waits in the inbox, the store holds its frame without
    the signed download URL and the key (secrets never reach the store)."""
    rig = WecomRig()
    async with receiving_bot(rig, tmp_path):
        fake = rig.fake
        item = fake.add_media(png(300))
        mixed = {
            "msg_item": [
                {"msgtype": "text", "text": {"content": "echo:slow 20 look"}},
                {"msgtype": "image", "image": item},
            ]
        }
        await fake.callback("aibot_msg_callback", fake.body("mixed", extra={"mixed": mixed}))
        await rig.wait_until(lambda: len(rig.dm_answers()) == 1)
        stored = await trio.to_thread.run_sync(read_all, tmp_path)
        assert b"echo:slow 20 look" in stored  # the frame is there
        assert item["url"].encode() not in stored
        assert item["aeskey"].encode() not in stored


async def test_question_card_click_answers_with_the_option(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    rig = WecomRig()
    async with receiving_bot(rig, tmp_path):
        await rig.user_dm("echo:question")
        await rig.wait_until(lambda: any(s.card for s in rig.fake.streams.values()))
        [card] = [s.card for s in rig.fake.streams.values() if s.card]
        assert [b["text"] for b in card["button_list"]] == ["Red", "Blue"]
        await trio.sleep(1)
        await rig.fake.click(card["task_id"], card["button_list"][1]["key"])
        await rig.wait_until(lambda: "Answer: Blue" in finals(rig))
        # a second click on the same card: the request no longer waits
        await trio.sleep(1)
        await rig.fake.click(card["task_id"], card["button_list"][0]["key"])
        await trio.sleep(10)
    assert "Answer: Red" not in " ".join(finals(rig))
    assert [u[1]["main_title"]["desc"] for u in rig.fake.card_updates] == [
        "Chosen: Blue",
        "This request no longer waits",
    ]


async def test_replies_stay_within_30_a_minute_per_conversation(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """34 quick messages in one chat: the 31st reply waits until the first is a minute old
    (WeCom's 30/minute per conversation), and every message is still answered once."""
    rig = WecomRig({"lanes": {"max_queue": 40}})
    async with receiving_bot(rig, tmp_path):
        for i in range(34):
            await rig.user_dm(f"quick {i}")
        await rig.wait_until(lambda: len([a for a in rig.dm_answers()]) == 34)
        await trio.sleep(5)
    streams = sorted(rig.fake.streams.values(), key=lambda s: s.first_at)
    starts = [s.first_at for s in streams]
    assert len(streams) == 34
    for i in range(30, 34):
        assert starts[i] - starts[i - 30] >= 60.0 - 1e-6
    assert sorted(finals(rig)) == sorted(echo_of(rig, f"quick {i}") for i in range(34))
