"""The DingTalk channel's entry in the registries (see :mod:`dshim.channels.spec`).

Light on purpose: it imports nothing of the channel.
"""

from __future__ import annotations

from dshim.channels.spec import RegistryEntry

SPEC = RegistryEntry(
    key="dingtalk",
    position=30,
    title="DingTalk",
    starter="""\
# DingTalk (an internal app robot, Stream mode)
# [[bots]]
# name = "dingtalk"
# channel = "dingtalk"
# client_id = "${DINGTALK_CLIENT_ID}"          # the AppKey
# client_secret = "${DINGTALK_CLIENT_SECRET}"  # the AppSecret
""",
    fixture_cases=frozenset(
        {
            "audio_recognition",
            "card_quote_ambiguous",
            "card_quote_by_history",
            "card_quote_by_msg_id",
            "card_quote_by_process_key",
            "card_quote_by_time",
            "content_json_string",
            "dm_text",
            "duplicate_event",
            "epoch_digit_strings",
            "group_addressed",
            "group_unaddressed",
            "legacy_quote_message",
            "malformed_event",
            "quote_file",
            "quote_image_only",
            "quote_richtext",
            "quote_user_text",
            "quote_user_without_content",
            "quoted_new_not_executed",
            "richtext_group_mention",
            "richtext_picture_at",
            "richtext_untyped_picture",
        }
    ),
)
