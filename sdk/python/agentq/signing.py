"""Standard Webhooks signatures (https://www.standardwebhooks.com), as agentq signs them.

A secret is ``whsec_`` + base64 of at least 16 bytes; a signature is ``v1,`` + base64 of
HMAC-SHA256 over ``{webhook-id}.{webhook-timestamp}.{body}`` keyed with the decoded secret; a
timestamp more than 5 minutes from now is refused; a header may list several signatures,
space separated. Signatures are compared in constant time. A :class:`Secret` never prints.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from typing import Iterable, Mapping, Optional, Sequence

TOLERANCE_SECS = 5 * 60

__all__ = ["Secret", "Refused", "verify", "sign_headers", "TOLERANCE_SECS"]


class Refused(Exception):
    """Why a signed request (or answer) was refused."""


class Secret:
    """A signing secret: the decoded key bytes. ``repr`` never shows it."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes):
        if len(key) < 16:
            raise ValueError("a webhook secret must be at least 16 bytes")
        self._key = bytes(key)

    @classmethod
    def parse(cls, text: str) -> "Secret":
        """Parses ``whsec_<base64>`` (the prefix is optional)."""
        b64 = text.strip()
        if b64.startswith("whsec_"):
            b64 = b64[len("whsec_"):]
        try:
            key = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("a webhook secret is whsec_ followed by base64") from None
        return cls(key)

    @classmethod
    def generate(cls) -> "Secret":
        import os

        return cls(os.urandom(32))

    def expose(self) -> str:
        """The ``whsec_<base64>`` form."""
        return "whsec_" + base64.b64encode(self._key).decode()

    def _mac(self, msg_id: str, timestamp: str, body: bytes) -> bytes:
        m = hmac.new(self._key, digestmod=hashlib.sha256)
        m.update(msg_id.encode())
        m.update(b".")
        m.update(timestamp.encode())
        m.update(b".")
        m.update(body)
        return m.digest()

    def sign(self, msg_id: str, timestamp: int, body: bytes) -> str:
        """The ``v1,<base64>`` signature of a message."""
        return "v1," + base64.b64encode(self._mac(msg_id, str(int(timestamp)), body)).decode()

    def __repr__(self) -> str:
        return "Secret(***)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:  # pragma: no cover - rarely used
        return hash(hashlib.sha256(self._key).digest())


def verify(
    secrets: Sequence[Secret],
    msg_id: Optional[str],
    timestamp: Optional[str],
    signature: Optional[str],
    body: bytes,
    now: Optional[float] = None,
) -> None:
    """Raises :class:`Refused` unless one of ``signature``'s ``v1`` signatures is one of
    ``secrets``' over ``msg_id.timestamp.body`` and ``timestamp`` is within 5 minutes of ``now``."""
    if not msg_id:
        raise Refused("missing webhook-id header")
    if not timestamp:
        raise Refused("missing webhook-timestamp header")
    if not signature:
        raise Refused("missing webhook-signature header")
    ts = timestamp.strip()
    try:
        seconds = int(ts)
    except ValueError:
        raise Refused("webhook-timestamp is not a Unix time in seconds") from None
    now = time.time() if now is None else now
    if abs(int(now) - seconds) > TOLERANCE_SECS:
        raise Refused("webhook-timestamp is more than 5 minutes from now")
    candidates = []
    for part in signature.split(" "):
        if not part.startswith("v1,"):
            continue
        try:
            candidates.append(base64.b64decode(part[3:], validate=True))
        except (binascii.Error, ValueError):
            continue
    for secret in secrets:
        expected = secret._mac(msg_id, ts, body)
        for candidate in candidates:
            if hmac.compare_digest(expected, candidate):
                return
    raise Refused("no valid v1 signature for this body")


def sign_headers(secret: Secret, msg_id: str, body: bytes, now: Optional[float] = None) -> dict:
    """The three Standard Webhooks headers for ``body`` signed as message ``msg_id``."""
    ts = int(time.time() if now is None else now)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": secret.sign(msg_id, ts, body),
    }


def parse_secrets(value: "str | Secret | Iterable[str | Secret] | None") -> list:
    """Secrets from a ``whsec_…`` string (several may be space separated, for a rotation), a
    :class:`Secret`, or a list of either. ``None`` gives none."""
    if value is None:
        return []
    if isinstance(value, Secret):
        return [value]
    if isinstance(value, str):
        parts = [p for p in value.split() if p]
        return [Secret.parse(p) for p in parts]
    out = []
    for v in value:
        out.extend(parse_secrets(v))
    return out
