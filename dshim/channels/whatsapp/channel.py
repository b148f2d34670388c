"""The WhatsApp channel (Cloud API): the webhook, the reader, the replay adapter, the probe.

``run`` authenticates (``GET /<PHONE_NUMBER_ID>``, retried through network errors and
5xx; 190 / 401 stop the bot for good), opens the pipeline, mounts the webhook at
``/hooks/<bot>`` on the local HTTP endpoint — a *public* mount: Meta cannot send the
endpoint's token, the handler authenticates every POST by its signature — and counts
as started.

The webhook handler (on the endpoint's task) answers the verification GET, checks the
signature of a POST on its raw bytes (401 and nothing else when it is bad or missing),
cuts the body into its messages and statuses and hands them, as one job, to the bot's
one reader (:meth:`Webhook.read`, under ``host.serve``), then waits: the reader
accepts each message in body order (pipeline steps 1-6: dedup key and inbox written),
records it in the message index, handles the statuses, and only then the handler
answers 200.  A bot that is stopping answers 503, so Meta delivers the body again after
the restart and the pipeline's dedup drops what was already accepted.  One reader keeps
one order for all requests, and it is the bot's task, so a request that disconnects in
the middle never cuts a message half-accepted.

A group message that names the bot neither by mention nor by ``context.from`` but
quotes an id the index holds as one of the bot's answers is a reply to the bot: it is
accepted addressed, its stored body marked so (``protocol.quoting_bot``) for a restart.

Statuses are not messages: a ``failed`` one is logged with its error code, counted, and
marks the index entry of our message ``undelivered``; a ``revoke`` marks the user's
indexed message ``deleted``.  A 190 from a send stops the bot (AuthError out of ``run``).
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
import trio
from msgspec import UNSET

from dshim.channels.base import (
    BotConfig,
    BotHost,
    ChannelSettings,
    ChannelSpec,
    ChannelStore,
    Check,
    ExpandsEvents,
    FixtureError,
    HttpHandler,
    HttpRequest,
    HttpResponse,
    Identity,
    Inbound,
    ProbeResult,
    ProbeRows,
    ReceivesEvents,
    Relay,
    ReplaySource,
    Secret,
    relay_of,
    settings_of,
)
from dshim.channels.kit.index import record_inbound, reference_from
from dshim.channels.kit.retry import until_ok
from dshim.channels.whatsapp import models as m
from dshim.channels.whatsapp import protocol
from dshim.channels.whatsapp.client import CALL_TIMEOUT, DEFAULT_API_BASE, USER_AGENT, GraphClient
from dshim.channels.whatsapp.protocol import BodyError, BotIdentity, Decoded, Part
from dshim.channels.whatsapp.render import WhatsAppOutbound, split
from dshim.channels.whatsapp.util import close_jobs
from dshim.errors import (
    AuthError,
    ChannelError,
    FencedError,
    StoreError,
    TransportError,
    single_error,
)
from dshim.model import InboundMessage, Loader, ReplyReference, Skip
from dshim.net.http import count_request, map_httpx_errors, open_http

log = structlog.get_logger("dshim.whatsapp")

#: Webhook jobs waiting for the reader (more requests wait: backpressure, Meta retries).
JOB_QUEUE = 32
#: Relayed bodies read per store call, and how long the runner waits for a relay
#: notification before it reads again (notifications are a wake-up, the table the truth).
RELAY_BATCH = 16
RELAY_POLL_S = 5.0
TEST_MESSAGE = "dshim connection test"
WINDOW_S = 24 * 3600.0
_PHONE_ID = re.compile(r"^\d{5,20}$")


class WhatsAppSettings(ChannelSettings):
    """The ``[[bots]]`` keys of a WhatsApp Cloud API bot."""

    #: The business phone number's id (WhatsApp Manager -> API setup), not the number.
    phone_number_id: str
    #: A system-user access token with whatsapp_business_messaging (``"${WHATSAPP_TOKEN}"``).
    access_token: Secret
    #: The Meta app's secret: webhook POSTs are signed with it (X-Hub-Signature-256).
    app_secret: Secret
    #: What you typed as "Verify token" when registering the callback URL.
    verify_token: Secret
    #: The Graph API base with its version (the fake in tests).
    api_base: str = DEFAULT_API_BASE

    def __post_init__(self) -> None:
        self.phone_number_id = self.phone_number_id.strip()
        if not _PHONE_ID.match(self.phone_number_id):
            raise ValueError(
                "phone_number_id: expected the numeric phone number id from WhatsApp Manager"
            )
        for name in ("access_token", "app_secret", "verify_token"):
            value: Secret = getattr(self, name)
            if not value.get().strip():
                raise ValueError(f"{name}: must not be empty")
        if not self.api_base.startswith(("http://", "https://")):
            raise ValueError(
                f"api_base: expected an http:// or https:// URL, got {self.api_base!r}"
            )
        self.api_base = self.api_base.rstrip("/")


# --- the message index --------------------------------------------------------------------


def index_loader(
    store: ChannelStore | None, me: BotIdentity, clock: Callable[[], float]
) -> protocol.LoaderFactory:
    """Quote loaders reading the conversation's message index (the Cloud API has no
    fetch-by-id): a known entry is the snapshot, a deleted one ``deleted``, an unknown
    id ``not-delivered``."""

    def make(conversation: str, message_id: str, from_bot: bool) -> Loader:
        async def load() -> ReplyReference | None:
            if store is None:
                return ReplyReference(message_id=message_id, unavailable_reason="not-delivered")
            entries = await store.indexed(conversation, message_id, now=clock())
            ref = reference_from(entries, message_id=message_id, bot_id=me.id)
            if ref is None:
                return ReplyReference(message_id=message_id, unavailable_reason="not-delivered")
            if ref.author_id == me.id:
                ref.author_name = me.name
            return ref

        return load

    return make


@dataclass
class Indexer:
    """What the channel writes to the message index of both directions as events pass."""

    store: ChannelStore
    clock: Callable[[], float]
    outbound: WhatsAppOutbound | None = None
    failed_statuses: dict[int, int] = field(default_factory=dict)

    async def before(self, decoded: Decoded) -> None:
        """Before the pipeline: a user's deletion marks their indexed message deleted."""
        if decoded.revoked is not None:
            conversation, wamid = decoded.revoked
            found = await self.store.update_outbound(
                conversation, wamid, now=self.clock(), state="deleted"
            )
            log.info("message_revoked", message_id=wamid, indexed=found)
        item = decoded.item
        if isinstance(item, InboundMessage) and self.outbound is not None:
            self.outbound.user_wrote(item.conversation_id)

    async def quotes_bot(self, item: InboundMessage | Skip) -> bool:
        """A group message not addressed otherwise whose quoted id is one of the bot's
        indexed answers (its ``context.from`` did not name the business number): it
        is addressed to the bot, as a reply to it."""
        if not isinstance(item, InboundMessage) or item.addressed or item.reply_to is None:
            return False
        quoted = item.reply_to.message_id
        if not isinstance(quoted, str) or not quoted:
            return False
        entries = await self.store.indexed(item.conversation_id, quoted, now=self.clock())
        return len(entries) == 1 and not entries[0].inbound

    async def record(self, item: InboundMessage | Skip) -> None:
        """An accepted user message enters the index (once, also when redelivered)."""
        await record_inbound(self.store, item, now=self.clock())

    async def status(self, status: m.Status | None) -> None:
        """A status of one of our sends: ``failed`` is logged, counted, and marks it."""
        if status is None:
            log.info("status_dropped", reason="malformed")
            return
        if status.status != "failed":
            return
        first = status.errors[0] if status.errors else None
        code = first.code if first is not None else None
        key = code if code is not None else 0
        self.failed_statuses[key] = self.failed_statuses.get(key, 0) + 1
        marked = False
        for conversation in dict.fromkeys(
            c for c in (status.recipient_user_id, status.recipient_id) if c
        ):
            if await self.store.update_outbound(
                conversation, status.id, now=self.clock(), state="undelivered"
            ):
                marked = True
            if code == protocol.WINDOW_CLOSED and self.outbound is not None:
                self.outbound.closed_by_status(conversation)
        # On /metrics: dshim_platform_requests_total{method="delivery_failed",status=<code>}
        count_request("delivery_failed", code if code is not None else "unknown")
        log.warning(
            "delivery_failed",
            message_id=status.id,
            code=code,
            title=(first.title or first.message or "")[:200] if first is not None else None,
            indexed=marked,
            failed_total=self.failed_statuses[key],
        )


