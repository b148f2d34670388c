"""Substitute targets given by email or union_id, resolved to this app's open_ids.

Feishu mentions carry the app-scoped ``open_id`` (and ``union_id`` / ``user_id``), so a
target configured by email matches nothing until the contact API names its open_id:
``POST contact/v3/users/batch_get_id`` (emails -> open_ids, one call) and ``GET
contact/v3/users/{id}`` (the strict profile: :class:`~.protocol.Profile`).  One
identifier per target, in this order: open_id, union_id, email, user_id.

Per target (the line reasons of the probe):

- open_id: kept as typed; checked only when asked (the probe): a cross-app id is
  ``cross_app_open_id``, one outside the contact visibility ``not_visible``, an invalid
  one ``unresolvable``, a failed lookup ``resolve_failed``;
- union_id: its profile names the open_id; a definite miss is ``unresolvable`` and a
  failed lookup ``resolve_failed`` -- the target still matches mentions by union_id;
- email: the batch call names the open_id (its profile, when it answers, the name); an
  unknown email is ``unresolvable``, a failed batch ``resolve_failed``: either way the
  target has nothing to match and is dropped;
- user_id alone: matched as is (no lookup).

A transient failure is never reported as a definite cause and never cached; definite
profile outcomes are cached per directory (at most :data:`CACHE_MAX`, then cleared).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import structlog

from dshim.channels.base import SubstituteTarget
from dshim.channels.feishu.client import RestClient
from dshim.channels.feishu.protocol import OPEN_ID_REASONS, Profile, profile_failure, profile_of
from dshim.errors import ChannelError

log = structlog.get_logger("dshim.feishu")

CACHE_MAX = 1000


class Directory:
    """Contact lookups of one bot, definite outcomes cached."""

    def __init__(self, rest: RestClient) -> None:
        self.rest = rest
        self._profiles: dict[tuple[str, str], Profile] = {}

    async def profile(self, user_id: str, id_type: str = "open_id") -> Profile:
        key = (id_type, user_id)
        hit = self._profiles.get(key)
        if hit is not None:
            return hit
        try:
            found = profile_of(await self.rest.user_profile(user_id, id_type))
        except ChannelError as exc:
            found = profile_failure(exc.code)
            if not found.definite:
                log.info("contact_lookup_failed", id_type=id_type, error=str(exc)[:200])
        if found.definite:
            if len(self._profiles) >= CACHE_MAX:
                self._profiles.clear()
            self._profiles[key] = found
        return found

    async def open_ids(self, emails: Sequence[str]) -> tuple[dict[str, str], bool]:
        """(lower-cased email -> open_id, whether the batch failed transiently)."""
        if not emails:
            return {}, False
        try:
            answer = await self.rest.ids_by_email(list(emails))
        except ChannelError as exc:
            log.info("contact_lookup_failed", id_type="email", error=str(exc)[:200])
            return {}, True
        entries = answer.data.user_list if answer.data and answer.data.user_list else []
        return {e.email.lower(): e.user_id for e in entries if e.email and e.user_id}, False


@dataclass(frozen=True, slots=True)
class Resolution:
    """One configured target: the copy matching uses (None: dropped), the reason of a
    failed resolution, and the profile when one was looked up."""

    configured: SubstituteTarget
    target: SubstituteTarget | None
    reason: str | None = None
    profile: Profile | None = None

    @property
    def label(self) -> str:
        return self.configured.name or self.configured.prompt_id()


def needs_lookup(targets: Sequence[SubstituteTarget]) -> bool:
    """Does any target lack an open_id but have a union_id or an email?"""
    return any(t.open_id is None and (t.union_id or t.email) for t in targets)


def _named(target: SubstituteTarget, profile: Profile | None, open_id: str) -> SubstituteTarget:
    name = target.name
    if name is None and profile is not None and profile.outcome == "ok":
        name = profile.name
    return msgspec.structs.replace(target, open_id=open_id, name=name)


async def resolve_targets(
    directory: Directory, targets: Sequence[SubstituteTarget], *, check_open_ids: bool = False
) -> list[Resolution]:
    """Each target resolved (see the module docstring); ``check_open_ids``: look typed
    open_ids up too (the probe)."""
    emails = [t.email for t in targets if t.open_id is None and not t.union_id and t.email]
    by_email, errored = await directory.open_ids(list(dict.fromkeys(emails)))
    out: list[Resolution] = []
    for t in targets:
        if t.open_id is not None:
            if not check_open_ids:
                out.append(Resolution(t, t))
                continue
            profile = await directory.profile(t.open_id)
            reason = OPEN_ID_REASONS[profile.outcome]
            kept = _named(t, profile, t.open_id) if reason is None else None
            out.append(Resolution(t, kept, reason, profile))
        elif t.union_id:
            profile = await directory.profile(t.union_id, "union_id")
            if profile.outcome == "ok" and profile.open_id:
                out.append(Resolution(t, _named(t, profile, profile.open_id), None, profile))
            else:
                reason = "resolve_failed" if profile.outcome == "error" else "unresolvable"
                out.append(Resolution(t, t, reason, profile))  # still matches by union_id
        elif t.email:
            open_id = by_email.get(t.email.lower())
            if open_id is None:
                reason = "resolve_failed" if errored else "unresolvable"
                keep = t if t.user_id else None  # a user_id still matches
                out.append(Resolution(t, keep, reason))
                continue
            # The open_id is this app's: a failed profile lookup only costs the name.
            profile = await directory.profile(open_id)
            out.append(Resolution(t, _named(t, profile, open_id), None, profile))
        else:
            out.append(Resolution(t, t))  # a user_id: matched as is
    return out
