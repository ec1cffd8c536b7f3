"""Fuzzing the body codec and the frame parser (hypothesis, derandomized: the same cases on every run).

Contract under test, for any bytes at all: ``codec.decode`` returns a value or raises ``PayloadError``;
``protocol.decode`` returns a ``Message`` or raises ``ProtocolError`` (``AuthenticationError``,
``SessionMismatchError`` and ``PayloadError`` are subclasses). No other exception escapes, and decoding allocates
at most :data:`ALLOCATION_BOUND_PER_BYTE` bytes of Python heap per input byte plus :data:`ALLOCATION_SLACK`
(measured with tracemalloc; tensor buffers, which tracemalloc does not see, are bounded by construction: a buffer
must lie inside the payload). The default suite runs 1,000 cases per target, the ``slow`` one 20,000.

Inputs: mutated encodings of valid bodies (bytes flipped, cut, repeated), payloads whose JSON tree is built from
the codec's own tags with arbitrary arguments, raw bytes, and for the frame parser frame lists with authentic
signatures over arbitrary headers and payloads, so every parser behind the signature check is reached.
"""

from __future__ import annotations

import json
import math
import tracemalloc
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlsdk.control import codec, protocol
from rlsdk.control.errors import PayloadError, ProtocolError

pytestmark = pytest.mark.security

SECRET = b"f" * 32
ALLOCATION_BOUND_PER_BYTE = 64
"""Largest Python-heap allocation per byte of input while decoding (parsed JSON costs ~25x its text)."""
ALLOCATION_SLACK = 256 << 10
"""Fixed allowance on top (interpreter caches, the decoder's own objects)."""

DEFAULT_CASES = 1_000
SLOW_CASES = 20_000


def _measured(function: Any, *args: Any, size: int, **kwargs: Any) -> tuple[Any, BaseException | None]:
    """Call ``function`` under tracemalloc; return (result or None, exception or None) and assert the allocation
    bound. Tracing only the call keeps hypothesis's own work untraced (and fast)."""
    if tracemalloc.is_tracing():
        pytest.skip("tracemalloc is already on (another tool traces this process): the bound cannot be measured")
    result: Any = None
    error: BaseException | None = None
    tracemalloc.start()
    try:
        result = function(*args, **kwargs)
    except BaseException as exc:  # classified by the caller; the bound holds either way
        error = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    bound = ALLOCATION_BOUND_PER_BYTE * size + ALLOCATION_SLACK
    assert peak <= bound, f"decoding {size} bytes allocated {peak} bytes, over the bound {bound}"
    return result, error


# ---------------------------------------------------------------------- strategies

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=32),
)


def _tensors() -> st.SearchStrategy[Any]:
    values = st.lists(st.floats(-1e6, 1e6, allow_nan=False), max_size=6)
    return st.one_of(
        values.map(lambda v: torch.tensor(v, dtype=torch.float32)),
        st.lists(st.integers(-100, 100), max_size=6).map(lambda v: torch.tensor(v, dtype=torch.int64)),
        st.lists(st.booleans(), max_size=6).map(lambda v: torch.tensor(v, dtype=torch.bool)),
        values.map(lambda v: np.asarray(v, dtype=np.float64)),
        st.lists(st.booleans(), max_size=6).map(lambda v: np.asarray(v, dtype=np.bool_)),
    )


bodies = st.recursive(
    st.one_of(_scalars, _tensors()),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), children, max_size=4),
    ),
    max_leaves=12,
)


@st.composite
def mutated_payloads(draw: st.DrawFn) -> bytes:
    """A valid encoding with bytes flipped, cut, inserted or repeated."""
    data = bytearray(codec.encode(draw(bodies)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "repeat"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:
            data += data[at : at + draw(st.integers(1, 64))]
    return bytes(data)


_json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)


@st.composite
def tagged_trees(draw: st.DrawFn) -> bytes:
    """A payload whose JSON tree uses the codec's tags with arbitrary arguments, then arbitrary buffers."""

    def tag() -> Any:
        name = draw(st.sampled_from(["$t", "$n", "$b", "$f", "$tuple", "$d", "$x"]))
        dtype = draw(st.sampled_from([*codec.TENSOR_DTYPES, "object", "float8", ""]))
        shape = draw(st.lists(st.integers(-2, 2**40), max_size=4))
        args = draw(
            st.one_of(
                st.lists(_json_leaves, max_size=5),
                st.tuples(st.integers(-1, 64), st.integers(-1, 64), st.just(dtype), st.just(shape)).map(list),
                st.tuples(st.integers(-1, 64), st.integers(-1, 64)).map(list),
                st.sampled_from(["nan", "inf", "-inf", "1e999", 0]),
                st.lists(st.lists(_json_leaves, max_size=3), max_size=3),
            )
        )
        return {name: args}

    tree = draw(st.recursive(st.one_of(_json_leaves, st.builds(tag)), lambda c: st.lists(c, max_size=4), max_leaves=6))
    text = json.dumps(tree).encode()
    if draw(st.booleans()):
        text = text.replace(b"0", draw(st.sampled_from([b"1e999", b"-1e999", b"NaN", b"Infinity", b"0"])), 1)
    declared = len(text) if draw(st.booleans()) else draw(st.integers(0, 2**32 - 1))
    return codec.MAGIC + declared.to_bytes(4, "little") + text + draw(st.binary(max_size=64))


raw_payloads = st.one_of(st.binary(max_size=256), st.binary(max_size=64).map(lambda b: codec.MAGIC + b))
payloads = st.one_of(mutated_payloads(), tagged_trees(), raw_payloads)


@st.composite
def frame_lists(draw: st.DrawFn) -> list[bytes]:
    """Frames for ``protocol.decode``: arbitrary, or with an authentic signature over arbitrary content."""
    header_fields = {
        "kind": draw(st.one_of(st.sampled_from(sorted(protocol.KINDS)), st.text(max_size=5))),
        "seq": draw(st.one_of(st.integers(-3, 2**63), st.booleans(), st.floats())),
        "rank": draw(st.one_of(st.integers(-3, 64), st.text(max_size=3))),
        "session": draw(st.one_of(st.just("s"), st.integers())),
        "time": draw(st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=3))),
        "from": draw(st.sampled_from(["rank", "controller", "x"])),
        "n": draw(st.one_of(st.integers(-2, 2**64), st.none())),
    }
    for key in draw(st.lists(st.sampled_from(sorted(header_fields)), max_size=2)):
        header_fields.pop(key, None)
    header = json.dumps(header_fields).encode() if draw(st.booleans()) else draw(st.binary(max_size=80))
    chunks = draw(st.lists(payloads, min_size=0, max_size=3))
    if draw(st.booleans()):
        sender = draw(st.sampled_from(protocol.SENDERS))
        signature = protocol.sign(protocol.sender_key(SECRET, sender), header, chunks)
    else:
        signature = draw(st.binary(max_size=40))
    return [header, *chunks, signature]