# --- the webhook ---------------------------------------------------------------------------


@dataclass
class Job:
    """One webhook POST for the reader: its parts, and how it ended."""

    parts: list[Part]
    done: trio.Event = field(default_factory=trio.Event)
    accepted: bool = False


def _text(status: int, text: str) -> HttpResponse:
    return HttpResponse(status, text.encode(), "text/plain; charset=utf-8")


class Webhook:
    """One running bot's webhook: the handler (endpoint tasks) and the reader (bot task)."""

    def __init__(
        self,
        *,
        me: BotIdentity,
        settings: WhatsAppSettings,
        client: GraphClient,
        outbound: WhatsAppOutbound,
        store: ChannelStore,
        clock: Callable[[], float],
        bot: str,
        relay: Relay | None = None,
    ) -> None:
        self.me = me
        self.bot = bot
        self._secret = settings.app_secret.get().encode()
        self._verify = settings.verify_token.get()
        self.outbound = outbound
        self.indexer = Indexer(store, clock, outbound)
        self._loader = index_loader(store, me, clock)
        self._fetcher = client.fetcher
        self._jobs_in, self._jobs_out = trio.open_memory_channel[Job](JOB_QUEUE)
        self.closed = False
        self._relay = relay

    def decode(self, raw: bytes) -> Decoded:
        return protocol.decode_event(raw, self.me, loader=self._loader, fetcher=self._fetcher)

    def decode_raw(self, raw: bytes) -> InboundMessage | Skip:
        """The inbox's decoder (after a restart)."""
        return self.decode(raw).item

    # -- the endpoint's side -------------------------------------------------------------

    async def handle(self, request: HttpRequest) -> HttpResponse:
        """``GET``: the verification handshake; ``POST``: a signed notification."""
        with structlog.contextvars.bound_contextvars(bot=self.bot, channel="whatsapp"):
            if request.method != "POST":
                return verification(request, self._verify)
            refused = unsigned(request, self._secret)
            return refused if refused is not None else await self._notification(request)

    async def _notification(self, request: HttpRequest) -> HttpResponse:
        parts = parts_of(request.body)
        if not parts:
            return _text(200, "ok")
        if self.closed:
            return await self._stopping(request.body)
        job = Job(parts)
        try:
            await self._jobs_in.send(job)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return await self._stopping(request.body)
        await job.done.wait()
        if not job.accepted:
            return await self._stopping(request.body)
        return _text(200, "ok")

    async def _stopping(self, body: bytes) -> HttpResponse:
        """The bot stops (a restart, a handover, a lost lease): with a shared store the
        body goes to the relay for whichever instance runs the bot next; else 503 and
        Meta delivers it again after the restart (the pipeline's dedup drops what was
        already accepted)."""
        if self._relay is None:
            return _text(503, "restarting")
        return await relayed(self._relay, body)

    # -- the reader (the bot's task) ------------------------------------------------------

    async def read(self, rt: Inbound) -> None:
        """Take every request's parts in one order; stop the bot on a rejected token."""
        try:
            with single_error():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch_fatal)
                    if self._relay is not None:
                        nursery.start_soon(self._drain, self._relay)
                    async for job in self._jobs_out:
                        try:
                            job.accepted = await self._take(rt, job)
                        finally:
                            job.done.set()
        finally:
            self.close()

    async def _watch_fatal(self) -> None:
        await self.outbound.fatal.wait()
        error = self.outbound.fatal_error or AuthError("WhatsApp rejected the access token")
        log.error("token_rejected", code=190, detail="the access token expired or was revoked")
        raise error

    async def _drain(self, relay: Relay) -> None:
        """Take the bodies other instances received for this bot (the relay), oldest
        first, each as one job of the one reader; a body goes from the relay once its
        messages are accepted (a fenced write: a lost lease cannot take it)."""
        while True:
            try:
                batch = await relay.pending(RELAY_BATCH)
            except StoreError as exc:
                if isinstance(exc, FencedError):
                    raise
                log.warning("relay_unavailable", error=str(exc)[:300])
                await trio.sleep(RELAY_POLL_S)
                continue
            for item in batch:
                parts = parts_of(item.body)
                if parts:
                    job = Job(parts)
                    try:
                        await self._jobs_in.send(job)
                    except (trio.ClosedResourceError, trio.BrokenResourceError):
                        return
                    await job.done.wait()
                    if not job.accepted:
                        return  # stopping: the body stays for the next runner
                    log.info("relayed_webhook_taken", seq=item.seq, parts=len(parts))
                await relay.done(item.seq)
            if len(batch) < RELAY_BATCH:
                with trio.move_on_after(RELAY_POLL_S):
                    await relay.wait()

    async def _take(self, rt: Inbound, job: Job) -> bool:
        for part in job.parts:
            if part.kind == "status":
                await self.indexer.status(part.status)
                continue
            if part.kind == "malformed":
                await rt.accept(Skip(reason="malformed", detail=part.detail), part.raw or None)
                continue
            decoded = self.decode(part.raw)
            await self.indexer.before(decoded)
            raw = part.raw
            if await self.indexer.quotes_bot(decoded.item):
                # The inbox keeps the verdict (a restart decodes the stored body again).
                raw = protocol.quoting_bot(raw)
                decoded = self.decode(raw)
            verdict = await rt.accept(decoded.item, raw)
            if not verdict.confirm:
                return False
            await self.indexer.record(decoded.item)
        return True

    def close(self) -> None:
        """No more jobs: queued ones are answered 503 (Meta delivers them again)."""
        self.closed = True
        close_jobs(self._jobs_in, self._jobs_out, lambda job: job.done.set())


