"""The WhatsApp Web channel (a personal account linked as a device): run, login, probe,
replay.

Theory of operation
-------------------
A bot is one linked device of a WhatsApp account.  ``dshim login BOT`` links it (a QR
code, redrawn as WhatsApp rotates it, or a pair code with ``--phone``); whatsmeow keeps
the device's keys in the session database ``<data dir>/whatsapp_web/<bot>.db`` (0600).
``run`` refuses to start without one (AuthError naming ``dshim login``), then:

- **connection**: :meth:`Session.keep_connected` runs the engine's connection and, when
  it ends or cannot be made, reconnects with the shared backoff (1-30 s with jitter);
  within a connection whatsmeow reconnects on its own after a drop (``Disconnected``,
  then ``Connected``).  The bot counts as started once the first ``Connected`` arrived
  and the account answered ``get_me`` (CHANNELS.md §3: started means authenticated).
- **ends that need a person**: logged out from the phone, or the session revoked
  (``LoggedOut``, a ``ConnectFailure`` of a logout kind, or a QR code offered while
  serving: the keys are no longer valid) stop the bot with one AuthError saying to run
  ``dshim login`` again; another client connecting with the same keys (``StreamReplaced``:
  a second ``dshim serve`` with the same data directory) and WhatsApp refusing the client
  (outdated, temporarily banned) stop it with a FatalChannelError.  No retry loop.
- **receiving**: messages arrive in WhatsApp's order through the engine (one at a time:
  whatsmeow's handler waits).  Each is mapped (:mod:`.protocol`), accepted by the
  pipeline (dedup by message id, durable inbox), recorded in the message index, and only
  then acknowledged: the engine lets whatsmeow's handler return, which sends the ack.  A
  message the pipeline did not take (the bot is stopping) is never acknowledged, so
  WhatsApp delivers it again at the next connect (whatsmeow serves it from its
  decrypted-event buffer) and dedup drops what was already taken.
- **answers**: :mod:`.render` (a reply quoting the message, composing presence, edits).
- **shutdown**: ``host.serve`` lets running answers finish within the grace, then the
  connection is closed (``Disconnect`` and ``Stop``, bounded) and the engine's handlers
  are let go.

The connection's state is kept in the store (cursor ``connection``: state, since, the
linked number and the serving process), which ``dshim probe`` reads: a probe never opens
a second connection with the session's keys while a ``dshim serve`` may hold it
(WhatsApp would throw the serving one out).
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import structlog
import trio

from dshim.channels.base import (
    BotHost,
    ChannelSettings,
    ChannelSpec,
    ChannelStore,
    Check,
    FixtureError,
    Identity,
    Inbound,
    LoginContext,
    ProbeResult,
    ProbeRows,
    ReceivesEvents,
    ReplaySource,
    data_dir_of,
    login_phone_of,
)
from dshim.channels.kit import Backoff
from dshim.channels.kit.index import record_inbound
from dshim.channels.kit.qr import render_qr
from dshim.channels.kit.retry import until_ok
from dshim.channels.whatsapp_web import protocol
from dshim.channels.whatsapp_web.engine import (
    Account,
    Connected,
    ConnectFailed,
    Disconnected,
    EngineEvent,
    Incoming,
    KeepAliveLost,
    LoggedOut,
    NeonizeEngine,
    Paired,
    QrCode,
    Replaced,
    WaEngine,
    saved_account,
    session_path,
)
from dshim.channels.whatsapp_web.protocol import BotIdentity, user_of
from dshim.channels.whatsapp_web.render import WhatsAppWebOutbound, split
from dshim.errors import (
    AuthError,
    ChannelError,
    ConfigError,
    FatalChannelError,
    TransportError,
    single_error,
)
from dshim.model import Fetcher, InboundMessage, Skip

log = structlog.get_logger("dshim.whatsapp_web")

#: The store cursor with the connection's state (for ``dshim probe``).
STATE_CURSOR = "connection"
#: Messages mapped but not yet accepted; more wait in whatsmeow (backpressure).
MESSAGE_QUEUE = 16
#: Connecting and closing are bounded.
DISCONNECT_WAIT_S = 5.0
#: The whole wait for a QR scan or a pair code.
LOGIN_DEADLINE_S = 300.0
TEST_MESSAGE = "dshim connection test"
_PHONE = re.compile(r"^\+?[0-9][0-9 ().-]{5,24}$")
#: ``ConnectFailure`` reasons after which reconnecting cannot help.
FATAL_FAILURES = {
    "CLIENT_OUTDATED": "WhatsApp refuses this client version: upgrade dshim[whatsapp-web] "
    "(neonize)",
    "TEMP_BANNED": "WhatsApp banned the account temporarily",
    "BAD_USER_AGENT": "WhatsApp refused the client's user agent",
}


class WhatsAppWebSettings(ChannelSettings):
    """The ``[[bots]]`` keys of a WhatsApp Web bot (none is required: ``dshim login``
    links the account)."""

    #: The device's name under the phone's Linked devices.
    device_name: str = "dshim"
    #: A scripted engine at this websocket URL instead of neonize (the fake,
    #: ``python -m dshim.testing.fakes.whatsapp_web``): tests and benches only.
    engine_url: str | None = None

    def __post_init__(self) -> None:
        self.device_name = self.device_name.strip()
        if not self.device_name or len(self.device_name) > 64:
            raise ValueError("device_name: expected 1 to 64 characters")
        if self.engine_url is not None and not self.engine_url.startswith(("ws://", "wss://")):
            raise ValueError(f"engine_url: expected a ws:// or wss:// URL, got {self.engine_url!r}")


def login_hint(bot: str) -> str:
    return f"run `dshim login {bot}` to link the account again"


def make_engine(settings: WhatsAppWebSettings, data_dir: Path | None, bot: str) -> WaEngine:
    """The bot's engine (create it inside the bot's trio run)."""
    if settings.engine_url is not None:
        from dshim.channels.whatsapp_web.wire import WireEngine

        return WireEngine(settings.engine_url)
    if data_dir is None:
        raise ConfigError(f"bots.{bot}: a WhatsApp Web bot needs a data directory")
    return NeonizeEngine(session_path(data_dir, bot), device_name=settings.device_name)


async def linked_account(
    settings: WhatsAppWebSettings, data_dir: Path | None, bot: str
) -> Account | None:
    """The account the session database holds (None: not linked); with a scripted
    engine the engine says it once connected (this returns a placeholder)."""
    if settings.engine_url is not None:
        return Account(jid="")
    if data_dir is None:
        return None
    return await trio.to_thread.run_sync(saved_account, session_path(data_dir, bot))


# --- the running account ------------------------------------------------------------------


class Session:
    """One bot's account while it runs: the connection kept up, its events sorted into
    messages (for the reader) and lifecycle (handled here; the ends raise)."""

    def __init__(
        self,
        engine: WaEngine,
        *,
        bot: str,
        store: ChannelStore | None,
        clock: Callable[[], float],
        backoff: Backoff | None = None,
    ) -> None:
        self.engine = engine
        self.bot = bot
        self.store = store
        self.clock = clock
        self.backoff = backoff or Backoff()
        self.connected = trio.Event()
        self.stopping = False
        self.account: Account | None = None
        self.connects = 0
        self._in, self._out = trio.open_memory_channel[Incoming](MESSAGE_QUEUE)

    async def keep_connected(self) -> None:
        """Run the connection; reconnect with backoff whenever it ends or fails."""
        while not self.stopping:
            try:
                self.connects += 1
                await self.engine.connect()
                reason = "ended"
            except TransportError as exc:
                reason = str(exc)[:300]
            if self.stopping:
                return
            delay = self.backoff.next_delay()
            log.warning("connection_lost", reason=reason, retry_in_s=round(delay, 1))
            await self._state("reconnecting")
            await trio.sleep(delay)

    async def dispatch(self) -> None:
        """Every engine event: messages to the reader, the rest handled (or raised)."""
        async with closing_events(self.engine) as events:
            async for event in events:
                if isinstance(event, Incoming):
                    await self._in.send(event)
                else:
                    await self._lifecycle(event)

    async def _lifecycle(self, event: EngineEvent) -> None:
        if isinstance(event, Connected):
            self.backoff.reset()
            log.info("connected", connects=self.connects)
            self.connected.set()
            await self._state("connected")
        elif isinstance(event, Disconnected):
            log.info("disconnected")
            await self._state("reconnecting")
        elif isinstance(event, KeepAliveLost):
            log.info("keepalive_lost", errors=event.errors)
        elif isinstance(event, LoggedOut):
            await self._state("logged_out")
            log.error("logged_out", reason=event.reason)
            raise AuthError(
                f"WhatsApp logged this device out ({event.reason or 'from the phone'}): "
                f"{login_hint(self.bot)}"
            )
        elif isinstance(event, QrCode):
            await self._state("logged_out")
            raise AuthError(
                f"WhatsApp no longer knows this device's session: {login_hint(self.bot)}"
            )
        elif isinstance(event, Replaced):
            await self._state("replaced")
            raise FatalChannelError(
                "another client connected with this WhatsApp session (a second dshim serve "
                "with the same data directory?): this one stops"
            )
        elif isinstance(event, ConnectFailed):
            fatal = FATAL_FAILURES.get(event.reason)
            if fatal is not None:
                await self._state("refused")
                raise FatalChannelError(f"{fatal} ({event.reason}: {event.message[:200]})")
            log.warning("connect_failed", reason=event.reason, detail=event.message[:200])
        elif isinstance(event, Paired):
            log.info("paired", error=event.error or None)

    async def _state(self, state: str) -> None:
        if self.store is None:
            return
        account = self.account
        value = {
            "state": state,
            "since": self.clock(),
            "number": user_of(account.jid) if account else "",
            "push_name": account.push_name if account else "",
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        try:
            await self.store.set_cursor(STATE_CURSOR, json.dumps(value))
        except Exception as exc:  # the state is for the probe: never the bot's end
            log.info("state_not_saved", error=str(exc)[:200])

    async def read(self, rt: Inbound, decode: Callable[[bytes], InboundMessage | Skip]) -> None:
        """The reader: accept each message in order, index it, then acknowledge it."""
        async for incoming in self._out:
            item = decode(incoming.raw)
            verdict = await rt.accept(item, incoming.raw)
            if not verdict.confirm:
                continue  # not taken (stopping): never acknowledged, delivered again
            if self.store is not None:
                await record_inbound(self.store, item, now=self.clock())
            incoming.taken.set()

    async def close(self, *, final_state: str | None = None) -> None:
        """End the connection (bounded), then let the engine's handlers go; with
        ``final_state``, the state the probe reads afterwards."""
        self.stopping = True
        with trio.CancelScope(shield=True), trio.move_on_after(DISCONNECT_WAIT_S):
            try:
                await self.engine.disconnect()
            except ChannelError as exc:
                log.info("disconnect_failed", error=str(exc)[:200])
            if final_state is not None and self.account is not None:
                await self._state(final_state)
        self.engine.close()
        self._in.close()


@asynccontextmanager
async def closing_events(engine: WaEngine) -> AsyncIterator[AsyncIterator[EngineEvent]]:
    """The engine's events, the iterator closed on the way out (also when an event
    raised: the bot's end)."""
    events = engine.events()
    try:
        yield events
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            with trio.CancelScope(shield=True):
                await aclose()


