"""A fake Telegram Bot API on 127.0.0.1: the real wire protocol, in memory.

It speaks the Bot API over HTTP (``/bot<token>/<method>`` with JSON, form or query
parameters; ``/file/bot<token>/<file_path>`` for downloads) with the semantics dshim relies
on, so the real client, channel and pipeline run against it unchanged:

- ``getUpdates`` long-polls: it answers as soon as an update with ``update_id >= offset``
  exists, else with ``[]`` after ``timeout`` seconds; ``offset`` confirms (forgets)
  everything below it, a negative offset keeps only the last N; ``allowed_updates`` is
  sticky and filters updates created afterwards; a second concurrent poll terminates the
  first with 409, and polling while a webhook is set is 409;
- message ids are per chat; ``sendMessage`` honours ``reply_parameters`` (with
  ``allow_sending_without_reply``), ``message_thread_id`` (forum topics) and the 4,096
  UTF-16 unit limit; ``editMessageText`` answers "message is not modified" for an edit that
  changes nothing, "message to edit not found" and "message can't be edited" as Telegram
  does; ``getFile`` + the file URL serve injected files;
- errors use the real envelope ``{"ok": false, "error_code", "description",
  "parameters"}``, and a wrong token is 401.

Test helpers: :meth:`FakeTelegram.user_message` injects a user's message (text, caption,
photo, document, a reply to a given message, a quote, an external reply, inside a forum
topic; mention and command entities are computed with UTF-16 offsets; a reply in a
supergroup outside a topic carries its reply chain's ``message_thread_id`` without
``is_topic_message``, as Telegram sends it in a forum's General topic), :meth:`add_update`
injects any raw Update.  From :class:`~dshim.testing.fakes.base.FakePlatform`:
:attr:`calls` records every request with its trio time (file downloads as ``"file"``),
:meth:`wait_until` waits for a condition, and the fault knobs :meth:`fail_next` (e.g. 429
with ``retry_after`` for the next k calls of a method, 409, 5xx), :meth:`slow_next` and
:meth:`drop_next` (close the connection without an answer, the call not performed).
:meth:`lose_response_next` performs the call, then closes the connection unanswered.

Use :func:`open_fake_telegram` in tests; the server exits with the block.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio

from dshim.testing.fakes import cli
from dshim.testing.fakes.base import FakePlatform, Fault, FaultQueue, IdleBench, open_servers
from dshim.testing.fakes.http import (
    DropConnection,
    HttpServer,
    Request,
    Response,
    json_response,
    serve_http,
)

#: Shaped like a token (so the client's checks pass), obviously not one.
TEST_TOKEN = "123456:TEST-token-for-dshim-tests-only"
BOT_ID = 123456
BOT_USERNAME = "dshim_test_bot"
MAX_TEXT_UTF16 = 4096
MAX_DOWNLOAD = 20 * 1024 * 1024
NOT_MODIFIED = (
    "Bad Request: message is not modified: specified new message content and reply markup "
    "are exactly the same as a current content and reply markup of the message"
)
CONFLICT = (
    "Conflict: terminated by other getUpdates request; make sure that only one bot instance "
    "is running"
)
_DEFAULT_DESCRIPTIONS = {
    409: CONFLICT,
    401: "Unauthorized",
    403: "Forbidden: bot was blocked by the user",
    404: "Not Found",
    500: "Internal Server Error",
    502: "Bad Gateway",
}
_MENTION_RE = re.compile(r"@[A-Za-z0-9_]{3,32}")
_COMMAND_RE = re.compile(r"^/[A-Za-z0-9_]{1,32}(?:@[A-Za-z0-9_]{3,32})?")
_UPDATE_TYPES = (
    "message",
    "edited_message",
    "channel_post",
    "edited_channel_post",
    "callback_query",
    "my_chat_member",
    "chat_member",
    "message_reaction",
)


def utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


class ApiError(Exception):
    """Raised inside a method: becomes an ``ok: false`` answer."""

    def __init__(self, status: int, description: str, **parameters: Any) -> None:
        super().__init__(description)
        self.status = status
        self.description = description
        self.parameters = parameters


class Call:
    """One request the bot made."""

    __slots__ = ("method", "params", "at", "status")

    def __init__(self, method: str, params: dict[str, Any], at: float) -> None:
        self.method = method
        self.params = params
        self.at = at  # trio time when the request arrived
        self.status = 0  # HTTP status answered (0: no answer, e.g. dropped)

    def __repr__(self) -> str:
        return f"Call({self.method}, status={self.status}, at={self.at:.3f})"


class FakeMessage:
    """A message in a fake chat (the bot's or a user's)."""

    def __init__(self, data: dict[str, Any], *, from_bot: bool, at: float) -> None:
        self.data = data
        self.from_bot = from_bot
        #: Every text the message showed, in order: the sent text, then each edit.
        self.history: list[str] = [data.get("text") or data.get("caption") or ""]
        self.sent_at = at
        self.edited_at: list[float] = []

    @property
    def message_id(self) -> int:
        return int(self.data["message_id"])

    @property
    def text(self) -> str:
        return str(self.data.get("text") or "")

    @property
    def reply_to_message_id(self) -> int | None:
        reply = self.data.get("reply_to_message")
        return int(reply["message_id"]) if reply else None

    @property
    def thread_id(self) -> int | None:
        value = self.data.get("message_thread_id")
        return int(value) if value is not None else None

    def __repr__(self) -> str:
        return f"FakeMessage({self.message_id}, {self.text[:30]!r}, edits={len(self.edited_at)})"


class FakeChat:
    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.next_id = 1
        self.messages: dict[int, FakeMessage] = {}
        self.topics: set[int] = set()
        self.blocked = False
        self.migrated_to: int | None = None

    @property
    def id(self) -> int:
        return int(self.data["id"])


class FakeTelegram(FakePlatform[Call]):
    """The fake Bot API state and its HTTP handler (serve it with :func:`open_fake_telegram`)."""

    def __init__(
        self,
        *,
        token: str = TEST_TOKEN,
        bot_id: int = BOT_ID,
        username: str = BOT_USERNAME,
        first_name: str = "dshim test",
        clock: Callable[[], float] = time.time,
        first_update_id: int = 700_000_000,
    ) -> None:
        super().__init__()
        self.token = token
        self.clock = clock
        self.bot = {"id": bot_id, "is_bot": True, "first_name": first_name, "username": username}
        self.server: HttpServer | None = None
        self.webhook_url = ""
        self.commands: list[dict[str, Any]] = []
        self.allowed_updates: list[str] | None = None
        self.chats: dict[int, FakeChat] = {}
        #: (chat id, user id) -> getChatMember status (else: "member" if they wrote there)
        self.members: dict[tuple[int, int], str] = {}
        self.files: dict[str, tuple[str, bytes]] = {}
        self._updates: list[tuple[int, dict[str, Any] | bytes]] = []
        self._next_update_id = first_update_id
        self._next_file = 1
        self._next_album = 0
        #: The update_id of the update injected last (None before the first).
        self.last_update_id: int | None = None
        self._new_update = trio.Event()
        #: Calls whose answer is lost after they were processed (lose_response_next).
        self._lost = FaultQueue()
        self._poll_terminate = trio.Event()
        self._poll_drop = trio.Event()
        #: Called with every message the bot sends (benchmarks account replies with it).
        self.on_bot_message: Callable[[FakeMessage], None] | None = None

    # -- where it listens -----------------------------------------------------------------

    @property
    def url(self) -> str:
        """The ``api_base`` to configure (``http://127.0.0.1:<port>``)."""
        assert self.server is not None, "not serving: use open_fake_telegram()"
        return self.server.url

    # -- observation ------------------------------------------------------------------------

    def calls_to(self, *methods: str) -> list[Call]:
        wanted = {m.lower() for m in methods}
        return [c for c in self.calls if c.method.lower() in wanted]

    def calls_except(self, *methods: str) -> list[Call]:
        unwanted = {m.lower() for m in methods}
        return [c for c in self.calls if c.method.lower() not in unwanted]

    def bot_messages(self, chat_id: int) -> list[FakeMessage]:
        """The bot's messages in a chat, in order."""
        chat = self.chats.get(chat_id)
        if chat is None:
            return []
        return [m for _, m in sorted(chat.messages.items()) if m.from_bot]

    def message(self, chat_id: int, message_id: int) -> FakeMessage | None:
        chat = self.chats.get(chat_id)
        return chat.messages.get(message_id) if chat else None

    def confirmed(self, update_id: int) -> bool:
        """True once the bot asked for a later offset (so the update is confirmed)."""
        return any(
            int(c.params.get("offset") or 0) > update_id for c in self.calls_to("getUpdates")
        )

    @property
    def pending_updates(self) -> int:
        """Updates not yet confirmed by an offset."""
        return len(self._updates)

    # -- fault knobs ------------------------------------------------------------------------
    # fail_next / slow_next / drop_next come from FakePlatform (operations are Bot API
    # method names, compared case-insensitively; "file" is a file download).  A status
    # fault is answered in the Bot API's error shape: 429 gets ``parameters.retry_after``
    # (default 3 s), 409 the polling conflict text, 5xx "Internal Server Error" unless a
    # ``description`` is given; ``migrate_to_chat_id=`` adds that parameter.

    # -- chats and people ---------------------------------------------------------------------

    @staticmethod
    def user(
        user_id: int,
        first_name: str = "Ada",
        last_name: str | None = None,
        username: str | None = None,
        *,
        is_bot: bool = False,
    ) -> dict[str, Any]:
        data: dict[str, Any] = {"id": user_id, "is_bot": is_bot, "first_name": first_name}
        if last_name:
            data["last_name"] = last_name
        if username:
            data["username"] = username
        return data

    def private_chat(self, user: dict[str, Any]) -> dict[str, Any]:
        data = {"id": user["id"], "type": "private", "first_name": user.get("first_name", "")}
        return self._chat(data).data

    def group_chat(
        self,
        chat_id: int,
        title: str = "Test group",
        *,
        supergroup: bool = True,
        forum: bool = False,
    ) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": chat_id,
            "type": "supergroup" if supergroup else "group",
            "title": title,
        }
        if forum:
            data["is_forum"] = True
        return self._chat(data).data

    def _chat(self, data: dict[str, Any]) -> FakeChat:
        chat = self.chats.get(int(data["id"]))
        if chat is None:
            chat = FakeChat(data)
            self.chats[chat.id] = chat
        return chat

    def block(self, chat_id: int) -> None:
        """The user blocked the bot: sends to this chat answer 403."""
        self.chats[chat_id].blocked = True

    def migrate(self, chat_id: int, new_chat_id: int) -> None:
        """Upgrade a group to a supergroup: sends to the old id answer 400 + migrate_to_chat_id."""
        old = self.chats[chat_id]
        old.migrated_to = new_chat_id
        self.group_chat(new_chat_id, old.data.get("title", "Test group"), supergroup=True)

    def create_topic(
        self, chat_id: int, name: str, *, creator: dict[str, Any] | None = None
    ) -> int:
        """Create a forum topic; returns its thread id (the root service message's id)."""
        chat = self.chats[chat_id]
        chat.data["is_forum"] = True
        root = self._store(
            chat,
            {
                "from": creator or self.bot,
                "forum_topic_created": {"name": name, "icon_color": 7322096},
            },
            from_bot=creator is None,
        )
        mid = root.message_id
        root.data["message_thread_id"] = mid
        root.data["is_topic_message"] = True
        chat.topics.add(mid)
        return mid

    def delete_topic(self, chat_id: int, thread_id: int) -> None:
        """Delete a forum topic: sends into it answer "message thread not found"."""
        chat = self.chats[chat_id]
        chat.topics.discard(thread_id)
        chat.messages.pop(thread_id, None)

    def add_file(self, data: bytes, *, name: str = "file") -> tuple[str, int]:
        """Store a downloadable file; returns (file_id, size)."""
        file_id = f"FILE{self._next_file:06d}"
        self.files[file_id] = (f"documents/{self._next_file}-{name}", data)
        self._next_file += 1
        return file_id, len(data)

    def _store(self, chat: FakeChat, fields: dict[str, Any], *, from_bot: bool) -> FakeMessage:
        mid = chat.next_id
        chat.next_id += 1
        data = {"message_id": mid, **fields, "chat": chat.data, "date": int(self.clock())}
        msg = FakeMessage(data, from_bot=from_bot, at=trio.current_time())
        chat.messages[mid] = msg
        if from_bot and self.on_bot_message is not None:
            self.on_bot_message(msg)
        return msg

    @staticmethod
    def _chain_root(chat: FakeChat, msg: FakeMessage) -> int:
        """The root of ``msg``'s reply chain: the first message that replies to nothing."""
        seen: set[int] = set()
        while msg.message_id not in seen:
            seen.add(msg.message_id)
            if msg.data.get("message_thread_id") is not None:
                return int(msg.data["message_thread_id"])
            parent = msg.reply_to_message_id
            up = chat.messages.get(parent) if parent is not None else None
            if up is None:
                break
            msg = up
        return msg.message_id

    def _entities(self, text: str) -> list[dict[str, Any]]:
        """mention and bot_command entities, as Telegram computes them (UTF-16 offsets)."""
        out: list[dict[str, Any]] = []
        command = _COMMAND_RE.match(text)
        if command:
            out.append({"type": "bot_command", "offset": 0, "length": utf16_len(command.group(0))})
        for match in _MENTION_RE.finditer(text):
            if command and match.start() < command.end():
                continue
            if match.start() > 0 and (
                text[match.start() - 1].isalnum() or text[match.start() - 1] == "_"
            ):
                continue
            out.append(
                {
                    "type": "mention",
                    "offset": utf16_len(text[: match.start()]),
                    "length": utf16_len(match.group(0)),
                }
            )
        return out

    @staticmethod
    def _one_level(msg: FakeMessage) -> dict[str, Any]:
        return {
            k: v
            for k, v in msg.data.items()
            if k not in ("reply_to_message", "quote", "external_reply")
        }

    def user_message(
        self,
        chat: dict[str, Any],
        sender: dict[str, Any],
        text: str | None = None,
        *,
        caption: str | None = None,
        entities: list[dict[str, Any]] | None = None,
        photo: bytes | None = None,
        document: tuple[str, str, bytes] | None = None,
        reply_to: int | None = None,
        quote: str | None = None,
        external_reply: dict[str, Any] | None = None,
        thread_id: int | None = None,
        date: int | None = None,
        forward_origin: dict[str, Any] | None = None,
        sender_chat: dict[str, Any] | None = None,
        media_group_id: str | None = None,
    ) -> dict[str, Any]:
        """Inject a message from a user; returns the Message object (also queued as an Update).

        ``entities`` default to the mentions and commands found in the text or caption.
        ``reply_to`` is a message id in the same chat; ``thread_id`` a forum topic (a
        message without ``reply_to`` then "replies" to the topic's root, as in Telegram).
        ``document`` is (file name, MIME type, bytes).  ``forward_origin`` (a MessageOrigin)
        makes it a forwarded message; ``sender_chat`` a message sent on behalf of a chat
        (then ``sender`` is the placeholder, e.g. GroupAnonymousBot); ``media_group_id``
        makes it one part of an album (see :meth:`album`).
        """
        state = self._chat(chat)
        fields: dict[str, Any] = {"from": sender}
        if sender_chat is not None:
            fields["sender_chat"] = sender_chat
        if media_group_id is not None:
            fields["media_group_id"] = media_group_id
        if forward_origin is not None:
            fields["forward_origin"] = forward_origin
            fields["forward_date"] = forward_origin.get("date", int(self.clock()))
        if text is not None:
            fields["text"] = text
            ents = entities if entities is not None else self._entities(text)
            if ents:
                fields["entities"] = ents
        if caption is not None:
            fields["caption"] = caption
            ents = entities if entities is not None else self._entities(caption)
            if ents:
                fields["caption_entities"] = ents
        if photo is not None:
            file_id, size = self.add_file(photo, name="photo.jpg")
            thumb_id, thumb_size = self.add_file(photo[:64], name="thumb.jpg")
            fields["photo"] = [
                {
                    "file_id": thumb_id,
                    "file_unique_id": thumb_id + "u",
                    "width": 90,
                    "height": 60,
                    "file_size": thumb_size,
                },
                {
                    "file_id": file_id,
                    "file_unique_id": file_id + "u",
                    "width": 1280,
                    "height": 853,
                    "file_size": size,
                },
            ]
        if document is not None:
            name, mime, data = document
            file_id, size = self.add_file(data, name=name)
            fields["document"] = {
                "file_id": file_id,
                "file_unique_id": file_id + "u",
                "file_name": name,
                "mime_type": mime,
                "file_size": size,
            }
        if thread_id is not None:
            fields["message_thread_id"] = thread_id
            fields["is_topic_message"] = True
            if reply_to is None:
                reply_to = thread_id  # Telegram: the topic's root service message
        if reply_to is not None:
            target = state.messages.get(reply_to)
            if target is not None:
                fields["reply_to_message"] = self._one_level(target)
                if thread_id is None and state.data.get("type") == "supergroup":
                    # Telegram: a reply outside a topic (a plain supergroup, a forum's
                    # General topic) belongs to its reply chain's thread, named by the
                    # chain's root message -- without is_topic_message.
                    fields["message_thread_id"] = self._chain_root(state, target)
        if quote is not None:
            fields["quote"] = {"text": quote, "position": 0, "is_manual": True}
        if external_reply is not None:
            fields["external_reply"] = external_reply
        msg = self._store(state, fields, from_bot=False)
        if date is not None:
            msg.data["date"] = date
        self.add_update({"message": msg.data})
        return msg.data

    def album(
        self,
        chat: dict[str, Any],
        sender: dict[str, Any],
        photos: list[bytes],
        *,
        caption: str | None = None,
        caption_on: int = 0,
        reply_to: int | None = None,
    ) -> list[dict[str, Any]]:
        """Inject an album as Telegram delivers it: one update per photo, all with the same
        ``media_group_id``; the caption (with its entities) on photo ``caption_on`` only.
        Returns the Message objects, in order."""
        self._next_album += 1
        group_id = f"1348{self._next_album:014d}"
        return [
            self.user_message(
                chat,
                sender,
                caption=caption if i == caption_on else None,
                photo=data,
                reply_to=reply_to if i == 0 else None,
                media_group_id=group_id,
            )
            for i, data in enumerate(photos)
        ]

    def add_update(self, update: dict[str, Any] | bytes) -> int:
        """Queue a raw Update (a dict without ``update_id`` gets the next one, or raw bytes
        queued as they are).  Returns its update_id."""
        if isinstance(update, bytes):
            uid = self._next_update_id
            self._next_update_id += 1
            self._updates.append((uid, update))
        else:
            if "update_id" in update:
                uid = int(update["update_id"])
                self._next_update_id = max(self._next_update_id, uid + 1)
            else:
                uid = self._next_update_id
                self._next_update_id += 1
                update = {"update_id": uid, **update}
            kind = next((k for k in _UPDATE_TYPES if k in update), None)
            if self.allowed_updates and kind not in self.allowed_updates:
                return uid  # filtered like Telegram: never delivered
            self._updates.append((uid, update))
        self.last_update_id = uid
        self._new_update.set()
        self._new_update = trio.Event()
        self.changed()
        return uid

    # -- HTTP ---------------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        path = request.path
        if path.startswith("/file/"):
            return await self._download(path)
        prefix, _, method = path[1:].partition("/")
        if not prefix.startswith("bot") or not method:
            return json_response({"ok": False, "error_code": 404, "description": "Not Found"}, 404)
        bad_body = False
        try:
            params = request.params()
        except ValueError:
            params, bad_body = {}, True
        # Recorded on arrival: observers see calls in flight (a long poll) too.
        call = self.record(Call(method, params, trio.current_time()))
        if prefix[3:] != self.token:
            return self._answered(call, _error(401, "Unauthorized", {}))
        if bad_body:
            return self._answered(call, _error(400, "Bad Request: can't parse request body", {}))
        try:
            response = await self._answer(method, params)
        except DropConnection:
            self.changed()
            raise
        if self._lost.take(method) or self.losing(method):
            # Processed, but the answer never reaches the bot (connection lost after it).
            call.status = response.status
            self.changed()
            raise DropConnection(method)
        return self._answered(call, response)

    def _answered(self, call: Call, response: Response) -> Response:
        call.status = response.status
        self.changed()
        return response

    async def _download(self, path: str) -> Response:
        """``/file/bot<token>/<file_path>``: the bytes of a file getFile pointed to."""
        file_prefix = f"/file/bot{self.token}/"
        call = self.record(Call("file", {"path": path.rsplit("/", 1)[-1]}, trio.current_time()))
        if not path.startswith(file_prefix):
            return self._answered(call, _error(401, "Unauthorized", {}))
        fault = await self.faults_for("file")
        if fault is not None:
            return self._answered(call, self._fault_response(fault))
        file_path = path[len(file_prefix) :]
        for stored_path, data in self.files.values():
            if stored_path == file_path:
                response = Response(200, data, [("content-type", "application/octet-stream")])
                return self._answered(call, response)
        return self._answered(call, _error(404, "Not Found", {}))

    def drop_polls(self) -> None:
        """The long polls waiting now lose their connection (unanswered, nothing confirmed)."""
        self._poll_drop.set()
        self._poll_drop = trio.Event()

    def lose_response_next(self, method: str, count: int = 1) -> None:
        """The next ``count`` calls of ``method`` are *processed* (a send creates its
        message), then the connection closes before the answer: the outcome the bot
        cannot know."""
        self._lost.drop_next(method, count)

    @staticmethod
    def _fault_response(fault: Fault) -> Response:
        """A status fault in the Bot API's error shape (see the fault knobs above)."""
        status = fault.status
        params: dict[str, Any] = {}
        description = fault.description
        if status == 429:
            retry = 3 if fault.retry_after is None else fault.retry_after
            params["retry_after"] = retry
            description = description or f"Too Many Requests: retry after {retry:g}"
        elif fault.retry_after is not None:
            params["retry_after"] = fault.retry_after
        if fault.extra.get("migrate_to_chat_id") is not None:
            params["migrate_to_chat_id"] = fault.extra["migrate_to_chat_id"]
        if description is None:
            description = _DEFAULT_DESCRIPTIONS.get(status, f"Error {status}")
        return _error(status, description, params)

    async def _answer(self, method: str, params: dict[str, Any]) -> Response:
        fault = await self.faults_for(method)
        if fault is not None:
            return self._fault_response(fault)
        handler = _METHODS.get(method.lower())
        if handler is None:
            return json_response({"ok": False, "error_code": 404, "description": "Not Found"}, 404)
        try:
            result = await handler(self, params)
        except ApiError as exc:
            return _error(exc.status, exc.description, exc.parameters)
        if isinstance(result, _RawList):
            body = b'{"ok":true,"result":[' + b",".join(result) + b"]}"
            return Response(200, body, [("content-type", "application/json")])
        return json_response({"ok": True, "result": result})

    # -- methods ------------------------------------------------------------------------------

    async def _get_me(self, params: dict[str, Any]) -> Any:
        return {
            **self.bot,
            "can_join_groups": True,
            "can_read_all_group_messages": False,
            "supports_inline_queries": False,
        }

    async def _get_webhook_info(self, params: dict[str, Any]) -> Any:
        return {
            "url": self.webhook_url,
            "has_custom_certificate": False,
            "pending_update_count": len(self._updates) if self.webhook_url else 0,
        }

    async def _set_webhook(self, params: dict[str, Any]) -> Any:
        self.webhook_url = str(params.get("url") or "")
        return True

    async def _delete_webhook(self, params: dict[str, Any]) -> Any:
        self.webhook_url = ""
        if _truthy(params.get("drop_pending_updates")):
            self._updates.clear()
        return True

    async def _set_my_commands(self, params: dict[str, Any]) -> Any:
        commands = _json_param(params, "commands")
        if not isinstance(commands, list):
            raise ApiError(400, 'Bad Request: parameter "commands" is required')
        self.commands = commands
        return True

    async def _get_updates(self, params: dict[str, Any]) -> Any:
        if self.webhook_url:
            raise ApiError(
                409,
                "Conflict: can't use getUpdates method while webhook is active; use deleteWebhook to delete the webhook first",
            )
        # A newer poll terminates the one still waiting (two processes, one token).
        self._poll_terminate.set()
        self._poll_terminate = terminate = trio.Event()
        dropped = self._poll_drop
        offset = _int_param(params, "offset")
        limit = max(1, min(100, _int_param(params, "limit") or 100))
        wait = float(params.get("timeout") or 0)
        allowed = _json_param(params, "allowed_updates")
        if isinstance(allowed, list):
            self.allowed_updates = [str(a) for a in allowed] or None
        if offset is not None:
            if offset < 0:
                self._updates = self._updates[offset:]  # keep the last -offset updates
            else:
                self._updates = [(uid, u) for uid, u in self._updates if uid >= offset]

        def ready() -> list[tuple[int, dict[str, Any] | bytes]]:
            return self._updates[:limit]

        if not ready() and wait > 0:
            with trio.move_on_after(wait):
                while not ready():
                    new = self._new_update
                    async with trio.open_nursery() as nursery:

                        async def until(ev: trio.Event) -> None:
                            await ev.wait()
                            nursery.cancel_scope.cancel()

                        nursery.start_soon(until, new)
                        nursery.start_soon(until, terminate)
                        nursery.start_soon(until, dropped)
                    if dropped.is_set():
                        raise DropConnection("getUpdates")
                    if terminate.is_set():
                        raise ApiError(409, CONFLICT)
        out = ready()
        return _RawList([u if isinstance(u, bytes) else json.dumps(u).encode() for _, u in out])

    def _chat_for(self, params: dict[str, Any]) -> FakeChat:
        chat_id = _int_param(params, "chat_id")
        chat = self.chats.get(chat_id) if chat_id is not None else None
        if chat is None:
            raise ApiError(400, "Bad Request: chat not found")
        if chat.migrated_to is not None:
            raise ApiError(
                400,
                "Bad Request: group chat was upgraded to a supergroup chat",
                migrate_to_chat_id=chat.migrated_to,
            )
        if chat.blocked:
            raise ApiError(403, "Forbidden: bot was blocked by the user")
        return chat

    @staticmethod
    def _check_text(text: Any) -> str:
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, "Bad Request: message text is empty")
        if utf16_len(text) > MAX_TEXT_UTF16:
            raise ApiError(400, "Bad Request: message is too long")
        return text

    async def _send_message(self, params: dict[str, Any]) -> Any:
        chat = self._chat_for(params)
        text = self._check_text(params.get("text"))
        fields: dict[str, Any] = {"from": self.bot, "text": text}
        entities = _json_param(params, "entities")
        if isinstance(entities, list) and entities:
            fields["entities"] = entities
        thread = _int_param(params, "message_thread_id")
        if thread is not None:
            if chat.data.get("is_forum") and thread not in chat.topics:
                raise ApiError(400, "Bad Request: message thread not found")
            fields["message_thread_id"] = thread
            if chat.data.get("is_forum") or chat.data.get("type") == "private":
                fields["is_topic_message"] = True
        reply = _json_param(params, "reply_parameters")
        if reply is None and params.get("reply_to_message_id") is not None:
            reply = {"message_id": params["reply_to_message_id"]}
        if isinstance(reply, dict):
            target = chat.messages.get(int(reply.get("message_id", 0)))
            if target is not None:
                fields["reply_to_message"] = self._one_level(target)
            elif not _truthy(reply.get("allow_sending_without_reply")):
                raise ApiError(400, "Bad Request: message to be replied not found")
        elif thread is not None and thread in chat.topics:
            fields["reply_to_message"] = self._one_level(chat.messages[thread])
        msg = self._store(chat, fields, from_bot=True)
        return msg.data

    async def _edit_message_text(self, params: dict[str, Any]) -> Any:
        chat = self._chat_for(params)
        mid = _int_param(params, "message_id")
        msg = chat.messages.get(mid) if mid is not None else None
        if msg is None:
            raise ApiError(400, "Bad Request: message to edit not found")
        if not msg.from_bot or "text" not in msg.data:
            raise ApiError(400, "Bad Request: message can't be edited")
        text = self._check_text(params.get("text"))
        if text == msg.data["text"]:
            raise ApiError(400, NOT_MODIFIED)
        msg.data["text"] = text
        entities = _json_param(params, "entities")
        if isinstance(entities, list) and entities:
            msg.data["entities"] = entities
        else:
            msg.data.pop("entities", None)
        msg.data["edit_date"] = int(self.clock())
        msg.history.append(text)
        msg.edited_at.append(trio.current_time())
        return msg.data

    async def _get_chat_member(self, params: dict[str, Any]) -> Any:
        """A member is whoever :attr:`members` says, or anyone who wrote in the chat."""
        chat = self._chat_for(params)
        user = _int_param(params, "user_id")
        if user is None:
            raise ApiError(400, "Bad Request: user_id is required")
        status = self.members.get((chat.id, user))
        if status is None:
            wrote = any(m.data.get("from", {}).get("id") == user for m in chat.messages.values())
            if not wrote:
                raise ApiError(400, "Bad Request: user not found")
            status = "member"
        return {"status": status, "user": {"id": user, "is_bot": False, "first_name": "?"}}

    async def _send_chat_action(self, params: dict[str, Any]) -> Any:
        self._chat_for(params)
        if not params.get("action"):
            raise ApiError(400, "Bad Request: action is required")
        return True

    async def _get_file(self, params: dict[str, Any]) -> Any:
        file_id = str(params.get("file_id") or "")
        stored = self.files.get(file_id)
        if stored is None:
            raise ApiError(400, "Bad Request: invalid file_id")
        path, data = stored
        if len(data) > MAX_DOWNLOAD:
            raise ApiError(400, "Bad Request: file is too big")
        return {
            "file_id": file_id,
            "file_unique_id": file_id + "u",
            "file_size": len(data),
            "file_path": path,
        }


