"""The QQ channel's entry in the registries (see :mod:`dshim.channels.spec`).

Light on purpose: it imports nothing of the channel.
"""

from __future__ import annotations

from dshim.channels.spec import RegistryEntry

SPEC = RegistryEntry(
    key="qq",
    position=50,
    title="QQ",
    starter="""\
# QQ (the official bot API)
# [[bots]]
# name = "qq"
# channel = "qq"
# app_id = "${QQ_APP_ID}"
# client_secret = "${QQ_CLIENT_SECRET}"
""",
    fixture_cases=frozenset(
        {
            "absurd_timestamp",
            "auth_token_never_in_prompt",
            "dm_text",
            "duplicate_event",
            "group_addressed",
            "group_mention_token",
            "group_unaddressed",
            "guild_dm_quote",
            "guild_message_create",
            "guild_quote_from_index",
            "guild_quote_lookup",
            "guild_quote_lookup_failed",
            "huge_id_dropped",
            "malformed_event",
            "quote_bot_answer_ref_idx",
            "quote_file",
            "quote_image_only",
            "quote_msg_elements_only",
            "quote_not_found",
            "quote_user_from_index",
            "quoted_new_not_executed",
            "voice_asr",
        }
    ),
)
