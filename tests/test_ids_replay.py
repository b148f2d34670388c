"""``dshim replay`` and event times: an absurd time is one ``malformed`` drop, as in
``serve``, and no event time -- absurd or merely far ahead -- stalls a fixture or ends it
with ``crashed: TooSlowError`` (the fixture's other events still run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dshim.replay import run_fixture

NOW = "2026-11-30T10:00:00Z"


def event(mid: str, content: str, received_at: object) -> dict[str, object]:
    return {
        "message_id": mid,
        "conversation_id": "42",
        "conversation_type": "direct",
        "sender_id": "42",
        "content": content,
        "received_at": received_at,
    }


def fixture(path: Path, *events: dict[str, object]) -> Path:
    body = {"channel": "telegram", "format": "normalized", "now": NOW, "events": list(events)}
    path.write_text(json.dumps(body))
    return path


def outcome(lines: list[dict[str, object]]) -> list[tuple[object, object]]:
    return [
        (x["kind"], x["reason"] if x["kind"] == "drop" else str(x["text"]).rsplit("\n\n")[-1])
        for x in lines
        if x["kind"] in ("drop", "send")
    ]


@pytest.mark.parametrize("absurd", [16407412978094929299, 1e300, -1.0, "9999-12-31T23:59:59Z"])
def test_an_absurd_event_time_is_a_malformed_drop_and_the_next_event_runs(
    tmp_path: Path, absurd: object
) -> None:
    path = fixture(
        tmp_path / "absurd.json",
        event("1", "from nowhere", absurd),
        event("2", "still there?", "2026-11-30T10:00:05Z"),
    )
    assert outcome(run_fixture(path)) == [("drop", "malformed"), ("send", "still there?")]


def test_a_time_years_ahead_is_answered_and_does_not_make_the_next_event_stale(
    tmp_path: Path,
) -> None:
    path = fixture(
        tmp_path / "ahead.json",
        event("1", "from a clock running ahead", "2099-01-01T00:00:00Z"),
        event("2", "still there?", "2026-11-30T10:00:05Z"),
    )
    assert outcome(run_fixture(path)) == [
        ("send", "from a clock running ahead"),
        ("send", "still there?"),
    ]


def test_events_hours_apart_move_the_clock_without_running_out_the_deadline(
    tmp_path: Path,
) -> None:
    path = fixture(
        tmp_path / "hours.json",
        event("1", "morning", "2026-11-30T10:00:00Z"),
        event("2", "evening", "2026-11-30T20:00:00Z"),
    )
    assert outcome(run_fixture(path)) == [("send", "morning"), ("send", "evening")]
