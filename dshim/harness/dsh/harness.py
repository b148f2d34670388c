"""The DSH adapter: a bot's DSH host, its sessions and turns, behind dshim's
:class:`~dshim.harness.base.Harness` interface.

Theory of operation
-------------------
The wire lives next door: calls go through :class:`~dshim.harness.dsh.rpc.DshRpc` (``POST
{base_url}/api/<method>``, every httpx exception mapped there, once), a turn's events come
from :class:`~dshim.harness.dsh.events.DshEvents` (the events websocket, or
``session.history`` polling when it is not there, and the approvals and questions asked
on it), and what they mean is :mod:`~dshim.harness.dsh.protocol`.  This module is the
session and turn logic on top; what leaves it is a turn event or a
:class:`~dshim.errors.HarnessError`.

Sessions: ``create_session`` finds the workspace (``workspace.list``; ``workspace.create``
when the path is not registered yet; the bot's ``workspace`` wins over ``[harness]
workspace``), then ``session.create`` (with ``agentPreset`` when configured) and names it
with ``session.rename`` (best effort).

Turns: a turn subscribes to its session's events before it sends its prompt, so it sees
every event of its turn (or, polling, notes the session's last ``seq`` first).  The prompt
is one ``session.prompt`` with ``mode: "queue"``, the prompt text and images, and
``clientTimeZone``; its ``rpcId`` identifies the turn among the session's events
(:class:`~dshim.harness.dsh.protocol.TurnTracker`).  A prompt is sent again only when the
host refused it: with its images left out (and a note) after ``attachment-error``, or to
a new session after ``session-not-found`` (the binding then maps to the new session);
after a timeout it is never sent again (``harness-result-uncertain``).  When the turn
ends, its open approvals and questions are withdrawn from the chat.

``/stop`` cancels the turn's generator: in a shielded scope it sends ``session.cancel
{keepInbox: true}`` and waits up to ``stop_timeout_s`` (10 s) for the ``turn/end``; a turn
that does not end in time is abandoned (logged ``turn_abandoned``, and the answer says so).
``/steer`` is ``session.prompt`` with ``mode: "steer"``.  ``/models`` is
``session.models`` (or ``llm.models`` without a session), ``/model``
``session.selectModel``.  ``history`` reads ``session.history`` pages for the core's quote
recovery.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import structlog
import trio

from dshim.errors import HarnessError
from dshim.harness.base import ModelInfo, ProbeItem, TurnContext
from dshim.harness.dsh import protocol
from dshim.harness.dsh.events import MUX_WAIT_S, POLL_INTERVAL_S, REPLY_TIMEOUT_S, DshEvents
from dshim.harness.dsh.protocol import DshRpcError, HistoryAnswer, TurnTracker
from dshim.harness.dsh.rpc import DEFAULT_BASE_URL, RPC_TIMEOUT_S, DshRpc, new_rpc_id
from dshim.model import HistoryPage, ImagePart, PromptPart, TurnEvent
from dshim.prompt import prompt_text

if TYPE_CHECKING:
    import httpx

    from dshim.config import HarnessConfig

__all__ = ["DEFAULT_BASE_URL", "DshHarness"]

log = structlog.get_logger("dshim.harness.dsh")

DESCRIBE_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 10.0
ABANDONED_NOTE = (
    "The DSH host did not stop this answer within {s} s; dshim stopped waiting for it"
    " (the host may still finish it there)."
)


class DshHarness:
    """A bot's DSH host: HTTP RPC calls, one events websocket, sessions bound per chat."""

    kind = "dsh"

    def __init__(
        self,
        cfg: HarnessConfig,
        *,
        bot: str,
        workspace: str | None = None,
        client: httpx.AsyncClient | None = None,
        poll_interval_s: float = POLL_INTERVAL_S,
        mux_wait_s: float = MUX_WAIT_S,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
    ) -> None:
        self.bot = bot
        self.base_url = (cfg.base_url or DEFAULT_BASE_URL).rstrip("/")
        token = cfg.token.get() if cfg.token is not None else None
        base = workspace or cfg.workspace or cfg.cwd or os.getcwd()
        self.workspace = os.path.abspath(os.path.expanduser(base))
        self.agent_preset = cfg.agent_preset
        self.stop_timeout_s = stop_timeout_s
        self._rpc = DshRpc(self.base_url, token, client=client)
        self._events = DshEvents(
            self._rpc,
            bot=bot,
            token=token,
            poll_interval_s=poll_interval_s,
            mux_wait_s=mux_wait_s,
            reply_timeout_s=reply_timeout_s,
        )
        self._workspace_id: str | None = None
        self._workspace_lock = trio.Lock()
        self.host_version: str | None = None
        #: Bound session ids the host lost -> the sessions that replaced them.
        self._aliases: dict[str, str] = {}

    def attach(self, nursery: trio.Nursery) -> None:
        """Give the harness the nursery its events websocket runs in (see open_harness)."""
        self._events.attach(nursery)

    # -- calls -------------------------------------------------------------------------

    async def call(
        self,
        method: str,
        payload: dict[str, Any],
        *,
        rpc_id: str | None = None,
        timeout_s: float = RPC_TIMEOUT_S,
    ) -> Any:
        """One RPC: its ``value``, or a HarnessError (see :class:`~.rpc.DshRpc`)."""
        return await self._rpc.call(method, payload, rpc_id=rpc_id, timeout_s=timeout_s)

    async def _respond(self, rpc_id: str, value: Any | None, *, cancelled: bool = False) -> None:
        """Answer an interaction (never raises: the turn goes on and reports what happens)."""
        await self._rpc.respond(rpc_id, value, cancelled=cancelled)

    # -- sessions ------------------------------------------------------------------------

    async def _workspace(self) -> str:
        async with self._workspace_lock:
            if self._workspace_id is None:
                self._workspace_id = await self._find_workspace() or await self._create_workspace()
            return self._workspace_id

    async def _find_workspace(self) -> str | None:
        """The id ``workspace.list`` gives our path (compared normalized), if any."""
        return protocol.workspace_id(await self.call("workspace.list", {}), self.workspace)

    async def _create_workspace(self) -> str:
        try:
            created = await self.call("workspace.create", {"path": self.workspace})
        except DshRpcError:
            # Registered meanwhile (another client), under a spelling we did not match:
            # look once more before giving up.
            found = await self._find_workspace()
            if found is None:
                raise
            return found
        ws = created.get("workspace") if isinstance(created, dict) else None
        wid = ws.get("workspaceId") if isinstance(ws, dict) else None
        if not isinstance(wid, str):
            raise HarnessError(
                "workspace.create: the DSH host sent no workspaceId",
                code="harness-response-invalid",
            )
        log.info("workspace_created", path=self.workspace)
        return wid

    async def create_session(self, *, title: str | None) -> str:
        payload: dict[str, Any] = {"workspaceId": await self._workspace()}
        if self.agent_preset:
            payload["agentPreset"] = self.agent_preset
        value = await self.call("session.create", payload)
        sid = value.get("sessionId") if isinstance(value, dict) else None
        if not isinstance(sid, str) or not sid:
            raise HarnessError(
                "session.create: the DSH host sent no sessionId", code="harness-response-invalid"
            )
        if title:
            try:
                await self.call("session.rename", {"sessionId": sid, "title": title})
            except HarnessError as exc:
                log.info("session_rename_failed", error=str(exc))
        return sid

    # -- turns ---------------------------------------------------------------------------

    async def prompt(
        self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext
    ) -> AsyncGenerator[TurnEvent, None]:
        try:
            async with aclosing(self._turn(self._sid(session_id), parts, ctx)) as events:
                async for event in events:
                    yield event
            return
        except _SessionGone:
            pass
        # The host lost the session (deleted in its UI, a new host): the conversation goes
        # on in a new one.  The prompt was refused, so sending it again cannot duplicate it.
        new = await self.create_session(title=None)
        self._aliases[session_id] = new
        log.warning("session_replaced", reason="the DSH host no longer knows the session")
        async with aclosing(self._turn(new, parts, ctx)) as events:
            async for event in events:
                yield event

    def _sid(self, session_id: str) -> str:
        return self._aliases.get(session_id, session_id)

    async def _turn(
        self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext
    ) -> AsyncGenerator[TurnEvent, None]:
        text = prompt_text(parts)
        images = [p for p in parts if isinstance(p, ImagePart)]
        rpc_id = new_rpc_id()
        owner = object()
        streamed = await self._events.subscribe(session_id, owner)
        tracker: TurnTracker | None = None
        accepted = False
        try:
            if not streamed:
                log.info("turn_events_polled", reason="events mux unavailable")
                try:
                    after = await self._events.latest_seq(session_id)
                except DshRpcError as exc:
                    if exc.rpc_code == "session-not-found":
                        raise _SessionGone from exc
                    raise
            else:
                log.info("turn_events_streamed")
                after = -1.0
            tracker = TurnTracker(rpc_id, after_seq=after)
            await self._send_prompt(session_id, rpc_id, text, images)
            accepted = True
            async for event in self._events.follow(session_id, tracker, owner):
                yield event
            assert tracker.end is not None
            yield tracker.end
        finally:
            self._events.withdraw_open(session_id, owner)
            if accepted and tracker is not None and not tracker.done:
                with trio.CancelScope(shield=True):
                    if not await self._stop(session_id, tracker, owner):
                        ctx.notes.append(ABANDONED_NOTE.format(s=round(self.stop_timeout_s)))
            self._events.unsubscribe(session_id, owner)

    async def _send_prompt(
        self, session_id: str, rpc_id: str, text: str, images: list[ImagePart]
    ) -> None:
        """``session.prompt`` (mode queue).  A refusal of the images (the model cannot read
        them) sends it once more without them, with a note, under the same ``rpcId``
        (refused: nothing ran).  A timeout is never followed by a second send."""
        try:
            try:
                await self._prompt_call(session_id, rpc_id, text, images)
            except DshRpcError as exc:
                if not images or exc.rpc_code != "attachment-error":
                    raise
                log.info("prompt_images_refused", images=len(images))
                note = (
                    f"[{len(images)} image(s) attached by the user were left out: the "
                    "selected model cannot read images]"
                )
                await self._prompt_call(session_id, rpc_id, f"{text}\n\n{note}", [])
        except HarnessError as exc:
            if isinstance(exc, DshRpcError) and exc.rpc_code == "session-not-found":
                raise _SessionGone from exc
            if exc.code != "harness-timeout":
                raise
            # Sent, outcome unknown: never sent again (it would run twice).
            raise HarnessError(
                "the DSH host did not confirm the message in time; it may still be "
                "answered there (check the DSH UI, or /stop) before you send it again",
                code="harness-result-uncertain",
            ) from exc

    async def _prompt_call(
        self, session_id: str, rpc_id: str, text: str, images: list[ImagePart]
    ) -> None:
        await self.call(
            "session.prompt",
            {
                "sessionId": session_id,
                "mode": "queue",
                "content": protocol.content_blocks(text, images),
                "clientTimeZone": _time_zone(),
            },
            rpc_id=rpc_id,
        )

    async def _stop(self, session_id: str, tracker: TurnTracker, owner: object) -> bool:
        """/stop or shutdown: ``session.cancel``, then wait (bounded) for the turn's end.
        False when the host did not end the turn in time (it is abandoned)."""
        started = trio.current_time()
        with trio.move_on_after(self.stop_timeout_s):
            try:
                await self.call("session.cancel", {"sessionId": session_id, "keepInbox": True})
                async for _ in self._events.follow(session_id, tracker, owner):
                    pass
            except HarnessError as exc:
                log.warning("turn_cancel_failed", error=str(exc))
                return False
        if tracker.done:
            log.info("turn_cancelled", ms=round((trio.current_time() - started) * 1000))
            return True
        log.warning("turn_abandoned", seconds=self.stop_timeout_s)
        return False

    async def cancel(self, session_id: str) -> None:
        try:
            await self.call(
                "session.cancel", {"sessionId": self._sid(session_id), "keepInbox": True}
            )
        except HarnessError as exc:
            log.info("turn_cancel_failed", error=str(exc))

    async def steer(self, session_id: str, text: str) -> bool:
        try:
            await self.call(
                "session.prompt",
                {
                    "sessionId": self._sid(session_id),
                    "mode": "steer",
                    "content": [{"type": "text", "text": text}],
                    "clientTimeZone": _time_zone(),
                },
            )
        except DshRpcError as exc:
            if exc.rpc_code in ("no-active-turn", "not-running", "session-idle"):
                raise HarnessError(
                    "nothing is running in the DSH session to steer", code=exc.rpc_code
                ) from exc
            raise
        return True

    # -- models --------------------------------------------------------------------------

    async def list_models(self, session_id: str | None) -> list[ModelInfo] | None:
        if session_id is not None:
            value = await self.call("session.models", {"sessionId": self._sid(session_id)})
        else:
            value = await self.call("llm.models", {})
        current = value.get("current") if isinstance(value, dict) else None
        cur = (current.get("provider"), current.get("model")) if isinstance(current, dict) else None
        out = []
        groups = value.get("groups") if isinstance(value, dict) else None
        for group in groups if isinstance(groups, list) else []:
            if not isinstance(group, dict):
                continue
            provider = group.get("id")
            for m in group.get("models") or []:
                if isinstance(m, dict) and isinstance(m.get("id"), str):
                    out.append(
                        ModelInfo(
                            id=f"{provider}/{m['id']}",
                            name=m.get("name") if isinstance(m.get("name"), str) else None,
                            current=cur == (provider, m["id"]),
                        )
                    )
        return out

    async def select_model(self, session_id: str, model: str) -> str:
        models = await self.list_models(session_id) or []
        wanted = model.strip()
        chosen = next((m for m in models if m.id == wanted), None) or next(
            (m for m in models if m.id.split("/", 1)[-1].casefold() == wanted.casefold()), None
        )
        if chosen is None:
            raise HarnessError(
                f"unknown model {wanted!r}; /models lists the choices", code="model-unknown"
            )
        provider, _, name = chosen.id.partition("/")
        await self.call(
            "session.selectModel",
            {"sessionId": self._sid(session_id), "provider": provider, "model": name},
        )
        return chosen.id

    # -- history -------------------------------------------------------------------------

    async def history(self, session_id: str, *, before: str | None, limit: int) -> HistoryPage:
        """One ``session.history`` page (newest first): the completed turns' answers."""
        payload: dict[str, Any] = {"sessionId": self._sid(session_id), "maxMessages": limit}
        if before is not None:
            payload["beforeSeq"] = float(before) if "." in before else int(before)
        value = await self.call("session.history", payload, timeout_s=5.0)
        events, more = protocol.page_events(value)
        if not events:
            return HistoryPage(items=[], before=None)
        oldest = min(e["seq"] for e in events)
        if before is not None and oldest >= float(before):
            raise HarnessError(
                "session.history: the page cursor did not advance", code="harness-response-invalid"
            )
        answers: list[HistoryAnswer] = protocol.completed_answers(events)
        times = [t for e in events if (t := protocol.event_time(e)) is not None]
        return HistoryPage(
            items=[(a.text, a.at) for a in answers],
            before=str(oldest) if more else None,
            oldest_at=min(times) if times else None,
        )

    # -- health --------------------------------------------------------------------------

    async def check(self) -> str:
        value = await self.call("host.describe", {}, timeout_s=DESCRIBE_TIMEOUT_S)
        version = value.get("version") if isinstance(value, dict) else None
        self.host_version = version if isinstance(version, str) else None
        return f"DSH host {self.host_version or '(version unknown)'} at {self.base_url}"

    async def probe_details(self) -> list[ProbeItem]:
        """Rows for ``dshim probe`` after :meth:`check` (host and version): workspace, models."""
        items = []
        exists = _is_dir(self.workspace)
        try:
            value = await self.call("workspace.list", {})
        except HarnessError as exc:
            items.append(ProbeItem(name="workspace", result="fail", detail=str(exc)))
        else:
            listed = protocol.workspace_id(value, self.workspace) is not None
            where = "registered on the host" if listed else "created on first use"
            items.append(
                ProbeItem(
                    name="workspace",
                    result="ok" if exists else "warn",
                    detail=f"{self.workspace} ({where})"
                    + ("" if exists else "; the directory does not exist here"),
                )
            )
        try:
            models = await self.list_models(None) or []
        except HarnessError as exc:
            items.append(ProbeItem(name="models", result="fail", detail=str(exc)))
        else:
            shown = ", ".join(m.id for m in models[:8])
            items.append(
                ProbeItem(
                    name="models",
                    result="ok" if models else "warn",
                    detail=f"{len(models)}: {shown}" if models else "the host lists no models",
                )
            )
        return items

    async def aclose(self) -> None:
        await self._rpc.aclose()


class _SessionGone(Exception):
    """``session.prompt`` answered ``session-not-found``: nothing was started."""


def _time_zone() -> str:
    """The IANA zone of this machine (``TZ``, else /etc/localtime's link), else UTC."""
    tz = os.environ.get("TZ", "").lstrip(":")
    if tz and "/" in tz:
        return tz
    try:
        link = os.readlink("/etc/localtime")
    except OSError:
        return time.tzname[0] if time.tzname[0] == "UTC" else "UTC"
    _, sep, name = link.partition("zoneinfo/")
    return name if sep and name else "UTC"


def _is_dir(path: str) -> bool:
    """One local stat, on the trio thread on purpose (a worker thread is not worth it)."""
    return os.path.isdir(path)
