"""Control-channel codec: exact round trips of the allowed values, clear errors for the rest, and strict decoding
of authentic but hostile payloads (nothing received is ever unpickled)."""

from __future__ import annotations

import collections
import enum
import json
import logging
import math
import os
import pickle
import random
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rlsdk.control import codec, protocol
from rlsdk.control.errors import PayloadError, ProtocolError

SECRET = b"k" * 32
SESSION = "session-codec"


def _round_trip(body: Any) -> Any:
    return codec.decode(codec.encode(body))


def _assert_same(actual: Any, expected: Any) -> None:
    """Equal values of exactly the same types, recursively; tensors and arrays bit for bit."""
    assert type(actual) is type(expected), (actual, expected)
    if isinstance(expected, torch.Tensor):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape)
        assert torch.equal(_bits(actual), _bits(expected))
    elif isinstance(expected, np.ndarray):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape)
        assert actual.tobytes() == expected.tobytes()
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)  # keys, their types and their order
        for key, value in expected.items():
            assert type(next(k for k in actual if k == key)) is type(key)
            _assert_same(actual[key], value)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            _assert_same(a, e)
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(actual)
    else:
        assert actual == expected
        if isinstance(expected, float):
            assert math.copysign(1.0, actual) == math.copysign(1.0, expected)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _signed(payload: bytes) -> list[bytes]:
    return protocol.encode(
        SECRET, sender="rank", counter=1, kind="result", seq=9, rank=1, session=SESSION, payload=payload
    )


def _payload(tree: Any, buffers: bytes = b"") -> bytes:
    """A hand-made payload: the codec's framing around an arbitrary JSON text or tree."""
    text = tree if isinstance(tree, bytes) else json.dumps(tree, separators=(",", ":")).encode()
    return codec.MAGIC + len(text).to_bytes(4, "little") + text + buffers


# ---------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "value",
    [None, True, False, 0, -1, 2**80, -(2**63), 1.5, -0.0, 1e308, 5e-324, math.inf, -math.inf, math.nan,
     "", "héllo ✓", "lone \ud800 surrogate", "$t", b"", b"\x00\xffpickle\x80\x05", [], (), {}],
)  # fmt: skip
def test_round_trip_of_a_scalar_or_empty_container_keeps_value_and_type(value: Any) -> None:
    _assert_same(_round_trip(value), value)


def test_round_trip_of_nested_structures_keeps_tuples_lists_and_key_order() -> None:
    body = {
        "z": [1, (2, [3, (4.5, None)]), {"inner": ((),)}],
        "a": ("x", b"y", [math.nan, -math.inf, {"deep": [[[[]]]]}]),
        "t": {"w": torch.ones(2, 2), "pair": (torch.zeros(3, dtype=torch.int64), b"\x01")},
    }

    _assert_same(_round_trip(body), body)


def test_round_trip_of_dicts_with_int_tuple_and_mixed_keys_keeps_keys_exactly() -> None:
    body = {
        0: "rank 0",
        1: {"nested": {3: 4}},
        -7: None,
        2.5: "float key",
        None: "none key",
        b"raw": 1,
        (1, "a", (2, None)): "tuple key",
        "str": "after the others",
    }

    _assert_same(_round_trip(body), body)
    _assert_same(_round_trip({True: "t", False: "f"}), {True: "t", False: "f"})


def test_round_trip_of_dicts_whose_keys_start_with_dollar_is_not_mistaken_for_tags() -> None:
    body = {"$t": [0, 4, "float32", [1]], "$b": [0, 1], "$tuple": [1], "$d": [], "$f": "nan", "$$": 1, "$": 2}

    _assert_same(_round_trip(body), body)
    _assert_same(_round_trip([{"$t": 1}, {"plain": {"$x": 2}}]), [{"$t": 1}, {"plain": {"$x": 2}}])


