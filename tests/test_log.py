"""dshim.log: what reaches the log stream.

Every test configures logging onto a StringIO (or capsys' stderr), logs through the real
structlog and stdlib paths, and reads the rendered output back: the assertions are about
text an operator would see, never about processor internals.  A secret test always checks
both that the record was written (so it cannot pass vacuously) and that the value is gone.
The autouse fixture restores the stdlib root logger and structlog's configuration.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest
import structlog
import trio

from dshim.channels.registry import parse_config
from dshim.config import Secret
from dshim.errors import ConfigError
from dshim.log import (
    bound_contextvars,
    configure_logging,
    get_logger,
    log_context,
    redact,
    register_secret,
)

SECRET = "s3cr3t-platform-app-secret"
TG_TOKEN = "123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw1"
TG_SECRET_PART = TG_TOKEN.split(":", 1)[1]

# Made at import, before any configure_logging, as dshim's modules make theirs.
EARLY = structlog.get_logger("dshim.early")


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    quiet = {name: logging.getLogger(name).level for name in ("httpx", "httpcore")}
    config = structlog.get_config()
    yield
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    for name, lvl in quiet.items():
        logging.getLogger(name).setLevel(lvl)
    structlog.configure(**config)
    structlog.contextvars.clear_contextvars()


def capture(fmt: str = "json", level: str = "debug", secrets: Any = (SECRET,)) -> io.StringIO:
    stream = io.StringIO()
    configure_logging(level, fmt, secrets, stream=stream)
    return stream


def records(stream: io.StringIO) -> list[dict[str, Any]]:
    """Every output line, each of which must be one JSON object."""
    out = []
    for line in stream.getvalue().splitlines():
        obj = json.loads(line)
        assert isinstance(obj, dict)
        out.append(obj)
    return out


def only(stream: io.StringIO, event: str) -> dict[str, Any]:
    found = [r for r in records(stream) if r["event"] == event]
    assert len(found) == 1, stream.getvalue()
    return found[0]


# --- format -------------------------------------------------------------------------------


def test_json_emits_one_object_per_line_with_event_level_timestamp() -> None:
    stream = capture()
    log = get_logger("dshim.test")
    log.info("turn_started", lane=3)
    log.warning("ws_reconnected", attempt=2)
    log.debug("reply_lookup_timed_out")

    recs = records(stream)
    assert [r["event"] for r in recs] == [
        "turn_started",
        "ws_reconnected",
        "reply_lookup_timed_out",
    ]
    assert [r["level"] for r in recs] == ["info", "warning", "debug"]
    for r in recs:
        assert r["logger"] == "dshim.test"
        assert datetime.fromisoformat(r["timestamp"]).tzinfo is not None
    assert recs[0]["lane"] == 3


def test_timestamps_are_iso_utc_to_the_microsecond(monkeypatch: pytest.MonkeyPatch) -> None:
    """As ``datetime.isoformat`` writes them: truncated to microseconds, no fraction on a
    whole second, ``Z`` for UTC; dshim and stdlib records alike."""
    import time

    stream = capture()
    clock = iter(
        [
            1_700_000_000_000_000_000,  # a whole second
            1_700_000_000_000_123_999,
            1_700_000_001_999_999_999,  # the next second
            1_700_000_001_999_999_999,
        ]
    )
    with monkeypatch.context() as patch:
        patch.setattr(time, "time_ns", lambda: next(clock))
        for n in range(3):
            get_logger().info("stamped", n=n)
        logging.getLogger("somelib").warning("stamped_too")
    assert [r["timestamp"] for r in records(stream)] == [
        "2023-11-14T22:13:20Z",
        "2023-11-14T22:13:20.000123Z",
        "2023-11-14T22:13:21.999999Z",
        "2023-11-14T22:13:21.999999Z",
    ]


def test_get_logger_defaults_to_calling_module_name() -> None:
    stream = capture()
    get_logger().info("module_named")
    assert only(stream, "module_named")["logger"] == __name__


def test_non_string_values_are_untouched() -> None:
    stream = capture()
    get_logger().info(
        "values_logged", n=123456789, f=1.5, flag=True, nothing=None, ids=[1234567, 2]
    )
    rec = only(stream, "values_logged")
    assert rec["n"] == 123456789
    assert rec["f"] == 1.5
    assert rec["flag"] is True
    assert rec["nothing"] is None
    assert rec["ids"] == [1234567, 2]


def test_console_format_renders_event_and_keys() -> None:
    stream = capture("console")
    log = get_logger("dshim.console")
    log.info("turn_started", bot="alpha", detail=f"key {SECRET}")
    try:
        raise RuntimeError("console boom")
    except RuntimeError:
        log.exception("turn_failed")

    text = stream.getvalue()
    first = text.splitlines()[0]
    assert not first.startswith("{")
    assert "turn_started" in first
    assert "bot=alpha" in first
    assert "[info" in first
    assert "turn_failed" in text
    assert "RuntimeError: console boom" in text
    assert "Traceback (most recent call last)" in text
    assert SECRET not in text
    assert "***" in first


def test_format_defaults_to_json_off_a_tty_and_console_on_one() -> None:
    class FakeTTY(io.StringIO):
        def isatty(self) -> bool:
            return True

    pipe = io.StringIO()
    configure_logging("info", None, stream=pipe)
    get_logger().info("format_picked")
    assert only(pipe, "format_picked")["level"] == "info"

    tty = FakeTTY()
    configure_logging("info", None, stream=tty)
    get_logger().info("format_picked")
    line = tty.getvalue().splitlines()[0]
    assert "format_picked" in line
    assert not line.startswith("{")


def test_default_stream_is_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json", [SECRET])
    get_logger().info("stderr_written", value=SECRET)
    out, err = capsys.readouterr()
    assert out == ""
    rec = json.loads(err.splitlines()[-1])
    assert rec["event"] == "stderr_written"
    assert rec["value"] == "***"


def test_reconfiguring_replaces_stream_level_and_secrets() -> None:
    first = capture(level="debug", secrets=["first-secret-value"])
    second = capture(level="info", secrets=["second-secret-value"])
    log = get_logger()
    log.debug("debug_dropped")
    log.info("info_kept", a="first-secret-value", b="second-secret-value")

    assert first.getvalue() == ""
    assert [r["event"] for r in records(second)] == ["info_kept"]
    rec = only(second, "info_kept")
    assert rec["a"] == "first-secret-value"  # replaced, as documented
    assert rec["b"] == "***"
    ours = [h for h in logging.getLogger().handlers if type(h).__module__ == "dshim.log"]
    assert len(ours) == 1


def test_unknown_level_or_format_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="log level"):
        configure_logging("loud", "json", stream=io.StringIO())
    with pytest.raises(ConfigError, match="log format"):
        configure_logging("info", "xml", stream=io.StringIO())


def test_a_logger_made_at_import_follows_every_reconfiguration() -> None:
    first = capture(level="warning")
    EARLY.info("info_dropped")
    EARLY.warning("warning_kept")
    second = capture("console", level="debug")
    EARLY.debug("debug_shown")

    assert [(r["event"], r["logger"]) for r in records(first)] == [("warning_kept", "dshim.early")]
    [line] = second.getvalue().splitlines()
    assert "debug_shown" in line and "[debug" in line


def test_stdlib_levels_set_at_runtime_apply_to_the_next_record() -> None:
    stream = capture(level="info")
    chatty = logging.getLogger("dshim.chatty")
    try:
        chatty.setLevel(logging.DEBUG)  # one module's debug records, the rest at info
        get_logger("dshim.chatty").debug("chatty_debug")
        get_logger("dshim.quiet").debug("quiet_debug")
        logging.getLogger().setLevel(logging.WARNING)
        get_logger("dshim.quiet").info("quiet_info")
        get_logger("dshim.quiet").warning("quiet_warning")
    finally:
        chatty.setLevel(logging.NOTSET)
    assert [r["event"] for r in records(stream)] == ["chatty_debug", "quiet_warning"]


def test_capture_logs_sees_every_level_and_output_resumes_after() -> None:
    stream = capture(level="info")
    log = get_logger("dshim.captured")
    with structlog.testing.capture_logs() as logs:
        log.debug("debug_captured", n=1)
        log.info("info_captured")
    log.debug("debug_dropped")
    log.info("info_written")

    assert [(e["event"], e["log_level"]) for e in logs] == [
        ("debug_captured", "debug"),
        ("info_captured", "info"),
    ]
    assert logs[0]["n"] == 1
    assert [r["event"] for r in records(stream)] == ["info_written"]


def test_a_logger_without_a_name_is_named_after_the_calling_module() -> None:
    stream = capture()
    structlog.get_logger().info("anonymous_logged")
    assert only(stream, "anonymous_logged")["logger"] == __name__


def test_stack_info_ends_at_the_caller() -> None:
    stream = capture()
    get_logger().info("stack_wanted", stack_info=True)
    stack = only(stream, "stack_wanted")["stack"].splitlines()
    assert stack[0] == "Stack (most recent call last):"
    assert stack[-2].endswith("in test_stack_info_ends_at_the_caller")
    assert "stack_wanted" in stack[-1]


def test_lines_from_threads_never_interleave() -> None:
    """dshim records and stdlib records logged at once from several threads: every line is
    one whole record."""
    import threading

    stream = capture()
    text = "x" * 4000  # far above any write buffer a thread switch could split

    def work(n: int) -> None:
        for i in range(200):
            get_logger("dshim.thread").info("thread_logged", n=n, i=i, text=text)
            logging.getLogger("somelib").warning("stdlib %d %d %s", n, i, text)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)

    recs = records(stream)
    ours = {(r["n"], r["i"]) for r in recs if r["event"] == "thread_logged"}
    assert ours == {(n, i) for n in range(4) for i in range(200)}
    assert all(r["text"] == text for r in recs if r["event"] == "thread_logged")
    assert sum(r["logger"] == "somelib" for r in recs) == 800
    assert len(recs) == 1600


def test_a_closed_stream_is_reported_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    stream = capture()
    stream.close()
    get_logger().info("after_close")  # must not raise into the caller
    logging.getLogger("somelib").warning("after_close_too")
    err = capsys.readouterr().err
    assert err.count("--- Logging error ---") == 2
    assert "after_close" in err


def test_records_stop_once_the_handler_is_removed() -> None:
    """Another configuration of stdlib logging (``dictConfig``) takes the stream away."""
    stream = capture()
    get_logger().info("before_removal")
    for handler in logging.getLogger().handlers[:]:
        if type(handler).__module__ == "dshim.log":
            logging.getLogger().removeHandler(handler)
    get_logger().info("after_removal")
    assert [r["event"] for r in records(stream)] == ["before_removal"]


# --- secrets ------------------------------------------------------------------------------


def test_registered_secret_masked_in_plain_field_and_event() -> None:
    stream = capture()
    get_logger().info("login_attempted", detail=f"using {SECRET} now", secret_itself=SECRET)
    logging.getLogger("somelib").info("raw message with %s inside", SECRET)

    text = stream.getvalue()
    assert SECRET not in text
    rec = only(stream, "login_attempted")
    assert rec["detail"] == "using *** now"
    assert rec["secret_itself"] == "***"
    assert only(stream, "raw message with *** inside")["logger"] == "somelib"


def test_registered_secret_masked_in_nested_containers() -> None:
    stream = capture()
    payload: dict[str, Any] = {
        "auth": {"headers": [("X-Token", SECRET)], SECRET: "as a key"},
        "n": 1,
    }
    get_logger().info("request_built", payload=payload)

    assert SECRET not in stream.getvalue()
    rec = only(stream, "request_built")
    assert rec["payload"] == {"auth": {"headers": [["X-Token", "***"]], "***": "as a key"}, "n": 1}
    assert payload["auth"]["headers"] == [("X-Token", SECRET)]  # caller's object not mutated


def test_secret_in_arbitrary_objects_is_masked_in_their_repr() -> None:
    stream = capture()
    get_logger().info(
        "poll_failed", error=KeyError(SECRET), secret=Secret(SECRET), raw=SECRET.encode()
    )
    assert SECRET not in stream.getvalue()
    rec = only(stream, "poll_failed")
    assert rec["error"] == "KeyError('***')"
    assert rec["secret"] == "Secret('***')"


def _login() -> None:
    raise RuntimeError("login rejected for s3cr3t-platform-app-secret")


def test_secret_masked_in_exception_message_and_traceback() -> None:
    stream = capture()
    log = get_logger()
    try:
        try:
            _login()
        except RuntimeError as exc:
            raise ConnectionError(f"cause was {SECRET}") from exc
    except ConnectionError:
        log.exception("login_failed")
    try:
        _login()
    except RuntimeError:
        logging.getLogger("trio_websocket").warning("handshake failed", exc_info=True)

    text = stream.getvalue()
    assert SECRET not in text
    rec = only(stream, "login_failed")
    # the traceback is there, with the source line that holds the literal secret
    assert "Traceback (most recent call last)" in rec["exception"]
    assert 'raise RuntimeError("login rejected for ***")' in rec["exception"]
    assert "ConnectionError: cause was ***" in rec["exception"]
    foreign = only(stream, "handshake failed")
    assert foreign["logger"] == "trio_websocket"
    assert "RuntimeError: login rejected for ***" in foreign["exception"]


def test_runtime_secret_registered_after_configure() -> None:
    stream = capture()
    runtime = "t-g1044dexAMPLEaccessTOKEN"
    register_secret(runtime)
    register_secret("abc12")  # shorter than 6: ignored, would garble ordinary text
    get_logger().info("token_refreshed", token=runtime, note="abc12 stays")

    assert runtime not in stream.getvalue()
    rec = only(stream, "token_refreshed")
    assert rec["token"] == "***"
    assert rec["note"] == "abc12 stays"


def test_a_value_seen_before_its_registration_is_masked_after_it() -> None:
    stream = capture()
    token = "t-late-registered-token"
    for _ in range(2):
        get_logger().info("token_used", token=token)
    register_secret(token)
    get_logger().info("token_used", token=token)
    assert [r["token"] for r in records(stream)] == [token, token, "***"]


def test_url_quoted_secret_is_masked() -> None:
    stream = capture(secrets=["p@ss/w0rd+x"])
    get_logger().info("url_built", url="https://h/x?pw=p%40ss%2Fw0rd%2Bx&y=1")
    assert only(stream, "url_built")["url"] == "https://h/x?pw=***&y=1"


def test_config_secrets_are_masked() -> None:
    raw = {"bots": [{"name": "tg", "channel": "telegram", "token": "${TG}"}]}
    config = parse_config(raw, env={"TG": "123456789:cfg-token-from-env-1234"})
    stream = capture(secrets=config.secrets())
    get_logger().info("bot_started", token="123456789:cfg-token-from-env-1234")
    assert only(stream, "bot_started")["token"] == "***"


def test_httpx_request_url_through_stdlib_logging_is_masked() -> None:
    stream = capture(secrets=[SECRET])
    logging.getLogger("httpx").setLevel(logging.INFO)  # the documented override
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json={"ok": True}))
    with httpx.Client(transport=transport) as client:
        client.get(f"http://127.0.0.1:8081/bot{TG_TOKEN}/getMe")
        client.get(f"https://open.example.com/callback?state={SECRET}")

    text = stream.getvalue()
    assert TG_SECRET_PART not in text
    assert SECRET not in text
    recs = [r for r in records(stream) if r["logger"] == "httpx"]
    assert len(recs) == 2
    assert "http://127.0.0.1:8081/bot123456789:***/getMe" in recs[0]["event"]
    assert "state=***" in recs[1]["event"]


def test_httpx_info_is_silenced_by_default() -> None:
    stream = capture(level="debug")
    transport = httpx.MockTransport(lambda request: httpx.Response(200))
    with httpx.Client(transport=transport) as client:
        client.get(f"http://127.0.0.1:8081/bot{TG_TOKEN}/getMe")
    logging.getLogger("httpx").warning("still_shown")
    assert [r["event"] for r in records(stream)] == ["still_shown"]


@pytest.mark.parametrize(
    ("text", "gone", "expected"),
    [
        pytest.param(TG_TOKEN, TG_SECRET_PART, "123456789:***", id="telegram"),
        pytest.param(
            f"GET http://127.0.0.1:8081/bot{TG_TOKEN}/getUpdates?offset=5",
            TG_SECRET_PART,
            "GET http://127.0.0.1:8081/bot123456789:***/getUpdates?offset=5",
            id="telegram-in-url-path",
        ),
        pytest.param(
            "token xoxb-1234567890-0987654321-AbCdEfGhIjKlMnOpQrStUv ok",
            "1234567890-0987654321-AbCdEfGhIjKlMnOpQrStUv",
            "token xoxb-*** ok",
            id="slack-bot",
        ),
        pytest.param("xoxp-11-22-33-abcdef", "11-22-33-abcdef", "xoxp-***", id="slack-user"),
        pytest.param(
            "app xapp-1-A0123456789-1234567890123-0123456789abcdef",
            "A0123456789-1234567890123-0123456789abcdef",
            "app xapp-***",
            id="slack-app",
        ),
        pytest.param(
            "Authorization: Bearer ya29.a0AfH6SMBx-opaque_token=",
            "ya29.a0AfH6SMBx-opaque_token=",
            "Authorization: Bearer ***",
            id="bearer",
        ),
        pytest.param(
            "{'authorization': 'bearer EAAGm0PX4ZCpsBA'}",
            "EAAGm0PX4ZCpsBA",
            "{'authorization': 'bearer ***'}",
            id="bearer-in-repr",
        ),
        pytest.param(
            "https://qyapi.weixin.qq.com/cgi-bin/gettoken?corpid=ww1&corpsecret=Zk9xQ2aa_Bb&x=1",
            "Zk9xQ2aa_Bb",
            "https://qyapi.weixin.qq.com/cgi-bin/gettoken?corpid=ww1&corpsecret=***&x=1",
            id="query-credential",
        ),
        pytest.param(
            "Bot MTA1MjM0NTY3ODkwMTIzNDU2.GhIjKl.abcdefghijklmnopqrstuvwxyz0123456789AB",
            "abcdefghijklmnopqrstuvwxyz0123456789AB",
            "Bot ***",
            id="discord",
        ),
    ],
)
def test_token_patterns_are_masked_without_registration(
    text: str, gone: str, expected: str
) -> None:
    stream = capture(secrets=[])
    get_logger().info("token_seen", text=text, nested={"list": [text]})
    logging.getLogger("httpcore").error("stdlib %s", text)

    assert gone not in stream.getvalue()
    rec = only(stream, "token_seen")
    assert rec["text"] == expected
    assert rec["nested"] == {"list": [expected]}
    assert only(stream, f"stdlib {expected}")["level"] == "error"
    assert redact(text) == expected


def test_ordinary_text_is_left_alone() -> None:
    stream = capture()
    text = "turn 12:30 took 1500 ms; see https://example.com/a?b=c#d, bearer-less xox"
    get_logger().info("turn_finished", text=text)
    assert only(stream, "turn_finished")["text"] == text


def test_the_shortest_maskable_values_are_masked() -> None:
    stream = capture(secrets=["abc123"])
    get_logger().info("abc123", value="abc123", slack="xoxb-1", short="abc12")
    rec = only(stream, "***")
    assert (rec["value"], rec["slack"], rec["short"]) == ("***", "xoxb-***", "abc12")


# --- context ------------------------------------------------------------------------------


def test_bound_contextvars_appear_in_structlog_and_stdlib_records() -> None:
    stream = capture()
    log = get_logger()
    with bound_contextvars(bot="alpha", conversation="c-42", turn=7):
        log.info("turn_started")
        logging.getLogger("httpx").warning("retrying")
    log.info("turn_ended")

    started = only(stream, "turn_started")
    assert (started["bot"], started["conversation"], started["turn"]) == ("alpha", "c-42", 7)
    assert only(stream, "retrying")["bot"] == "alpha"
    assert "bot" not in only(stream, "turn_ended")


def test_log_context_skips_none_and_nests() -> None:
    stream = capture()
    log = get_logger()
    with log_context(bot="alpha", conversation="c-1"):
        with log_context(turn=3, lane="q"):
            log.info("inner_logged")
        log.info("outer_logged")

    inner = only(stream, "inner_logged")
    assert (inner["bot"], inner["conversation"], inner["turn"], inner["lane"]) == (
        "alpha",
        "c-1",
        3,
        "q",
    )
    outer = only(stream, "outer_logged")
    assert outer["bot"] == "alpha"
    assert "turn" not in outer
    assert "lane" not in outer


async def test_trio_child_tasks_inherit_context() -> None:
    stream = capture()
    log = get_logger()

    async def child(n: int) -> None:
        await trio.lowlevel.checkpoint()
        log.info("child_ran", n=n)

    with log_context(bot="alpha", conversation="c-9"):
        async with trio.open_nursery() as nursery:
            for n in range(2):
                nursery.start_soon(child, n)

    recs = [r for r in records(stream) if r["event"] == "child_ran"]
    assert len(recs) == 2
    assert {(r["bot"], r["conversation"]) for r in recs} == {("alpha", "c-9")}


def test_a_json_record_with_a_lone_surrogate_is_still_one_line() -> None:
    """Hostile text in a log field (a lone surrogate) cannot stop logging."""
    import io

    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    structlog.get_logger("t").warning("event_dropped", detail="bad \ud800 text")
    [line] = out.getvalue().splitlines()
    assert json.loads(line)["detail"] == "bad \ud800 text"
