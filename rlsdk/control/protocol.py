"""Wire protocol of the control channel: framing, HMAC authentication, and the environment contract.

Every message is a zmq multipart ``[header, payload, signature]`` (the controller's ROUTER socket adds the
peer identity frame in front):

- ``header``: UTF-8 JSON object ``{"kind", "seq", "rank", "session", "time", ...}``. ``kind`` is one of
  :data:`KINDS`; ``rank`` is the sending rank for messages from a rank and the destination rank for messages
  from the controller; ``time`` is the sender's wall clock (``time.time()``). ``command`` messages add
  ``"command": name``.
- ``payload``: the body encoded by :mod:`rlsdk.control.codec`: plain values (``None``, ``bool``, ``int``,
  ``float``, ``str``, ``bytes``, lists, tuples, dicts) and CPU tensors / numpy arrays, nothing else.
- ``signature``: HMAC-SHA256 keyed with the session secret over ``len(header) as 8 big-endian bytes ||
  header || payload``. The length prefix makes the header/payload boundary part of what is signed, so bytes
  cannot be moved from one frame to the other under the same signature.

:func:`decode` checks the signature with :func:`hmac.compare_digest` before it parses the header or the payload,
so only holders of the secret reach the parsers. Nothing received is ever unpickled: the codec builds only plain
values and tensors, so even a peer holding the secret cannot make the receiver run code. The secret is shared
with the ranks through the environment (:data:`RLSDK_SESSION_SECRET`, hex), never the command line, so it does
not show in ``ps``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlsdk.control import codec
from rlsdk.control.errors import AuthenticationError, PayloadError, ProtocolError, SessionMismatchError

__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL_S",
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "KINDS",
    "RLSDK_CONTROL_ADDR",
    "RLSDK_HEARTBEAT_INTERVAL_S",
    "RLSDK_HEARTBEAT_TIMEOUT_S",
    "RLSDK_SESSION_ID",
    "RLSDK_SESSION_SECRET",
    "AuthenticationError",
    "Message",
    "PayloadError",
    "ProtocolError",
    "SessionMismatchError",
    "decode",
    "dumps_body",
    "encode",
    "new_session_id",
    "new_session_secret",
    "rank_environment",
    "sign",
]

RLSDK_CONTROL_ADDR = "RLSDK_CONTROL_ADDR"
"""Connect address of the controller's ROUTER socket, e.g. ``tcp://127.0.0.1:PORT``."""
RLSDK_SESSION_SECRET = "RLSDK_SESSION_SECRET"
"""The session secret, hex-encoded."""
RLSDK_SESSION_ID = "RLSDK_SESSION_ID"
"""The session id every message must carry."""
RLSDK_HEARTBEAT_INTERVAL_S = "RLSDK_HEARTBEAT_INTERVAL_S"
"""Seconds between a rank's heartbeats to the controller."""
RLSDK_HEARTBEAT_TIMEOUT_S = "RLSDK_HEARTBEAT_TIMEOUT_S"
"""Seconds without a controller heartbeat after which a rank considers the controller lost."""

DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
# Largest frame a socket of the channel accepts: a body at the codec's limit plus room for the header. ZeroMQ
# disconnects a peer that sends more (ZMQ_MAXMSGSIZE) before any byte of it reaches Python.
MAX_MESSAGE_BYTES = codec.MAX_PAYLOAD_BYTES + (1 << 20)
# Generous on purpose: a notebook cell that runs synchronous code blocks the kernel's event loop, and with it
# the controller's heartbeats; ranks must not kill themselves because a user ran a slow cell.
DEFAULT_HEARTBEAT_TIMEOUT_S = 60.0
# The event-thread query every rank answers with its current command: {"command": name or None, "seq": int or None}.
CURRENT_QUERY = "current_command"

KINDS = frozenset({"hello", "command", "result", "error", "log", "heartbeat", "shutdown", "query", "reply"})
"""Every message kind the protocol knows. ``query`` (controller -> a rank's event socket, header ``"query":
name``) asks the rank's event thread for state, e.g. the collective tracer's records, and is answered with a
``reply`` of the same seq; it works while the rank's main thread is blocked in a collective."""

SIGNATURE_BYTES = hashlib.sha256().digest_size


@dataclass(frozen=True)
class Message:
    """A decoded, authenticated message. ``header`` holds every header field, the standard ones included."""

    kind: str
    seq: int
    rank: int
    session: str
    time: float
    header: dict[str, Any]
    body: Any


def new_session_secret() -> bytes:
    """A fresh 32-byte random secret for one session."""
    return secrets.token_bytes(32)


def new_session_id() -> str:
    """A fresh random session id (32 hex characters)."""
    return uuid.uuid4().hex


