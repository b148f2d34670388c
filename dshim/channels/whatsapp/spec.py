"""The WhatsApp channel's entry in the registries (see :mod:`dshim.channels.spec`).

Light on purpose: it imports nothing of the channel.
"""

from __future__ import annotations

from dshim.channels.spec import RegistryEntry

SPEC = RegistryEntry(
    key="whatsapp",
    position=90,
    title="WhatsApp",
    starter="""\
# WhatsApp (Cloud API; webhooks arrive at /hooks/whatsapp through your public HTTPS proxy)
# [[bots]]
# name = "whatsapp"
# channel = "whatsapp"
# phone_number_id = "${WHATSAPP_PHONE_NUMBER_ID}"
# access_token = "${WHATSAPP_TOKEN}"
# app_secret = "${WHATSAPP_APP_SECRET}"
# verify_token = "${WHATSAPP_VERIFY_TOKEN}"
""",
    fixture_cases=frozenset(
        {
            "bsuid_only_user",
            "dm_text",
            "document_with_filename",
            "duplicate_wamid",
            "group_mention",
            "group_reply_to_bot",
            "group_reply_to_bot_by_index",
            "group_unaddressed",
            "image_with_caption",
            "malformed_events",
            "quote_bot_answer",
            "quote_file_message",
            "quote_image_only",
            "quote_revoked",
            "quote_unknown_wamid",
            "quote_user_message",
            "quoted_new_not_executed",
            "reaction_and_edit_not_prompted",
            "two_messages_and_a_status",
        }
    ),
    webhook_only=True,
)
