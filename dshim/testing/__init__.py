"""Test support that ships with dshim: fake platform servers and recording outbounds."""