def _fuzz_settings(cases: int) -> settings:
    return settings(
        max_examples=cases,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


def _check_codec(payload: bytes) -> None:
    result, error = _measured(codec.decode, payload, size=len(payload))
    if error is not None:
        assert isinstance(error, PayloadError), f"{type(error).__name__}: {error}"
        return
    _assert_plain(result)


def _check_parser(frames: list[bytes]) -> None:
    size = sum(len(frame) for frame in frames)
    result, error = _measured(protocol.decode, SECRET, frames, sender="rank", session="s", size=size)
    if error is not None:
        assert isinstance(error, ProtocolError), f"{type(error).__name__}: {error}"
        return
    assert result.header["from"] == "rank" and result.session == "s"
    assert isinstance(result.counter, int) and result.counter >= 1
    _assert_plain(result.body)


def _assert_plain(value: Any) -> None:
    """Decoded values are only the allowed types; plain floats are finite unless they came through a tag."""
    if isinstance(value, (list, tuple)):
        for item in value:
            _assert_plain(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _assert_plain(key)
            _assert_plain(item)
    elif isinstance(value, torch.Tensor):
        if value.dtype == torch.bool:
            assert value.view(torch.uint8).max().item() <= 1 if value.numel() else True
    elif isinstance(value, np.ndarray):
        if value.dtype == np.bool_ and value.size:
            assert value.view(np.uint8).max() <= 1
    else:
        assert value is None or isinstance(value, (bool, int, float, str, bytes)), type(value)
        if isinstance(value, float) and not math.isfinite(value):
            pass  # nan/inf arrive only tagged ({"$f": ...}); plain 1e999 is refused


@_fuzz_settings(DEFAULT_CASES)
@given(payloads)
def test_codec_decode_of_any_bytes_returns_plain_values_or_raises_payload_error(payload: bytes) -> None:
    _check_codec(payload)


@_fuzz_settings(DEFAULT_CASES)
@given(frame_lists())
def test_frame_parser_on_any_frames_returns_a_message_or_raises_protocol_error(frames: list[bytes]) -> None:
    _check_parser(frames)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 20,000 cases: minutes on a shared 2-core machine
@_fuzz_settings(SLOW_CASES)
@given(payloads)
def test_codec_decode_of_any_bytes_holds_its_contract_over_many_cases(payload: bytes) -> None:
    _check_codec(payload)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 20,000 cases: minutes on a shared 2-core machine
@_fuzz_settings(SLOW_CASES)
@given(frame_lists())
def test_frame_parser_on_any_frames_holds_its_contract_over_many_cases(frames: list[bytes]) -> None:
    _check_parser(frames)


# ---------------------------------------------------------------------- the specific holes of issue 19


def test_plain_json_number_that_overflows_to_infinity_is_refused() -> None:
    payload = codec.MAGIC + len(b'{"x": 1e999}').to_bytes(4, "little") + b'{"x": 1e999}'

    with pytest.raises(PayloadError, match="finite"):
        codec.decode(payload)


@pytest.mark.parametrize("kind", ["tensor", "array"])
def test_bool_buffer_with_a_byte_other_than_0_or_1_is_refused(kind: str) -> None:
    value = torch.tensor([True, False, True]) if kind == "tensor" else np.array([True, False, True])
    payload = bytearray(codec.encode({"mask": value}))
    payload[-1] = 2  # the last buffer byte: an odd bool

    with pytest.raises(PayloadError, match="bytes other than 0 and 1"):
        codec.decode(bytes(payload))


def test_payload_with_json_over_the_cap_is_refused_before_it_is_parsed() -> None:
    text = b"[" + b"[]," * ((9 << 20) // 3) + b"[]]"  # 9 MiB of JSON: ~200 MiB once parsed
    payload = codec.MAGIC + len(text).to_bytes(4, "little") + text

    result, error = _measured(codec.decode, payload, size=0)  # size 0: only the fixed slack is allowed

    assert result is None and isinstance(error, PayloadError) and "MAX_JSON_BYTES" in str(error)


def test_encode_of_a_body_whose_json_is_over_the_cap_raises_value_error_naming_the_cap() -> None:
    with pytest.raises(ValueError, match="MAX_JSON_BYTES"):
        codec.encode({"ids": list(range(codec.MAX_JSON_BYTES // 4))})