def rank_environment(
    address: str,
    secret: bytes,
    session_id: str,
    *,
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> dict[str, str]:
    """The environment variables a rank process needs to connect; merge them into the child's environment.

    Raises:
        ValueError: ``heartbeat_timeout_s`` is not larger than ``heartbeat_interval_s``, or either is not
            positive.
    """
    if heartbeat_interval_s <= 0 or heartbeat_timeout_s <= heartbeat_interval_s:
        raise ValueError(
            f"heartbeat_interval_s={heartbeat_interval_s!r}, heartbeat_timeout_s={heartbeat_timeout_s!r} are "
            "invalid: allowed 0 < heartbeat_interval_s < heartbeat_timeout_s"
        )
    return {
        RLSDK_CONTROL_ADDR: address,
        RLSDK_SESSION_SECRET: secret.hex(),
        RLSDK_SESSION_ID: session_id,
        RLSDK_HEARTBEAT_INTERVAL_S: repr(float(heartbeat_interval_s)),
        RLSDK_HEARTBEAT_TIMEOUT_S: repr(float(heartbeat_timeout_s)),
    }


def sign(secret: bytes, header: bytes, payload: bytes) -> bytes:
    """HMAC-SHA256 of ``len(header) || header || payload`` (see the module docstring)."""
    prefix = len(header).to_bytes(8, "big")
    if len(payload) <= _ONE_SHOT_BYTES:  # hmac.digest is OpenSSL's one-shot path: ~3x faster on small messages
        return hmac.digest(secret, b"".join((prefix, header, payload)), "sha256")
    mac = hmac.new(secret, prefix, hashlib.sha256)  # large payloads: no concatenation copy
    mac.update(header)
    mac.update(payload)
    return mac.digest()


_ONE_SHOT_BYTES = 1 << 16


def dumps_body(body: Any) -> bytes:
    """Encode a body once (:func:`rlsdk.control.codec.encode`), to send the same payload to many ranks with
    :func:`encode`'s ``payload``.

    Raises:
        TypeError: ``body`` holds a value the codec does not allow; the message names its path in the body.
        ValueError: ``body`` nests too deep or encodes to more than ``codec.MAX_PAYLOAD_BYTES``.
    """
    return codec.encode(body)


def encode(
    secret: bytes,
    *,
    kind: str,
    seq: int,
    rank: int,
    session: str,
    body: Any = None,
    extra: Mapping[str, Any] | None = None,
    payload: bytes | None = None,
) -> list[bytes]:
    """Build the signed frames ``[header, payload, signature]`` of one message.

    ``extra`` adds JSON-serialisable header fields (it cannot override the standard ones). ``payload`` passes
    an already encoded body (from :func:`dumps_body`); ``body`` is ignored then.

    Raises:
        ValueError: unknown ``kind``, or ``extra`` names a standard header field; or as :func:`dumps_body`.
        TypeError: as :func:`dumps_body`.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is invalid: allowed {sorted(KINDS)}")
    header_fields: dict[str, Any] = {
        "kind": kind,
        "seq": int(seq),
        "rank": int(rank),
        "session": session,
        "time": time.time(),
    }
    if extra:
        clash = header_fields.keys() & extra.keys()
        if clash:
            raise ValueError(f"extra header fields {sorted(clash)} would override standard fields")
        header_fields.update(extra)
    header = json.dumps(header_fields, separators=(",", ":")).encode()
    if payload is None:
        payload = dumps_body(body)
    return [header, payload, sign(secret, header, payload)]


def decode(secret: bytes, frames: Sequence[bytes], *, session: str | None = None) -> Message:
    """Authenticate and decode the three frames of one message (without the ROUTER identity frame).

    The order of checks: frame count and signature first, then the header, then the session id, and only then
    the payload, which :func:`rlsdk.control.codec.decode` turns into plain values and tensors (never pickle).

    Raises:
        AuthenticationError: the signature is missing, has the wrong length or does not match.
        SessionMismatchError: ``session`` is given and the (authentic) header names another session.
        PayloadError: the (authentic) payload does not decode; ``header`` holds the parsed header and
            ``__cause__`` the codec's error.
        ProtocolError: wrong number of frames, or a header that is not a JSON object with the standard fields
            and a known kind.
    """
    if len(frames) != 3:
        raise ProtocolError(f"expected 3 frames [header, payload, signature], got {len(frames)}")
    header_bytes, payload, signature = (bytes(frame) for frame in frames)
    if len(signature) != SIGNATURE_BYTES:
        raise AuthenticationError(f"signature has {len(signature)} bytes, expected {SIGNATURE_BYTES}")
    if not hmac.compare_digest(signature, sign(secret, header_bytes, payload)):
        raise AuthenticationError("signature does not match the session secret")
    header = _parse_header(header_bytes)
    if session is not None and header["session"] != session:
        raise SessionMismatchError(f"message is for session {header['session']!r}, expected {session!r}")
    try:
        body = codec.decode(payload)
    except Exception as exc:  # PayloadError; anything else would be a codec bug, reported the same way
        raise PayloadError(
            f"payload of a {header['kind']!r} message (seq {header['seq']}, rank {header['rank']}) does not "
            f"decode: {type(exc).__name__}: {exc}",
            header=header,
        ) from exc
    return Message(
        kind=header["kind"],
        seq=header["seq"],
        rank=header["rank"],
        session=header["session"],
        time=header["time"],
        header=header,
        body=body,
    )


_HEADER_TYPES: dict[str, type | tuple[type, ...]] = {
    "kind": str,
    "seq": int,
    "rank": int,
    "session": str,
    "time": (int, float),
}


def _parse_header(header_bytes: bytes) -> dict[str, Any]:
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"header is a JSON {type(header).__name__}, expected an object")
    for field, expected in _HEADER_TYPES.items():
        value = header.get(field)
        # bool is an int subclass; a boolean seq or rank is malformed.
        if not isinstance(value, expected) or isinstance(value, bool):
            raise ProtocolError(f"header field {field!r}={value!r} is missing or has the wrong type")
    if header["kind"] not in KINDS:
        raise ProtocolError(f"header kind {header['kind']!r} is unknown: allowed {sorted(KINDS)}")
    return header
