"""The WeCom channel's entry in the registries (see :mod:`dshim.channels.spec`).

Light on purpose: it imports nothing of the channel.
"""

from __future__ import annotations

from dshim.channels.spec import RegistryEntry

SPEC = RegistryEntry(
    key="wecom",
    position=40,
    title="WeCom",
    starter="""\
# WeCom (an intelligent robot in long-connection API mode)
# [[bots]]
# name = "wecom"
# channel = "wecom"
# bot_id = "${WECOM_BOT_ID}"
# secret = "${WECOM_BOT_SECRET}"
""",
    fixture_cases=frozenset(
        {
            "dm_text",
            "duplicate_msgid",
            "enter_chat",
            "group_mention",
            "image_and_file",
            "malformed",
            "mixed_with_image",
            "quote_bot_answer",
            "quote_empty",
            "quote_file",
            "quote_image",
            "quote_mixed",
            "quote_text",
            "quote_voice",
            "quoted_new_not_executed",
            "takeover_event",
            "voice",
        }
    ),
)
