"""Telegram: Bot API long polling, quoted replies, streaming by edits.

``models`` (msgspec views), ``protocol`` (sans-IO mapping, errors, poller), ``client``
(the hand-written Bot API client), ``render`` (the outbound side), ``channel`` (run,
replay adapter, probe).  The fake Bot API is :mod:`dshim.testing.fakes.telegram`.
"""