@pytest.mark.parametrize("name", sorted(codec._tensor_dtypes()))
def test_round_trip_of_a_tensor_keeps_dtype_shape_and_every_bit(name: str) -> None:
    dtype = getattr(torch, name)
    generator = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (3, 5, 4 * dtype.itemsize), dtype=torch.uint8, generator=generator)
    tensor = raw.view(dtype) if dtype != torch.bool else raw.remainder(2).bool()

    decoded = _round_trip({"x": tensor})["x"]

    _assert_same(decoded, tensor)
    if dtype in (torch.bool, torch.int64, torch.float32, torch.bfloat16, torch.float16, torch.float64):
        torch.testing.assert_close(decoded, tensor, rtol=0.0, atol=0.0, equal_nan=True)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12.0).reshape(3, 4).t(),  # transposed
        lambda: torch.arange(20, dtype=torch.int32)[1::3],  # strided
        lambda: torch.arange(3.0).expand(4, 3),  # stride 0
        lambda: torch.arange(24.0).reshape(2, 3, 4).permute(2, 0, 1)[:, 1:],  # permuted and sliced
        lambda: torch.tensor(3.25),  # zero-dimensional
        lambda: torch.empty(0, 3),  # no elements
        lambda: torch.ones(2, requires_grad=True) * 2,  # part of an autograd graph
        lambda: torch.tensor([1 + 2j, 3 - 4j]).conj(),  # lazily conjugated
        lambda: torch.nn.Parameter(torch.ones(2)),  # a Tensor subclass
    ],
)
def test_round_trip_of_a_non_contiguous_or_unusual_tensor_gives_an_equal_plain_contiguous_tensor(make: Any) -> None:
    tensor = make()

    decoded = _round_trip(tensor)

    assert type(decoded) is torch.Tensor and decoded.is_contiguous() and not decoded.requires_grad
    assert (decoded.dtype, decoded.shape) == (tensor.dtype, tensor.shape)
    torch.testing.assert_close(decoded, tensor.detach().resolve_conj(), rtol=0.0, atol=0.0)


def test_encode_of_a_slice_sends_only_the_slice_not_its_whole_storage() -> None:
    storage = torch.arange(100_000, dtype=torch.float32)
    shard = storage[10:20]

    payload = codec.encode({"shard": shard})

    assert len(payload) < 200
    torch.testing.assert_close(codec.decode(payload)["shard"], shard, rtol=0.0, atol=0.0)


def test_decoded_tensor_owns_writable_memory_apart_from_the_payload() -> None:
    payload = codec.encode({"x": torch.zeros(4), "y": torch.zeros(2, dtype=torch.int64)})
    before = bytes(payload)

    body = codec.decode(payload)
    body["x"].add_(1.0)
    body["y"][0] = 5

    assert payload == before
    assert body["x"].untyped_storage().nbytes() == body["x"].nbytes
    torch.testing.assert_close(body["x"], torch.ones(4), rtol=0.0, atol=0.0)


@pytest.mark.parametrize("name", codec.NUMPY_DTYPES)
def test_round_trip_of_a_numpy_array_keeps_dtype_shape_and_bits(name: str) -> None:
    raw = np.random.default_rng(0).integers(0, 256, size=(3, 8 * np.dtype(name).itemsize), dtype=np.uint8)
    array = raw.view(name) if name != "bool" else raw % 2 == 1

    _assert_same(_round_trip([array])[0], array)


def test_round_trip_of_non_contiguous_or_big_endian_numpy_array_gives_native_contiguous_array() -> None:
    transposed = np.arange(12, dtype=np.int16).reshape(3, 4).T
    big_endian = np.arange(5, dtype=">f8")

    decoded_t, decoded_b, decoded_0 = _round_trip((transposed, big_endian, np.array(7, dtype=np.uint32)))

    np.testing.assert_array_equal(decoded_t, transposed)
    assert decoded_t.flags.c_contiguous and decoded_t.flags.writeable
    np.testing.assert_array_equal(decoded_b, big_endian)
    assert decoded_b.dtype == np.float64 and decoded_b.dtype.isnative
    assert decoded_0.shape == () and int(decoded_0) == 7


class _Color(enum.IntEnum):
    RED = 3


class _Shade(str, enum.Enum):  # noqa: UP042 - the mixin form: its str() is "_Shade.DARK", not the value
    DARK = "dark"


