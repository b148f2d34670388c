"""The WhatsApp Web channel's entry in the registries (see :mod:`dshim.channels.spec`).

Light on purpose: it imports nothing of the channel.
"""

from __future__ import annotations

from dshim.channels.spec import RegistryEntry

SPEC = RegistryEntry(
    key="whatsapp_web",
    position=95,
    title="WhatsApp Web",
    starter="""\
# WhatsApp Web (a personal number linked as a device: pip install 'dshim[whatsapp-web]',
# then `dshim login whatsapp_web` and scan the QR code with the phone)
# [[bots]]
# name = "whatsapp_web"
# channel = "whatsapp_web"
""",
    fixture_cases=frozenset(
        {
            "dm_text",
            "document_with_filename",
            "duplicate_message_id",
            "edit_reaction_poll_dropped",
            "ephemeral_wrapped_text",
            "forwarded_command_not_executed",
            "group_mention",
            "group_mention_lid",
            "group_reply_to_bot",
            "group_unaddressed",
            "image_with_caption",
            "location_and_contact",
            "malformed_events",
            "own_message_dropped",
            "quote_bot_answer",
            "quote_bot_answer_by_index",
            "quote_document",
            "quote_image_with_caption",
            "quote_unknown_not_delivered",
            "quote_user_message",
            "quoted_new_not_executed",
            "status_broadcast_dropped",
        }
    ),
)
