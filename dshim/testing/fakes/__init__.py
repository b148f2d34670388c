"""Fake platform servers speaking the real wire protocols on 127.0.0.1."""
