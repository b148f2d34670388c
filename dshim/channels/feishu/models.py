"""msgspec views of the Feishu / Lark payloads dshim reads (only the fields it uses).

Events are the schema 2.0 envelopes carried in long-connection DATA frames
(``{"schema": "2.0", "header": {...}, "event": {...}}``); the envelope is decoded first with
``event`` kept raw, then the event body per ``header.event_type``.  REST answers share
the ``{code, msg, data}`` envelope.  See /shared/protocols/feishu.md for the shapes.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Header(msgspec.Struct, kw_only=True):
    event_id: str = ""
    event_type: str = ""
    create_time: str = ""
    app_id: str = ""
    tenant_key: str = ""


class Envelope(msgspec.Struct, kw_only=True):
    schema: str = ""
    header: Header | None = None
    event: msgspec.Raw = msgspec.Raw(b"null")


class UserId(msgspec.Struct, kw_only=True):
    open_id: str | None = None
    union_id: str | None = None
    user_id: str | None = None


class Sender(msgspec.Struct, kw_only=True):
    sender_id: UserId | None = None
    sender_type: str = ""
    tenant_key: str = ""


class Mention(msgspec.Struct, kw_only=True):
    key: str = ""
    id: UserId | str | None = None
    id_type: str = ""
    name: str = ""


class Message(msgspec.Struct, kw_only=True):
    message_id: str
    chat_id: str
    chat_type: str = ""
    message_type: str = ""
    content: str = ""
    root_id: str | None = None
    parent_id: str | None = None
    thread_id: str | None = None
    create_time: str = ""
    mentions: list[Mention] | None = None


class ReceiveEvent(msgspec.Struct, kw_only=True):
    """``im.message.receive_v1``."""

    sender: Sender
    message: Message


class RecalledEvent(msgspec.Struct, kw_only=True):
    """``im.message.recalled_v1``."""

    message_id: str
    chat_id: str = ""
    recall_time: str = ""
    recall_type: str = ""


class Operator(msgspec.Struct, kw_only=True):
    open_id: str | None = None
    user_id: str | None = None
    name: str | None = None


class CardAction(msgspec.Struct, kw_only=True):
    tag: str = ""
    value: dict[str, Any] | None = None
    option: str | None = None


class CardContext(msgspec.Struct, kw_only=True):
    open_message_id: str = ""
    open_chat_id: str = ""


class CardActionEvent(msgspec.Struct, kw_only=True):
    """``card.action.trigger`` (card callbacks over the long connection, schema 2.0)."""

    operator: Operator | None = None
    token: str = ""
    action: CardAction | None = None
    context: CardContext | None = None


# --- REST ---------------------------------------------------------------------------------


class ErrorBody(msgspec.Struct, kw_only=True):
    code: int = -1
    msg: str = ""


class TokenAnswer(msgspec.Struct, kw_only=True):
    code: int = -1
    msg: str = ""
    tenant_access_token: str = ""
    expire: int = 0


class BotInfo(msgspec.Struct, kw_only=True):
    open_id: str = ""
    app_name: str = ""
    activate_status: int | None = None


class BotAnswer(msgspec.Struct, kw_only=True):
    code: int = -1
    msg: str = ""
    bot: BotInfo | None = None


class ClientConfig(msgspec.Struct, kw_only=True, rename="pascal"):
    """Long-connection settings (seconds), from the endpoint answer or a pong."""

    reconnect_count: int | None = None
    reconnect_interval: float | None = None
    reconnect_nonce: float | None = None
    ping_interval: float | None = None


class EndpointData(msgspec.Struct, kw_only=True):
    url: str = msgspec.field(default="", name="URL")
    client_config: ClientConfig | None = msgspec.field(default=None, name="ClientConfig")


class EndpointAnswer(msgspec.Struct, kw_only=True):
    code: int = -1
    msg: str = ""
    data: EndpointData | None = None


class ItemSender(msgspec.Struct, kw_only=True):
    id: str = ""
    id_type: str = ""
    sender_type: str = ""


class ItemBody(msgspec.Struct, kw_only=True):
    content: str = ""


class MessageItem(msgspec.Struct, kw_only=True):
    """One item of ``GET /open-apis/im/v1/messages/{id}`` (``msg_type``, not ``message_type``)."""

    message_id: str = ""
    msg_type: str = ""
    chat_id: str | None = None
    deleted: bool = False
    create_time: str = ""
    upper_message_id: str | None = None
    sender: ItemSender | None = None
    body: ItemBody | None = None
    mentions: list[Mention] | None = None


class MessageList(msgspec.Struct, kw_only=True):
    items: list[MessageItem] | None = None


class MessageAnswer(msgspec.Struct, kw_only=True):
    code: int = -1
    msg: str = ""
    data: MessageList | None = None


class SentData(msgspec.Struct, kw_only=True):
    message_id: str = ""
    card_id: str = ""
    reaction_id: str = ""


class SentAnswer(msgspec.Struct, kw_only=True):
    code: int = -1
    msg: str = ""
    data: SentData | None = None


class Avatar(msgspec.Struct, kw_only=True):
    avatar_72: str = ""
    avatar_240: str = ""


class ContactUser(msgspec.Struct, kw_only=True):
    """A user of ``GET /open-apis/contact/v3/users/{id}``."""

    open_id: str = ""
    union_id: str = ""
    name: str = ""
    avatar: Avatar | None = None


class ContactData(msgspec.Struct, kw_only=True):
    user: ContactUser | None = None


class ContactAnswer(msgspec.Struct, kw_only=True):
    code: int = -1
    msg: str = ""
    data: ContactData | None = None


class IdEntry(msgspec.Struct, kw_only=True):
    email: str = ""
    user_id: str | None = None


class IdList(msgspec.Struct, kw_only=True):
    user_list: list[IdEntry] | None = None


class IdAnswer(msgspec.Struct, kw_only=True):
    """``POST /open-apis/contact/v3/users/batch_get_id``."""

    code: int = -1
    msg: str = ""
    data: IdList | None = None


envelope_decoder = msgspec.json.Decoder(Envelope)
contact_decoder = msgspec.json.Decoder(ContactAnswer)
ids_decoder = msgspec.json.Decoder(IdAnswer)
receive_decoder = msgspec.json.Decoder(ReceiveEvent)
recalled_decoder = msgspec.json.Decoder(RecalledEvent)
card_action_decoder = msgspec.json.Decoder(CardActionEvent)
error_decoder = msgspec.json.Decoder(ErrorBody)
token_decoder = msgspec.json.Decoder(TokenAnswer)
bot_decoder = msgspec.json.Decoder(BotAnswer)
endpoint_decoder = msgspec.json.Decoder(EndpointAnswer)
client_config_decoder = msgspec.json.Decoder(ClientConfig)
message_decoder = msgspec.json.Decoder(MessageAnswer)
sent_decoder = msgspec.json.Decoder(SentAnswer)
any_decoder = msgspec.json.Decoder()
encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    return encoder.encode(obj)
