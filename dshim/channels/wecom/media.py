"""WeCom media decryption (sans-IO): AES-256-CBC with the per-URL ``aeskey``.

protocols/wecom.md §6 (the SDK's ``src/crypto.ts``, doc 100719): key =
base64-decode(``aeskey``), 32 bytes; IV = the key's first 16 bytes; the plaintext is
PKCS#7-padded to a **32-byte** block (pad value 1..32), so the library's 16-byte unpadding
cannot be used: the padding is checked and stripped here by hand.

When downloads happen: a media URL expires about 5 minutes after the callback.  The
handle made by the channel downloads when the pipeline asks for it, which is when the
turn starts (prompt assembly); a turn queued for longer than that behind others in the
same conversation finds the URL expired and the agent is told the file could not be
downloaded (the message itself still goes through).

``cryptography`` is imported at the first media call: its Rust extension is ~6 MB of every
process otherwise.
"""

from __future__ import annotations

import base64
import binascii

from dshim.errors import ChannelError

BLOCK = 32


class MediaError(ChannelError):
    """The media could not be decrypted (bad key, bad padding, truncated)."""


def media_key(aeskey: str) -> bytes:
    """The 32-byte key of an ``aeskey`` (base64, with or without its ``=`` padding)."""
    text = aeskey.strip()
    try:
        key = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("media: the aeskey is not base64") from None
    if len(key) != 32:
        raise MediaError(f"media: the aeskey is {len(key)} bytes, expected 32")
    return key


def pad(data: bytes) -> bytes:
    """PKCS#7 to 32-byte blocks (what WeCom does; the fake encrypts with it)."""
    n = BLOCK - len(data) % BLOCK
    return data + bytes([n]) * n


def unpad(data: bytes) -> bytes:
    """Strip 32-byte PKCS#7 padding, checking it."""
    if not data:
        raise MediaError("media: empty ciphertext")
    n = data[-1]
    if not 1 <= n <= BLOCK or n > len(data) or data[-n:] != bytes([n]) * n:
        raise MediaError("media: bad padding (wrong key?)")
    return data[:-n]


def encrypt(plain: bytes, key: bytes) -> bytes:
    """AES-256-CBC, IV = key[:16], 32-byte PKCS#7 (for the fake and tests)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    enc = Cipher(algorithms.AES(key), modes.CBC(key[:16])).encryptor()
    return enc.update(pad(plain)) + enc.finalize()


def decrypt(data: bytes, key: bytes) -> bytes:
    """Decrypt a downloaded media body."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    if len(data) % 16:
        raise MediaError("media: the ciphertext is not a whole number of AES blocks")
    dec = Cipher(algorithms.AES(key), modes.CBC(key[:16])).decryptor()
    return unpad(dec.update(data) + dec.finalize())
