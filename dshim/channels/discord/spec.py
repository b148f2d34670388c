"""The Discord channel's entry in the registries (see :mod:`dshim.channels.spec`).

Light on purpose: it imports nothing of the channel.
"""

from __future__ import annotations

from dshim.channels.spec import RegistryEntry

SPEC = RegistryEntry(
    key="discord",
    position=80,
    title="Discord",
    starter="""\
# Discord (Developer Portal -> Bot; turn on the Message Content intent)
# [[bots]]
# name = "discord"
# channel = "discord"
# token = "${DISCORD_BOT_TOKEN}"
""",
    fixture_cases=frozenset(
        {
            "dm",
            "forum_post_starter_and_reply",
            "guild_mention",
            "guild_reply_to_bot_without_mention",
            "quote_deleted",
            "quote_lookup_200",
            "quote_lookup_403",
            "quote_lookup_404",
            "quote_lookup_other_channel_answer",
            "quote_snapshot",
            "quoted_new_not_executed",
            "thread_from_a_message",
        }
    ),
    log_tokens=(
        # A bot token: base64(user id) "." timestamp "." HMAC, masked whole.
        r"(?P<discord>)[A-Za-z0-9_-]{23,28}\.[A-Za-z0-9_-]{6,7}\.[A-Za-z0-9_-]{27,}",
    ),
)
