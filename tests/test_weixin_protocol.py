"""Table tests of the WeChat iLink mapping (sans-IO): ids, times, items, quotes, errors."""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import datetime, timedelta, timezone
from typing import Any

import msgspec
import pytest

from dshim.channels.weixin import media as crypto
from dshim.channels.weixin import models as m
from dshim.channels.weixin import protocol as p
from dshim.errors import AuthError, ChannelError, RemoteProtocolError
from dshim.model import InboundMessage, ReplyReference, Skip

BOT = "b0f5e7c1d2a3@im.bot"
USER = "o9cq8000aaaaaaa@im.wechat"
NOW_MS = 1_796_000_000_000.0  # 2026-11-30
SEED_ID = 7500595754332471560  # quoted in the dsh-im seed


def raw(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode()


def user_msg(items: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "seq": 7,
        "message_id": SEED_ID,
        "from_user_id": USER,
        "to_user_id": BOT,
        "create_time_ms": 1_795_999_990_000,
        "message_type": 1,
        "message_state": 2,
        "item_list": items,
        "context_token": "ctx-secret-token",
    }
    msg.update(kw)
    return msg


def mapped(obj: Any, **kw: Any) -> p.Mapped:
    data = obj if isinstance(obj, bytes) else raw(obj)
    return p.map_message(data, bot_id=BOT, now_ms=NOW_MS, **kw)


def inbound(obj: Any, **kw: Any) -> InboundMessage:
    item = mapped(obj, **kw).item
    assert isinstance(item, InboundMessage), item
    return item


# --- ids and times --------------------------------------------------------------------------


def test_the_seed_id_decodes_to_its_send_time() -> None:
    ms = p.id_time_ms(SEED_ID, now_ms=NOW_MS)
    assert ms is not None
    when = datetime.fromtimestamp(ms / 1000, tz=timezone(timedelta(hours=8)))
    assert when.isoformat(timespec="milliseconds") == "2026-09-02T00:49:42.163+08:00"


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        (SEED_ID, True),
        (str(SEED_ID), True),  # compared as strings either way
        ("123456789012345", False),  # 15 digits
        (str(1_577_836_800_000 << 22), True),  # exactly 2020-01-01, 20 digits
        (str((1_577_836_800_000 - 1) << 22), False),  # just before 2020
        (str(int(NOW_MS + 24 * 3600 * 1000) << 22), True),  # now + 24 h
        (str(int(NOW_MS + 24 * 3600 * 1000 + 1) << 22), False),  # beyond now + 24 h
        ("9" * 20, False),  # far future
        ("1" * 21, False),  # 21 digits
        ("1234567890123456", False),  # 16 digits but 1970
        ("75005957543324715a", False),
        ("", False),
        (None, False),
        (True, False),
    ],
)
def test_id_time_table(value: Any, valid: bool) -> None:
    assert (p.id_time_ms(value, now_ms=NOW_MS) is not None) is valid


def test_ids_are_compared_as_exact_strings() -> None:
    msg = inbound(user_msg([{"type": 1, "text_item": {"text": "hi"}}]))
    assert msg.message_id == "7500595754332471560"  # no float rounding of 64-bit ids


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"message_id": None, "client_id": "c-1"}, "client:c-1"),
        ({"message_id": None, "client_id": None, "seq": 9}, "seq:9"),
        ({"message_id": None, "client_id": None, "seq": None}, "items:111,222"),
    ],
)
def test_dedup_id_falls_back(fields: dict[str, Any], expected: str) -> None:
    items = [
        {"type": 1, "msg_id": "222", "text_item": {"text": "a"}},
        {"type": 1, "msg_id": "111", "text_item": {"text": "b"}},
    ]
    assert inbound(user_msg(items, **fields)).message_id == expected


# --- messages -------------------------------------------------------------------------------


def test_direct_text_message() -> None:
    m_ = mapped(user_msg([{"type": 1, "text_item": {"text": "hello"}}]))
    msg = m_.item
    assert isinstance(msg, InboundMessage)
    assert (msg.conversation_id, msg.sender_id, msg.conversation_type) == (USER, USER, "direct")
    assert msg.addressed and msg.content == "hello" and msg.reply_to is None
    assert msg.received_at == 1_795_999_990.0
    assert m_.context is not None and m_.context.token == "ctx-secret-token"
    assert m_.context.seq == 7
    assert "ctx-secret-token" not in repr(m_)