def mapper(engine: WaEngine, me: BotIdentity) -> Callable[[bytes], InboundMessage | Skip]:
    """The mapping of one stored or live event, its media downloaded through the engine
    inside the turn."""

    def decode(raw: bytes) -> InboundMessage | Skip:
        def media(field: str, size: int | None) -> Fetcher:
            async def fetch(limit: int) -> bytes:
                if size is not None and size > limit:
                    raise ChannelError(f"the {field} is larger than {limit} bytes")
                data = await engine.download(raw, field)
                if len(data) > limit:
                    raise ChannelError(f"the {field} is larger than {limit} bytes")
                return data

            return fetch

        return protocol.map_event(raw, bot_id=me.id, me=me, media=media)

    return decode


async def run(
    host: BotHost,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    rng: random.Random | None = None,
) -> None:
    """Run one WhatsApp Web bot: connect, open the pipeline, read until shutdown."""
    settings = host.settings_as(WhatsAppWebSettings)
    name = host.bot.name
    data_dir = data_dir_of(host)
    if await linked_account(settings, data_dir, name) is None:
        raise AuthError(f"WhatsApp Web bot {name!r} is not linked: run `dshim login {name}`")
    engine = make_engine(settings, data_dir, name)
    session = Session(
        engine, bot=name, store=host.store, clock=host.clock, backoff=Backoff(rng=rng)
    )
    with single_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.dispatch)
            nursery.start_soon(session.keep_connected)
            ended: str | None = None  # an error's own state is written where it is raised
            try:
                await session.connected.wait()
                account = await until_ok("account", engine.me)
                if account is None:
                    raise AuthError(
                        f"WhatsApp Web bot {name!r} is not linked: run `dshim login {name}`"
                    )
                session.account = account
                await session._state("connected")
                me = BotIdentity(account.jid, account.lid, account.push_name)
                log.info("bot_authenticated", number=me.id, lid=user_of(me.lid), name=me.name)
                host.capture_identity({"jid": me.jid, "lid": me.lid, "name": me.name})
                outbound = WhatsAppWebOutbound(engine, clock=host.clock)
                decode = mapper(engine, me)
                async with host.open_runtime(
                    outbound=outbound, bot_id=me.id, decode_raw=decode
                ) as rt:
                    task_status.started()
                    await host.serve(rt, functools.partial(session.read, rt, decode))
                ended = "stopped"
            finally:
                await session.close(final_state=ended)
                nursery.cancel_scope.cancel()


