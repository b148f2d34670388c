"""AES-128-ECB with PKCS#7 padding, as the iLink CDN stores media (``cryptography``).

ECB is not a choice dshim makes: it is how iLink encrypts every file on its CDN (the key
travels in the message).  Sans-IO: bytes in, bytes out.  ``cryptography`` is imported at
the first media call: its Rust extension is ~6 MB of every process otherwise.
"""

from __future__ import annotations

from dshim.errors import ChannelError

BLOCK = 16


class MediaDecryptError(ChannelError):
    """The downloaded media does not decrypt with its key (wrong key, damaged data)."""


def decrypt(data: bytes, key: bytes) -> bytes:
    """Decrypt AES-128-ECB ciphertext and strip its PKCS#7 padding."""
    from cryptography.hazmat.primitives import padding
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    if len(key) != BLOCK:
        raise MediaDecryptError("media key is not 16 bytes")
    if not data or len(data) % BLOCK:
        raise MediaDecryptError("encrypted media is not a whole number of AES blocks")
    dec = Cipher(algorithms.AES(key), modes.ECB()).decryptor()  # noqa: S305 - iLink's cipher
    padded = dec.update(data) + dec.finalize()
    unpad = padding.PKCS7(128).unpadder()
    try:
        return unpad.update(padded) + unpad.finalize()
    except ValueError:
        raise MediaDecryptError("encrypted media has bad padding (wrong key?)") from None


def encrypt(data: bytes, key: bytes) -> bytes:
    """Encrypt with AES-128-ECB and PKCS#7 padding (uploads; the fake CDN)."""
    from cryptography.hazmat.primitives import padding
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    if len(key) != BLOCK:
        raise MediaDecryptError("media key is not 16 bytes")
    pad = padding.PKCS7(128).padder()
    padded = pad.update(data) + pad.finalize()
    enc = Cipher(algorithms.AES(key), modes.ECB()).encryptor()  # noqa: S305 - iLink's cipher
    return enc.update(padded) + enc.finalize()