# --- the webhook's checks, shared with the relay -----------------------------------------


def verification(request: HttpRequest, verify_token: str) -> HttpResponse:
    """A request that is not a POST: the verification handshake (``GET``/``HEAD``)."""
    if request.method in ("GET", "HEAD"):
        challenge = protocol.challenge_answer(request.query, verify_token)
        if challenge is None:
            log.info("verification_refused")
            return _text(403, "forbidden")
        log.info("verification_answered")
        return _text(200, challenge)
    return HttpResponse(405, b"", "text/plain; charset=utf-8", headers=(("allow", "GET, POST"),))


def unsigned(request: HttpRequest, secret: bytes) -> HttpResponse | None:
    """The 401 for a POST whose signature is missing or wrong (checked on its raw bytes),
    None when Meta signed it."""
    header = request.header(protocol.SIGNATURE_HEADER)
    if protocol.signature_ok(secret, request.body, header):
        return None
    log.warning("webhook_refused", reason="missing signature" if not header else "bad signature")
    return _text(401, "bad signature")


def parts_of(body: bytes) -> list[Part]:
    """A signed body's messages and statuses, in order; an unreadable one is one
    malformed part (a retry would carry the same bytes: the pipeline's malformed drop,
    answered 200), its bytes kept so a capture keeps the dropped body."""
    try:
        return protocol.split_body(body)
    except BodyError as exc:
        return [Part("malformed", body, detail=str(exc)[:300])]


