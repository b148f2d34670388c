"""The DSH HTTP RPC client: thin trio I/O over the envelopes of :mod:`.protocol`.

Theory of operation
-------------------
A :class:`DshRpc` is one bot's way to call its DSH host.  Every call is ``POST
{base_url}/api/<method>`` over one :class:`httpx.AsyncClient` (the bot's own unless one is
handed in; ``Authorization: Bearer <token>`` when ``[harness] token`` is set) with a
``client-request`` envelope under a fresh ``rpcId`` (:func:`new_rpc_id`);
:func:`~dshim.harness.dsh.protocol.parse_response` checks the echoed ``rpcId`` and
``result.ok`` of the answer and gives its ``value`` or raises
:class:`~dshim.harness.dsh.protocol.DshRpcError`.  :meth:`DshRpc.respond` answers an
approval or question (``POST /api/respond``, a ``client-response`` envelope) and reads its
receipt; it never raises, the turn goes on and the log says what happened.

Each call runs under its own deadline (``timeout_s``, 30 s unless the caller says
otherwise; 5 s for a cancelled question's answer), a trio cancel scope at the call, with
httpx's own timeouts behind it.  An answer is read up to :data:`ANSWER_MAX` (32 MiB); of a
non-2xx answer only its first 64 bytes, which
:func:`~dshim.harness.dsh.protocol.http_error` maps once (401/407 not logged in, 403 the
host refuses this client, split by whether it is on loopback, 404 the host too old).

This is the boundary for HTTP: every httpx exception is mapped here, once, so what leaves
a call is its value or a :class:`~dshim.errors.HarnessError` (``harness-timeout``,
``harness-connect-failed``, ``harness-response-invalid``, an HTTP or RPC error).
"""

from __future__ import annotations

import ipaddress
import urllib.parse
import uuid
from typing import Any

import httpx
import structlog
import trio

import dshim
from dshim.errors import HarnessError
from dshim.harness.dsh import protocol
from dshim.harness.httpio import release_response
from dshim.log import register_secret

__all__ = ["ANSWER_MAX", "DEFAULT_BASE_URL", "RPC_TIMEOUT_S", "DshRpc", "new_rpc_id"]

log = structlog.get_logger("dshim.harness.dsh")

DEFAULT_BASE_URL = "http://127.0.0.1:3080"
RPC_TIMEOUT_S = 30.0
#: The largest answer read from the host (a history page of big messages fits easily).
ANSWER_MAX = 32 * 1024 * 1024


class DshRpc:
    """Calls to one DSH host: ``call`` an RPC method, ``respond`` to an interaction."""

    def __init__(
        self, base_url: str, token: str | None, *, client: httpx.AsyncClient | None = None
    ) -> None:
        self.base_url = base_url
        self._token = token
        if token:
            register_secret(token)
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(connect=10.0, read=RPC_TIMEOUT_S, write=RPC_TIMEOUT_S, pool=10.0),
            headers={"user-agent": f"dshim/{dshim.__version__}"},
        )
        host = urllib.parse.urlsplit(base_url).hostname or ""
        self._loopback = host == "localhost" or _is_loopback(host)

    def _headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json", "accept": "application/json"}
        if self._token:
            headers["authorization"] = f"Bearer {self._token}"
        return headers

    async def _post(self, path: str, what: str, body: bytes, timeout_s: float) -> bytes:
        try:
            with trio.fail_after(timeout_s):
                request = self._client.build_request(
                    "POST", self.base_url + path, content=body, headers=self._headers()
                )
                resp = await self._client.send(request, stream=True)
                status = resp.status_code
                content = bytearray()
                chunks = resp.aiter_bytes()
                try:
                    async for chunk in chunks:
                        content += chunk
                        if len(content) > ANSWER_MAX:
                            raise HarnessError(
                                f"{what}: the DSH host's answer is larger than "
                                f"{ANSWER_MAX // (1024 * 1024)} MiB",
                                code="harness-response-invalid",
                            )
                        if not 200 <= status < 300 and len(content) >= 64:
                            break  # only the start of an error body is read
                finally:
                    await release_response(resp, chunks)
        except trio.TooSlowError as exc:
            raise HarnessError(
                f"{what}: the DSH host did not answer within {timeout_s:g} s",
                code="harness-timeout",
            ) from exc
        except httpx.TimeoutException as exc:
            raise HarnessError(
                f"{what}: the DSH host did not answer in time", code="harness-timeout"
            ) from exc
        except httpx.HTTPError as exc:
            raise HarnessError(
                f"cannot reach the DSH host at {self.base_url} ({type(exc).__name__})",
                code="harness-connect-failed",
            ) from exc
        if not 200 <= status < 300:
            raise protocol.http_error(what, status, bytes(content[:64]), loopback=self._loopback)
        return bytes(content)

    async def call(
        self,
        method: str,
        payload: dict[str, Any],
        *,
        rpc_id: str | None = None,
        timeout_s: float = RPC_TIMEOUT_S,
    ) -> Any:
        """One RPC: its ``value``, or a HarnessError."""
        rid = rpc_id or new_rpc_id()
        body = await self._post(
            f"/api/{method}", method, protocol.request_body(rid, method, payload), timeout_s
        )
        return protocol.parse_response(method, rid, body)

    async def respond(self, rpc_id: str, value: Any | None, *, cancelled: bool = False) -> None:
        """Answer an interaction (never raises: the turn goes on and reports what happens)."""
        try:
            body = await self._post(
                "/api/respond",
                "respond",
                protocol.respond_body(rpc_id, value, cancelled=cancelled),
                5.0 if cancelled else RPC_TIMEOUT_S,
            )
        except HarnessError as exc:
            log.warning("interaction_response_failed", error=str(exc), code=exc.code)
            return
        accepted, reason = protocol.parse_receipt(body)
        if accepted:
            log.info("interaction_response_accepted")
        else:
            log.warning("interaction_response_refused", reason=reason)

    async def aclose(self) -> None:
        """Close the HTTP client when it is our own."""
        if self._own_client:
            await self._client.aclose()


def new_rpc_id() -> str:
    """A fresh ``rpcId``: a call's, or a prompt's that names its turn among the events."""
    return f"dshim-{uuid.uuid4()}"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
