"""Discord: Gateway v10 (trio-websocket) + REST v10, hand-written.  See ``protocol.py``."""
