"""``dshim serve --capture`` round trips on DingTalk (Stream mode) and WeCom (AI bot).

Each test runs the channel's rig (its fake on 127.0.0.1, a real SQLite file, the
recording echo harness) through ``serve_bots`` with a capture directory
(:func:`tests.test_capture.capturing`), scripts the conversation issue 29 names — a plain
direct message, a quote of the bot's own answer (DingTalk: a card quote that carries only
its placeholder and the card's process key, recovered from the message index; WeCom: the
quote carries its content), a duplicate redelivery (the same robot message pushed again;
the same WeCom ``msgid`` again), an unaddressed group message where the platform delivers
one, an addressed group message — stops, then runs a real ``dshim replay --check``
subprocess on the capture.  The prompts replay prints must be byte for byte the ones the
harness received live; no captured byte may hold a credential, an access token, a session
webhook or a media key; directories are 0700, files 0600.  Autojump clock, hard deadline
(``tests/conftest.py``), never the internet.
"""

from __future__ import annotations

from pathlib import Path

import trio

from dshim.model import ImagePart
from tests.capture_kit import Script, captured, captured_bytes, check_round_trip, fixtures_of
from tests.capture_kit import replay as _replay
from tests.channel_contract import RecordingHarness, echo_of, final_texts
from tests.rig_dingtalk import DingTalkRig
from tests.rig_wecom import WecomRig

# --- DingTalk -------------------------------------------------------------------------------


