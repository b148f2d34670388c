"""The web chat channel: the page, its websocket, the reader, the replay adapter, the probe.

``run`` mounts the page (``""``, ``app.js``, ``app.css``) and the socket (``ws``) on the
local HTTP endpoint — served at ``/hooks/<bot>/`` and, for the web chat bot, at ``/``
and ``/ws`` — opens the pipeline and counts as started: there is no platform to
authenticate with (the endpoint's bearer token, when set, guards the page and the
socket).  Without the endpoint (``[http] enabled = false``) mounting fails with a
ConfigError: the bot stops once, with that reason.

Each socket is served by :meth:`Chat.serve_tab` on the endpoint's task: ``join`` is
answered from the message log at once; a ``send`` (or a button's ``answer``) becomes a
stored event (:func:`.protocol.build_event`) handed to the bot's one reader
(:meth:`Chat.read`, under ``host.serve``), which logs it, shows it to the conversation's
tabs, runs the pipeline's steps 1-6 on it and only then answers ``accepted``.  One reader
keeps one order for all tabs, and it is the bot's task, so a tab that closes in the middle
never cuts a message half-accepted.  When the bot stops, every tab is closed (the page
reconnects with backoff to the next start and reloads the history) and new sockets are
refused with 1013 until then.

Sockets that only hold a slot: one that has not joined (a valid ``join``) within
:data:`JOIN_DEADLINE_S` is closed with :data:`JOIN_TIMEOUT_CODE` (the page joins as soon
as its socket is open); one that stops answering the endpoint's pings is closed by the
endpoint (:mod:`dshim.http.wsstream`); the caps per client, per address and for all, and
who loses a slot to a new socket, are :class:`~.client.Tabs`'s.  A socket closed to make
room, or refused, gets 1013 with the reason.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

import structlog
import trio

from dshim.channels.base import (
    AcceptsMany,
    BotHost,
    ChannelSettings,
    ChannelSpec,
    ChannelStore,
    Check,
    HttpRequest,
    HttpResponse,
    Identity,
    Inbound,
    LoggedMessage,
    ProbeResult,
    ProbeRows,
    ReceivesEvents,
    ReplaySource,
    WebSocket,
    WebSocketClosed,
)
from dshim.channels.webchat import models as m
from dshim.channels.webchat import protocol
from dshim.channels.webchat.client import Tab, Tabs
from dshim.channels.webchat.protocol import BotIdentity, FrameError, Received
from dshim.channels.webchat.render import WebchatOutbound, new_id, split
from dshim.errors import StoreError
from dshim.model import InboundMessage, Loader, ReplyReference, Skip

log = structlog.get_logger("dshim.webchat")

#: Events waiting for the reader (a socket that sends faster waits: backpressure).
JOB_QUEUE = 64
#: The most events the reader takes together (see :meth:`Chat.read`).
BATCH_MAX = 64
#: Close code for sockets while the bot is not running (the page retries).
RESTARTING_CODE = 1012
UNAVAILABLE_CODE = 1013
#: A socket must join within this long of connecting ...
JOIN_DEADLINE_S = 10.0
#: ... or it is closed with this code (an application code: 4000 + HTTP 408).
JOIN_TIMEOUT_CODE = 4408
#: How long closing a dismissed tab's socket may take (the peer may not read).
DISMISS_CLOSE_S = 5.0
HISTORY_MAX = 500
TEST_TEXT = "✅ dshim connection test: this conversation is reachable."
#: The page's files (package data), by mount path.
ASSETS = {
    "": ("index.html", "text/html; charset=utf-8"),
    "app.js": ("app.js", "text/javascript; charset=utf-8"),
    "app.css": ("app.css", "text/css; charset=utf-8"),
}
#: No inline script or style, no other origin, no framing: whatever an agent or a user
#: writes can never run as code on the page, even if the page had a bug.
PAGE_HEADERS = (
    (
        "content-security-policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' blob: data:; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'none'",
    ),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("cache-control", "no-cache"),
)


class WebchatSettings(ChannelSettings):
    """The ``[[bots]]`` keys of a web chat bot (none are required)."""

    #: The bot's name on the page and what ``@<name>`` addresses in rooms (default: the
    #: bot's ``name``).
    display_name: str | None = None
    #: Messages a page gets when it joins a conversation (the newest).
    history_limit: int = 200

    def __post_init__(self) -> None:
        if self.display_name is not None:
            name = self.display_name.strip()
            if not name or len(name) > 64 or any(c.isspace() or c == "@" for c in name):
                raise ValueError(
                    "display_name: expected 1-64 characters without spaces or '@' "
                    "(it is what @<name> addresses)"
                )
            self.display_name = name
        if not 1 <= self.history_limit <= HISTORY_MAX:
            raise ValueError(f"history_limit: expected 1-{HISTORY_MAX}, got {self.history_limit}")


@functools.cache
def asset(name: str) -> bytes:
    """One file of the page (read once)."""
    return resources.files("dshim.channels.webchat").joinpath("static", name).read_bytes()


async def serve_asset(request: HttpRequest) -> HttpResponse:
    """``GET`` the page or one of its files."""
    name, content_type = ASSETS.get(request.path.strip("/"), ("", ""))
    if not name:
        return _json_error(404, "not_found", f"nothing at {request.path[:80]}")
    if request.method not in ("GET", "HEAD"):
        return _json_error(405, "method_not_allowed", "use GET")
    body = asset(name) if request.method == "GET" else b""
    return HttpResponse(200, body, content_type, PAGE_HEADERS)


def _json_error(status: int, code: str, message: str) -> HttpResponse:
    return HttpResponse(status, m.encoder.encode({"error": code, "message": message}))


def lookup_factory(
    store: ChannelStore | None, me: BotIdentity, clock: Callable[[], float]
) -> Callable[[str, str], Loader]:
    """Quote loaders: the conversation's message log, then its outbound index (the bot's
    answers, also those the log no longer holds); None (``not-found``) when neither knows
    the id in this conversation."""

    def make(conversation: str, message_id: str) -> Loader:
        async def load() -> ReplyReference | None:
            if store is None:
                return None
            logged = await store.logged_message(conversation, message_id)
            if logged is not None:
                return protocol.reference_from_log(logged)
            for entry in await store.outbound(conversation, now=clock()):
                if message_id in entry.message_ids:
                    return ReplyReference(
                        message_id=message_id,
                        author_id=me.id,
                        author_name=me.name,
                        content=entry.text,
                        attachments=[],
                    )
            return None

        return load

    return make


@dataclass(frozen=True, slots=True)
class Job:
    """One stored event for the reader, and the tab that sent it."""

    tab: Tab
    raw: bytes
    client_id: str


class Chat:
    """One running web chat bot: its tabs, its reader and the frames it answers."""

    def __init__(
        self,
        *,
        store: ChannelStore,
        me: BotIdentity,
        clock: Callable[[], float],
        history_limit: int = 200,
        bot: str = "web",
        file_max: int = protocol.FILE_MAX_BYTES,
    ) -> None:
        self.bot = bot
        #: The bot's ``max_file_bytes``: a larger upload is refused when it is sent.
        self.file_max = file_max
        self.store = store
        self.me = me
        self.clock = clock
        self.history_limit = history_limit
        self.tabs = Tabs()
        self.outbound = WebchatOutbound(self.tabs, store, me, clock=clock)
        self.lookup = lookup_factory(store, me, clock)
        self._jobs_in, self._jobs_out = trio.open_memory_channel[Job](JOB_QUEUE)
        self.closed = False

    def map(self, raw: bytes) -> Received | Skip:
        return protocol.map_event(raw, self.me, lookup=self.lookup)

    def decode_raw(self, raw: bytes) -> InboundMessage | Skip:
        """The inbox's decoder (after a restart)."""
        got = self.map(raw)
        return got.message if isinstance(got, Received) else got

    # -- the reader (the bot's task) ------------------------------------------------------

    async def read(self, rt: Inbound) -> None:
        """Take every tab's events in one order: log, show, steps 1-6, then ``accepted``.
        Events that wait together are taken together (at most :data:`BATCH_MAX`): their
        log entries in one store transaction, steps 1-6 in one (``accept_many``), in the
        order they came — a busy chat costs a few store round trips per batch rather than
        per message."""
        try:
            async for job in self._jobs_out:
                batch = [job]
                while len(batch) < BATCH_MAX:
                    try:
                        batch.append(self._jobs_out.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                await self._take(rt, batch)
        finally:
            self.close()

    async def _take(self, rt: Inbound, batch: list[Job]) -> None:
        mapped = [self.map(job.raw) for job in batch]
        logged = await self._log_all(mapped)
        for got, shown in zip(mapped, logged, strict=True):
            if shown and isinstance(got, Received):
                conversation = got.message.conversation_id
                self.tabs.broadcast(conversation, protocol.message_frame(conversation, got.logged))
        items = [got.message if isinstance(got, Received) else got for got in mapped]
        if len(batch) > 1 and isinstance(rt, AcceptsMany):
            verdicts = await rt.accept_many(
                [(item, job.raw) for item, job in zip(items, batch, strict=True)]
            )
        else:
            verdicts = [
                await rt.accept(item, job.raw) for item, job in zip(items, batch, strict=True)
            ]
        for job, got, verdict in zip(batch, mapped, verdicts, strict=True):
            if isinstance(got, Skip):  # build_event checked it: only a bug gets here
                job.tab.push(protocol.error_frame("bad_frame", got.detail, client_id=job.client_id))
            elif verdict.confirm:
                conversation = got.message.conversation_id
                job.tab.push(
                    protocol.accepted_frame(job.client_id, got.message.message_id, conversation)
                )
            else:  # the bot is stopping: the page sends it again after reconnecting
                job.tab.push(_unavailable(job.client_id))

    async def _log_all(self, mapped: list[Received | Skip]) -> list[bool]:
        """Each event's entry in its conversation's log (True: new), all in one store
        transaction (the store gathers the calls made together); the first failure is
        raised once all are done."""
        out = [False] * len(mapped)
        failed: list[BaseException] = []

        async def log_one(i: int, got: Received) -> None:
            try:
                out[i] = await self.store.log_message(
                    got.message.conversation_id, got.logged, now=self.clock()
                )
            except Exception as exc:  # noqa: BLE001 (raised below, as itself)
                failed.append(exc)

        todo = [(i, got) for i, got in enumerate(mapped) if isinstance(got, Received)]
        if len(todo) == 1:
            i, got = todo[0]
            out[i] = await self.store.log_message(
                got.message.conversation_id, got.logged, now=self.clock()
            )
        elif todo:
            async with trio.open_nursery() as nursery:
                for i, got in todo:
                    nursery.start_soon(log_one, i, got)
            if failed:
                raise failed[0]
        return out

    def close(self) -> None:
        """No more events: queued ones are refused (the pages send them again)."""
        self.closed = True
        self._jobs_in.close()
        while True:
            try:
                job = self._jobs_out.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            job.tab.push(_unavailable(job.client_id))

    # -- one tab (the endpoint's task) ---------------------------------------------------

    async def serve_tab(self, ws: WebSocket) -> None:
        """Serve one websocket until it closes (on the endpoint's task: the bot's log
        context is bound here)."""
        # The socket's own task (the endpoint's, one per socket): bound for good, which
        # costs an open socket less than a context manager held all along.
        structlog.contextvars.bind_contextvars(bot=self.bot, channel="webchat")
        if self.closed:
            await ws.close(RESTARTING_CODE, "the web chat is restarting")
            return
        tab = Tab(ws, client=ws.client)
        victims = self.tabs.admit(tab)
        if victims is None:
            log.warning("tab_refused", reason="too_many_tabs", tabs=len(self.tabs))
            await ws.close(UNAVAILABLE_CODE, "too many open tabs")
            return
        for victim in victims:
            log.info("tab_dismissed", reason="made_room", tabs=len(self.tabs))
            victim.dismiss(UNAVAILABLE_CODE, "closed to make room: it had not joined")
        try:
            async with trio.open_nursery() as nursery:
                tab.attach(nursery)
                try:
                    await self._read_tab(tab)
                finally:
                    tab.detach()
                    nursery.cancel_scope.cancel()
        finally:
            self.tabs.remove(tab)
        if tab.dismissed is not None:
            with trio.move_on_after(DISMISS_CLOSE_S):
                await ws.close(*tab.dismissed)

    async def _read_tab(self, tab: Tab) -> None:
        """Handle the tab's frames in order until it closes; one that has not joined
        within :data:`JOIN_DEADLINE_S` is dismissed (no task of its own waits for that)."""
        join_by = trio.current_time() + JOIN_DEADLINE_S
        data: str | bytes = ""
        while True:
            try:
                if tab.user is None:
                    with trio.move_on_at(join_by) as waiting:
                        data = await tab.ws.receive()
                    if waiting.cancelled_caught:
                        log.info("tab_dismissed", reason="no_join", tabs=len(self.tabs))
                        self.tabs.remove(tab)
                        tab.dismiss(JOIN_TIMEOUT_CODE, f"no join within {JOIN_DEADLINE_S:g} s")
                        return
                else:
                    data = await tab.ws.receive()
            except WebSocketClosed:
                return
            await self._frame(tab, data)

    async def _frame(self, tab: Tab, data: str | bytes) -> None:
        try:
            frame = protocol.parse_frame(data)
            if isinstance(frame, m.JoinFrame):
                await self._join(tab, protocol.check_join(frame))
            elif isinstance(frame, m.LeaveFrame):
                tab.leave(frame.conversation)
            elif isinstance(frame, m.SendFrame):
                member = _member(tab, frame.conversation, frame.client_id)
                raw = protocol.build_event(frame, member, at=self.clock(), file_max=self.file_max)
                await self._submit(tab, raw, frame.client_id)
            else:
                member = _member(tab, frame.conversation, frame.client_id)
                await self._submit(tab, self._answer(frame, member), frame.client_id)
        except FrameError as exc:
            log.info("frame_refused", code=exc.code, detail=exc.message[:200])
            tab.push(protocol.error_frame(exc.code, exc.message, client_id=exc.client_id))
        except StoreError as exc:  # the history could not be read: the page tries again
            log.warning("history_failed", error=str(exc)[:300])
            tab.push(protocol.error_frame("unavailable", "the history could not be read"))

    async def _join(self, tab: Tab, member: protocol.Member) -> None:
        if not self.tabs.joining(tab, member.user_id):
            log.warning("tab_refused", reason="too_many_tabs_of_client", tabs=len(self.tabs))
            self.tabs.remove(tab)
            tab.dismiss(UNAVAILABLE_CODE, "too many open tabs for this user")
            return
        tab.join(member)
        conversation = member.conversation
        logged = await self.store.message_log(conversation, limit=self.history_limit)
        live = self.outbound.live(conversation)
        known = {lm.message_id for lm in logged}
        messages = [(lm, True) for lm in logged] + [
            (lm, False) for lm in live if lm.message_id not in known
        ]
        messages.sort(key=lambda pair: pair[0].at)
        tab.push(protocol.history_frame(conversation, messages))
        for pending in self.outbound.pending(conversation):
            tab.push(pending.frame)

    def _answer(self, frame: m.AnswerFrame, member: protocol.Member) -> bytes:
        pending = self.outbound.interaction(frame.conversation, frame.interaction)
        if pending is None:
            raise FrameError(
                "not_found",
                "this request no longer waits for an answer",
                client_id=frame.client_id,
            )
        text = protocol.answer_text(pending.prompt.options, frame.option)
        if text is None:
            raise FrameError(
                "bad_frame",
                f"option: not an option of {frame.interaction}",
                client_id=frame.client_id,
            )
        return protocol.answer_event(frame, member, text, at=self.clock())

    async def _submit(self, tab: Tab, raw: bytes, client_id: str) -> None:
        try:
            await self._jobs_in.send(Job(tab, raw, client_id))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            tab.push(_unavailable(client_id))


def _member(tab: Tab, conversation: str, client_id: str) -> protocol.Member:
    member = tab.member(conversation)
    if member is None:
        raise FrameError(
            "not_joined",
            "join the conversation before sending to it",
            client_id=client_id if len(client_id) <= protocol.ID_MAX else None,
        )
    return member


def _unavailable(client_id: str) -> str:
    return protocol.error_frame(
        "unavailable", "dshim is restarting: send it again in a moment", client_id=client_id
    )


def identity_of(host_bot_name: str, settings: WebchatSettings) -> BotIdentity:
    return BotIdentity.for_bot(host_bot_name, settings.display_name)


async def run(
    host: BotHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run one web chat bot until shutdown (see the module docstring)."""
    settings = host.settings_as(WebchatSettings)
    me = identity_of(host.bot.name, settings)
    chat = Chat(
        store=host.store,
        me=me,
        clock=host.clock,
        history_limit=settings.history_limit,
        bot=host.bot.name,
        file_max=host.bot.max_file_bytes,
    )
    for path in ASSETS:
        host.mount(path, serve_asset)
    host.mount_websocket("ws", chat.serve_tab)
    try:
        async with host.open_runtime(
            outbound=chat.outbound, bot_id=me.id, decode_raw=chat.decode_raw
        ) as rt:
            log.info("chat_mounted", bot_id=me.id, name=me.name, paths=[*ASSETS, "ws"])
            task_status.started()
            await host.serve(rt, functools.partial(chat.read, rt))
    finally:
        chat.close()
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await chat.tabs.close_all(RESTARTING_CODE, "the web chat is restarting")


# --- replay ---------------------------------------------------------------------------------


class WebchatReplayAdapter(ReceivesEvents):
    """Maps fixture events (``send`` frames with ``user`` and ``kind``) with the real code;
    each event is logged, like a live one, before the pipeline gets it."""

    def __init__(self, fx: ReplaySource) -> None:
        name = fx.bot_username or "web"
        self.me = BotIdentity(id=fx.bot_id or BotIdentity.for_bot(name).id, name=name)
        self.bot_id = self.me.id
        self.bot_username: str | None = name
        self._store = fx.store
        clock = fx.clock or (lambda: 0.0)
        self._clock = clock
        self._lookup = lookup_factory(fx.store, self.me, clock)

    def decode(self, raw: bytes) -> InboundMessage | Skip:
        got = protocol.map_event(raw, self.me, lookup=self._lookup)
        return got.message if isinstance(got, Received) else got

    async def received(self, item: InboundMessage | Skip, raw: bytes) -> None:
        got = protocol.map_event(raw, self.me)
        if self._store is not None and isinstance(got, Received):
            await self._store.log_message(
                got.message.conversation_id, got.logged, now=self._clock()
            )

    #: The chunks an answer is delivered in (the renderer's own split).
    split = staticmethod(split)


# --- probe ------------------------------------------------------------------------------------


async def probe(rows: ProbeRows) -> None:
    """``dshim probe`` rows: the page's files, the store, ``--send-test`` into the log."""
    settings = rows.settings_as(WebchatSettings)
    me = identity_of(rows.bot.name, settings)

    async def identity() -> Identity:
        return Identity(name=me.name, id=me.id)

    async def page() -> tuple[ProbeResult, str]:
        sizes = [len(asset(name)) for name, _ in ASSETS.values()]
        return "ok", f"index.html, app.js, app.css present ({sum(sizes)} bytes)"

    async def send_test(conversation_id: str) -> str:
        mid = new_id()
        now = time.time()
        await rows.store.log_message(
            conversation_id,
            LoggedMessage(
                message_id=mid,
                author_id=me.id,
                author_name=me.name,
                author_bot=True,
                text=TEST_TEXT,
                at=now,
            ),
            now=now,
        )
        return mid

    await rows.standard(
        credentials="none needed: the page is served by dshim's local HTTP endpoint",
        identity=identity,
        checks=[Check("page", page)],
        send_test=send_test,
    )


#: key, settings, run, replay adapter, probe (see ChannelSpec).
CHANNEL = ChannelSpec("webchat", WebchatSettings, run, WebchatReplayAdapter, probe)

__all__ = ["CHANNEL", "WebchatSettings"]