# --- login --------------------------------------------------------------------------------


def phone_digits(phone: str) -> str:
    """``+49 151 ...`` as WhatsApp wants it for a pair code: digits with country code."""
    if not _PHONE.match(phone.strip()):
        raise ConfigError(f"--phone: expected a number with country code, got {phone!r}")
    return re.sub(r"\D", "", phone)


async def login(ctx: LoginContext) -> int:
    """``dshim login BOT``: link the account by QR (or pair code with ``--phone``)."""
    settings = ctx.settings_as(WhatsAppWebSettings)
    name = ctx.bot.name
    phone = login_phone_of(ctx)
    digits = phone_digits(phone) if phone else None
    if settings.engine_url is None:
        found = await trio.to_thread.run_sync(saved_account, session_path(ctx.data_dir, name))
        if found is not None:
            ctx.say(
                f"{name}: already linked to +{user_of(found.jid)} ({found.push_name or 'no name'})."
                " To link another account, remove this device under Linked devices on the "
                f"phone (the bot stops and asks for a login), then run dshim login {name} again."
            )
            return 0
    engine = make_engine(settings, ctx.data_dir, name)
    outcome = 1
    with trio.move_on_after(LOGIN_DEADLINE_S) as waited, single_error():
        async with trio.open_nursery() as nursery:

            async def connection() -> None:
                try:
                    await engine.connect()
                except TransportError as exc:
                    ctx.say(f"{name}: cannot reach WhatsApp: {exc}")
                    nursery.cancel_scope.cancel()

            nursery.start_soon(connection)
            try:
                outcome = await _link(ctx, engine, digits)
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(DISCONNECT_WAIT_S):
                    try:
                        await engine.disconnect()
                    except ChannelError:
                        pass
                engine.close()
                nursery.cancel_scope.cancel()
    if waited.cancelled_caught:
        ctx.say(f"{name}: no scan within {LOGIN_DEADLINE_S:.0f} s; run dshim login {name} again")
    return outcome