async def relayed(relay: Relay, body: bytes) -> HttpResponse:
    """Keep a signed body in the relay for the instance that runs the bot: 200 once it is
    stored (Meta does not send it again), 503 when the store cannot take it (it does)."""
    try:
        await relay.put(body)
    except StoreError as exc:
        log.warning("relay_failed", error=str(exc)[:300])
        return _text(503, "store unavailable")
    log.info("webhook_relayed", bytes=len(body))
    return _text(200, "ok")


def relay_handler(bot: BotConfig, relay: Relay) -> HttpHandler:
    """``/hooks/<bot>`` on an instance that does not run ``bot`` (a shared store): the
    same verification and signature check as the bot's own webhook; a signed body with
    messages or statuses goes to the relay, and the instance holding the bot's lease
    takes it (woken by the store's notification)."""
    settings = settings_of(bot, WhatsAppSettings)
    secret = settings.app_secret.get().encode()
    verify = settings.verify_token.get()

    async def handle(request: HttpRequest) -> HttpResponse:
        with structlog.contextvars.bound_contextvars(bot=bot.name, channel="whatsapp"):
            if request.method != "POST":
                return verification(request, verify)
            refused = unsigned(request, secret)
            if refused is not None:
                return refused
            if not parts_of(request.body):
                return _text(200, "ok")  # nothing to run (a self-test, an empty change)
            return await relayed(relay, request.body)

    return handle