class _RawList(list[bytes]):
    """getUpdates' result: updates serialized as they were stored (raw bytes kept)."""


def _error(status: int, description: str, parameters: dict[str, Any]) -> Response:
    body: dict[str, Any] = {"ok": False, "error_code": status, "description": description}
    if parameters:
        body["parameters"] = parameters
    return json_response(body, status)


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.lower() in ("1", "true", "yes")
    return bool(value)


def _int_param(params: dict[str, Any], name: str) -> int | None:
    value = params.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ApiError(400, f"Bad Request: invalid {name}") from None


def _json_param(params: dict[str, Any], name: str) -> Any:
    """A structured parameter: JSON in a JSON body, a JSON string in a form or query."""
    value = params.get(name)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise ApiError(400, f"Bad Request: can't parse {name} JSON object") from None
    return value


_METHODS = {
    "getme": FakeTelegram._get_me,
    "getwebhookinfo": FakeTelegram._get_webhook_info,
    "setwebhook": FakeTelegram._set_webhook,
    "deletewebhook": FakeTelegram._delete_webhook,
    "setmycommands": FakeTelegram._set_my_commands,
    "getupdates": FakeTelegram._get_updates,
    "sendmessage": FakeTelegram._send_message,
    "editmessagetext": FakeTelegram._edit_message_text,
    "sendchataction": FakeTelegram._send_chat_action,
    "getfile": FakeTelegram._get_file,
    "getchatmember": FakeTelegram._get_chat_member,
}


