"""The Telegram replay fixtures still produce their goldens (what ``dshim replay --check`` does).

Each fixture is a list of Update objects exactly as getUpdates returns them; the golden is
what the pipeline decided and sent.  A failure prints the diff; review it, then refresh
with ``dshim replay --update fixtures/telegram/`` only when the change is intended.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dshim.replay import diff_lines, run_fixture

FIXTURES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "telegram").glob("*.json"))


def test_every_case_of_the_issue_has_a_fixture() -> None:
    names = {p.stem for p in FIXTURES}
    assert {
        "dm_text",
        "group_mention",
        "group_unaddressed",
        "group_command_botname",
        "reply_to_bot_text",
        "reply_to_user_photo",
        "reply_quote_only",
        "reply_to_bot_recovered_outbound",
        "reply_to_bot_recovered_history",
        "external_reply",
        "forum_topic_root",
        "quoted_new_not_executed",
        "duplicate_update",
    } <= names


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_fixture_matches_its_golden(path: Path) -> None:
    fixture = json.loads(path.read_text(encoding="utf-8"))
    assert fixture["format"] == "raw" and "update_id" in fixture["events"][0]
    actual = run_fixture(path)
    expected = fixture["expect"]
    stripped = [{k: v for k, v in line.items() if k != "fixture"} for line in actual]
    assert stripped == expected, diff_lines(expected, actual)
