"""Every replay fixture still produces its golden (what ``dshim replay --check`` does).

A fixture is a list of platform events exactly as the platform delivers them
(``"format": "raw"``) or normalized messages; the golden (``expect``) is what the
pipeline decided and sent, reviewed by hand.  A failure prints the diff: review it,
then refresh with ``dshim replay --update fixtures/<channel>/`` only when the change is
intended.  CHANNELS.md §10 lists the cases every channel's fixtures must cover.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dshim.replay import diff_lines, load_fixture, run_fixture

ROOT = Path(__file__).resolve().parents[1] / "fixtures"
FIXTURES = sorted(ROOT.rglob("*.json"))

#: Cases every raw channel's fixtures cover (file stems), beyond their own.
REQUIRED: dict[str, set[str]] = {
    "telegram": {
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
    },
    "discord": {
        "dm",
        "guild_mention",
        "guild_reply_to_bot_without_mention",
        "quote_snapshot",
        "quote_lookup_200",
        "quote_lookup_403",
        "quote_lookup_404",
        "quote_lookup_other_channel_answer",
        "quote_deleted",
        "quoted_new_not_executed",
    },
    "wecom": {
        "dm_text",
        "group_mention",
        "voice",
        "mixed_with_image",
        "image_and_file",
        "quote_text",
        "quote_bot_answer",
        "quote_voice",
        "quote_mixed",
        "quote_image",
        "quote_file",
        "quote_empty",
        "quoted_new_not_executed",
        "duplicate_msgid",
        "enter_chat",
        "malformed",
    },
    "webchat": {
        "dm",
        "room_addressed",
        "room_unaddressed",
        "quote_bot_answer",
        "quote_earlier_session",
        "quote_user_message",
        "quote_image_only",
        "quote_unknown_id",
        "quoted_new_not_executed",
        "duplicate_client_id",
        "malformed",
    },
}


@pytest.mark.parametrize("channel", sorted(REQUIRED))
def test_every_required_case_has_a_fixture(channel: str) -> None:
    names = {p.stem for p in (ROOT / channel).glob("*.json")}
    assert REQUIRED[channel] <= names, sorted(REQUIRED[channel] - names)


@pytest.mark.parametrize("path", FIXTURES, ids=[str(p.relative_to(ROOT)) for p in FIXTURES])
def test_fixture_matches_its_golden(path: Path) -> None:
    fixture = load_fixture(path)
    assert fixture.expect is not None, "no golden: run dshim replay --update on it and review"
    actual = run_fixture(path)
    stripped = [{k: v for k, v in line.items() if k != "fixture"} for line in actual]
    assert stripped == fixture.expect, diff_lines(fixture.expect, actual)
