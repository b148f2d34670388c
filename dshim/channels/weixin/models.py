"""msgspec view structs of the iLink bot API: only the fields dshim reads.

Ids that iLink sends as bare 64-bit JSON numbers (``message_id``, ``msg_id``, ``svr_id``)
are typed ``int | str``: msgspec keeps a Python int exact, and the mapping compares them
as decimal strings (the official plugin rewrites them to strings before parsing).
"""

from __future__ import annotations

import msgspec

Id = int | str | None


class _View(msgspec.Struct, kw_only=True):
    """Unknown fields are ignored (iLink adds fields without notice)."""


class Media(_View):
    encrypt_query_param: str | None = None
    aes_key: str | None = None
    full_url: str | None = None


class TextItem(_View):
    text: str | None = None


class ImageItem(_View):
    media: Media | None = None
    aeskey: str | None = None
    mid_size: int | None = None


class VoiceItem(_View):
    media: Media | None = None
    text: str | None = None
    encode_type: int | None = None
    playtime: int | None = None


class FileItem(_View):
    media: Media | None = None
    file_name: str | None = None
    len: str | int | None = None


class VideoItem(_View):
    media: Media | None = None
    video_size: int | None = None


class PartialText(_View):
    """A quote of part of a message: the selection's first and last words and which
    occurrence of each (``quotemd5``: hex MD5 of the selected text)."""

    start: str | None = None
    end: str | None = None
    startindex: int | None = None
    endindex: int | None = None
    quotemd5: str | None = None


class RefMsg(_View):
    title: str | None = None
    message_item: MessageItem | None = None
    svr_id: Id = None
    partial_text: PartialText | str | None = None
    create_time_ms: int | None = None


class MessageItem(_View):
    type: int | None = None
    msg_id: Id = None
    create_time_ms: int | None = None
    update_time_ms: int | None = None
    text_item: TextItem | None = None
    image_item: ImageItem | None = None
    voice_item: VoiceItem | None = None
    file_item: FileItem | None = None
    video_item: VideoItem | None = None
    ref_msg: RefMsg | None = None


class WeixinMessage(_View):
    """One entry of ``getupdates``' ``msgs``."""

    seq: int | None = None
    message_id: Id = None
    from_user_id: str | None = None
    to_user_id: str | None = None
    client_id: str | None = None
    create_time_ms: int | None = None
    update_time_ms: int | None = None
    group_id: str | None = None
    message_type: int | None = None
    item_list: list[MessageItem] = msgspec.field(default_factory=list)
    context_token: str | None = None


class Envelope(_View):
    """The status part every answer carries (``ret`` 0 = ok; ``errcode`` on failure)."""

    ret: int | None = None
    errcode: int | None = None
    errmsg: str | None = None


class Updates(Envelope):
    """``getupdates`` without its messages (they are split and decoded one by one)."""

    get_updates_buf: str | None = None
    longpolling_timeout_ms: int | None = None


class Sent(Envelope):
    message_id: Id = None


class Config(Envelope):
    typing_ticket: str | None = None


class QrCode(Envelope):
    qrcode: str | None = None
    qrcode_img_content: str | None = None


class QrStatus(Envelope):
    status: str | None = None
    bot_token: str | None = None
    ilink_bot_id: str | None = None
    baseurl: str | None = None
    ilink_user_id: str | None = None
    redirect_host: str | None = None


MESSAGE_DECODER = msgspec.json.Decoder(WeixinMessage)
UPDATES_DECODER = msgspec.json.Decoder(Updates)
ENVELOPE_DECODER = msgspec.json.Decoder(Envelope)
SENT_DECODER = msgspec.json.Decoder(Sent)
CONFIG_DECODER = msgspec.json.Decoder(Config)
QRCODE_DECODER = msgspec.json.Decoder(QrCode)
QRSTATUS_DECODER = msgspec.json.Decoder(QrStatus)
