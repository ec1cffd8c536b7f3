"""Wire protocol: signing, verification order, session binding, malformed frames, environment contract."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from rlsdk.control import protocol
from rlsdk.control.errors import AuthenticationError, PayloadError, ProtocolError, SessionMismatchError

SECRET = b"s" * 32
SESSION = "session-a"

UNPICKLED: list[str] = []


class _Tripwire:
    """Records that it was unpickled: no payload, forged or authentic, may ever reach pickle.loads."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (UNPICKLED.append, ("unpickled",))


def _frames(body: object = None, **kwargs: object) -> list[bytes]:
    fields = {"sender": "rank", "kind": "result", "seq": 3, "rank": 1, "session": SESSION, "counter": 1, "body": body}
    fields.update(kwargs)
    return protocol.encode(SECRET, **fields)  # type: ignore[arg-type]


def test_encode_decode_round_trip_keeps_header_and_tensor_body() -> None:
    body = {"loss": torch.tensor([1.5, -2.0]), "step": 7}

    message = protocol.decode(SECRET, _frames(body, extra={"command": "update"}), sender="rank", session=SESSION)

    assert (message.kind, message.seq, message.rank, message.session) == ("result", 3, 1, SESSION)
    assert message.header["command"] == "update"
    torch.testing.assert_close(message.body["loss"], body["loss"], rtol=0.0, atol=0.0)
    assert message.body["step"] == 7


def test_decode_with_wrong_secret_raises_authentication_error_without_unpickling() -> None:
    UNPICKLED.clear()
    payload = pickle.dumps(_Tripwire())
    frames = protocol.encode(
        b"x" * 32, sender="rank", counter=1, kind="result", seq=1, rank=0, session=SESSION, payload=payload
    )

    with pytest.raises(AuthenticationError):
        protocol.decode(SECRET, frames, sender="rank", session=SESSION)

    assert UNPICKLED == []


def test_decode_of_an_authentic_pickle_payload_raises_payload_error_without_unpickling() -> None:
    UNPICKLED.clear()
    frames = protocol.encode(
        SECRET,
        sender="rank",
        counter=1,
        kind="result",
        seq=1,
        rank=0,
        session=SESSION,
        payload=pickle.dumps(_Tripwire()),
    )

    with pytest.raises(PayloadError):
        protocol.decode(SECRET, frames, sender="rank", session=SESSION)

    assert UNPICKLED == []


def test_encode_of_an_unencodable_body_raises_type_error_naming_its_path() -> None:
    with pytest.raises(TypeError, match=r"^body\['x'\]\[1\] has type .*_Tripwire"):
        _frames({"x": [1, _Tripwire()]})

    assert UNPICKLED == []


def test_decode_with_tampered_payload_or_header_raises_authentication_error() -> None:
    header, payload, signature = _frames({"value": 1})
    forged_header = json.dumps({**json.loads(header), "rank": 0}).encode()

    with pytest.raises(AuthenticationError):
        protocol.decode(SECRET, [header, protocol.dumps_body({"value": 2}), signature], sender="rank")
    with pytest.raises(AuthenticationError):
        protocol.decode(SECRET, [forged_header, payload, signature], sender="rank")


def test_decode_with_bytes_moved_across_the_frame_boundary_raises_authentication_error() -> None:
    header, payload, signature = _frames({"value": 1})

    with pytest.raises(AuthenticationError):
        protocol.decode(SECRET, [header[:-1], header[-1:] + payload, signature], sender="rank")


@pytest.mark.parametrize("signature", [b"", b"short", b"\0" * 32])
def test_decode_with_missing_or_bad_signature_raises_authentication_error(signature: bytes) -> None:
    header, payload, _ = _frames()

    with pytest.raises(AuthenticationError):
        protocol.decode(SECRET, [header, payload, signature], sender="rank")


