"""OpenAI-compatible Chat Completions adapter (DeepSeek, OpenAI, vLLM, llama.cpp, Ollama).

Theory of operation
-------------------
dshim owns the conversation: a session is just an id (``oai-<hex>``) and the context of a
turn is rebuilt from the store's transcript of the bound session — the newest
``max_context_messages`` rows (the current prompt included), the ``system_prompt``
first.  The current prompt is sent as the current parts, so images can ride along as
``image_url`` data-URL parts when ``vision = true`` (otherwise a message with images is
refused with a clear reply and nothing is sent).  The pipeline writes the prompt's own row
once part of the answer is shown; should the newest row already be this very prompt (role
``user``, same text), it is recognised and not sent twice.

One turn is one ``POST {base_url}/chat/completions`` with ``stream: true`` over the bot's
single shared :class:`httpx.AsyncClient`.  The body is read as Server-Sent Events by the
hand-written, sans-IO :class:`SseDecoder`: ``data:`` lines (multi-line data joined with
``\\n``), ``:`` comment lines (keep-alives; they do *not* count as progress for the idle
watchdog), blank-line event boundaries, ``\\r\\n``/``\\r``/``\\n`` line ends, and the
``[DONE]`` sentinel.  Each data payload is one ``chat.completion.chunk``:
``delta.content`` becomes text, ``delta.reasoning_content`` (preferred) or
``delta.reasoning`` becomes thinking, a trailing ``usage`` chunk is logged, and a payload
``{"error": ...}`` after HTTP 200 ends the turn with that error, keeping the partial text.

Failures before the first token — HTTP 429 or 5xx, a connection error, a stream that
ends before any token — are retried, at most 3 tries in all, waiting ``Retry-After``
when the server sends it (else 1 s, 2 s).  After the first token nothing is retried (the
user already sees text): the turn ends with one clear error.  Other HTTP errors map to a
sentence naming the cause (401 key, 402 balance, 404 model/endpoint ...).  The API key
only ever travels in the ``Authorization`` header and is scrubbed from any error text.
Every httpx exception is mapped here, at the adapter's boundary: what leaves the adapter
is a :class:`~dshim.errors.HarnessError` or a turn event.

``/stop`` cancels the turn's generator; the response is closed in a shielded, bounded
scope (servers abort generation on disconnect) and the partial answer stays.

``/models`` is ``GET {base_url}/models``; ``/model`` is stored per session (in the store's
cursor table, so it survives restarts).
"""

from __future__ import annotations

import base64
import codecs
import email.utils
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
import structlog
import trio

import dshim
from dshim.backoff import Backoff
from dshim.errors import HarnessError
from dshim.harness.base import ModelInfo, ProbeItem, TurnContext
from dshim.harness.httpio import release_response
from dshim.log import register_secret
from dshim.model import (
    ImagePart,
    PromptPart,
    TextDelta,
    Thinking,
    TurnEnd,
    TurnEvent,
)
from dshim.prompt import prompt_text

if TYPE_CHECKING:
    from dshim.config import HarnessConfig
    from dshim.store.base import Store

log = structlog.get_logger("dshim.harness.openai")

MAX_TRIES = 3
RETRY_BASE_S = 1.0
RETRY_AFTER_MAX_S = 60.0
RETRY_BACKOFF_MAX_S = 30.0
IDLE_DATA_TIMEOUT_S = 600.0
CLOSE_TIMEOUT_S = 2.0
ERROR_BODY_MAX = 8192
MODEL_CURSOR = "openai.model:"

IMAGES_REFUSED = (
    "This model is configured without image input (vision = false), so your message was "
    "not sent. Send it again as text only, or ask the operator to enable vision."
)


# --- SSE, sans-IO ----------------------------------------------------------------------------


class SseItem(msgspec.Struct, frozen=True):
    """One dispatched event (``data``) or one comment line (``comment`` set)."""

    data: str | None = None
    comment: str | None = None


