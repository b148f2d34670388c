"""``dshim replay`` on hostile and broken fixtures: one bad event is one ``malformed`` drop,
one bad fixture is one FAIL, and memory stays linear in the length of an answer."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import pytest

from dshim.channels.telegram import protocol as telegram_protocol
from dshim.replay import TEXT_PRINT_MAX, replay, run_fixture

DEEP = 3000


def event(mid: str, content: str) -> bytes:
    return json.dumps(
        {"message_id": mid, "conversation_id": "c1", "sender_id": "u1", "content": content}
    ).encode()


def write_fixture(path: Path, events: list[bytes], **extra: object) -> Path:
    head = json.dumps({"channel": "telegram", "format": "normalized", **extra})[:-1]
    path.write_bytes(head.encode() + b', "events": [' + b",\n".join(events) + b"]}")
    return path


def deep_event() -> bytes:
    return (
        b'{"message_id":"d","conversation_id":"c1","sender_id":"u1","content":"x","x":'
        + b"[" * DEEP
        + b"]" * DEEP
        + b"}"
    )


def lone_surrogate_event() -> bytes:
    return b'{"message_id":"s","conversation_id":"c1","sender_id":"u1","content":"\\ud800"}'


def kinds(lines: list[dict[str, object]]) -> list[tuple[object, ...]]:
    return [(x["kind"], x.get("index", x.get("text"))) for x in lines if x["kind"] != "prompt"]


def test_deep_and_lone_surrogate_events_are_dropped_and_the_others_run(tmp_path: Path) -> None:
    path = write_fixture(
        tmp_path / "hostile.json",
        [event("1", "first"), deep_event(), lone_surrogate_event(), event("4", "last")],
    )
    lines = run_fixture(path)
    drops = [(x["index"], x["reason"]) for x in lines if x["kind"] == "drop"]
    sends = [str(x["text"]) for x in lines if x["kind"] == "send"]
    assert drops == [(1, "malformed"), (2, "malformed")]
    assert [s.rsplit("\n\n", 1)[-1] for s in sends] == ["first", "last"]


def test_a_broken_fixture_fails_alone_and_the_others_still_run(tmp_path: Path) -> None:
    good = write_fixture(tmp_path / "b_good.json", [event("1", "hello")])
    out: list[str] = []
    assert replay([good], check=False, update=True, out=out.append, err=out.append) == 0
    (tmp_path / "a_not_json.json").write_text("{ this is not json")
    raw_tg = {"channel": "telegram", "format": "raw", "events": [{"update_id": 1}], "expect": []}
    (tmp_path / "a_raw_without_bot.json").write_text(json.dumps(raw_tg))
    errors: list[str] = []
    printed: list[str] = []
    code = replay([tmp_path], check=True, update=False, out=printed.append, err=errors.append)
    assert code == 1
    assert any("a_not_json.json" in e and "invalid fixture" in e for e in errors)
    assert any("a_raw_without_bot.json" in e and '"bot"' in e for e in errors)
    assert not any("Traceback" in e for e in errors)
    assert printed[-1] == "1 passed, 2 failed"  # b_good.json ran after the broken ones


def test_update_writes_goldens_for_a_fixture_the_json_module_cannot_read(tmp_path: Path) -> None:
    path = write_fixture(tmp_path / "deep.json", [deep_event(), event("2", "after")])
    out: list[str] = []
    assert replay([path], check=False, update=True, out=out.append, err=out.append) == 0
    assert replay([path], check=True, update=False, out=out.append, err=out.append) == 0
    assert out[-1] == "1 passed, 0 failed"


def test_memory_stays_linear_in_the_answer_length(tmp_path: Path) -> None:
    text = "lorem ipsum " * 15_000  # 180,000 characters, streamed in ~2,800 updates
    path = write_fixture(tmp_path / "long.json", [event("1", text)])
    tracemalloc.start()
    try:
        lines = run_fixture(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    [send] = [x for x in lines if x["kind"] == "send"]
    assert str(send["text"]).endswith("more characters]")
    assert len(str(send["text"])) < TEXT_PRINT_MAX + 100
    # Keeping every intermediate text costs ~250 MB here; only the final text is kept.
    assert peak < 40 * 1024 * 1024, f"peak {peak / 1e6:.0f} MB"


def test_recorded_lookups_match_on_the_path_and_their_query_in_any_order() -> None:
    """A recorded path with a query answers only the same parameters (in any order); one
    without a query answers whatever query the channel sends."""
    import httpx

    from dshim.replay import Fixture, HttpExchange, _mock_transport, _Recorder

    fx = Fixture(
        channel="slack",
        format="raw",
        events=[],
        http=[
            HttpExchange(method="GET", path="/history?channel=C1&latest=1.5", json={"n": 1}),
            HttpExchange(method="GET", path="/messages/om_1", json={"n": 2}),
        ],
    )
    rec = _Recorder("f")
    client = httpx.Client(transport=_mock_transport(fx, rec, "/api"), base_url="http://x/api")  # type: ignore[arg-type]
    assert client.get("/history?latest=1.5&channel=C1").json() == {"n": 1}
    assert client.get("/history?channel=C1&latest=2").status_code == 404
    assert client.get("/history?channel=C1").status_code == 404
    assert client.get("/messages/om_1?user_id_type=open_id").json() == {"n": 2}
    assert [line["path"] for line in rec.lines] == ["/history"] * 3 + ["/messages/om_1"]


def test_update_of_a_golden_with_a_lone_surrogate_keeps_the_fixture(tmp_path: Path) -> None:
    """A hostile event's text can reach a golden as a lone surrogate: writing it keeps it
    as a \\u escape instead of truncating the file on the failed UTF-8 encode."""
    from dshim.replay import _write_expect

    path = write_fixture(tmp_path / "f.json", [event("1", "hello")])
    _write_expect(path, [{"kind": "prompt", "text": "bad \ud800 text"}])
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["events"] and data["expect"] == [{"kind": "prompt", "text": "bad \ud800 text"}]


def telegram_update(uid: int, mid: int, **message: object) -> bytes:
    chat = {"id": 42, "first_name": "Ada", "type": "private"}
    sender = {"id": 42, "is_bot": False, "first_name": "Ada"}
    body = {"message_id": mid, "from": sender, "chat": chat, "date": 1796032800, **message}
    return json.dumps({"update_id": uid, "message": body}).encode()


def album_part(uid: int, n: int, **extra: object) -> bytes:
    photo = [{"file_id": f"p{n}", "file_unique_id": f"u{n}", "width": 9, "height": 9}]
    return telegram_update(uid, 100 + n, media_group_id="1348000000000001", photo=photo, **extra)


def test_a_telegram_album_is_collected_as_serve_does_on_the_replay_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A collection window of two minutes: a replay that really waited would take them.
    slow = telegram_protocol.AlbumLimits(quiet_s=120.0, max_s=300.0)
    monkeypatch.setattr(telegram_protocol, "ALBUM_LIMITS", slow)
    events = [
        album_part(1, 1),
        album_part(2, 2, caption="compare these three"),
        album_part(3, 3),
        telegram_update(4, 200, text="and a text"),
    ]
    head = json.dumps({"channel": "telegram", "format": "raw", "bot": {"id": 9, "username": "b"}})
    path = tmp_path / "album.json"
    path.write_bytes(head[:-1].encode() + b', "events": [' + b",".join(events) + b"]}")
    started = time.monotonic()
    lines = run_fixture(path)
    assert time.monotonic() - started < 60
    prompts = [
        (str(x["text"]).rsplit("\n\n", 1)[-1], x["images"]) for x in lines if x["kind"] == "prompt"
    ]
    # As serve hands them over: the text at once, the album once it is complete, whole.
    assert prompts == [("and a text", 0), ("compare these three", 3)]
    assert not [x for x in lines if x["kind"] == "drop"]