def test_round_trip_of_subclasses_of_allowed_types_gives_their_base_type() -> None:
    Point = collections.namedtuple("Point", "x y")
    body = {
        "size": torch.Size([2, 3]),
        "point": Point(1, 2),
        "ordered": collections.OrderedDict(b=1, a=2),
        "enum": _Color.RED,
        "str_enum": _Shade.DARK,
        "np_float": np.float64(0.5),
        "keys": {_Shade.DARK: 1, _Color.RED: 2},
    }

    decoded = _round_trip(body)

    _assert_same(
        decoded,
        {
            "size": (2, 3),
            "point": (1, 2),
            "ordered": {"b": 1, "a": 2},
            "enum": 3,
            "str_enum": "dark",
            "np_float": 0.5,
            "keys": {"dark": 1, 3: 2},
        },
    )


# ---------------------------------------------------------------------- what the code base sends


def test_every_body_the_code_base_sends_round_trips(tmp_path: Path) -> None:
    from rlsdk.config import ModelConfig, SessionConfig, config_to_dict
    from rlsdk.debug.tracer import Tracer, thread_stacks
    from rlsdk.observe.logging import record_to_dict

    tracer = Tracer(capacity=8)
    tracer.groups["0"] = {"rank": 0, "size": 2, "ranks": [0, 1]}
    tracer.record("0", False, "allreduce", [torch.ones(4, 2)], "SUM", None)
    tracer.record("0", True, "send", [torch.ones(3)], None, 1)
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("rlsdk.x", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info())
    bodies = {
        "init": {"config": config_to_dict(SessionConfig(model=ModelConfig(path="models/tiny")))},
        "update": {
            "shard": {
                "prompt_ids_B_P": torch.randint(0, 100, (8, 5))[2:4],
                "completion_mask_B_C": torch.ones(2, 7, dtype=torch.bool),
                "logprobs_B_C": torch.randn(2, 7),
                "advantages_B": torch.randn(2),
            },
            "num_tokens": 14,
        },
        "update_result": {"loss_sum": 1.5, "grad_norm": math.nan, "ratio_max": -math.inf, "version": 3},
        "export_weights": {"publish_dir": str(tmp_path), "src": 0},
        "save_checkpoint_result": ["rng_rank0.pt", "model/config.json"],
        "hello": {"rank": 0, "world_size": 2, "pid": os.getpid(), "hostname": "host"},
        "heartbeat": {"command": "update", "seq": 4, "progress": (3, 8)},
        "idle_heartbeat": {"command": None, "seq": None, "progress": None},
        "logs": [record_to_dict(record), {"name": "test", "levelno": 20, "message": "m", "i": 1, "rank": 0}],
        "error": {"type": "ValueError", "message": "boom", "traceback": "Traceback ...\n"},
        "trace_reply": {"ok": True, "value": {**tracer.snapshot(), "stacks": thread_stacks()}},
        "call_function": {"target": "_faults:session_hang", "kwargs": {"seconds": 1.5}},
    }

    for name, body in bodies.items():
        decoded = protocol.decode(SECRET, _signed(protocol.dumps_body(body)), sender="rank").body
        _assert_same(decoded, body)
        assert name


# ---------------------------------------------------------------------- what cannot be sent


@pytest.mark.parametrize(
    ("body", "path", "type_name"),
    [
        ({"shard": [1, 2, object()]}, "body['shard'][2]", "object"),
        ([{"lock": threading.Lock()}], "body[0]['lock']", "_thread.lock"),
        ((1, {5: {1, 2}}), "body[1][5]", "set"),
        ({"f": lambda: None}, "body['f']", "function"),
        ({"c": 1 + 2j}, "body['c']", "complex"),
        ({"n": np.int64(3)}, "body['n']", "numpy.int64"),
        ({"n": np.array([object()])}, "body['n']", "object"),
        ({"s": torch.ones(2, 2).to_sparse()}, "body['s']", "sparse"),
        ({"h": torch.zeros(2, dtype=torch.bits8)}, "body['h']", "bits8"),
        ({"m": torch.empty(2, device="meta")}, "body['m']", "meta"),
        ({object(): 1}, "body[<object object", "object"),
        ({(1, frozenset()): 1}, "body[(1, frozenset())]", "tuple"),
        (Path("/x"), "body", "Path"),
    ],
)
def test_encode_of_an_unallowed_value_raises_type_error_naming_path_type_and_allowed_types(
    body: Any, path: str, type_name: str
) -> None:
    with pytest.raises(TypeError) as info:
        protocol.dumps_body(body)

    message = str(info.value)
    assert message.startswith(path), message
    assert type_name in message
    assert "allowed" in message


