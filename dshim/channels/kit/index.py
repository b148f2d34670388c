"""The message index of both directions, as channels without a fetch-by-id API use it.

WeChat, DingTalk, QQ and WhatsApp give a quote as an id (or an empty shell) and offer no
way to read the quoted message.  Such a channel records every message it accepted with
:func:`inbound_entry` (``host.store.record_outbound``), the pipeline records every answer
the bot delivered, and a quote is then answered from the index without a request:

- synchronously, when the channel wants the snapshot at mapping time, with
  :func:`reference_from` on ``host.store.indexed(...)``;
- or lazily, inside the turn, by setting ``recover=True`` (and ``recover_keys`` for the
  platform's extra keys, tried before the quoted id) on the
  :class:`~dshim.model.ReplyReference`: the core's recovery looks in the same index,
  then at the bot's answers by time, then in the session history
  (see :mod:`dshim.reply`).

The index keeps the newest 200 entries per conversation, none completed more than 30
days ago, text cut to 8,000 code points.
"""

from __future__ import annotations

from collections.abc import Sequence

from dshim.channels.base import ChannelStore, OutboundEntry
from dshim.model import Attachment, InboundMessage, ReplyReference

__all__ = ["inbound_entry", "record_inbound", "reference_from"]


def inbound_entry(
    msg: InboundMessage, *, at: float, extra_ids: Sequence[str] = ()
) -> OutboundEntry:
    """The index entry of an accepted user message: its id (and ``extra_ids``, e.g. a
    quote index key or a client id), author, text, attachment kinds and names, time."""
    ids = list(dict.fromkeys([msg.message_id, *extra_ids]))
    attachments = [Attachment(kind="image", name=m.name) for m in msg.images]
    attachments += [Attachment(kind=m.kind, name=m.name) for m in msg.files]
    return OutboundEntry(
        message_ids=ids,
        text=msg.content,
        sent_at=at,
        completed_at=at,
        inbound=True,
        author_id=msg.sender_id,
        author_name=msg.sender_name,
        attachments=attachments,
    )


async def record_inbound(store: ChannelStore, item: InboundMessage | object, *, now: float) -> None:
    """An accepted user message enters the index once (a redelivery adds nothing), so a
    later quote of it that carries only its id is recovered; anything else is ignored."""
    if not isinstance(item, InboundMessage):
        return
    if await store.indexed(item.conversation_id, item.message_id, now=now):
        return
    entry = inbound_entry(item, at=item.received_at or now)
    await store.record_outbound(item.conversation_id, entry, now=now)


def reference_from(
    entries: Sequence[OutboundEntry], *, message_id: str, bot_id: str
) -> ReplyReference | None:
    """The quote snapshot of the one entry found for ``message_id``.

    None when there is no entry; several entries for one id are ambiguous and give a
    ``not-delivered`` reference.  A deleted entry is ``deleted``; the bot's own entries
    are authored by ``bot_id``.
    """
    if not entries:
        return None
    if len(entries) > 1:
        return ReplyReference(message_id=message_id, unavailable_reason="not-delivered")
    entry = entries[0]
    if entry.state == "deleted":
        return ReplyReference(message_id=message_id, unavailable_reason="deleted")
    if entry.inbound:
        author_id, author_name = entry.author_id, entry.author_name
    else:
        author_id, author_name = bot_id, None
    return ReplyReference(
        message_id=message_id,
        author_id=author_id,
        author_name=author_name,
        content=entry.text,
        attachments=list(entry.attachments),
    )
