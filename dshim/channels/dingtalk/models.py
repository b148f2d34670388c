"""msgspec view structs for the DingTalk Stream frames and the OpenAPI answers dshim reads.

Only the fields dshim uses are named; everything else is skipped by the decoder.  Two
shapes vary by client version and are kept raw for :mod:`.protocol` to read defensively:
a robot message's ``content`` (an object *or* a JSON string) and the quote objects
(``text.repliedMsg``, ``quoteMessage``).  Decoders are built once per type.

Wire facts: /work/shared/protocols/dingtalk.md (Stream protocol §2, robot callback §3,
sending §4).
"""

from __future__ import annotations

from typing import Any

import msgspec

#: An absent raw member (msgspec.Raw cannot be part of a union).
NULL = msgspec.Raw(b"null")


class FrameHeaders(msgspec.Struct, kw_only=True, gc=False):
    topic: str = ""
    messageId: str | None = None
    contentType: str | None = None


class Frame(msgspec.Struct, kw_only=True, gc=False):
    """A downstream Stream frame; ``data`` is a JSON *string* (decoded twice)."""

    type: str = ""
    headers: FrameHeaders = msgspec.field(default_factory=FrameHeaders)
    data: msgspec.Raw = msgspec.Raw(b'""')


class Ping(msgspec.Struct, kw_only=True, gc=False):
    opaque: Any = None


class AtUser(msgspec.Struct, kw_only=True, gc=False):
    dingtalkId: str | None = None
    staffId: str | None = None


class Text(msgspec.Struct, kw_only=True, gc=False):
    content: str = ""
    isReplyMsg: bool = False
    repliedMsg: msgspec.Raw = NULL


class RobotMessage(msgspec.Struct, kw_only=True, gc=False):
    """A robot message callback (``/v1.0/im/bot/messages/get``), the decoded ``data``."""

    msgId: str
    conversationId: str
    msgtype: str = "text"
    text: Text | None = None
    content: msgspec.Raw = NULL
    createAt: int | float | str | None = None
    conversationType: str | int = "1"
    conversationTitle: str | None = None
    senderId: str = ""
    senderStaffId: str | None = None
    senderNick: str | None = None
    chatbotUserId: str | None = None
    robotCode: str | None = None
    isInAtList: bool | None = None
    atUsers: list[AtUser] | None = None
    sessionWebhook: str | None = None
    sessionWebhookExpiredTime: int | float | str | None = None
    originalMsgId: str | None = None
    originalProcessQueryKey: str | None = None
    quoteMessage: msgspec.Raw = NULL


class Token(msgspec.Struct, kw_only=True, gc=False):
    accessToken: str
    expireIn: float = 7200.0


class Connection(msgspec.Struct, kw_only=True, gc=False):
    endpoint: str
    ticket: str


class ErrorBody(msgspec.Struct, kw_only=True, gc=False):
    """Both error shapes: api.dingtalk.com ``{code, message}``, oapi ``{errcode, errmsg}``."""

    code: str | int | None = None
    message: str | None = None
    errcode: int | None = None
    errmsg: str | None = None


class SendResult(msgspec.Struct, kw_only=True, gc=False):
    processQueryKey: str | None = None


class DownloadResult(msgspec.Struct, kw_only=True, gc=False):
    downloadUrl: str


class RobotInfo(msgspec.Struct, kw_only=True, gc=False):
    name: str | None = None
    robotCode: str | None = None


frame_decoder = msgspec.json.Decoder(Frame)
ping_decoder = msgspec.json.Decoder(Ping)
message_decoder = msgspec.json.Decoder(RobotMessage)
token_decoder = msgspec.json.Decoder(Token)
connection_decoder = msgspec.json.Decoder(Connection)
error_decoder = msgspec.json.Decoder(ErrorBody)
send_decoder = msgspec.json.Decoder(SendResult)
download_decoder = msgspec.json.Decoder(DownloadResult)
any_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder()
str_decoder = msgspec.json.Decoder(str)
encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    return encoder.encode(obj)