async def _link(ctx: LoginContext, engine: WaEngine, digits: str | None) -> int:
    async with closing_events(engine) as events:
        return await _link_events(ctx, engine, events, digits)


async def _link_events(
    ctx: LoginContext, engine: WaEngine, events: AsyncIterator[EngineEvent], digits: str | None
) -> int:
    name = ctx.bot.name
    codes = 0
    async for event in events:
        if isinstance(event, QrCode):
            codes += 1
            if digits is not None:
                if codes == 1:
                    code = await engine.pair_phone(digits)
                    ctx.say(
                        f"{name}: on the phone open Linked devices (iPhone: WhatsApp > Settings;"
                        " Android: the ⋮ menu) > Link a device > Link with phone number "
                        f"instead, and enter {code}"
                    )
                continue
            ctx.say(render_qr(event.code))
            ctx.say(
                f"{name}: scan it with the phone: Linked devices (iPhone: WhatsApp > "
                "Settings; Android: the ⋮ menu) > Link a device"
                + (" (a new code: the last one expired)" if codes > 1 else "")
            )
        elif isinstance(event, Paired):
            if event.error:
                ctx.say(f"{name}: linking failed: {event.error}")
                return 1
            ctx.say(f"{name}: linked to +{user_of(event.jid)}; finishing...")
        elif isinstance(event, Connected):
            account = await engine.me()
            if account is None:
                continue  # connected, not linked yet: the QR follows
            ctx.say(
                f"{name}: linked to +{user_of(account.jid)} ({account.push_name or 'no name'}); "
                "the session is saved in the data directory (whatsapp_web/, readable only "
                "by you). Start the bot with dshim serve."
            )
            return 0
        elif isinstance(event, (LoggedOut, Replaced, ConnectFailed)):
            ctx.say(f"{name}: WhatsApp ended the login ({type(event).__name__}).")
            return 1
        elif isinstance(event, Incoming):
            event.taken.set()  # nothing runs during a login; the history is not replayed
    return 1


