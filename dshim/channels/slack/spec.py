"""The Slack channel's entry in the registries (see :mod:`dshim.channels.spec`).

Light on purpose: it imports nothing of the channel.
"""

from __future__ import annotations

from dshim.channels.spec import RegistryEntry

SPEC = RegistryEntry(
    key="slack",
    position=60,
    title="Slack",
    starter="""\
# Slack (Socket Mode)
# [[bots]]
# name = "slack"
# channel = "slack"
# bot_token = "${SLACK_BOT_TOKEN}"    # xoxb-...
# app_token = "${SLACK_APP_TOKEN}"    # xapp-... with connections:write
""",
    fixture_cases=frozenset(
        {
            "bot_message_dropped",
            "channel_mention",
            "channel_unaddressed",
            "dm_text",
            "event_delivered_twice",
            "later_reply_in_bot_thread",
            "lookup_missing_scope",
            "lookup_not_found",
            "lookup_not_in_channel",
            "lookup_thread_not_found",
            "malformed_envelope",
            "mention_twins",
            "message_changed_ignored",
            "permalink_in_thread",
            "permalink_other_channel",
            "permalink_same_channel",
            "quote_bot_answer_lookup",
            "quote_bot_answer_recovered",
            "quote_file_message",
            "quote_image_only",
            "quoted_new_not_executed",
            "redelivery_retry_attempt",
            "scope_known_missing_no_request",
            "text_decoding",
            "thread_reply_quotes_parent",
            "top_level_mention_thread_is_one_conversation",
        }
    ),
    log_tokens=(
        # Bot, user and app-level tokens; the prefix is kept.
        r"(?P<slack>(?:xox[a-z]|xapp)-)[A-Za-z0-9-]+",
    ),
)