def test_encode_of_a_reference_cycle_or_too_deep_nesting_raises_value_error() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    deep: Any = 1
    for _ in range(codec.MAX_DEPTH + 1):
        deep = [deep]
    fits: Any = 1
    for _ in range(codec.MAX_DEPTH):
        fits = {"k": fits}

    with pytest.raises(ValueError, match="MAX_DEPTH"):
        codec.encode(cycle)
    with pytest.raises(ValueError, match="MAX_DEPTH"):
        codec.encode(deep)
    assert _round_trip(fits) == fits


def test_payload_over_the_size_limit_is_refused_on_both_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    payload = codec.encode({"x": torch.zeros(64)})
    monkeypatch.setattr(codec, "MAX_PAYLOAD_BYTES", 100)

    with pytest.raises(ValueError, match="MAX_PAYLOAD_BYTES"):
        codec.encode({"x": torch.zeros(64)})
    with pytest.raises(PayloadError, match="MAX_PAYLOAD_BYTES"):
        codec.decode(payload)


# ---------------------------------------------------------------------- hostile payloads with a valid HMAC


class _RunsShell:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


def _decode_fails(payload: bytes) -> PayloadError:
    with pytest.raises(PayloadError) as info:
        protocol.decode(SECRET, _signed(payload), sender="rank", session=SESSION)
    assert isinstance(info.value, ProtocolError)
    assert info.value.header is not None and info.value.header["seq"] == 9
    assert isinstance(info.value.__cause__, PayloadError)
    return info.value


def test_decode_of_an_authentic_code_running_pickle_raises_payload_error_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    exploit = pickle.dumps({"x": _RunsShell(f"touch {marker}")}, protocol=5)

    _decode_fails(exploit)
    _decode_fails(_payload(exploit))  # behind a valid prefix, as if it were the JSON
    body = protocol.decode(SECRET, _signed(codec.encode({"blob": exploit})), sender="rank", session=SESSION).body

    assert body == {"blob": exploit}  # carried as bytes, never loaded
    assert not marker.exists()


def test_decode_of_random_bytes_raises_payload_error() -> None:
    rng = random.Random(0)
    for size in (0, 1, 7, 8, 64, 4096):
        _decode_fails(rng.randbytes(size))
        _decode_fails(codec.MAGIC + rng.randbytes(size))
        _decode_fails(_payload(rng.randbytes(size)))


def test_decode_of_a_truncated_or_extended_payload_raises_payload_error() -> None:
    payload = codec.encode({"x": torch.arange(10), "b": b"abc"})

    for cut in (1, 3, 50, len(payload) - 9):
        _decode_fails(payload[:-cut])
    _decode_fails(payload + b"\0")
    _decode_fails(payload[:4] + (10**6).to_bytes(4, "little") + payload[8:])  # JSON length past the end