class SseDecoder:
    """Bytes in, :class:`SseItem` out.  No I/O, no clock.

    Follows the WHATWG event-stream rules that matter for chat completions: lines end with
    CRLF, LF or CR (also split across chunks); ``:``-lines are comments; ``data:`` values
    (one optional space after the colon removed) accumulate and are joined with ``\\n``
    when a blank line ends the event; other fields are ignored.
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._tail = ""
        self._cr = False
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[SseItem]:
        text = self._utf8.decode(chunk)
        if self._cr and text.startswith("\n"):
            text = text[1:]  # the LF of a CRLF split across chunks
        self._cr = False
        buf = self._tail + text
        out: list[SseItem] = []
        start = 0
        n = len(buf)
        i = 0
        while i < n:
            c = buf[i]
            if c == "\n" or c == "\r":
                self._line(buf[start:i], out)
                if c == "\r":
                    if i + 1 < n and buf[i + 1] == "\n":
                        i += 1
                    elif i + 1 == n:
                        self._cr = True
                start = i + 1
            i += 1
        self._tail = buf[start:]
        return out

    def close(self) -> list[SseItem]:
        """End of stream: an unterminated last event is still dispatched (lenient)."""
        out: list[SseItem] = []
        if self._tail:
            self._line(self._tail, out)
            self._tail = ""
        if self._data:
            out.append(SseItem(data="\n".join(self._data)))
            self._data = []
        return out

    def _line(self, line: str, out: list[SseItem]) -> None:
        if not line:
            if self._data:
                out.append(SseItem(data="\n".join(self._data)))
                self._data = []
            return
        if line.startswith(":"):
            out.append(SseItem(comment=line[1:].strip()))
            return
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)


# --- wire views ------------------------------------------------------------------------------


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: Any = None
    reasoning: Any = None
    refusal: str | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


class _Message(msgspec.Struct):
    content: str | None = None
    reasoning_content: Any = None
    reasoning: Any = None


class _FullChoice(msgspec.Struct):
    message: _Message | None = None
    finish_reason: str | None = None


class _Completion(msgspec.Struct):
    choices: list[_FullChoice] | None = None
    error: Any = None


class _ModelEntry(msgspec.Struct):
    id: str


class _ModelList(msgspec.Struct):
    data: list[_ModelEntry] = msgspec.field(default_factory=list)


class _ErrorBody(msgspec.Struct):
    error: Any = None


_CHUNK = msgspec.json.Decoder(_Chunk)
_COMPLETION = msgspec.json.Decoder(_Completion)
_MODELS = msgspec.json.Decoder(_ModelList)
_ERROR_BODY = msgspec.json.Decoder(_ErrorBody)


class _StreamState:
    """What one SSE response has told us so far."""

    def __init__(self) -> None:
        self.done = False
        self.finish: str | None = None
        self.error: str | None = None


class _Retry(Exception):
    """A failure before the first token that may be retried after ``delay_s``."""

    def __init__(self, reason: str, delay_s: float | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.delay_s = delay_s


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        message = error.get("message") or error.get("msg") or error.get("type") or "unknown error"
        code = error.get("code")
        text = str(message)
        return f"{text} ({code})" if code not in (None, "") and str(code) not in text else text
    if isinstance(error, str) and error:
        return error
    return "unknown error"


def _thinking_of(delta: _Delta | _Message) -> str | None:
    for value in (delta.reasoning_content, delta.reasoning):
        if isinstance(value, str) and value:
            return value
    return None


_FINISH_ERRORS = {
    "length": ("max_tokens", "the answer was cut off: the model reached its output limit"),
    "content_filter": ("refusal", "the provider's content filter stopped the answer"),
    "insufficient_system_resource": ("error", "the provider ran out of capacity; try again later"),
}


def _end_for(finish_reason: str | None) -> TurnEnd:
    if finish_reason in (None, "stop", "tool_calls", "function_call"):
        return TurnEnd()
    if finish_reason in _FINISH_ERRORS:
        reason, error = _FINISH_ERRORS[finish_reason]
        return TurnEnd(stop_reason=reason, error=error)
    return TurnEnd(stop_reason=finish_reason)


# --- the adapter -----------------------------------------------------------------------------


class OpenAIHarness:
    """Chat Completions over SSE; the transcript in dshim's store is the conversation."""

    kind = "openai"

    def __init__(
        self,
        cfg: HarnessConfig,
        *,
        bot: str,
        store: Store | None,
        client: httpx.AsyncClient | None = None,
        retry_base_s: float = RETRY_BASE_S,
        idle_timeout_s: float = IDLE_DATA_TIMEOUT_S,
    ) -> None:
        if not cfg.base_url or not cfg.model:
            raise HarnessError(
                'harness.base_url and harness.model are required when kind = "openai"',
                code="config",
            )
        self.bot = bot
        self.base_url = cfg.base_url.rstrip("/")
        self.model = cfg.model
        self.system_prompt = cfg.system_prompt
        self.max_context_messages = max(1, cfg.max_context_messages)
        self.vision = cfg.vision
        self._key = cfg.api_key.get() if cfg.api_key is not None else None
        if self._key:
            register_secret(self._key)
        self._store = store
        self.retry_base_s = retry_base_s
        self.idle_timeout_s = idle_timeout_s
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(connect=10.0, read=120.0, write=30.0, pool=10.0),
            headers={"user-agent": f"dshim/{dshim.__version__}"},
        )
        self._models: dict[str, str] = {}

    # -- helpers -----------------------------------------------------------------------

    def _headers(self, *, stream: bool = False) -> dict[str, str]:
        headers = {"accept": "text/event-stream" if stream else "application/json"}
        if self._key:
            headers["authorization"] = f"Bearer {self._key}"
        return headers

    def _scrub(self, text: str) -> str:
        text = " ".join(text.split())
        if self._key:
            text = text.replace(self._key, "***")
        return text[:400]

    def _http_error(self, status: int, body: bytes) -> HarnessError:
        detail = ""
        try:
            err = _ERROR_BODY.decode(body).error
            if err is not None:
                detail = _error_text(err)
        except (msgspec.DecodeError, msgspec.ValidationError):
            detail = body[:200].decode("utf-8", "replace")
        detail = self._scrub(detail)
        suffix = f": {detail}" if detail else ""
        if status == 401:
            msg = f"the model API rejected the API key (HTTP 401); check [harness] api_key{suffix}"
        elif status == 402:
            msg = f"the model API account has insufficient balance (HTTP 402){suffix}"
        elif status == 403:
            msg = f"the model API refused access (HTTP 403){suffix}"
        elif status == 404:
            msg = f"the model API has no such endpoint or model (HTTP 404){suffix}"
        elif status in (400, 422):
            msg = f"the model API rejected the request (HTTP {status}){suffix}"
        else:
            msg = f"the model API failed (HTTP {status}){suffix}"
        return HarnessError(msg, code=f"http-{status}")

    async def _get_json(self, path: str) -> bytes:
        try:
            resp = await self._client.get(self.base_url + path, headers=self._headers())
        except httpx.TimeoutException as exc:
            raise HarnessError(f"{self.base_url}{path}: no answer in time", code="timeout") from exc
        except httpx.HTTPError as exc:
            raise HarnessError(
                self._scrub(f"cannot reach {self.base_url}{path}: {type(exc).__name__} {exc}"),
                code="connect-failed",
            ) from exc
        if resp.status_code != 200:
            raise self._http_error(resp.status_code, resp.content[:ERROR_BODY_MAX])
        return resp.content

    async def _model_ids(self) -> list[str]:
        body = await self._get_json("/models")
        try:
            return [m.id for m in _MODELS.decode(body).data]
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HarnessError(
                f"{self.base_url}/models: not an OpenAI model list", code="bad-response"
            ) from exc

    async def model_for(self, session_id: str | None) -> str:
        """The model a session uses: its /model choice, else the configured one."""
        if session_id is None:
            return self.model
        chosen = self._models.get(session_id)
        if chosen is None and self._store is not None:
            chosen = await self._store.get_cursor(self.bot, MODEL_CURSOR + session_id)
            if chosen:
                self._models[session_id] = chosen
        return chosen or self.model

    async def build_messages(
        self, session_id: str, parts: Sequence[PromptPart]
    ) -> list[dict[str, Any]]:
        """System prompt, the session's recent transcript, then the current parts."""
        messages: list[dict[str, Any]] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        current = prompt_text(parts)
        if self._store is not None and self.max_context_messages > 1:
            rows = await self._store.transcript_page(
                session_id, before_id=None, limit=self.max_context_messages
            )
            if rows and rows[0].role == "user" and rows[0].text == current:
                rows = rows[1:]  # this very prompt, already recorded
            else:
                rows = rows[: self.max_context_messages - 1]
            for row in reversed(rows):
                if row.role in ("user", "assistant") and row.text.strip():
                    _add_turn(messages, row.role, row.text)
        content = self._user_content(current, parts)
        if messages and messages[-1]["role"] == "user" and isinstance(content, str):
            # The previous turn failed before any answer: one user message, not two in a
            # row (several APIs refuse that); a retry of the same text is not repeated.
            earlier = messages.pop()["content"]
            content = content if earlier == content else f"{earlier}\n\n{content}"
        elif messages and messages[-1]["role"] == "user":
            earlier = messages.pop()["content"]
            content = [{"type": "text", "text": earlier}, *content]
        messages.append({"role": "user", "content": content})
        return messages

    def _user_content(self, text: str, parts: Sequence[PromptPart]) -> str | list[dict[str, Any]]:
        images = [p for p in parts if isinstance(p, ImagePart)]
        if not images:
            return text
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        for image in images:
            data = base64.b64encode(image.data).decode("ascii")
            content.append(
                {"type": "image_url", "image_url": {"url": f"data:{image.mime};base64,{data}"}}
            )
        return content

    # -- Harness -----------------------------------------------------------------------

    async def check(self) -> str:
        ids = await self._model_ids()
        if self.model not in ids:
            shown = ", ".join(ids[:10]) or "none"
            raise HarnessError(
                f"the configured model {self.model!r} is not listed by {self.base_url}/models "
                f"({len(ids)} listed: {shown})",
                code="model-unavailable",
            )
        return f"{self.base_url}: {len(ids)} model(s), configured model {self.model} is listed"

    async def probe_details(self) -> list[ProbeItem]:
        return [
            ProbeItem(
                name="vision",
                result="ok" if self.vision else "warn",
                detail="images are sent as data URLs"
                if self.vision
                else "vision = false: messages with images are refused",
            )
        ]

    async def create_session(self, *, title: str | None) -> str:
        return "oai-" + uuid.uuid4().hex[:16]

    async def prompt(
        self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext
    ) -> AsyncGenerator[TurnEvent, None]:
        if any(isinstance(p, ImagePart) for p in parts) and not self.vision:
            log.info("openai_images_refused")
            yield TextDelta(IMAGES_REFUSED)
            yield TurnEnd(stop_reason="refusal")
            return
        body = {
            "model": await self.model_for(session_id),
            "messages": await self.build_messages(session_id, parts),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        payload = msgspec.json.encode(body)
        # 1 s, 2 s between the tries unless the server says how long (no jitter: one
        # client, and tests rely on the exact waits).
        backoff = Backoff(self.retry_base_s, max(RETRY_BACKOFF_MAX_S, self.retry_base_s), 2.0, 0.0)
        tries = 0
        while True:
            tries += 1
            retry: _Retry | None = None
            resp: httpx.Response | None = None
            chunks: AsyncIterator[bytes] | None = None
            first_token = False
            try:
                resp = await self._open(payload)
                if resp.headers.get("content-type", "").startswith("application/json"):
                    for ev in await self._whole(resp):
                        yield ev
                    return
                decoder = SseDecoder()
                st = _StreamState()
                last_data = trio.current_time()
                chunks = resp.aiter_bytes()
                try:
                    async for chunk in chunks:
                        for item in decoder.feed(chunk):
                            if item.data is None:  # a comment: keep-alive, not progress
                                if trio.current_time() - last_data > self.idle_timeout_s:
                                    raise HarnessError(
                                        f"the model API sent only keep-alives for {self.idle_timeout_s:g} s",
                                        code="stream-idle",
                                    )
                                continue
                            last_data = trio.current_time()
                            for event in self._events_for(item.data, st):
                                first_token = True
                                yield event
                            if st.done or st.error is not None:
                                break
                        if st.done or st.error is not None:
                            break
                    else:  # end of body: an unterminated last event still counts
                        for item in decoder.close():
                            if item.data is not None and not st.done and st.error is None:
                                for event in self._events_for(item.data, st):
                                    first_token = True
                                    yield event
                except (httpx.HTTPError, httpx.StreamError) as exc:  # network, decoding
                    if not first_token:
                        raise _Retry(
                            self._scrub(
                                f"the connection to the model API broke ({type(exc).__name__})"
                            ),
                            None,
                        ) from exc
                    log.warning("openai_stream_broken", error=type(exc).__name__)
                    yield TurnEnd(
                        stop_reason="error",
                        error="the connection to the model API broke off in the middle of the answer",
                    )
                    return
                if st.error is not None:
                    log.warning("openai_stream_error", error=st.error)
                    yield TurnEnd(
                        stop_reason="error", error=f"the model API reported an error: {st.error}"
                    )
                    return
                if st.done:
                    # Read the end of the response (normally nothing) so the connection goes back
                    # to the pool instead of being closed.
                    with trio.move_on_after(CLOSE_TIMEOUT_S):
                        try:
                            async for _ in chunks:
                                pass
                        except httpx.HTTPError:
                            pass
                elif st.finish is not None:
                    # Ended cleanly after a finish_reason but without [DONE]: some servers do
                    # that; the answer is complete.
                    log.info("openai_stream_without_done", finish_reason=st.finish)
                else:
                    if not first_token:
                        raise _Retry("the model API closed the stream before answering", None)
                    yield TurnEnd(
                        stop_reason="error",
                        error="the model API ended the answer unexpectedly (the stream closed without [DONE])",
                    )
                    return
                yield _end_for(st.finish)
                return
            except _Retry as exc:
                retry = exc
            finally:
                if resp is not None:
                    await release_response(resp, chunks)
            assert retry is not None
            if tries >= MAX_TRIES:
                raise HarnessError(
                    f"{retry.reason}; gave up after {MAX_TRIES} tries", code="retries-exhausted"
                )
            fallback = backoff.next_delay()
            delay = retry.delay_s if retry.delay_s is not None else fallback
            log.info("openai_retrying", reason=retry.reason, attempt=tries, delay_s=delay)
            await trio.sleep(delay)

    def _events_for(self, data: str, st: _StreamState) -> list[TurnEvent]:
        """One SSE data payload -> turn events; records [DONE], finish_reason, errors."""
        if data.strip() == "[DONE]":
            st.done = True
            return []
        try:
            parsed = _CHUNK.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("openai_chunk_unreadable", sample=data[:120])
            return []
        if parsed.error is not None:
            st.error = self._scrub(_error_text(parsed.error))
            return []
        if parsed.usage is not None:
            log.info(
                "openai_usage",
                prompt_tokens=parsed.usage.prompt_tokens,
                completion_tokens=parsed.usage.completion_tokens,
            )
        events: list[TurnEvent] = []
        for choice in parsed.choices or ():
            if choice.index != 0:
                continue
            if choice.finish_reason:
                st.finish = choice.finish_reason
            delta = choice.delta
            if delta is None:
                continue
            thinking = _thinking_of(delta)
            if thinking:
                events.append(Thinking(thinking))
            piece = delta.content or delta.refusal
            if piece:
                events.append(TextDelta(piece))
        return events

    async def _open(self, payload: bytes) -> httpx.Response:
        """POST the request; a 200 response is returned open, retryable failures raise _Retry."""
        request = self._client.build_request(
            "POST",
            self.base_url + "/chat/completions",
            content=payload,
            headers={**self._headers(stream=True), "content-type": "application/json"},
        )
        try:
            resp = await self._client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise _Retry("the model API did not answer in time", None) from exc
        except httpx.TransportError as exc:
            raise _Retry(
                self._scrub(
                    f"cannot reach the model API at {self.base_url} ({type(exc).__name__})"
                ),
                None,
            ) from exc
        status = resp.status_code
        if status == 200:
            return resp
        try:
            body = b""
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) >= ERROR_BODY_MAX:
                    break
        except httpx.HTTPError:
            pass
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
                await resp.aclose()
        if status == 429 or status >= 500:
            wait = parse_retry_after(resp.headers.get("retry-after"))
            if wait is not None and wait > RETRY_AFTER_MAX_S:
                raise HarnessError(
                    f"the model API is rate limiting (HTTP {status}) and asks to wait {wait:.0f} s",
                    code=f"http-{status}",
                )
            what = "rate limiting" if status == 429 else "unavailable"
            raise _Retry(f"the model API is {what} (HTTP {status})", wait)
        raise self._http_error(status, body)

    async def _whole(self, resp: httpx.Response) -> list[TurnEvent]:
        """A server that ignored ``stream: true`` and sent one JSON completion."""
        try:
            body = await resp.aread()
        except (httpx.HTTPError, httpx.StreamError) as exc:
            raise HarnessError(
                self._scrub(f"the model API's answer broke off ({type(exc).__name__})"),
                code="bad-response",
            ) from exc
        try:
            completion = _COMPLETION.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HarnessError(
                "the model API sent an unreadable answer", code="bad-response"
            ) from exc
        if completion.error is not None:
            text = self._scrub(_error_text(completion.error))
            return [TurnEnd(stop_reason="error", error=f"the model API reported an error: {text}")]
        events: list[TurnEvent] = []
        choice = completion.choices[0] if completion.choices else None
        if choice is not None and choice.message is not None:
            thinking = _thinking_of(choice.message)
            if thinking:
                events.append(Thinking(thinking))
            if choice.message.content:
                events.append(TextDelta(choice.message.content))
        events.append(_end_for(choice.finish_reason if choice is not None else None))
        return events

    async def cancel(self, session_id: str) -> None:
        """Nothing to do: a turn is stopped by cancelling it, which closes its stream."""
        return None

    async def list_models(self, session_id: str | None) -> list[ModelInfo] | None:
        current = await self.model_for(session_id)
        return [ModelInfo(id=m, current=m == current) for m in await self._model_ids()]

    async def select_model(self, session_id: str, model: str) -> str:
        ids = await self._model_ids()
        wanted = model.strip()
        chosen = next((m for m in ids if m == wanted), None) or next(
            (m for m in ids if m.casefold() == wanted.casefold()), None
        )
        if chosen is None:
            raise HarnessError(
                f"unknown model {wanted!r}; /models lists the choices", code="model-unknown"
            )
        self._models[session_id] = chosen
        if self._store is not None:
            await self._store.set_cursor(self.bot, MODEL_CURSOR + session_id, chosen)
        return chosen

    async def steer(self, session_id: str, text: str) -> bool:
        return False

    async def aclose(self) -> None:
        if self._own_client:
            await self._client.aclose()


def _add_turn(messages: list[dict[str, Any]], role: str, text: str) -> None:
    """Append a transcript row, folding it into the previous message of the same role (an
    unanswered prompt followed by the next one): roles alternate, as APIs expect."""
    if messages and messages[-1]["role"] == role and role != "system":
        earlier = messages[-1]["content"]
        messages[-1]["content"] = text if earlier == text else f"{earlier}\n\n{text}"
        return
    messages.append({"role": role, "content": text})


__all__ = ["OpenAIHarness", "SseDecoder", "SseItem", "parse_retry_after"]