# --- replay -------------------------------------------------------------------------------


class ReplayAdapter(ReceivesEvents):
    """Decodes fixture events (neonize ``Message`` events as protobuf JSON) with the real
    mapping; ``received`` indexes accepted user messages as the live reader does."""

    def __init__(self, fx: ReplaySource) -> None:
        bot = dict(fx.bot_info)
        jid = str(bot.get("jid") or "")
        if "@" not in jid:
            raise FixtureError(
                'whatsapp_web fixtures need "bot": {"jid": "<number>@s.whatsapp.net", '
                '"lid": "<lid>@lid"}'
            )
        self.me = BotIdentity(jid, str(bot.get("lid") or ""), str(bot.get("name") or ""))
        self.bot_id = self.me.id
        self.bot_username: str | None = None
        self._store = fx.store
        self._clock = fx.clock or (lambda: 0.0)

    def decode(self, raw: bytes) -> InboundMessage | Skip:
        return protocol.map_event(raw, bot_id=self.me.id, me=self.me)

    async def received(self, item: InboundMessage | Skip, raw: bytes) -> None:
        if self._store is not None:
            await record_inbound(self._store, item, now=self._clock())

    #: The chunks an answer is delivered in (the renderer's own split).
    split = staticmethod(split)


# --- probe --------------------------------------------------------------------------------


class State(msgspec.Struct):
    state: str = ""
    since: float = 0.0
    number: str = ""
    push_name: str = ""
    host: str = ""
    pid: int = 0