async def test_dingtalk_capture_replays_a_recovered_card_quote_a_redelivery_and_groups(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    rig = DingTalkRig()
    webhooks: list[str] = []

    def script(harness: RecordingHarness) -> Script:
        async def run() -> None:
            fake = rig.fake
            first = await rig.user_dm("list <two> things & stop")
            await rig.wait_until(
                lambda: echo_of(rig, "list <two> things & stop") in final_texts(rig)
            )
            await trio.sleep(5)
            [answer] = rig.dm_answers()
            # A quote of the bot's AI card: only its placeholder and the card's process key.
            await rig.user_dm("why the second one?", reply_to=answer.id)
            await rig.wait_until(lambda: len(harness.prompts) == 2 and len(rig.dm_answers()) == 2)
            await trio.sleep(5)
            # The Stream pushes the same robot message again (same msgId, a new frame).
            [frame] = [f for f, m in fake.pushed.items() if m["msgId"] == first]
            fake.redeliver(frame)
            await trio.sleep(5)
            # Robots get group messages only when @-mentioned; the fake pushes one anyway,
            # flagged isInAtList false, for the negative case.
            await rig.user_group("just chatting", mention=False)
            await rig.user_group("and you?", mention=True)
            await rig.wait_until(lambda: len(harness.prompts) == 3)
            await trio.sleep(5)
            webhooks.extend(m["sessionWebhook"] for m in fake.pushed.values())

        return run

    harness = await captured(rig, tmp_path, script)
    cap = tmp_path / "cap"
    fake = rig.fake
    sessions = list(fake.webhooks)
    assert len(webhooks) == 5 and len(sessions) == 4
    secrets = [rig.secret, *fake.tokens, *webhooks, *sessions]
    check_round_trip(cap, harness, prompts=3, drops={"duplicate", "unaddressed"}, secrets=secrets)
    # The card quote was recovered from the index: the card's entry is seeded, and the
    # quote carries the answer's text.
    quoted = harness.texts()[1]
    assert "<dsh_im_reply_to>" in quoted and "list \\u003ctwo\\u003e things" in quoted
    fixtures = fixtures_of(cap)
    [dm] = [fx for fx in fixtures.values() if fx["outbound"]]
    cards = {m.track_id for m in fake.messages if m.kind == "card"}
    seeded = {i for seeds in dm["outbound"].values() for s in seeds for i in s["message_ids"]}
    assert seeded and seeded <= cards
    # Each answer shown in a card is a send line (replay prints one per answer).
    assert [x["kind"] for x in dm["expect"]] == ["prompt", "send", "prompt", "send", "drop"]
    # The identity the replay adapter reads, no credential.
    assert dm["bot"] == {
        "id": fake.robot_code,
        "robot_code": fake.robot_code,
        "chatbot_user_id": fake.chatbot_user_id,
    }
    # The events are the inbox's copies: the session webhook blanked, the rest kept.
    assert fake.tokens and all(e["sessionWebhook"] == "" for e in dm["events"])
    ids = [e["msgId"] for e in dm["events"]]
    assert len(ids) == 3 and ids[0] == ids[2]  # the redelivered message, twice


# --- WeCom ----------------------------------------------------------------------------------


async def test_wecom_capture_replays_a_quote_with_content_a_repeated_msgid_and_a_group(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    rig = WecomRig()
    req_ids: list[str] = []

    def script(harness: RecordingHarness) -> Script:
        async def run() -> None:
            fake = rig.fake
            first = await fake.user_message("list <two> things & stop")
            await rig.wait_until(
                lambda: echo_of(rig, "list <two> things & stop") in final_texts(rig)
            )
            await trio.sleep(5)
            [answer] = rig.dm_answers()
            # A WeCom quote carries the quoted content (no id, author or time).
            await rig.user_dm("why the second one?", reply_to=answer.id)
            await rig.wait_until(lambda: len(harness.prompts) == 2 and len(rig.dm_answers()) == 2)
            await trio.sleep(5)
            # The same msgid delivered again (a new frame, a new req_id).
            await fake.callback("aibot_msg_callback", first)
            await trio.sleep(5)
            # WeCom delivers group messages only when they @-mention the bot.
            await rig.user_group("and you?", mention=True)
            await rig.wait_until(lambda: len(harness.prompts) == 3)
            await trio.sleep(5)
            req_ids.extend(fake.inbound)

        return run

    harness = await captured(rig, tmp_path, script)
    cap = tmp_path / "cap"
    check_round_trip(cap, harness, prompts=3, drops={"duplicate"}, secrets=[rig.secret])
    assert '"content":"\\u003cdsh_im_source\\u003e' in harness.texts()[1]
    fixtures = fixtures_of(cap)
    dm = fixtures[rig.fake.user_id]
    assert dm["bot"] == {"id": rig.fake.bot_id}
    # Frames as received: req_ids (not secrets) kept, the repeat there twice.
    msgids = [e["body"]["msgid"] for e in dm["events"]]
    assert len(msgids) == 3 and msgids[0] == msgids[2]
    assert {e["headers"]["req_id"] for e in dm["events"]} <= set(req_ids)
    assert not dm["http"] and not dm["outbound"]


async def test_wecom_capture_holds_no_media_url_or_aes_key(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """An image's signed URL and AES key are replaced (the inbox's copy, ``scrub``): no
    captured byte holds them; the event keeps its shape, with the placeholders."""
    rig = WecomRig()
    media: dict[str, str] = {}

    def script(harness: RecordingHarness) -> Script:
        async def run() -> None:
            fake = rig.fake
            media.update(fake.add_media(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64))
            await fake.callback("aibot_msg_callback", fake.body("image", extra={"image": media}))
            await rig.wait_until(lambda: len(harness.prompts) == 1)
            await trio.sleep(5)

        return run

    harness = await captured(rig, tmp_path, script)
    assert any(isinstance(p, ImagePart) for p in harness.prompts[0])  # downloaded live
    cap = tmp_path / "cap"
    data = captured_bytes(cap)
    token = media["url"].rsplit("/", 1)[-1]
    for secret in [rig.secret, media["aeskey"], media["url"], token]:
        assert secret.encode() not in data, secret
    [dm] = fixtures_of(cap).values()
    assert dm["events"][0]["body"]["image"] == {"url": "dshim:removed", "aeskey": ""}
    # Replay cannot download what the capture left out; the live prompt had the image,
    # and the replayed one has it too (the placeholder every replayed image is).
    assert dm["expect"][0]["images"] == 1
    checked = _replay("--check", str(cap))
    assert checked.returncode == 0, checked.stdout + checked.stderr


async def test_dingtalk_capture_of_a_picture_and_its_quote_replays_without_the_download(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """A picture's ``downloadCode`` is kept (it opens nothing without the app's access
    token); the signed download URL the OpenAPI answers with is not in the capture. A
    quote of the picture, which DingTalk sends without content, is recovered from the
    index both live and in replay (the picture's entry is recreated by replaying it)."""
    rig = DingTalkRig()

    def script(harness: RecordingHarness) -> Script:
        async def run() -> None:
            fake = rig.fake
            fake.files["pic-1"] = b"\x89PNG\r\n\x1a\nfake-image"
            pic = fake.user_message(
                fake.dm_conversation, msgtype="picture", content={"downloadCode": "pic-1"}
            )
            await rig.wait_until(lambda: len(harness.prompts) == 1)
            await trio.sleep(5)
            quote = {"msgId": pic["msgId"], "msgType": "picture", "senderId": pic["senderId"]}
            fake.user_message(
                fake.dm_conversation,
                "what is on it?",
                extra={
                    "text": {"content": "what is on it?", "isReplyMsg": True, "repliedMsg": quote}
                },
            )
            await rig.wait_until(lambda: len(harness.prompts) == 2)
            await trio.sleep(5)

        return run

    harness = await captured(rig, tmp_path, script)
    assert any(isinstance(p, ImagePart) for p in harness.prompts[0])  # downloaded live
    assert '"attachments":[{"kind":"image"' in harness.texts()[1]  # the quote, recovered
    cap = tmp_path / "cap"
    fake = rig.fake
    secrets = [rig.secret, *fake.tokens, *fake.webhooks, f"{fake.api_base}/files/pic-1"]
    check_round_trip(cap, harness, prompts=2, drops=set(), secrets=secrets)
    [dm] = fixtures_of(cap).values()
    assert dm["events"][0]["content"] == {"downloadCode": "pic-1"}