async def run(
    host: BotHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run one WhatsApp bot: authenticate, mount the webhook, accept until shutdown."""
    settings = host.settings_as(WhatsAppSettings)
    async with open_http(settings.api_base, user_agent=USER_AGENT, timeout=CALL_TIMEOUT) as http:
        client = GraphClient(http, settings.access_token.get(), settings.phone_number_id)
        info = await until_ok("phone number", client.phone_number)
        me = BotIdentity(settings.phone_number_id, info.display_phone_number, info.verified_name)
        log.info(
            "bot_authenticated",
            phone_number_id=me.id,
            display_phone_number=me.display_phone_number,
            name=me.name,
        )
        # What the replay adapter reads from a capture's ``bot`` (no credential).
        host.capture_identity(
            {
                "phone_number_id": me.id,
                "display_phone_number": me.display_phone_number,
                "verified_name": me.name,
            }
        )
        outbound = WhatsAppOutbound(client, clock=host.clock)
        hook = Webhook(
            me=me,
            settings=settings,
            client=client,
            outbound=outbound,
            store=host.store,
            clock=host.clock,
            bot=host.bot.name,
            relay=relay_of(host),
        )
        try:
            async with host.open_runtime(
                outbound=outbound, bot_id=me.id, decode_raw=hook.decode_raw
            ) as rt:
                host.mount("", hook.handle, public=True)
                log.info("webhook_mounted", path=f"/hooks/{host.bot.name}")
                task_status.started()
                await host.serve(rt, functools.partial(hook.read, rt))
        finally:
            hook.close()


# --- replay -------------------------------------------------------------------------------


class ReplayAdapter(ExpandsEvents, ReceivesEvents):
    """Decodes fixture events (webhook POST bodies) with the real mapping code.

    ``expand`` cuts a body into its messages and statuses, as the live webhook does;
    ``received`` writes the message index as the live reader does (statuses, revokes,
    accepted user messages).
    """

    def __init__(self, fx: ReplaySource) -> None:
        bot = dict(fx.bot_info)
        pnid = str(bot.get("phone_number_id") or fx.bot_id or "")
        if not _PHONE_ID.match(pnid):
            raise FixtureError(
                'whatsapp fixtures need "bot": {"phone_number_id": "<digits>", '
                '"display_phone_number": "..."}'
            )
        display = bot.get("display_phone_number") or fx.bot_username
        name = bot.get("verified_name")
        self.me = BotIdentity(pnid, str(display) if display else None, str(name) if name else None)
        self.bot_id = pnid
        self.bot_username: str | None = None
        clock = fx.clock or (lambda: 0.0)
        self._loader = index_loader(fx.store, self.me, clock)
        self._indexer = Indexer(fx.store, clock) if fx.store is not None else None

    def expand(self, raw: bytes) -> list[bytes]:
        try:
            parts = protocol.split_body(raw)
        except BodyError:
            return [raw]  # decoded on its own: a malformed drop
        return [p.raw for p in parts] or [raw]

    def decode(self, raw: bytes) -> InboundMessage | Skip:
        return protocol.decode_event(raw, self.me, loader=self._loader).item

    async def received(self, item: InboundMessage | Skip, raw: bytes) -> None:
        if self._indexer is None:
            return
        try:
            parts = protocol.split_body(raw)
        except BodyError:
            return
        for part in parts:
            if part.kind == "status":
                await self._indexer.status(part.status)
            else:
                await self._indexer.before(protocol.decode_event(part.raw, self.me))
        if isinstance(item, InboundMessage) and await self._indexer.quotes_bot(item):
            # As the live reader does: it decodes the marked body, which is addressed.
            item.addressed = True
            if item.reply_to is not None:
                item.reply_to.author_id = self.me.id
                item.reply_to.author_name = self.me.name or UNSET
        await self._indexer.record(item)

    #: The chunks an answer is delivered in (the renderer's own split).
    split = staticmethod(split)


# --- probe ----------------------------------------------------------------------------------


def local_base(listen: str) -> str:
    """The URL of the local endpoint at ``[http] listen`` (a wildcard host is loopback)."""
    host, _, port = listen.strip().rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


#: A notification with no change: accepted by a working route, changes nothing.
SELF_TEST_BODY = b'{"object":"whatsapp_business_account","entry":[]}'


async def probe(rows: ProbeRows) -> None:
    """``dshim probe`` rows: the number, the webhook route of the running ``dshim serve``
    (verification and a signed self-test POST), the store, the send test."""
    settings = rows.settings_as(WhatsAppSettings)
    name = rows.bot.name
    listen = rows.http_listen
    secret = settings.app_secret.get().encode()
    async with open_http(settings.api_base, user_agent=USER_AGENT, timeout=CALL_TIMEOUT) as http:
        client = GraphClient(http, settings.access_token.get(), settings.phone_number_id)

        async def identity() -> Identity:
            info = await client.phone_number()
            label = info.verified_name or info.display_phone_number or settings.phone_number_id
            quality = f", quality {info.quality_rating}" if info.quality_rating else ""
            return Identity(
                name=f"{label} ({info.display_phone_number or 'no display number'}{quality})",
                id=settings.phone_number_id,
            )

        async def route() -> tuple[ProbeResult, str]:
            register = (
                f"register https://<your public host>/hooks/{name} as the callback URL in "
                "the Meta app (a reverse proxy or tunnel in front of dshim), subscribed to "
                "the messages field"
            )
            if listen is None:
                return "fail", "[http] enabled = false: WhatsApp webhooks need the endpoint"
            url = f"{local_base(listen)}/hooks/{name}"
            challenge = f"dshim-probe-{int(time.time())}"
            params = {
                "hub.mode": "subscribe",
                "hub.verify_token": settings.verify_token.get(),
                "hub.challenge": challenge,
            }
            try:
                with map_httpx_errors("webhook route"):
                    resp = await http.get(url, params=params)
            except TransportError:
                return (
                    "warn",
                    f"nothing listens on {local_base(listen)}: start `dshim serve`; {register}",
                )
            if resp.status_code == 200 and resp.text == challenge:
                return "ok", f"/hooks/{name} answers the verification on {listen}; {register}"
            if resp.status_code == 403:
                return (
                    "fail",
                    f"/hooks/{name} refused the verify token: another dshim listens there",
                )
            return "fail", f"/hooks/{name} is not mounted on {listen} (HTTP {resp.status_code})"

        async def signature() -> tuple[ProbeResult, str]:
            good = protocol.signature_ok(
                secret, SELF_TEST_BODY, protocol.sign(secret, SELF_TEST_BODY)
            )
            bad = protocol.signature_ok(secret, SELF_TEST_BODY, None)
            if not good or bad:
                return "fail", "the signature check does not work"
            if listen is None:
                return "ok", "a signed body is accepted, an unsigned one refused (in-process)"
            url = f"{local_base(listen)}/hooks/{name}"
            try:
                with map_httpx_errors("signature self-test"):
                    signed = await http.post(
                        url,
                        content=SELF_TEST_BODY,
                        headers={
                            protocol.SIGNATURE_HEADER: protocol.sign(secret, SELF_TEST_BODY),
                            "content-type": "application/json",
                        },
                    )
                    unsigned = await http.post(
                        url, content=SELF_TEST_BODY, headers={"content-type": "application/json"}
                    )
            except TransportError:
                return "ok", (
                    "a signed body is accepted, an unsigned one refused (in-process: "
                    "dshim serve is not running)"
                )
            if signed.status_code == 200 and unsigned.status_code == 401:
                return "ok", "the running route accepts a signed POST and refuses an unsigned one"
            return "fail", (
                f"the running route answered {signed.status_code} to a signed POST and "
                f"{unsigned.status_code} to an unsigned one (expected 200 and 401): "
                "is app_secret the one dshim serve uses?"
            )

        async def send_test(conversation_id: str) -> str:
            entries = await rows.store.outbound(conversation_id, now=time.time())
            last = max((e.sent_at for e in entries if e.inbound), default=None)
            if last is None or time.time() - last > WINDOW_S:
                rows.add(
                    "24-hour window",
                    "warn",
                    "the user's last message is older than 24 hours (or unknown): WhatsApp "
                    "accepts only template messages until they write again",
                )
            payload = protocol.text_payload(conversation_id, TEST_MESSAGE, reply_to=None)
            try:
                return await client.send(payload)
            except protocol.WindowClosed as exc:
                raise ChannelError(
                    f"outside the 24-hour window: the user must write to the bot first ({exc})"
                ) from exc

        await rows.standard(
            credentials=(
                f"phone_number_id {settings.phone_number_id}, access token, app secret "
                "and verify token present"
            ),
            identity=identity,
            checks=[Check("webhook route", route), Check("signature self-test", signature)],
            send_test=send_test,
        )


#: key, settings, run, replay adapter, probe (see ChannelSpec).
CHANNEL = ChannelSpec(
    "whatsapp", WhatsAppSettings, run, ReplayAdapter, probe, relay_fn=relay_handler
)

__all__ = ["CHANNEL", "WhatsAppSettings"]
