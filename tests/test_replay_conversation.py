"""``dshim replay --only-conversation ID``: one conversation's lines, printed or checked.

The fixture runs whole (a conversation's lines can depend on another's events: an
operator's command in a group sends a notice to a direct chat), then only the chosen
conversation's lines are printed, and ``--check`` compares only those of ``expect``.
Real ``dshim`` subprocesses on the repository's fixtures and copies of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dshim.replay import conversation_lines

REPO = Path(__file__).resolve().parent.parent
#: Five events of one group; the operator's /substitute also sends a notice to DM 43.
SUBSTITUTE = REPO / "fixtures" / "telegram" / "substitute_toggle_off.json"
GROUP = "-1001234567890"
DM = "43"


def dshim(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSHIM_")}
    return subprocess.run(
        [sys.executable, "-m", "dshim", "replay", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def printed(r: subprocess.CompletedProcess[str]) -> list[dict[str, object]]:
    assert r.returncode == 0, r.stderr
    return [json.loads(x) for x in r.stdout.splitlines()]


def test_only_the_conversation_s_lines_are_printed_drops_and_commands_by_their_event() -> None:
    everything = printed(dshim(str(SUBSTITUTE)))
    group = printed(dshim("--only-conversation", GROUP, str(SUBSTITUTE)))
    dm = printed(dshim("--only-conversation", DM, str(SUBSTITUTE)))
    # The group's commands and its unaddressed drop go with their events; the notice the
    # operator's command sent to the direct chat is the direct chat's only line.
    assert [x["kind"] for x in dm] == ["send"] and dm[0]["conversation"] == DM
    assert {x.get("conversation") for x in group} == {GROUP, None}
    assert {(x["kind"], x.get("reason")) for x in group} >= {
        ("command", None),
        ("drop", "unaddressed"),
    }
    # Together they are the whole output, in its order.
    assert [x for x in everything if x in group or x in dm] == everything
    assert len(group) + len(dm) == len(everything)


def _tampered(tmp_path: Path, conversation: str) -> Path:
    """A copy of the fixture whose golden is wrong in one line of ``conversation``."""
    fx = json.loads(SUBSTITUTE.read_text())
    [line] = [x for x in fx["expect"] if x.get("conversation") == conversation][-1:]
    line["text"] = "not what replay gives"
    path = tmp_path / "tampered.json"
    path.write_text(json.dumps(fx, ensure_ascii=False, indent=2))
    return path


def test_check_compares_only_the_chosen_conversation(tmp_path: Path) -> None:
    path = _tampered(tmp_path, DM)
    assert dshim("--check", str(path)).returncode == 1
    ok = dshim("--check", "--only-conversation", GROUP, str(path))
    assert ok.returncode == 0, ok.stderr
    assert "1 passed, 0 failed" in ok.stdout
    bad = dshim("--check", "--only-conversation", DM, str(path))
    assert bad.returncode == 1
    assert "FAIL" in bad.stderr and "+" in bad.stderr and "not what replay gives" in bad.stderr
    assert "0 passed, 1 failed" in bad.stdout


def test_fixtures_without_the_conversation_are_skipped_and_counted(tmp_path: Path) -> None:
    r = dshim("--check", "--only-conversation", DM, "fixtures/telegram")
    assert r.returncode == 0, r.stderr
    total = len(list((REPO / "fixtures" / "telegram").glob("*.json")))
    assert r.stdout.splitlines()[-1] == (
        f"1 passed, 0 failed, {total - 1} skipped (without conversation '{DM}')"
    )
    assert "ok   fixtures/telegram/substitute_toggle_off.json (1 lines)" in r.stdout


def test_a_conversation_no_fixture_has_is_a_usage_error() -> None:
    r = dshim("--only-conversation", "no-such-chat", str(SUBSTITUTE))
    assert r.returncode == 2
    assert "no fixture has conversation 'no-such-chat'" in r.stderr
    assert r.stdout == ""


def test_update_does_not_combine_with_it_and_leaves_the_fixture(tmp_path: Path) -> None:
    path = _tampered(tmp_path, DM)
    before = path.read_bytes()
    r = dshim("--update", "--only-conversation", DM, str(path))
    assert r.returncode == 2
    assert "cannot be combined with --only-conversation" in r.stderr
    assert path.read_bytes() == before


def _l(kind: str, **fields: object) -> dict[str, object]:
    return {"kind": kind, **fields}


def test_an_http_line_goes_with_the_line_after_it_else_the_one_before() -> None:
    events = ["a", "b", None]
    lines = [
        _l("http", method="GET", path="/x"),  # before b's prompt: b's lookup
        _l("prompt", conversation="b"),
        _l("drop", index=0, reason="unaddressed"),
        _l("drop", index=2, reason="malformed"),  # an event of no conversation
        _l("command", index=9, name="/x"),  # an index past the events: nobody's
        _l("send", conversation="a"),
        _l("http", method="GET", path="/y"),  # last: with the send before it
    ]
    assert conversation_lines(lines, "a", events) == [lines[2], lines[5], lines[6]]
    assert conversation_lines(lines, "b", events) == lines[:2]
    assert conversation_lines(lines, "c", events) == []