def test_the_bots_own_message_is_an_echo() -> None:
    item = mapped(user_msg([{"type": 1, "text_item": {"text": "x"}}], message_type=2)).item
    assert isinstance(item, Skip) and item.reason == "echo"


def test_a_group_message_is_never_addressed() -> None:
    m_ = mapped(user_msg([{"type": 1, "text_item": {"text": "hi all"}}], group_id="g@chatroom"))
    msg = m_.item
    assert isinstance(msg, InboundMessage)
    assert msg.conversation_type == "group" and not msg.addressed
    assert m_.group_id == "g@chatroom"


@pytest.mark.parametrize(
    "data",
    [
        b"{not json",
        b"[" * 200 + b"]" * 200,
        b'{"message_id": 1, "from_user_id": "\\ud800", "item_list": []}',
        b'{"message_id": 1, "from_user_id": "' + b"\xff\xfe" + b'"}',
        raw(user_msg("not a list")),  # type: ignore[arg-type]
        raw(user_msg([], from_user_id="")),
        raw({"item_list": []}),  # no id at all
        raw(user_msg([{"type": 1, "text_item": {"text": ["nested"]}}])),
    ],
)
def test_bad_input_is_a_malformed_skip(data: bytes) -> None:
    item = mapped(data).item
    assert isinstance(item, Skip) and item.reason == "malformed"


def test_voice_with_speech_to_text_is_text_plus_an_audio_file() -> None:
    voice = {
        "type": 3,
        "voice_item": {"text": "call me later", "media": {"encrypt_query_param": "q"}},
    }
    msg = inbound(user_msg([voice]))
    assert msg.content == "call me later"
    assert [(f.kind, f.name) for f in msg.files] == [("audio", "voice.silk")]


def test_media_become_lazy_handles_without_any_download() -> None:
    seen: list[p.MediaHandle] = []

    def fetcher_for(h: p.MediaHandle) -> Any:
        seen.append(h)
        return None

    items = [
        {"type": 2, "image_item": {"aeskey": "00" * 16, "media": {"encrypt_query_param": "img"}}},
        {
            "type": 4,
            "file_item": {
                "file_name": "report.pdf",
                "len": "1234",
                "media": {"encrypt_query_param": "f"},
            },
        },
        {"type": 5, "video_item": {"video_size": 99, "media": {"encrypt_query_param": "v"}}},
    ]
    msg = inbound(user_msg(items), fetcher_for=fetcher_for)
    assert [i.kind for i in msg.images] == ["image"]
    assert [(f.kind, f.name, f.size) for f in msg.files] == [
        ("file", "report.pdf", 1234),
        ("video", "video.mp4", 99),
    ]
    assert [h.kind for h in seen] == ["image", "file", "video"]
    assert "img" not in repr(seen[0])  # the signed parameter never shows


@pytest.mark.parametrize(
    ("aeskey", "aes_key", "expected"),
    [
        (
            "00112233445566778899aabbccddeeff",
            None,
            bytes.fromhex("00112233445566778899aabbccddeeff"),
        ),
        (None, base64.b64encode(bytes(range(16))).decode(), bytes(range(16))),
        (
            None,
            base64.b64encode(b"00112233445566778899aabbccddeeff").decode(),
            bytes.fromhex("00112233445566778899aabbccddeeff"),
        ),
        (None, base64.b64encode(b"short").decode(), None),
        ("nothex", None, None),
        (None, None, None),
    ],
)
def test_media_key_encodings(
    aeskey: str | None, aes_key: str | None, expected: bytes | None
) -> None:
    assert p.media_key(aeskey, m.Media(aes_key=aes_key)) == expected


def test_aes_ecb_round_trip_and_wrong_key() -> None:
    key = bytes(range(16))
    data = b"\x89PNG" + bytes(range(256)) * 3
    enc = crypto.encrypt(data, key)
    assert len(enc) % 16 == 0 and enc != data
    assert crypto.decrypt(enc, key) == data
    with pytest.raises(crypto.MediaDecryptError):
        crypto.decrypt(enc[:-3], key)
    with pytest.raises(ChannelError):
        crypto.decrypt(enc, bytes(16))


# --- quotes ---------------------------------------------------------------------------------


def quote(ref: dict[str, Any], **kw: Any) -> ReplyReference:
    msg = inbound(user_msg([{"type": 1, "text_item": {"text": "and?"}, "ref_msg": ref}]), **kw)
    assert msg.reply_to is not None
    return msg.reply_to


