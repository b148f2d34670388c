"""Platform ids and event times checked at decode: bounded length, a known shape.

Every id a platform hands us may end up in a URL path or query (``GET
/messages/{message_id}``, ``POST /v2/users/{user_openid}/messages``) or in a store key.
An id of 70 KiB makes httpx refuse the URL, one with ``/``, ``?``, ``#`` or ``..`` points
the request somewhere else, one with control characters breaks logs and keys.  None of
that is a platform's real id, so such an event is refused where it is decoded, as every
other bad event is: a ``malformed`` :class:`~dshim.model.Skip` (one logged drop; the bot
goes on with the next event).

The rules, per field:

- the ids that say *what* the message is and *where* it goes -- its own id, the chat /
  conversation / channel / group, the sender, the thread or topic, media handles -- must
  be valid, or the whole event is a ``malformed`` drop (:func:`check_id`, which raises
  :class:`BadId`, a ``ValueError`` the channels' decode already turns into that drop);
- an id that only names something *else* -- the message being quoted or replied to --
  never costs the current message: a bad one makes the quote unavailable
  (``unavailable_reason`` ``not-found``: no lookup is attempted) and the message goes on
  (:func:`valid_id` to decide).

An id is at most :data:`MAX_ID_CHARS` characters (real ones are far shorter: Slack's
``ts`` 17, Discord's snowflakes 20, Feishu's ``om_`` ids 35, WhatsApp's ``wamid`` about
60) of the shape the platform uses.  The shapes are :class:`IdShape` values built from
the character classes below; each channel names the shapes of its own fields, next to
the platform fact they come from (``protocol.py``).  An id made of dots only (``.``,
``..``) is refused by every shape: it is a path segment of its own.

Times: :func:`check_time` refuses an event time that is not a finite epoch time between
:data:`MIN_EPOCH_S` (exclusive of negatives; 0 means "not given") and
:data:`MAX_EPOCH_S` -- a time past the year 2100 is no platform's clock but a corrupt or
hostile field, and would otherwise skew staleness checks and the replay's timeline.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TypeGuard

__all__ = [
    "MAX_EPOCH_S",
    "MAX_ID_CHARS",
    "MIN_EPOCH_S",
    "BadId",
    "BadTime",
    "IdShape",
    "check_id",
    "check_optional_id",
    "check_time",
    "plausible_time",
    "shape",
    "valid_id",
]

#: The longest id accepted from any platform.
MAX_ID_CHARS = 512
#: Event times are epoch seconds in ``[MIN_EPOCH_S, MAX_EPOCH_S]`` (0: the event has none).
MIN_EPOCH_S = 0.0
#: 2100-01-01T00:00:00Z.
MAX_EPOCH_S = 4_102_444_800.0

# Character classes shared by several platforms (regular-expression class bodies).
#: ASCII letters and digits.
ALNUM = "A-Za-z0-9"
#: Letters, digits, ``_`` and ``-``: base64url and most prefixed ids (``om_…``, ``oc_…``).
TOKEN = ALNUM + "_\\-"


class BadId(ValueError):
    """An id of the wrong shape or length (the message never repeats the id itself)."""


class BadTime(ValueError):
    """An event time that is no plausible clock reading."""


@dataclass(frozen=True, slots=True)
class IdShape:
    """What one kind of platform id looks like: ``pattern`` must match the whole id."""

    name: str
    pattern: re.Pattern[str]

    def matches(self, value: str) -> bool:
        """True when ``value`` is an id of this shape (length included)."""
        return (
            0 < len(value) <= MAX_ID_CHARS
            and self.pattern.fullmatch(value) is not None
            and value.strip(".") != ""
        )


def shape(name: str, pattern: str) -> IdShape:
    """An :class:`IdShape` for the full-match regular expression ``pattern`` (ASCII).

    ``shape("digits", "[0-9]+")``, ``shape("slack ts", "[0-9]+\\\\.[0-9]+")``.  The
    length bound is :data:`MAX_ID_CHARS` whatever the pattern says.
    """
    return IdShape(name, re.compile(pattern, re.ASCII))


#: Decimal digits (Discord snowflakes, QQ guild ids, WhatsApp phone numbers ...).
DIGITS = shape("digits", "[0-9]+")


def valid_id(value: str | None, kind: IdShape) -> TypeGuard[str]:
    """True when ``value`` is a string id of shape ``kind`` (None and "" are not)."""
    return isinstance(value, str) and kind.matches(value)


def check_id(value: str, kind: IdShape, field: str) -> str:
    """``value`` when it is an id of shape ``kind``, else :class:`BadId` naming ``field``.

    The error says what is wrong and how long the value is, never the value: it may be
    70 KiB, and it is the platform's or an attacker's text, not ours to log.
    """
    if isinstance(value, str) and kind.matches(value):
        return value
    if not isinstance(value, str):
        raise BadId(f"{field}: not a string")
    if len(value) > MAX_ID_CHARS:
        raise BadId(f"{field}: {len(value)} characters, more than {MAX_ID_CHARS}")
    raise BadId(f"{field}: not a {kind.name} id ({len(value)} characters)")


def check_optional_id(value: str | None, kind: IdShape, field: str) -> str | None:
    """As :func:`check_id` for a field the platform may leave out: None and "" pass as
    None."""
    if value is None or value == "":
        return None
    return check_id(value, kind, field)


def plausible_time(t: float) -> bool:
    """True for 0 ("no time") and finite epoch seconds up to :data:`MAX_EPOCH_S`."""
    return isinstance(t, int | float) and math.isfinite(t) and MIN_EPOCH_S <= t <= MAX_EPOCH_S


def check_time(t: float, field: str) -> float:
    """``t`` when :func:`plausible_time`, else :class:`BadTime` naming ``field``."""
    if not plausible_time(t):
        raise BadTime(f"{field}: not a plausible time")
    return t
