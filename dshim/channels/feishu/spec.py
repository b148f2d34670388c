"""The Feishu channel's entry in the registries (see :mod:`dshim.channels.spec`).

Light on purpose: it imports nothing of the channel.
"""

from __future__ import annotations

from dshim.channels.spec import RegistryEntry

SPEC = RegistryEntry(
    key="feishu",
    position=20,
    title="Feishu",
    starter="""\
# Feishu / Lark (a custom app with the bot capability, long-connection events)
# [[bots]]
# name = "feishu"
# channel = "feishu"
# app_id = "${FEISHU_APP_ID}"
# app_secret = "${FEISHU_APP_SECRET}"
# domain = "feishu"                   # or "lark"
""",
    fixture_cases=frozenset(
        {
            "dm_text",
            "duplicate_event",
            "group_mention",
            "group_two_mentions",
            "group_unaddressed",
            "huge_id_dropped",
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
            "quote_lookup_without_chat_id",
            "quote_missing_scope",
            "quote_other_chat",
            "quote_own_streaming_card",
            "quote_recalled",
            "quote_user_text",
            "quoted_new_not_executed",
            "topic_group_one_conversation",
            "topic_group_starter_without_thread_id",
            "topic_message",
            "topic_quote_non_root",
            "topic_reply_quotes_root",
        }
    ),
    resolves_email=True,
)