def test_quote_of_a_text_is_a_snapshot() -> None:
    ref = quote({"svr_id": 123, "message_item": {"type": 1, "text_item": {"text": "the plan"}}})
    assert (ref.message_id, ref.content, ref.recover) == ("123", "the plan", False)


def test_quote_of_a_voice_message_uses_its_speech_to_text() -> None:
    ref = quote({"message_item": {"type": 3, "msg_id": "77", "voice_item": {"text": "said this"}}})
    assert (ref.message_id, ref.content) == ("77", "said this")
    assert [a.kind for a in ref.attachments] == ["audio"]  # type: ignore[union-attr]


def test_quote_read_by_shape_not_type() -> None:
    ref = quote({"message_item": {"type": 0, "text_item": {"text": "typed 0 but has text"}}})
    assert ref.content == "typed 0 but has text" and not ref.recover


def test_quote_with_only_a_title() -> None:
    ref = quote({"title": "a summary", "svr_id": 5})
    assert (ref.content, ref.recover) == ("a summary", False)


@pytest.mark.parametrize(
    ("item", "kinds"),
    [
        ({"type": 2, "image_item": {"media": {}}}, [("image", None)]),
        ({"type": 4, "file_item": {"file_name": "a.pdf"}}, [("file", "a.pdf")]),
        ({"type": 5, "video_item": {}}, [("video", None)]),
    ],
)
def test_quote_of_media_gives_attachment_kinds(item: dict[str, Any], kinds: list[Any]) -> None:
    ref = quote({"svr_id": 9, "message_item": item})
    assert [(a.kind, a.name) for a in ref.attachments] == kinds  # type: ignore[union-attr]
    assert not ref.recover


def test_partial_quote_selects_the_part() -> None:
    full = "one two three two four"
    sel = "two four"
    partial = {
        "start": "two",
        "end": "four",
        "startindex": 1,
        "endindex": 0,
        "quotemd5": hashlib.md5(sel.encode()).hexdigest(),
    }
    ref = quote({"message_item": {"type": 1, "text_item": {"text": full}}, "partial_text": partial})
    assert ref.content == sel


def test_a_bot_answer_shell_goes_to_recovery_with_keys_and_times() -> None:
    lookups: list[p.QuoteLookup] = []

    def loader_for(lookup: p.QuoteLookup) -> Any:
        lookups.append(lookup)
        return None

    ref = quote(
        {"svr_id": SEED_ID, "message_item": {"type": 8, "create_time_ms": 1_795_000_000_000}},
        loader_for=loader_for,
    )
    assert ref.recover and ref.recover_keys == [str(SEED_ID)]
    assert ref.recover_at == 1_795_000_000.0
    assert ref.unavailable_reason is None
    [lookup] = lookups
    assert lookup.conversation_id == USER
    seed_ms = p.id_time_ms(SEED_ID, now_ms=NOW_MS)
    assert seed_ms is not None
    assert lookup.times == (1_795_000_000.0, seed_ms / 1000)


def test_an_id_only_shell_recovers_by_the_id_time() -> None:
    ref = quote({"message_item": {"type": 0, "msg_id": str(SEED_ID)}})
    assert ref.recover and ref.message_id == str(SEED_ID)
    assert ref.recover_at == p.id_time_ms(SEED_ID, now_ms=NOW_MS) / 1000  # type: ignore[operator]


def test_an_unknown_quoted_type_is_unsupported_unless_recovered() -> None:
    ref = quote({"svr_id": 1, "message_item": {"type": 42}})
    assert ref.recover and ref.unavailable_reason == "unsupported"


def test_quote_on_a_non_text_item_is_found() -> None:
    items = [
        {"type": 3, "voice_item": {"text": "hm"}, "ref_msg": {"title": "earlier"}},
    ]
    msg = inbound(user_msg(items))
    assert msg.reply_to is not None and msg.reply_to.content == "earlier"


def test_only_one_level_of_quote() -> None:
    inner = {"message_item": {"type": 1, "text_item": {"text": "x"}, "ref_msg": {"title": "deep"}}}
    ref = quote(inner)
    assert ref.content == "x"


# --- answers and errors -------------------------------------------------------------------------


