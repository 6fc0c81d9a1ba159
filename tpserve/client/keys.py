"""CurveZMQ key files for a daemon listening beyond loopback.

``tpserve keys DIR`` writes ``DIR/NAME.key`` (public key, hand it to clients) and
``DIR/NAME.key_secret`` (public and secret key, mode 0600, for whoever owns the identity), in
the ZPL certificate format that ZeroMQ's own tools read. Loaders also accept a file holding
just the 40-character Z85 key.
"""
from __future__ import annotations

import datetime
import os
import re
from pathlib import Path

import zmq

from tpserve.errors import TpserveError

_KEY_RE = re.compile(r'^\s*(public|secret)-key\s*=\s*"?([0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40})"?\s*$')


class KeyFileError(TpserveError, ValueError):
    """A key file is missing, unreadable or does not hold a Z85 CurveZMQ key."""


def generate_keypair(directory: str | os.PathLike, name: str = "tpserve", force: bool = False) -> tuple[Path, Path]:
    """Write a fresh key pair; returns (public file, secret file). Refuses to overwrite unless ``force``."""
    if not zmq.has("curve"):
        raise KeyFileError("this libzmq was built without CURVE support")
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    public_path, secret_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    for p in (public_path, secret_path):
        if p.exists() and not force:
            raise KeyFileError(f"{p} exists; pass --force to overwrite it")
    public, secret = zmq.curve_keypair()
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    header = f"#   tpserve CurveZMQ certificate, generated {stamp}\n"
    _write(public_path, header + f'metadata\ncurve\n    public-key = "{public.decode()}"\n', 0o644)
    _write(secret_path, header + "#   keep this file private\n"
           f'metadata\ncurve\n    public-key = "{public.decode()}"\n    secret-key = "{secret.decode()}"\n', 0o600)
    return public_path, secret_path


def _write(path: Path, content: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(content)
    os.chmod(path, mode)


def load_keys(path: str | os.PathLike) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a certificate file or a bare Z85 key (taken as public)."""
    path = Path(path)
    try:
        content = path.read_text()
    except OSError as e:
        raise KeyFileError(f"cannot read key file {path}: {e.strerror or e}") from None
    stripped = content.strip()
    if len(stripped) == 40 and "\n" not in stripped:
        return stripped.encode(), None
    found = {}
    for line in content.splitlines():
        m = _KEY_RE.match(line)
        if m:
            found[m.group(1)] = m.group(2).encode()
    if "public" not in found:
        raise KeyFileError(f"{path} holds no CurveZMQ public key (expected a file from `tpserve keys`)")
    return found["public"], found.get("secret")


def load_secret_keys(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file; KeyFileError if it has no secret key."""
    public, secret = load_keys(path)
    if secret is None:
        raise KeyFileError(f"{path} holds no secret key (pass the .key_secret file, not the .key file)")
    return public, secret


def load_public_key(key: str | bytes | os.PathLike) -> bytes:
    """A Z85 public key given as the key itself or as a path to a key file."""
    if isinstance(key, bytes):
        key = key.decode()
    if isinstance(key, str) and len(key) == 40 and not os.path.exists(key):
        return key.encode()
    return load_keys(key)[0]


def public_keys_in(directory: str | os.PathLike) -> list[bytes]:
    """Public keys of every ``*.key`` file in ``directory`` (the allowed clients)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise KeyFileError(f"{directory} is not a directory of client public keys")
    keys = [load_keys(p)[0] for p in sorted(directory.glob("*.key"))]
    if not keys:
        raise KeyFileError(f"{directory} holds no *.key files (client public keys)")
    return keys
