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
    "slack": {
        "dm_text",
        "channel_mention",
        "channel_unaddressed",
        "mention_twins",
        "redelivery_retry_attempt",
        "event_delivered_twice",
        "thread_reply_quotes_parent",
        "later_reply_in_bot_thread",
        "quote_bot_answer_recovered",
        "quote_bot_answer_lookup",
        "quote_image_only",
        "quote_file_message",
        "lookup_not_found",
        "lookup_missing_scope",
        "lookup_not_in_channel",
        "permalink_same_channel",
        "permalink_other_channel",
        "permalink_in_thread",
        "quoted_new_not_executed",
        "malformed_envelope",
        "message_changed_ignored",
        "bot_message_dropped",
        "text_decoding",
        "scope_known_missing_no_request",
        "lookup_thread_not_found",
    },  # noqa: E501
    "dingtalk": {
        "dm_text",
        "group_addressed",
        "group_unaddressed",
        "quote_user_text",
        "quote_image_only",
        "quote_file",
        "quote_richtext",
        "quote_user_without_content",
        "richtext_picture_at",
        "audio_recognition",
        "content_json_string",
        "card_quote_by_process_key",
        "card_quote_by_msg_id",
        "card_quote_by_time",
        "card_quote_by_history",
        "card_quote_ambiguous",
        "legacy_quote_message",
        "quoted_new_not_executed",
        "duplicate_event",
        "malformed_event",
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
    "feishu": {
        "dm_text",
        "duplicate_event",
        "group_mention",
        "group_two_mentions",
        "group_unaddressed",
        "malformed_event",
        "p2p_post_with_image",
        "quote_bot_answer",
        "quote_card_v1",
        "quote_cardkit_json_card",
        "quote_empty_card",
        "quote_file",
        "quote_i18n_card",
        "quote_image_only",
        "quote_lookup_not_found",
        "quote_missing_scope",
        "quote_other_chat",
        "quote_own_streaming_card",
        "quote_recalled",
        "quote_user_text",
        "quoted_new_not_executed",
        "topic_message",
        "topic_quote_non_root",
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
    "weixin": {
        "dm_text",
        "group_unaddressed",
        "bot_echo_skipped",
        "voice_asr",
        "quote_user_text",
        "quote_voice",
        "quote_title_only",
        "quote_image_only",
        "quote_file",
        "quote_bot_shell_index_id",
        "quote_bot_shell_id_time",
        "quote_bot_shell_history",
        "quote_bot_shell_history_beyond",
        "quote_bot_shell_history_ambiguous",
        "quote_two_index_entries",
        "quote_unknown_type",
        "quoted_new_not_executed",
        "duplicate_message",
        "malformed",
    },
    "whatsapp": {
        "dm_text",
        "group_mention",
        "group_unaddressed",
        "two_messages_and_a_status",
        "quote_user_message",
        "quote_bot_answer",
        "quote_unknown_wamid",
        "quote_revoked",
        "quote_image_only",
        "quote_file_message",
        "image_with_caption",
        "document_with_filename",
        "bsuid_only_user",
        "reaction_and_edit_not_prompted",
        "duplicate_wamid",
        "quoted_new_not_executed",
        "malformed_events",
    },
    "qq": {
        "dm_text",
        "group_addressed",
        "group_unaddressed",
        "group_mention_token",
        "quote_user_from_index",
        "quote_msg_elements_only",
        "quote_bot_answer_ref_idx",
        "quote_not_found",
        "quote_image_only",
        "quote_file",
        "quoted_new_not_executed",
        "duplicate_event",
        "malformed_event",
        "voice_asr",
        "auth_token_never_in_prompt",
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