def test_updates_carry_cursor_window_and_raw_messages() -> None:
    body = (
        b'{"ret":0,"msgs":[' + raw(user_msg([])) + b',{"bad":"\\ud800"}],'
        b'"get_updates_buf":"CURSOR","longpolling_timeout_ms":25000}'
    )
    batch = p.decode_updates(body)
    assert batch.cursor == "CURSOR" and batch.window_s == 25.0 and len(batch.raws) == 2
    assert isinstance(mapped(batch.raws[0]).item, InboundMessage)
    assert isinstance(mapped(batch.raws[1]).item, Skip)  # one bad message, not the batch


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"ret": -14, "errmsg": "session timeout"}, p.SessionExpired),
        ({"ret": 0, "errcode": -14}, p.SessionExpired),
        ({"ret": -2, "errmsg": ""}, p.ReplyRefused),
        ({"ret": -1}, ChannelError),
    ],
)
def test_error_codes(body: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        p.decode_updates(raw(body))
    assert issubclass(p.SessionExpired, AuthError)


def test_undecodable_answer_and_empty_send_answer() -> None:
    with pytest.raises(RemoteProtocolError):
        p.decode_envelope("x", b"<html>", m.ENVELOPE_DECODER)
    assert p.decode_envelope("sendmessage", b"", m.SENT_DECODER).message_id is None


@pytest.mark.parametrize(
    ("status", "action"),
    [
        ({"status": "wait"}, "wait"),
        ({"status": "scaned"}, "wait"),
        ({"status": "need_verifycode"}, "verify"),
        ({"status": "verify_code_blocked"}, "new_qr"),
        ({"status": "expired"}, "new_qr"),
        ({"status": "scaned_but_redirect", "redirect_host": "x.weixin.qq.com"}, "redirect"),
        ({"status": "scaned_but_redirect"}, "fail"),
        ({"status": "binded_redirect"}, "bound"),
        ({"status": "confirmed", "bot_token": "t", "ilink_bot_id": "b"}, "confirmed"),
        ({"status": "confirmed"}, "fail"),
        ({"status": "weird"}, "fail"),
    ],
)
def test_login_steps(status: dict[str, Any], action: str) -> None:
    assert p.login_step(msgspec.convert(status, m.QrStatus)).action == action


def test_plain_text_reduces_markdown() -> None:
    md = "# Title\n\n**bold** and *it* and `code`\n\n- one\n- two\n\n[site](https://x.y)\n\n```py\nx = 1\n```"
    assert (
        p.plain_text(md)
        == "Title\n\nbold and it and code\n\n• one\n• two\n\nsite (https://x.y)\n\nx = 1"
    )


def test_newer_context_token_wins() -> None:
    old = p.ContextToken("a", 5, 1000)
    assert p.ContextToken("b", 6, 900).newer_than(old)
    assert not p.ContextToken("c", 4, 2000).newer_than(old)
    assert p.ContextToken("d", None, 1001).newer_than(old)
    assert not p.ContextToken("e", None, 999).newer_than(old)


def test_headers() -> None:
    assert p.client_version("2.4.6") == 132102
    assert base64.b64decode(p.uin_header(123456)).decode() == "123456"


async def test_media_urls_stay_on_the_cdn() -> None:
    import httpx

    from dshim.channels.weixin.client import IlinkClient

    async with httpx.AsyncClient() as http:
        client = IlinkClient(http, "t", cdn_base="https://novac2c.cdn.weixin.qq.com/c2c")
        on_cdn = p.MediaHandle("image", "a b", "https://novac2c.cdn.weixin.qq.com/c2c/x?y=1", None)
        elsewhere = p.MediaHandle("image", "a b", "https://evil.example/x", None)
        plain = p.MediaHandle("image", "a b", "http://novac2c.cdn.weixin.qq.com/c2c/x", None)
        assert client.media_url(on_cdn) == on_cdn.full_url
        expected = "https://novac2c.cdn.weixin.qq.com/c2c/download?encrypted_query_param=a%20b"
        assert client.media_url(elsewhere) == client.media_url(plain) == expected


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"api_base": "ftp://x"}, "api_base: expected an http:// or https:// URL"),
        ({"token": "two words"}, "token: empty or contains whitespace"),
        ({"cdn": "https://x"}, "cdn"),
        ({"token": 5}, "token"),
    ],
)
def test_bad_settings_name_the_key(table: dict[str, Any], message: str) -> None:
    from dshim.channels.registry import parse_config
    from dshim.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_config({"bots": [{"name": "wx", "channel": "weixin", **table}]}, env={})


def test_null_msgs_is_an_empty_batch() -> None:
    batch = p.decode_updates(b'{"ret":0,"msgs":null,"get_updates_buf":"c2"}')
    assert batch.raws == [] and batch.cursor == "c2"
