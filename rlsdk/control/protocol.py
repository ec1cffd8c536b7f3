"""Wire protocol of the control channel: framing, authentication, and the environment contract.

Every message is a zmq multipart ``[header, payload chunk, ..., signature]`` (the controller's ROUTER socket adds
the peer's routing id in front):

- ``header``: UTF-8 JSON object ``{"kind", "seq", "rank", "session", "time", "from", "n", ...}``, at most
  :data:`MAX_HEADER_BYTES`. ``kind`` is one of :data:`KINDS`; ``from`` is the sender, ``"controller"`` or
  ``"rank"``; ``rank`` is the sending rank for messages from a rank and the destination rank for messages from the
  controller; ``n`` counts the messages of one link (one socket of one rank, each direction) from 1 and only
  grows, so a receiver refuses a message whose ``n`` it has passed (a replay); ``seq`` is the command a message
  belongs to (a result names its command's ``seq``); ``time`` is the sender's wall clock. ``command`` messages add
  ``"command": name``.
- ``payload``: the body encoded by :mod:`rlsdk.control.codec` (plain values, CPU tensors, numpy arrays; never
  pickle), cut into chunks of at most :data:`FRAME_BYTES`: every socket of the channel refuses larger frames
  (``ZMQ_MAXMSGSIZE``), so a peer that has not authenticated can make ZeroMQ buffer at most one small frame.
- ``signature``: HMAC-SHA256 over ``len(header) as 8 big-endian bytes || header || payload``, keyed with the key
  of the sender's direction, derived from the session secret (:func:`sender_key`). A message the controller signed
  can therefore never pass as a rank's, nor the other way round, and the header names the direction too. The length
  prefix makes the header/payload boundary part of what is signed.

:func:`decode` checks the frame count and sizes, then the signature (:func:`hmac.compare_digest`), before it parses
the header or the payload, so only holders of the secret reach the parsers. The secret is shared with the ranks
through the environment (:data:`RLSDK_SESSION_SECRET`, hex), never the command line, so it does not show in
``ps``.

Transport (see :mod:`rlsdk.control.controller`): on one machine the channel is a Unix socket (``ipc://``) in the
session's 0700 runtime directory; where TCP is needed it runs ZeroMQ's CURVE with a key pair derived from the
secret (:func:`curve_keys`): traffic is encrypted, and a peer without the key cannot finish the handshake.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import math
import secrets
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rlsdk.control import codec
from rlsdk.control.errors import AuthenticationError, PayloadError, ProtocolError, SessionMismatchError

__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL_S",
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "FRAME_BYTES",
    "HELLO_MAX_BYTES",
    "KINDS",
    "MAX_FRAMES",
    "MAX_HEADER_BYTES",
    "RLSDK_CONTROL_ADDR",
    "RLSDK_HEARTBEAT_INTERVAL_S",
    "RLSDK_HEARTBEAT_TIMEOUT_S",
    "RLSDK_SESSION_ID",
    "RLSDK_SESSION_SECRET",
    "SENDERS",
    "AuthenticationError",
    "CurveKeys",
    "Message",
    "PayloadError",
    "ProtocolError",
    "SessionMismatchError",
    "curve_keys",
    "decode",
    "dumps_body",
    "encode",
    "new_session_id",
    "new_session_secret",
    "rank_environment",
    "sender_key",
    "sign",
]

RLSDK_CONTROL_ADDR = "RLSDK_CONTROL_ADDR"
"""Connect address of the controller's ROUTER socket: ``ipc:///RUNTIME_DIR/control`` on one machine,
``tcp://HOST:PORT`` (with CURVE) where TCP is needed."""
RLSDK_SESSION_SECRET = "RLSDK_SESSION_SECRET"
"""The session secret, hex-encoded."""
RLSDK_SESSION_ID = "RLSDK_SESSION_ID"
"""The session id every message must carry."""
RLSDK_HEARTBEAT_INTERVAL_S = "RLSDK_HEARTBEAT_INTERVAL_S"
"""Seconds between a rank's heartbeats to the controller."""
RLSDK_HEARTBEAT_TIMEOUT_S = "RLSDK_HEARTBEAT_TIMEOUT_S"
"""Seconds without a controller heartbeat after which a rank considers the controller lost."""

DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
FRAME_BYTES = 256 << 10
"""Largest frame any socket of the channel accepts (``ZMQ_MAXMSGSIZE``), and the size payloads are cut into.

ZeroMQ buffers a whole frame before anything can look at it, even during the CURVE handshake, so this is what a
peer that never authenticates can make a receiver hold per connection. Chunks of this size cost nothing measurable
against one large frame (benchmarks/session_overhead.py covers the small messages of the hot path)."""
MAX_HEADER_BYTES = 4096
"""Largest header frame a receiver parses."""
MAX_FRAMES = 2 + -(-codec.MAX_PAYLOAD_BYTES // FRAME_BYTES)
"""Most frames one message may have: header, the chunks of the largest payload, signature."""
HELLO_MAX_BYTES = 16 << 10
"""Largest message (header, payload and signature together) the controller reads from a peer that has not yet
completed an authenticated hello; anything larger from such a peer is dropped before its signature is computed."""
# Generous on purpose: a notebook cell that runs synchronous code blocks the kernel's event loop, and with it
# the controller's heartbeats; ranks must not kill themselves because a user ran a slow cell.
DEFAULT_HEARTBEAT_TIMEOUT_S = 60.0
# The event-thread query every rank answers with its current command: {"command": name or None, "seq": int or None}.
CURRENT_QUERY = "current_command"

KINDS = frozenset({"hello", "command", "result", "error", "log", "heartbeat", "shutdown", "query", "reply"})
"""Every message kind the protocol knows. ``query`` (controller -> a rank's event socket, header ``"query":
name``) asks the rank's event thread for state, e.g. the collective tracer's records, and is answered with a
``reply`` of the same seq; it works while the rank's main thread is blocked in a collective."""

Sender = Literal["controller", "rank"]
SENDERS: tuple[Sender, ...] = ("controller", "rank")
"""The two senders; each signs with a key of its own (:func:`sender_key`)."""

SIGNATURE_BYTES = hashlib.sha256().digest_size

# Labels of the keys derived from the session secret. Distinct labels give independent keys (HMAC is a PRF).
_KEY_LABELS: dict[str, bytes] = {
    "controller": b"rlsdk control channel v2: controller to rank",
    "rank": b"rlsdk control channel v2: rank to controller",
}
_CURVE_LABELS = (b"rlsdk control channel v2: curve server", b"rlsdk control channel v2: curve client")


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
    counter: int = 0
    """The link's message counter (header ``n``)."""


@dataclass(frozen=True)
class CurveKeys:
    """A session's CURVE key pairs (Z85 text, as ZeroMQ takes them): the controller's server pair and the pair
    every rank of the session presents as a client."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def new_session_secret() -> bytes:
    """A fresh 32-byte random secret for one session."""
    return secrets.token_bytes(32)


def new_session_id() -> str:
    """A fresh random session id (32 hex characters)."""
    return uuid.uuid4().hex


@functools.lru_cache(maxsize=32)
def sender_key(secret: bytes, sender: Sender) -> bytes:
    """The HMAC key ``sender`` (``"controller"`` or ``"rank"``) signs with, derived from the session secret.

    Raises:
        ValueError: ``sender`` is not one of :data:`SENDERS`.
    """
    label = _KEY_LABELS.get(sender)
    if label is None:
        raise ValueError(f"sender={sender!r} is invalid: allowed {list(SENDERS)}")
    return hmac.digest(secret, label, "sha256")


def curve_keys(secret: bytes) -> CurveKeys:
    """The session's CURVE key pairs, derived from the session secret (so the ranks need nothing but the secret).

    A Curve25519 secret key is any 32 bytes; HMAC-SHA256 output under distinct labels gives two independent ones.

    Raises:
        zmq.ZMQError: this libzmq was built without CURVE (``zmq.has("curve")`` is false).
    """
    from zmq import curve_public
    from zmq.utils import z85

    server_secret, client_secret = (z85.encode(hmac.digest(secret, label, "sha256")) for label in _CURVE_LABELS)
    return CurveKeys(
        server_public=curve_public(server_secret),
        server_secret=server_secret,
        client_public=curve_public(client_secret),
        client_secret=client_secret,
    )


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


def sign(key: bytes, header: bytes, payload: bytes | Sequence[bytes | memoryview]) -> bytes:
    """HMAC-SHA256 of ``len(header) || header || payload`` (see the module docstring); ``payload`` may be given as
    its chunks. ``key`` is a sender's key (:func:`sender_key`)."""
    prefix = len(header).to_bytes(8, "big")
    if isinstance(payload, (bytes, bytearray, memoryview)):
        chunks: Sequence[Any] = (payload,)
    else:
        chunks = payload
    if len(chunks) == 1 and len(chunks[0]) <= _ONE_SHOT_BYTES:
        # hmac.digest is OpenSSL's one-shot path: no HMAC object per message, on the small messages of the hot path.
        return hmac.digest(key, b"".join((prefix, header, chunks[0])), "sha256")
    mac = hmac.new(key, prefix, hashlib.sha256)  # large payloads: no concatenation copy
    mac.update(header)
    for chunk in chunks:
        mac.update(chunk)
    return mac.digest()


_ONE_SHOT_BYTES = 1 << 16
# Built once: json.dumps with non-default options builds an encoder per call.
_HEADER_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def dumps_body(body: Any) -> bytes:
    """Encode a body once (:func:`rlsdk.control.codec.encode`), to send the same payload to many ranks with
    :func:`encode`'s ``payload``.

    Raises:
        TypeError: ``body`` holds a value the codec does not allow; the message names its path in the body.
        ValueError: ``body`` nests too deep, encodes to more than ``codec.MAX_PAYLOAD_BYTES`` or holds more than
            ``codec.MAX_JSON_BYTES`` of JSON.
    """
    return codec.encode(body)


def chunks(payload: bytes) -> list[bytes | memoryview]:
    """``payload`` cut into frames of at most :data:`FRAME_BYTES` (views, no copy)."""
    if len(payload) <= FRAME_BYTES:
        return [payload]
    view = memoryview(payload)
    return [view[start : start + FRAME_BYTES] for start in range(0, len(payload), FRAME_BYTES)]


def encode(
    secret: bytes,
    *,
    sender: Sender,
    kind: str,
    seq: int,
    rank: int,
    session: str,
    counter: int,
    body: Any = None,
    extra: Mapping[str, Any] | None = None,
    payload: bytes | None = None,
) -> list[bytes | memoryview]:
    """Build the signed frames ``[header, payload chunks..., signature]`` of one message from ``sender``.

    ``counter`` is the link's message counter (header ``n``, >= 1, larger than the link's previous one).
    ``extra`` adds JSON-serialisable header fields (it cannot override the standard ones). ``payload`` passes an
    already encoded body (from :func:`dumps_body`); ``body`` is ignored then.

    Raises:
        ValueError: unknown ``kind`` or ``sender``, ``counter < 1``, ``extra`` names a standard header field, or
            the header is over :data:`MAX_HEADER_BYTES`; or as :func:`dumps_body`.
        TypeError: as :func:`dumps_body`.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is invalid: allowed {sorted(KINDS)}")
    if counter < 1:
        raise ValueError(f"counter={counter!r} is invalid: allowed an int >= 1")
    key = sender_key(secret, sender)
    header_fields: dict[str, Any] = {
        "kind": kind,
        "seq": int(seq),
        "rank": int(rank),
        "session": session,
        "time": time.time(),
        "from": sender,
        "n": int(counter),
    }
    if extra:
        clash = header_fields.keys() & extra.keys()
        if clash:
            raise ValueError(f"extra header fields {sorted(clash)} would override standard fields")
        header_fields.update(extra)
    header = _HEADER_ENCODER.encode(header_fields).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"header is {len(header)} bytes, over MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    if payload is None:
        payload = dumps_body(body)
    parts = chunks(payload)
    return [header, *parts, sign(key, header, parts)]


def decode(secret: bytes, frames: Sequence[bytes], *, sender: Sender, session: str | None = None) -> Message:
    """Authenticate and decode one message from ``sender`` (its frames without the ROUTER routing id).

    The order of checks: frame count and sizes, then the signature under ``sender``'s key, then the header (the
    ``from`` field must name ``sender``), then the session id, and only then the payload, which
    :func:`rlsdk.control.codec.decode` turns into plain values and tensors (never pickle).

    Raises:
        AuthenticationError: the signature is missing, has the wrong length or does not match ``sender``'s key.
        SessionMismatchError: ``session`` is given and the (authentic) header names another session.
        PayloadError: the (authentic) payload does not decode; ``header`` holds the parsed header and
            ``__cause__`` the codec's error.
        ProtocolError: too few or too many frames, a frame over its size limit, or a header that is not a JSON
            object with the standard fields (finite numbers, a known kind, ``from`` naming ``sender``).
    """
    count = len(frames)
    if count < 3 or count > MAX_FRAMES:
        raise ProtocolError(f"expected 3 to {MAX_FRAMES} frames [header, payload chunks..., signature], got {count}")
    header_bytes, signature = bytes(frames[0]), bytes(frames[-1])
    parts = frames[1:-1]
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame is {len(header_bytes)} bytes, over MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    if (len(parts) != 1 or len(parts[0]) > FRAME_BYTES) and any(len(part) > FRAME_BYTES for part in parts):
        raise ProtocolError(f"a payload frame is over FRAME_BYTES={FRAME_BYTES}")
    if len(signature) != SIGNATURE_BYTES:
        raise AuthenticationError(f"signature has {len(signature)} bytes, expected {SIGNATURE_BYTES}")
    if not hmac.compare_digest(signature, sign(sender_key(secret, sender), header_bytes, parts)):
        raise AuthenticationError(f"signature does not match the {sender}'s key of the session secret")
    header = _parse_header(header_bytes)
    if header["from"] != sender:
        raise ProtocolError(f"header says the message is from {header['from']!r}, expected {sender!r}")
    if session is not None and header["session"] != session:
        raise SessionMismatchError(f"message is for session {header['session']!r}, expected {session!r}")
    payload = parts[0] if len(parts) == 1 else b"".join(parts)
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
        counter=header["n"],
    )


_HEADER_TYPES: dict[str, type | tuple[type, ...]] = {
    "kind": str,
    "seq": int,
    "rank": int,
    "session": str,
    "time": (int, float),
    "from": str,
    "n": int,
}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"JSON constant {name} is not allowed")


# Floats keep the C parser's fast path; the one float field ("time") is checked for 1e999 after parsing.
_HEADER_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _parse_header(header_bytes: bytes) -> dict[str, Any]:
    try:
        text = header_bytes.decode("utf-8")
        header, end = _HEADER_DECODER.raw_decode(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict) or end != len(text):
        raise ProtocolError(f"header is a JSON {type(header).__name__} (or has trailing text), expected one object")
    for field, expected in _HEADER_TYPES.items():
        value = header.get(field)
        # bool is an int subclass; a boolean seq or rank is malformed.
        if not isinstance(value, expected) or isinstance(value, bool):
            raise ProtocolError(f"header field {field!r}={value!r} is missing or has the wrong type")
    if header["kind"] not in KINDS:
        raise ProtocolError(f"header kind {header['kind']!r} is unknown: allowed {sorted(KINDS)}")
    if header["from"] not in SENDERS:
        raise ProtocolError(f"header field 'from'={header['from']!r} is unknown: allowed {list(SENDERS)}")
    if header["n"] < 1:
        raise ProtocolError(f"header field 'n'={header['n']!r} is invalid: allowed an int >= 1")
    if not math.isfinite(header["time"]):
        raise ProtocolError(f"header field 'time'={header['time']!r} is not a finite number")
    return header