def _serving(state: State) -> bool:
    """A ``dshim serve`` on this host holds the connection (its process is alive)."""
    if state.state not in ("connected", "reconnecting") or state.host != socket.gethostname():
        return False
    try:
        os.kill(state.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def probe(rows: ProbeRows) -> None:
    """``dshim probe`` rows: the linked account (read from the session, no connection),
    the connection's state as the running ``dshim serve`` reports it, the store, and the
    send test (only when no ``dshim serve`` holds the connection)."""
    settings = rows.settings_as(WhatsAppWebSettings)
    name = rows.bot.name
    data_dir = data_dir_of(rows)
    where = (
        f"engine {settings.engine_url}"
        if settings.engine_url is not None
        else f"session {session_path(data_dir, name) if data_dir else '(no data directory)'}"
    )

    async def stored_state() -> State | None:
        raw = await rows.store.get_cursor(STATE_CURSOR)
        if not raw:
            return None
        try:
            return msgspec.json.decode(raw, type=State)
        except msgspec.DecodeError:
            return None

    async def with_connection(fn: Callable[[WaEngine], Any]) -> Any:
        """Open a connection of the probe's own for ``fn`` (only when none is served)."""
        engine = make_engine(settings, data_dir, name)
        # The probe's own connection keeps no state: it must not overwrite the served one.
        session = Session(engine, bot=name, store=None, clock=time.time)
        with single_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.dispatch)
                nursery.start_soon(session.keep_connected)
                try:
                    with trio.fail_after(15):
                        await session.connected.wait()
                    return await fn(engine)
                finally:
                    await session.close()
                    nursery.cancel_scope.cancel()

    async def identity() -> Identity:
        if settings.engine_url is not None:
            account = await with_connection(lambda e: e.me())
        else:
            account = await linked_account(settings, data_dir, name)
        if account is None:
            raise AuthError(f"not linked: run `dshim login {name}`")
        return Identity(
            name=f"{account.push_name or 'no push name'} (+{user_of(account.jid)})",
            id=user_of(account.jid),
        )

    async def connection() -> tuple[ProbeResult, str]:
        state = await stored_state()
        if state is None:
            return "warn", "never connected: start dshim serve"
        age = max(0.0, time.time() - state.since)
        detail = f"{state.state} for {age:.0f} s (dshim serve on {state.host}, pid {state.pid})"
        if state.state == "logged_out":
            return "fail", f"{detail}: {login_hint(name)}"
        if state.state == "replaced":
            return "fail", (
                f"{detail}: another client used this session; stop the other dshim serve "
                "(one data directory, one serve), then start this one again"
            )
        if state.state == "refused":
            return "fail", f"{detail}: WhatsApp refused the client (see the serve's log)"
        serving = _serving(state)
        if state.state == "connected" and serving:
            return "ok", detail
        if state.state == "reconnecting" and serving:
            return "warn", f"{detail}: the connection dropped, dshim serve reconnects"
        return "warn", f"{detail}; dshim serve is not running"

    async def send_test(conversation_id: str) -> str:
        state = await stored_state()
        if settings.engine_url is None and state is not None and _serving(state):
            raise ChannelError(
                "dshim serve holds the connection (a second one would throw it out): send "
                "the test from the chat instead, or stop dshim serve first"
            )
        sent: str = await with_connection(lambda e: e.send(conversation_id, TEST_MESSAGE))
        return sent

    await rows.standard(
        credentials=where,
        identity=identity,
        checks=[Check("connection", connection)],
        send_test=send_test,
    )


#: key, settings, run, replay adapter, probe, login (see ChannelSpec).
CHANNEL = ChannelSpec(
    "whatsapp_web", WhatsAppWebSettings, run, ReplayAdapter, probe, login_fn=login
)

__all__ = ["CHANNEL", "WhatsAppWebSettings"]
