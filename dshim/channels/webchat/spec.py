"""The web chat's entry in the registries (see :mod:`dshim.channels.spec`).

Light on purpose: it imports nothing of the channel.
"""

from __future__ import annotations

from dshim.channels.spec import RegistryEntry

SPEC = RegistryEntry(
    key="webchat",
    position=100,
    title="Web chat",
    starter="""\
# The web chat, served at the root of [http] listen: open http://127.0.0.1:8910/
[[bots]]
name = "web"
channel = "webchat"
""",
    starter_enabled=True,
    local=True,
    fixture_cases=frozenset(
        {
            "dm",
            "duplicate_client_id",
            "files_block",
            "malformed",
            "quote_bot_answer",
            "quote_earlier_session",
            "quote_image_only",
            "quote_unknown_id",
            "quote_user_message",
            "quoted_new_not_executed",
            "room_addressed",
            "room_unaddressed",
        }
    ),
)