@asynccontextmanager
async def open_fake_telegram(
    *, host: str = "127.0.0.1", port: int = 0, **kwargs: Any
) -> AsyncIterator[FakeTelegram]:
    """Serve a :class:`FakeTelegram` on 127.0.0.1 (port 0) for the duration of the block.

    An error that ends the server is raised as itself, never as an ExceptionGroup.
    """
    fake = FakeTelegram(**kwargs)
    async with open_servers(partial(serve_http, fake.handle, host=host, port=port)) as (server,):
        fake.server = server
        yield fake


def _announcement(fake: FakeTelegram) -> cli.Announcement:
    settings = {"token": fake.token, "api_base": fake.url}
    notes = {"bot": f"@{BOT_USERNAME}"}
    return cli.Announcement("Telegram Bot API", fake.url, "telegram", settings, notes)


#: How the idle bench runs this fake: the bot's first contact is its first long poll.
IDLE_BENCH: IdleBench[FakeTelegram] = IdleBench(
    open_fake_telegram,
    lambda f: {"token": f.token, "api_base": f.url},
    lambda f: bool(f.calls_to("getUpdates")),
)


def main(argv: list[str] | None = None) -> None:
    """Run the fake as a process (see :mod:`dshim.testing.fakes.cli`)."""
    module = "dshim.testing.fakes.telegram"
    args = cli.parser(__doc__, module=module).parse_args(argv)
    cli.run(
        args,
        module=module,
        open_fake=lambda: open_fake_telegram(host=args.host, port=args.port),
        announce=_announcement,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