def test_decode_with_other_session_raises_session_mismatch_error() -> None:
    frames = _frames(session="session-b")

    with pytest.raises(SessionMismatchError, match="session-b"):
        protocol.decode(SECRET, frames, sender="rank", session=SESSION)


@pytest.mark.parametrize("count", [0, 1, 2, protocol.MAX_FRAMES + 1])
def test_decode_with_wrong_frame_count_raises_protocol_error(count: int) -> None:
    frames = [*_frames(), *[b"extra"] * count][:count]

    with pytest.raises(ProtocolError, match="expected 3 to"):
        protocol.decode(SECRET, frames, sender="rank")


@pytest.mark.parametrize(
    "header",
    [
        b"not json",
        b"[1, 2]",
        b'{"kind": "result"}',
        b'{"kind": "nope", "seq": 1, "rank": 0, "session": "s", "time": 0, "from": "rank", "n": 1}',
        b'{"kind": "result", "seq": 1, "rank": 0, "session": "s", "time": 1e999, "from": "rank", "n": 1}',
        b'{"kind": "result", "seq": 1, "rank": 0, "session": "s", "time": NaN, "from": "rank", "n": 1}',
        b'{"kind": "result", "seq": 1, "rank": 0, "session": "s", "time": 0, "from": "rank", "n": 0}',
        b'{"kind": "result", "seq": 1, "rank": 0, "session": "s", "time": 0, "from": "rank", "n": 1} x',
    ],
)
def test_decode_with_authentic_but_malformed_header_raises_protocol_error(header: bytes) -> None:
    payload = protocol.dumps_body(None)

    with pytest.raises(ProtocolError) as info:
        protocol.decode(
            SECRET,
            [header, payload, protocol.sign(protocol.sender_key(SECRET, "rank"), header, payload)],
            sender="rank",
        )

    assert not isinstance(info.value, AuthenticationError)


def test_decode_with_authentic_undecodable_payload_raises_payload_error_carrying_the_header() -> None:
    frames = protocol.encode(
        SECRET, sender="rank", counter=1, kind="result", seq=5, rank=2, session=SESSION, payload=b"\x80garbage"
    )

    with pytest.raises(PayloadError, match="does not decode") as info:
        protocol.decode(SECRET, frames, sender="rank", session=SESSION)

    assert isinstance(info.value, ProtocolError) and not isinstance(info.value, AuthenticationError)
    assert isinstance(info.value.__cause__, PayloadError)
    assert info.value.header is not None
    assert (info.value.header["seq"], info.value.header["rank"]) == (5, 2)


def test_encode_with_unknown_kind_or_clashing_extra_raises_value_error() -> None:
    with pytest.raises(ValueError, match="kind"):
        protocol.encode(SECRET, sender="rank", counter=1, kind="bogus", seq=1, rank=0, session=SESSION)
    with pytest.raises(ValueError, match="override"):
        protocol.encode(
            SECRET, sender="rank", counter=1, kind="result", seq=1, rank=0, session=SESSION, extra={"seq": 2}
        )


def test_new_session_secret_is_32_random_bytes() -> None:
    first, second = protocol.new_session_secret(), protocol.new_session_secret()

    assert len(first) == 32
    assert first != second


def test_rank_environment_carries_secret_as_hex_and_validates_heartbeats() -> None:
    env = protocol.rank_environment("tcp://127.0.0.1:5", SECRET, SESSION, heartbeat_interval_s=0.5)

    assert env[protocol.RLSDK_CONTROL_ADDR] == "tcp://127.0.0.1:5"
    assert bytes.fromhex(env[protocol.RLSDK_SESSION_SECRET]) == SECRET
    assert env[protocol.RLSDK_SESSION_ID] == SESSION
    assert float(env[protocol.RLSDK_HEARTBEAT_INTERVAL_S]) == 0.5
    with pytest.raises(ValueError, match="heartbeat"):
        protocol.rank_environment("tcp://x:1", SECRET, SESSION, heartbeat_interval_s=2.0, heartbeat_timeout_s=1.0)
