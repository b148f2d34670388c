"""The WeChat channel's entry in the registries (see :mod:`dshim.channels.spec`).

Light on purpose: it imports nothing of the channel.
"""

from __future__ import annotations

from dshim.channels.spec import RegistryEntry

SPEC = RegistryEntry(
    key="weixin",
    position=10,
    title="WeChat",
    starter="""\
# WeChat (personal, Tencent iLink).  Without a token, `dshim login weixin` logs in by QR code.
# [[bots]]
# name = "weixin"
# channel = "weixin"
# token = "${WEIXIN_BOT_TOKEN}"
""",
    fixture_cases=frozenset(
        {
            "bot_echo_skipped",
            "dm_text",
            "duplicate_message",
            "group_unaddressed",
            "malformed",
            "quote_bot_shell_history",
            "quote_bot_shell_history_ambiguous",
            "quote_bot_shell_history_beyond",
            "quote_bot_shell_id_time",
            "quote_bot_shell_index_id",
            "quote_file",
            "quote_image_only",
            "quote_title_only",
            "quote_two_index_entries",
            "quote_unknown_type",
            "quote_user_text",
            "quote_voice",
            "quoted_new_not_executed",
            "voice_asr",
        }
    ),
)
