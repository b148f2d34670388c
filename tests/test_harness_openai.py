"""The OpenAI-compatible adapter end to end: the real pipeline against the fake SSE server.

The fake (:mod:`dshim.testing.fakes.openai`) listens on 127.0.0.1 port 0 and streams
chunked SSE like the real servers, with faults chosen by ``fake:...`` directives in the
user's text.  Real sockets need the real clock; every test has a ``trio.fail_after``
deadline.  Table tests of the SSE decoder come first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from structlog.testing import capture_logs

from dshim.channels.registry import parse_config
from dshim.harness.openai import IMAGES_REFUSED, OpenAIHarness, SseDecoder, parse_retry_after
from dshim.model import MediaRef
from dshim.pipeline.turn import STOPPED_MARK
from dshim.probe import ProbeRow, _harness_check
from dshim.store import open_store
from dshim.testing.fakes.openai import FakeOpenAI, open_fake_openai
from tests.harness_rig import open_harness_rig, wait_until
from tests.helpers import Rig, msg

DEADLINE_S = 15.0
KEY = "sk-test-0123456789abcdef"
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 10


# -- SSE decoding (sans-IO) ---------------------------------------------------------------------


def _decode(chunks: list[bytes]) -> list[tuple[str, str]]:
    d = SseDecoder()
    out = []
    for c in chunks:
        out += d.feed(c)
    out += d.close()
    return [("data", i.data) if i.data is not None else ("comment", i.comment or "") for i in out]


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        ([b"data: a\n\n"], [("data", "a")]),
        ([b"data: a\r\n\r\ndata: b\r\r"], [("data", "a"), ("data", "b")]),
        ([b"data: a\r", b"\n\r", b"\ndata:b\n\n"], [("data", "a"), ("data", "b")]),
        ([b"data: one\ndata: two\n\n"], [("data", "one\ntwo")]),
        ([b": keep-alive\n\n", b"data: x\n\n"], [("comment", "keep-alive"), ("data", "x")]),
        ([b"event: ping\nid: 3\nretry: 10\n\n"], []),
        ([b"da", b'ta: {"a"', b": 1}\n", b"\n"], [("data", '{"a": 1}')]),
        ([b"data: [DONE]"], [("data", "[DONE]")]),  # no trailing blank line at EOF
        (["data: é\n\n".encode()[:7], "data: é\n\n".encode()[7:]], [("data", "é")]),
        ([b"data:no-space\n\n"], [("data", "no-space")]),
    ],
)
def test_sse_decoder(chunks: list[bytes], expected: list[tuple[str, str]]) -> None:
    assert _decode(chunks) == expected


def test_retry_after_forms() -> None:
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after("0.5") == 0.5
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0


# -- rig ----------------------------------------------------------------------------------------


def harness_for(fake: FakeOpenAI, store: Any, **cfg: Any) -> OpenAIHarness:
    table = {
        "kind": "openai",
        "base_url": fake.base_url,
        "model": "fake-small",
        "api_key": "${OAI_KEY}",
        **cfg,
    }
    config = parse_config({"harness": table}, env={"OAI_KEY": KEY})
    return OpenAIHarness(config.harness, bot="t", store=store, retry_base_s=0.05)


@asynccontextmanager
async def oai_rig(
    tmp_path: Path, fake: FakeOpenAI, **cfg: Any
) -> AsyncIterator[tuple[Rig, OpenAIHarness]]:
    async with open_store(tmp_path / "data", inline=True) as store:
        h = harness_for(fake, store, **cfg)
        try:
            async with open_harness_rig(tmp_path, harness=h, store=store) as rig:
                yield rig, h
        finally:
            await h.aclose()


async def ask(rig: Rig, text: str, **kw: Any) -> str:
    await rig.rt.accept(msg(text, **kw))
    await rig.rt.wait_idle()
    return rig.texts[-1]


# -- streaming ----------------------------------------------------------------------------------


async def test_streamed_answer_with_reasoning_hidden(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_fake_openai(api_key=KEY) as fake, oai_rig(tmp_path, fake) as (rig, _):
            answer = await ask(rig, "hello there, model of mine")
    assert answer == "echo: hello there, model of mine"
    updates = rig.out.streams[0].updates
    assert len(updates) >= 2 and all(answer.startswith(u) for u in updates)
    assert not any("Thinking about" in u for u in updates)
    body = fake.chat_requests[0].body
    assert body["stream"] is True and body["model"] == "fake-small"
    assert body["stream_options"] == {"include_usage": True}
    assert fake.chat_requests[0].headers["authorization"] == f"Bearer {KEY}"


@pytest.mark.parametrize(
    "directive", ["fake:keepalive", "fake:reasoning", "fake:json", "fake:nodone"]
)
async def test_keepalives_reasoning_field_and_plain_json(tmp_path: Path, directive: str) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_fake_openai() as fake, oai_rig(tmp_path, fake) as (rig, _):
            answer = await ask(rig, f"{directive} please")
    assert answer == f"echo: {directive} please"


async def test_error_after_200_keeps_the_partial_answer(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_fake_openai() as fake, oai_rig(tmp_path, fake) as (rig, _):
            answer = await ask(rig, "fake:error-after")
            assert await ask(rig, "next") == "echo: next"
    assert answer == (
        "partial answer\n\n⚠️ The agent failed: the model API reported an error: "
        "scripted failure after 200"
    )
    assert len(fake.chat_requests) == 2  # nothing retried after the first token


async def test_stream_cut_without_done_fails_once(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_fake_openai() as fake, oai_rig(tmp_path, fake) as (rig, _):
            answer = await ask(rig, "fake:eof")
    assert answer.startswith("partial answer\n\n⚠️ The agent failed:")
    assert "broke off" in answer
    assert len(rig.texts) == 1 and len(fake.chat_requests) == 1


async def test_output_limit_is_reported(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_fake_openai() as fake, oai_rig(tmp_path, fake) as (rig, _):
            answer = await ask(rig, "fake:length")
    assert answer.startswith("echo: fake:length") and "output limit" in answer


# -- retries ------------------------------------------------------------------------------------


async def test_429_before_the_first_token_is_retried_after_retry_after(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_fake_openai() as fake, oai_rig(tmp_path, fake) as (rig, _):
            t0 = trio.current_time()
            answer = await ask(rig, "fake:429 hello")
            elapsed = trio.current_time() - t0
    assert answer == "echo: fake:429 hello"
    assert len(rig.texts) == 1  # one answer, no error
    assert len(fake.chat_requests) == 2
    assert elapsed >= 1.0  # Retry-After: 1 honoured


async def test_5xx_three_times_gives_up_with_one_clear_reply(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_fake_openai() as fake, oai_rig(tmp_path, fake) as (rig, _):
            fake.fail_next(503, times=5)
            answer = await ask(rig, "hello")
    assert len(fake.chat_requests) == 3
    assert rig.texts == [answer]
    assert answer == (
        "⚠️ The agent failed: the model API is unavailable (HTTP 503); gave up after 3 tries"
    )


async def test_auth_error_is_clear_and_never_shows_the_key(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_fake_openai(api_key="sk-other-key-xyz") as fake:
            with capture_logs() as logs:
                async with oai_rig(tmp_path, fake) as (rig, _):
                    answer = await ask(rig, "hello")
    assert "HTTP 401" in answer and "api_key" in answer
    assert len(fake.chat_requests) == 1  # 401 is not retried
    assert KEY not in answer and KEY not in repr(logs)


# -- stop ---------------------------------------------------------------------------------------


async def test_stop_closes_the_stream_and_keeps_the_partial_answer(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with (
            open_fake_openai(slow_interval_s=0.05) as fake,
            oai_rig(tmp_path, fake) as (rig, _),
        ):
            await rig.rt.accept(msg("fake:slow 200"))
            await wait_until(lambda: bool(rig.out.streams) and len(rig.out.streams[0].updates) >= 2)
            t0 = trio.current_time()
            await rig.rt.accept(msg("/stop"))
            await rig.rt.wait_idle()
            elapsed = trio.current_time() - t0
            await wait_until(lambda: fake.disconnects == 1)  # the server saw the stream closed
            assert await ask(rig, "after") == "echo: after"
    assert elapsed < 3.0
    assert rig.texts[0].startswith("chunk 1 chunk 2") and rig.texts[0].endswith(STOPPED_MARK)
    rows = await _transcript(tmp_path)
    assert rows[1] == ("assistant", rig.texts[0].removesuffix("\n\n" + STOPPED_MARK).strip(), False)


async def _transcript(tmp_path: Path) -> list[tuple[str, str, bool]]:
    async with open_store(tmp_path / "data", inline=True) as store:
        binding = await store.get_binding("t", "42", "")
        assert binding is not None
        rows = await store.transcript_page(binding.session_id, before_id=None, limit=100)
    return [(r.role, r.text.strip(), r.completed) for r in reversed(rows)]


# -- context ------------------------------------------------------------------------------------


async def test_context_is_rebuilt_from_the_transcript_after_a_restart(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_fake_openai() as fake:
            async with oai_rig(tmp_path, fake, system_prompt="You are terse.") as (rig, _):
                await ask(rig, "first question")
                first_prompt = rig.events.prompts[0]
            # dshim restarts: a new store connection, a new harness, the same data dir.
            async with oai_rig(tmp_path, fake, system_prompt="You are terse.") as (rig, _):
                await ask(rig, "second question")
                second_prompt = rig.events.prompts[0]
    messages = fake.chat_requests[-1].body["messages"]
    assert messages == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": first_prompt},
        {"role": "assistant", "content": "echo: first question"},
        {"role": "user", "content": second_prompt},
    ]


async def test_after_a_failed_turn_the_next_request_has_no_two_user_messages_in_a_row(
    tmp_path: Path,
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_fake_openai() as fake, oai_rig(tmp_path, fake) as (rig, _):
            await ask(rig, "first question")
            fake.fail_next(503, times=3)
            failed = await ask(rig, "second question")
            answer = await ask(rig, "third question")
    assert failed.startswith("⚠️ The agent failed")
    assert answer == "echo: third question"
    messages = fake.chat_requests[-1].body["messages"]
    roles = [m["role"] for m in messages]
    assert roles == ["user", "assistant", "user"]
    assert "second question" in messages[2]["content"]
    assert messages[2]["content"].endswith("third question")


async def test_context_keeps_the_newest_max_context_messages(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with (
            open_fake_openai() as fake,
            oai_rig(tmp_path, fake, max_context_messages=3) as (rig, _),
        ):
            for i in range(4):
                await ask(rig, f"question {i}")
    messages = fake.chat_requests[-1].body["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[0]["content"].endswith("question 2")
    assert messages[1]["content"] == "echo: question 2"
    assert messages[2]["content"].endswith("question 3")


async def _png(limit: int) -> bytes:
    return PNG


async def test_images_are_refused_without_vision(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_fake_openai() as fake, oai_rig(tmp_path, fake) as (rig, _):
            answer = await ask(rig, "what is this?", images=[MediaRef(kind="image", fetch=_png)])
    assert answer == IMAGES_REFUSED
    assert fake.chat_requests == []


async def test_images_are_sent_as_data_urls_with_vision(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_fake_openai() as fake, oai_rig(tmp_path, fake, vision=True) as (rig, _):
            answer = await ask(rig, "what is this?", images=[MediaRef(kind="image", fetch=_png)])
    assert answer == "echo: what is this?"
    content = fake.chat_requests[0].body["messages"][-1]["content"]
    assert content[0]["type"] == "text" and content[0]["text"].endswith("what is this?")
    assert content[1] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAAAAAAAAAAA"},
    }


# -- models -------------------------------------------------------------------------------------


async def test_models_listed_and_chosen_per_session(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_fake_openai() as fake:
            async with oai_rig(tmp_path, fake) as (rig, _):
                listed = await ask(rig, "/models")
                chosen = await ask(rig, "/model 2")
                answer = await ask(rig, "hi")
                other_chat = await ask(rig, "hi", conversation_id="77", sender_id="77")
                unknown = await ask(rig, "/model gpt-9")
            async with oai_rig(tmp_path, fake) as (rig, _):  # survives a restart
                again = await ask(rig, "hi again")
    assert listed == "Models:\n1. fake-small (current)\n2. fake-large"
    assert chosen == "Model set to fake-large."
    assert answer == "[fake-large] echo: hi"
    assert other_chat == "echo: hi"  # another conversation keeps the configured model
    assert "unknown model 'gpt-9'" in unknown
    assert again == "[fake-large] echo: hi again"


# -- probe --------------------------------------------------------------------------------------


async def test_probe_confirms_the_configured_model(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_fake_openai(api_key=KEY) as fake:
            rows: list[ProbeRow] = []
            table = {
                "kind": "openai",
                "base_url": fake.base_url,
                "model": "fake-large",
                "api_key": "${K}",
            }
            await _harness_check(parse_config({"harness": table}, env={"K": KEY}), rows)
            missing: list[ProbeRow] = []
            table["model"] = "gpt-missing"
            await _harness_check(parse_config({"harness": table}, env={"K": KEY}), missing)
    assert rows[0].result == "ok" and "configured model fake-large is listed" in rows[0].detail
    assert missing[0].result == "fail" and "'gpt-missing' is not listed" in missing[0].detail
    assert all(KEY not in r.detail for r in rows + missing)
