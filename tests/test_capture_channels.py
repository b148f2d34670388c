"""``dshim serve --capture`` round trips on Discord, WhatsApp (Cloud API) and WeChat (iLink).

Each test runs the channel's rig (its fake on 127.0.0.1, a real SQLite file, the
recording echo harness) through ``serve_bots`` with a capture directory
(``tests.test_capture.capturing``), scripts a conversation with every case issue 29
names — a plain direct message, a quote that needs a platform lookup (Discord: a bare
reference fetched with ``GET /channels/{id}/messages/{id}``) or the bot's own answer
recovered from the message index (WhatsApp and WeChat have no fetch API), a duplicate
redelivery (a gateway Resume replaying dispatches, a webhook body delivered again, an
iLink message redelivered) and an unaddressed group message — stops, then runs a real
``dshim replay --check`` subprocess on the capture.  The prompts replay prints must be
byte for byte the ones the harness received live; no captured byte may hold a
credential; directories are 0700, files 0600.  Autojump clock, hard deadline
(``tests/conftest.py``), never the internet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from structlog.testing import capture_logs

from dshim.channels.weixin.channel import media_secrets
from dshim.model import ImagePart
from dshim.replay import load_fixture
from dshim.testing.fakes.weixin import FakeWeixin
from dshim.testing.fakes.whatsapp import TEST_APP_SECRET, TEST_VERIFY_TOKEN
from tests.capture_kit import Script, captured, check_round_trip, fixtures_of
from tests.capture_kit import replay as _replay
from tests.channel_contract import RecordingHarness, echo_of, final_texts
from tests.rig_discord import DiscordRig
from tests.rig_weixin import WeixinRig
from tests.rig_whatsapp import GROUP_ID, WhatsAppRig

# --- Discord ------------------------------------------------------------------------------


async def test_discord_capture_replays_a_looked_up_quote_a_resume_replay_and_a_guild_message(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    rig = DiscordRig()
    answer_id = ""

    def script(harness: RecordingHarness) -> Script:
        async def run() -> None:
            nonlocal answer_id
            fake = rig.fake
            await rig.user_dm("list <two> things & stop")
            first = echo_of(rig, "list <two> things & stop")
            await rig.wait_until(lambda: first in final_texts(rig))
            await trio.sleep(5)
            [answer] = rig.dm_answers()
            answer_id = answer.id
            # A bare reference (no referenced_message): the channel fetches the message.
            await fake.user_message(
                fake.dm_channel, "why the second one?", reply_to=answer.id, reference="bare"
            )
            await rig.wait_until(lambda: len(harness.prompts) == 2 and len(rig.dm_answers()) == 2)
            await trio.sleep(5)
            # The socket drops; the Resume replays dispatches the bot already had.
            fake.replay_on_resume = 4
            await rig.drop_connection()
            await fake.wait_until(lambda: fake.resumed_count >= 1)
            await trio.sleep(5)
            await rig.user_group("just chatting", mention=False)
            await rig.user_group("and you?", mention=True)
            await rig.wait_until(lambda: len(harness.prompts) == 3)
            await trio.sleep(5)

        return run

    harness = await captured(rig, tmp_path, script)
    cap = tmp_path / "cap"
    lines = check_round_trip(cap, harness, prompts=3, secrets=[rig.secret])
    # The lookup is in the capture, path relative to api_base, and replay makes it again.
    path = f"/channels/{rig.fake.dm_channel}/messages/{answer_id}"
    [dm] = [fx for fx in fixtures_of(cap).values() if fx["http"]]
    assert [(h["method"], h["path"], h["status"]) for h in dm["http"]] == [("GET", path, 200)]
    assert dm["http"][0]["json"]["id"] == answer_id
    assert {"kind": "http", "method": "GET", "path": path} in [
        {k: x.get(k) for k in ("kind", "method", "path")} for x in lines if x["kind"] == "http"
    ]
    # The quote's prompt carries the fetched answer.
    quoted = harness.texts()[1]
    assert f'"messageId":"{answer_id}"' in quoted
    # The replayed dispatches are events of the capture (the same frames again).
    frames = [json.dumps(e, sort_keys=True) for e in dm["events"]]
    assert len(frames) > len(set(frames))
    assert load_fixture(next(cap.rglob("*.json"))).bot["id"] == rig.fake.bot_user["id"]


# --- WhatsApp -----------------------------------------------------------------------------


async def test_whatsapp_capture_replays_a_recovered_quote_a_webhook_retry_and_a_group(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    rig = WhatsAppRig()
    bodies: list[bytes] = []
    answer_id = ""

    def script(harness: RecordingHarness) -> Script:
        async def deliver(
            *messages: dict[str, Any], statuses: tuple[dict[str, Any], ...] = ()
        ) -> None:
            body = rig.fake.body(list(messages), list(statuses))
            bodies.append(body)
            await rig.fake.deliver(body)

        async def run() -> None:
            nonlocal answer_id
            fake, ada = rig.fake, rig.ada
            assert ada is not None
            await deliver(fake.user_message(ada, "list <two> things & stop"))
            first = echo_of(rig, "list <two> things & stop")
            await rig.wait_until(lambda: first in final_texts(rig))
            await trio.sleep(5)
            [answer] = rig.dm_answers()
            answer_id = answer.id
            # A quote carries only the quoted wamid: the answer comes from the index.
            await deliver(fake.user_message(ada, "why the second one?", reply_to=answer.id))
            await rig.wait_until(lambda: len(harness.prompts) == 2 and len(rig.dm_answers()) == 2)
            await trio.sleep(5)
            # A body of a message and a status, delivered again (its 200 was lost).
            [sent] = [s for s in fake.sent if s.id == answer.id]
            await deliver(
                fake.user_message(ada, "one more thing"),
                statuses=(fake.status_update(sent, "read"),),
            )
            await rig.wait_until(lambda: len(harness.prompts) == 3)
            await fake.deliver(bodies[-1])
            await trio.sleep(5)
            await deliver(fake.user_message(ada, "just chatting", group_id=GROUP_ID))
            mention = f"@{fake.display_phone_number} and you?"
            await deliver(fake.user_message(ada, mention, group_id=GROUP_ID))
            await rig.wait_until(lambda: len(harness.prompts) == 4)
            await trio.sleep(5)

        return run

    harness = await captured(rig, tmp_path, script)
    cap = tmp_path / "cap"
    # The webhook's signature header is never captured (nor the endpoint's own token).
    signatures = [rig.fake.signature(b).removeprefix("sha256=") for b in bodies]
    secrets = [rig.secret, TEST_APP_SECRET, TEST_VERIFY_TOKEN, *signatures]
    check_round_trip(cap, harness, prompts=4, secrets=secrets)
    fixtures = fixtures_of(cap)
    dm = fixtures[rig.ada.key if rig.ada else ""]
    # The identity the replay adapter reads (as GET /<PHONE_NUMBER_ID> gave it), no more.
    assert dm["bot"] == {
        "id": rig.fake.phone_number_id,
        "phone_number_id": rig.fake.phone_number_id,
        "display_phone_number": f"+{rig.fake.display_phone_number}",
        "verified_name": rig.fake.verified_name,
    }
    # The quoted answer was recovered from the index: its entry is seeded.
    seeded = {i for seeds in dm["outbound"].values() for s in seeds for i in s["message_ids"]}
    assert answer_id in seeded
    assert not dm["http"]
    # Each event is one message's webhook entry, as the reader accepted it (the status
    # of the retried body is the reader's, not the pipeline's); the retry is there twice.
    texts = [
        m["text"]["body"]
        for e in dm["events"]
        for [entry] in [e["entry"]]
        for [change] in [entry["changes"]]
        for m in change["value"]["messages"]
    ]
    assert texts == [
        "list <two> things & stop",
        "why the second one?",
        "one more thing",
        "one more thing",
    ]
    assert all("statuses" not in e["entry"][0]["changes"][0]["value"] for e in dm["events"])


# --- WeChat -------------------------------------------------------------------------------


async def test_weixin_capture_replays_a_recovered_quote_a_redelivery_and_a_group(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    rig = WeixinRig()
    answer_id = ""

    def script(harness: RecordingHarness) -> Script:
        async def run() -> None:
            nonlocal answer_id
            fake = rig.fake
            fake.user_message("list <two> things & stop")
            first = echo_of(rig, "list <two> things & stop")
            await rig.wait_until(lambda: first in final_texts(rig))
            await trio.sleep(5)
            [answer] = rig.dm_answers()
            answer_id = answer.id
            # A quote of the bot's message is a shell with times only: the index answers.
            quote = fake.user_message("why the second one?", quote=fake.quote_of(answer.id))
            await rig.wait_until(lambda: len(harness.prompts) == 2 and len(rig.dm_answers()) == 2)
            await trio.sleep(5)
            fake.redeliver(quote)  # iLink delivers the same message again
            await trio.sleep(5)
            # iLink bots answer direct chats only: a group message is never addressed.
            fake.user_message("just chatting", group_id="1234@chatroom")
            fake.user_message("and you?")
            await rig.wait_until(lambda: len(harness.prompts) == 3)
            await trio.sleep(5)

        return run

    harness = await captured(rig, tmp_path, script)
    cap = tmp_path / "cap"
    check_round_trip(cap, harness, prompts=3, secrets=[rig.secret])
    # The answer is authored by the bot's configured name, live and in replay.
    assert f'"messageId":"{answer_id}"' in harness.texts()[1]
    assert '"authorName":"contract"' in harness.texts()[1]
    dm = next(fx for fx in fixtures_of(cap).values() if fx["outbound"])
    assert dm["bot"] == {"id": rig.fake.bot_id, "name": "contract"}
    seeded = {i for seeds in dm["outbound"].values() for s in seeds for i in s["message_ids"]}
    assert answer_id in seeded
    ids = [e["message_id"] for e in dm["events"]]
    assert len(ids) == 4 and len(set(ids)) == 3  # the redelivered one twice


def _image(fake: FakeWeixin) -> tuple[dict[str, Any], list[str]]:
    param, key = fake.add_media(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    item = {"type": 2, "image_item": {"aeskey": key, "media": {"encrypt_query_param": param}}}
    return item, [param, key]


async def test_weixin_capture_holds_no_media_key_or_signed_cdn_parameter(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """An image's AES key and CDN parameter, its own and a quoted one's, are secrets: no
    captured byte and no log record holds them; the captured events keep their shape."""
    rig = WeixinRig()
    keys: list[str] = []

    def script(harness: RecordingHarness) -> Script:
        async def run() -> None:
            fake = rig.fake
            item, secrets = _image(fake)
            keys.extend(secrets)
            photo = fake.user_message(items=[item])
            await rig.wait_until(lambda: len(harness.prompts) == 1)
            await trio.sleep(5)
            fake.user_message("what is on it?", quote=fake.quote_of(photo["message_id"]))
            await rig.wait_until(lambda: len(harness.prompts) == 2)
            await trio.sleep(5)

        return run

    with capture_logs() as logs:
        harness = await captured(rig, tmp_path, script)
    assert any(isinstance(p, ImagePart) for p in harness.prompts[0])  # downloaded live
    cap = tmp_path / "cap"
    data = b"".join(p.read_bytes() for p in cap.rglob("*") if p.is_file())
    for secret in [rig.secret, *keys]:
        assert secret.encode() not in data, secret
        assert not [e for e in logs if secret in repr(e)]
    [dm] = fixtures_of(cap).values()
    own = dm["events"][0]["item_list"][0]["image_item"]
    quoted = dm["events"][1]["item_list"][0]["ref_msg"]["message_item"]["image_item"]
    for image in (own, quoted):
        assert image["aeskey"] and image["media"]["encrypt_query_param"]  # masked, kept


def test_media_secrets_are_every_key_and_cdn_reference_of_items_and_quotes() -> None:
    media = {"encrypt_query_param": "param-1a2b3c", "aes_key": "a2V5LWtleS1rZXk=", "full_url": ""}
    entry = {
        "message_id": 1,
        "item_list": [
            {"type": 2, "image_item": {"aeskey": "00112233445566778899aabbccddeeff"}},
            {"type": 3, "voice_item": {"media": media}},
            {"type": 4, "file_item": {"media": {"full_url": "https://cdn/x?sig=s3cr3t"}}},
            {
                "type": 1,
                "text_item": {"text": "see"},
                "ref_msg": {"message_item": {"type": 5, "video_item": {"media": media}}},
            },
        ],
    }
    got = media_secrets(json.dumps(entry).encode())
    assert sorted(set(got)) == sorted(
        {
            "00112233445566778899aabbccddeeff",
            "param-1a2b3c",
            "a2V5LWtleS1rZXk=",
            "https://cdn/x?sig=s3cr3t",
        }
    )
    assert media_secrets(b'{"message_id": 1, "item_list": [{"type": 1}]}') == []
    assert media_secrets(b'{"aes_key": [') == []  # unreadable: the mapping's malformed drop


async def test_whatsapp_capture_keeps_a_signed_body_that_is_no_notification(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    # Signed by Meta but not a notification: a malformed drop, and the capture keeps the
    # body (a capture holds every event, the dropped ones too) so replay shows the drop.
    rig = WhatsAppRig()
    odd = b'{"object":"whatsapp_business_account","entry":"not a list"}'

    def script(harness: RecordingHarness) -> Script:
        async def run() -> None:
            assert await rig.fake.deliver(odd) == 200
            assert rig.ada is not None
            await rig.fake.deliver(rig.fake.body([rig.fake.user_message(rig.ada, "still there?")]))
            await rig.wait_until(lambda: len(harness.prompts) == 1)
            await trio.sleep(5)

        return run

    await captured(rig, tmp_path, script)
    cap = tmp_path / "cap"
    [unsorted] = [p for p in cap.rglob("*.json") if p.parent.name == "_unsorted"]
    events = json.loads(unsorted.read_bytes())["events"]
    assert events == [json.loads(odd)]
    checked = _replay("--check", str(cap))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    printed = [json.loads(x) for x in _replay(str(unsorted)).stdout.splitlines()]
    assert [(x["kind"], x.get("reason")) for x in printed] == [("drop", "malformed")]
