"""What the `tpserve` commands share: help settings, the options that find a daemon, the client
they connect with, and how a command fails.

Light on purpose: this module imports click and the standard library only; the client library
(zmq, msgpack) is imported when a command connects, so `stop` and `--help` never load it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

import click

from tpserve.client.addresses import RuntimeDirError, client_address, resolve_runtime_dir
from tpserve.server.runtime import PID_NAME, live_daemon_pid

CONTEXT = dict(help_option_names=["-h", "--help"], max_content_width=100)


def runtime_dir_option(f):
    return click.option("--runtime-dir", type=click.Path(file_okay=False), show_envvar=True,
                        envvar="TPSERVE_RUNTIME_DIR",
                        help="directory of the socket, pid file and log "
                             "[default: $XDG_RUNTIME_DIR/tpserve or ~/.tpserve]")(f)


def address_option(f):
    return click.option("--address", show_envvar=True, envvar="TPSERVE_ADDRESS", metavar="ADDR",
                        help="ZMQ endpoint: ipc://PATH or tcp://HOST:PORT "
                             "[default: ipc://RUNTIME_DIR/tpserve.sock]")(f)


def client_options(timeout: float):
    """Options of commands that talk to a running daemon; ``timeout`` is the --timeout default."""
    def decorate(f):
        opts = [
            address_option,
            runtime_dir_option,
            click.option("--timeout", type=float, default=timeout, show_default=True, show_envvar=True,
                         envvar="TPSERVE_TIMEOUT", help="seconds to wait for each reply"),
            click.option("--server-key", show_envvar=True, envvar="TPSERVE_SERVER_KEY", metavar="FILE",
                         help="the daemon's public key file (.key) when it uses CurveZMQ"),
            click.option("--client-key", type=click.Path(dir_okay=False), show_envvar=True,
                         envvar="TPSERVE_CLIENT_KEY", metavar="FILE",
                         help="this client's .key_secret file [default: a fresh key pair]"),
        ]
        for opt in reversed(opts):
            f = opt(f)
        return f
    return decorate


def connect(kw: dict):
    """A Client for a command's client options; fails (status 1) at once when no daemon runs.

    Without --address the runtime dir's pid-file lock says at once whether its daemon is alive
    (a socket file left by a killed daemon would only time out, and is cleaned up here), and its
    ready file has the address it serves on, which need not be the default socket.
    """
    if kw["address"]:
        address = kw["address"]
    else:
        rd = resolve_runtime_dir(kw["runtime_dir"])
        if (live_pid(rd) if rd.is_dir() else None) is None:
            fail(f"no tpserve daemon is running with runtime dir {rd} (no live process holds "
                 f"{rd / PID_NAME}); start one with `tpserve start`")
        address = client_address(None, rd)
    if address.startswith("ipc://") and not os.path.exists(address[len("ipc://"):]):
        fail(f"no tpserve daemon at {address} (the socket does not exist); start one with `tpserve start`")
    from tpserve.client.client import Client
    from tpserve.client.keys import KeyFileError, load_public_key, load_secret_keys
    server_key = client_keys = None
    try:
        if kw.get("server_key"):
            server_key = load_public_key(kw["server_key"])
        if kw.get("client_key"):
            client_keys = load_secret_keys(kw["client_key"])
    except KeyFileError as e:
        raise click.BadParameter(str(e)) from None
    return Client(address, timeout=kw["timeout"], runtime_dir=kw["runtime_dir"], server_public_key=server_key,
                  client_keys=client_keys)


def live_pid(rd: Path) -> int | None:
    """The pid of ``rd``'s live daemon, or None (a dead daemon's files are removed)."""
    try:
        return live_daemon_pid(rd)
    except RuntimeDirError as e:
        fail(str(e))


def fail(message: str) -> NoReturn:
    """An operational failure: the message on stderr, exit status 1."""
    click.echo(f"tpserve: {message}", err=True)
    sys.exit(1)
