"""The WeChat (personal, Tencent iLink) channel: QR login, ``getupdates`` long polling,
context tokens, quotes from the message index, AES-128-ECB media."""