def _tensor_payload(offset: Any = 0, nbytes: Any = 16, dtype: Any = "float32", shape: Any = (4,)) -> bytes:
    shape = list(shape) if isinstance(shape, tuple) else shape
    return _payload({"x": {"$t": [offset, nbytes, dtype, shape]}}, b"\0" * 16)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (_tensor_payload(shape=(5,)), "needs 20 bytes"),
        (_tensor_payload(shape=(2, 3)), "needs 24 bytes"),
        (_tensor_payload(shape=(-4,)), "non-negative"),
        (_tensor_payload(shape=(4.0,)), "non-negative"),
        (_tensor_payload(shape=[1] * 65), "at most 64"),
        (_tensor_payload(shape="4"), "shape"),
        (_tensor_payload(dtype="object"), "not allowed"),
        (_tensor_payload(dtype="torch.float32"), "not allowed"),
        (_tensor_payload(dtype=["float32"]), "not allowed"),
        (_tensor_payload(offset=4, nbytes=12, shape=(3,)), "out of place"),
        (_tensor_payload(offset=True), "non-negative"),
        (_tensor_payload(nbytes=-16), "non-negative"),
        (_payload({"x": {"$t": [0, 16, "float32"]}}, b"\0" * 16), "offset, nbytes, dtype, shape"),
        (_payload([{"$t": [0, 8, "int64", [1]]}, {"$t": [0, 8, "int64", [1]]}], b"\0" * 8), "out of place"),
        (_payload({"b": {"$b": [0, 32]}}, b"\0" * 16), "out of place"),
        (_payload({"b": {"$b": [0, 8]}}, b"\0" * 16), "after its last buffer"),
        (_payload({"b": {"$b": "0"}}), "non-negative"),
        (_payload({"n": {"$n": [0, 16, "object", [2]]}}, b"\0" * 16), "not allowed"),
    ],
)
def test_decode_of_a_buffer_that_lies_about_shape_dtype_or_place_raises_payload_error(
    payload: bytes, match: str
) -> None:
    error = _decode_fails(payload)

    assert match in str(error)


@pytest.mark.parametrize(
    "tree",
    [
        {"$x": 1},
        {"$t": "a"},
        {"$f": "NaN"},
        {"$f": 1},
        {"$tuple": 1},
        {"$tuple": [1], "other": 2},
        {"$d": {"a": 1}},
        {"$d": [[1]]},
        {"$d": [[[1], 2]]},
        {"$d": [[{"a": 1}, 2]]},
        {"$d": [[{"$t": [0, 0, "float32", [0]]}, 2]]},
        {"$pickle": "gASVAAAAAAAAAAA="},
        [1, {"a": {"$": 3}}],
        b'{"x": NaN}',
        b'{"x": Infinity}',
        b"[1] [2]",
        b'"\xff\xfe"',
        b"1" * 5000,
    ],
)
def test_decode_of_a_bogus_tag_or_invalid_json_raises_payload_error(tree: Any) -> None:
    _decode_fails(_payload(tree))


def test_decode_of_excessive_nesting_raises_payload_error() -> None:
    for opening, closing in ((b"[", b"]"), (b'{"a":', b"}"), (b'{"$tuple":[', b"]}")):
        _decode_fails(_payload(opening * (codec.MAX_DEPTH + 1) + b"1" + closing * (codec.MAX_DEPTH + 1)))
        _decode_fails(_payload(opening * 100_000 + b"1" + closing * 100_000))  # past the interpreter's limit


# ---------------------------------------------------------------------- the channel around an encoding failure


def test_query_answer_that_cannot_be_encoded_becomes_an_error_and_the_event_thread_keeps_answering() -> None:
    from _control_helpers import new_controller, rank_threads, run

    from rlsdk.control import ControlError

    async def body() -> tuple[dict[int, Any], dict[int, Any]]:
        channel, secret, session_id = new_controller()
        await channel.start()
        try:
            with rank_threads(channel, 1, secret, session_id) as ranks:
                ranks[0].set_query_handler("lock", lambda _body: {"held": threading.Lock()})
                ranks[0].set_query_handler("state", lambda _body: {"rank": 0})
                await channel.wait_for_ranks(1, 10.0)
                for _ in range(50):  # the hello came on the command socket; wait for the event socket too
                    if await channel.query_events("state", 0.2):
                        break
                return await channel.query_events("lock", 5.0), await channel.query_events("state", 5.0)
        finally:
            await channel.close()

    unencodable, after = run(body)

    assert isinstance(unencodable[0], ControlError)
    assert "cannot be encoded" in str(unencodable[0]) and "body['value']['held']" in str(unencodable[0])
    assert after == {0: {"rank": 0}}
