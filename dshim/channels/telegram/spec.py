"""The Telegram channel's entry in the registries (see :mod:`dshim.channels.spec`).

Light on purpose: it imports nothing of the channel.
"""

from __future__ import annotations

from dshim.channels.spec import RegistryEntry

SPEC = RegistryEntry(
    key="telegram",
    position=70,
    title="Telegram",
    starter="""\
# Telegram (a bot from @BotFather)
# [[bots]]
# name = "telegram"
# channel = "telegram"
# token = "${TELEGRAM_BOT_TOKEN}"     # "<bot id>:<secret>"
""",
    fixture_cases=frozenset(
        {
            "album_group_caption_mention",
            "album_private_three_photos",
            "approval_answered_by_reply",
            "dm_text",
            "duplicate_update",
            "external_reply",
            "forum_topic_and_general_conversations",
            "forum_topic_root",
            "group_command_botname",
            "group_mention",
            "group_unaddressed",
            "quoted_new_not_executed",
            "reply_quote_only",
            "reply_to_bot_recovered_history",
            "reply_to_bot_recovered_outbound",
            "reply_to_bot_text",
            "reply_to_user_photo",
        }
    ),
    log_tokens=(
        # A bot token "<bot id>:<35 chars>", also inside URL paths ("/bot<token>/getMe": no
        # boundary before the digits on purpose); the bot id is kept.
        r"(?P<telegram>\d{5,20}:)[A-Za-z0-9_-]{35}",
    ),
)
