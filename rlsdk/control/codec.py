"""The control channel's body codec: plain values and tensors to bytes and back, without pickle.

Nothing received from a socket is unpickled: :func:`decode` builds only the allowed value types, so a payload
can describe data but never name a class or a function to call. The HMAC in :mod:`rlsdk.control.protocol`
decides whom to trust; this codec decides what a trusted peer may send.

Allowed values (checked by :func:`encode`, recursively):

- ``None``, ``bool``, ``int``, ``float`` (``nan`` and ``inf`` included), ``str``, ``bytes``;
- ``list``, ``tuple`` (decodes as a tuple), ``dict`` whose keys are ``str``, ``int``, ``bool``, ``float``,
  ``None``, ``bytes`` or tuples of those (keys round-trip exactly, ``"$"``-prefixed strings included);
- ``torch.Tensor`` on the CPU, strided, of a dtype in :data:`TENSOR_DTYPES`; it decodes as a contiguous tensor
  that owns its (writable) memory, with ``requires_grad=False``;
- ``numpy.ndarray`` of a dtype in :data:`NUMPY_DTYPES`; it decodes as a C-contiguous array in native byte order.

Subclasses decode as their base type (``torch.Size`` and named tuples as ``tuple``, ``IntEnum`` as ``int``,
``OrderedDict`` as ``dict``, ``nn.Parameter`` as ``Tensor``).

Payload layout: ``MAGIC`` (4 bytes) || JSON length (4 bytes, little-endian) || UTF-8 JSON tree || raw buffers.
The JSON tree is at most :data:`MAX_JSON_BYTES` (parsed JSON takes ~25x its size in Python objects; bulk data
belongs in tensors, which cost their size once). A plain JSON number must be finite (``1e999`` is refused, not
read as ``inf``), and a ``bool`` tensor or array may hold only the bytes 0 and 1.
The JSON tree holds JSON values as themselves and everything else as a one-key object with a tag:

- ``{"$f": "nan" | "inf" | "-inf"}``: a non-finite float;
- ``{"$tuple": [...]}``: a tuple;
- ``{"$d": [[key, value], ...]}``: a dict with a non-``str`` key or a key starting with ``"$"``;
- ``{"$b": [offset, nbytes]}``: bytes;
- ``{"$t": [offset, nbytes, dtype, shape]}`` / ``{"$n": [offset, nbytes, dtype, shape]}``: a tensor / array.

Offsets count from the first byte after the JSON. Buffers are laid out back to back in tree order, so the
decoder requires each buffer to start where the previous one ended and the last one to end at the end of the
payload: no buffer is read twice, and nothing is allocated that the payload does not carry.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from rlsdk.control.errors import PayloadError

__all__ = [
    "MAGIC",
    "MAX_DEPTH",
    "MAX_JSON_BYTES",
    "MAX_PAYLOAD_BYTES",
    "NUMPY_DTYPES",
    "TENSOR_DTYPES",
    "decode",
    "encode",
]

MAGIC = b"RLC1"
"""First four bytes of every payload (codec version 1)."""
MAX_DEPTH = 100
"""Deepest nesting of containers (list, tuple, dict) a body may have; deeper raises on both ends."""
MAX_PAYLOAD_BYTES = 1 << 30
"""Largest payload :func:`encode` builds and :func:`decode` accepts, in bytes (1 GiB)."""
MAX_JSON_BYTES = 8 << 20
"""Largest JSON part of a payload :func:`encode` builds and :func:`decode` accepts, in bytes (8 MiB): parsing
JSON allocates many times its size, so this bounds what a body can make the receiver allocate beyond its raw
buffers."""

TENSOR_DTYPES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e5m2",
)
"""``torch`` dtype names a tensor may have (those that exist in the installed torch)."""
NUMPY_DTYPES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
"""``numpy`` dtype names an array may have."""

_PREFIX_BYTES = 8
_NONE_PAYLOAD = MAGIC + (4).to_bytes(4, "little") + b"null"  # the body of heartbeats and body-less commands
_MAX_DIMS = 64
_ALLOWED = (
    "None, bool, int, float, str, bytes, list, tuple, dict (keys: str, int, bool, float, None, bytes or tuples "
    "of those), torch.Tensor (CPU, strided) and numpy.ndarray"
)
_KEY_TYPES = (str, int, float, bytes, type(None))  # bool is an int
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_JSON_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False, check_circular=False)


def _no_default(value: Any) -> Any:
    raise TypeError(f"{_type_name(value)} reached the JSON encoder")  # the tree walk lets none through


# JSONEncoder.encode builds a C encoder per call, on every message; build it once. Falls back where the C accelerator
# is missing (then c_make_encoder is None).
_c_make_encoder = getattr(json.encoder, "c_make_encoder", None)
_C_JSON_ENCODER = (
    None
    if _c_make_encoder is None
    else _c_make_encoder(None, _no_default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, False)
)


def _json(tree: Any) -> bytes:
    if _C_JSON_ENCODER is None:
        return _JSON_ENCODER.encode(tree).encode()
    return "".join(_C_JSON_ENCODER(tree, 0)).encode()


def _reject_constant(name: str) -> Any:
    raise PayloadError(f"JSON constant {name} is not allowed (non-finite floats are tagged)")


def _finite_float(text: str) -> float:
    value = float(text)
    if value - value != 0.0:  # inf or nan: an out-of-range literal such as 1e999
        raise PayloadError(f"JSON number {text[:24]!r} is not a finite float (non-finite floats are tagged)")
    return value


_JSON_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)

_torch_dtypes: dict[str, Any] | None = None


def _tensor_dtypes() -> dict[str, Any]:
    global _torch_dtypes
    if _torch_dtypes is None:
        import torch

        _torch_dtypes = {name: getattr(torch, name) for name in TENSOR_DTYPES if hasattr(torch, name)}
    return _torch_dtypes


# ---------------------------------------------------------------------- encoding


class _EncodeError(Exception):
    """Unwinds the encoder; each container on the way out adds its key, so the error names the full path."""

    def __init__(self, error: type[Exception], reason: str) -> None:
        super().__init__(reason)
        self.error = error
        self.reason = reason
        self.path: list[Any] = []


class _Encoder:
    __slots__ = ("buffers", "offset")

    def __init__(self) -> None:
        self.buffers: list[Any] = []
        self.offset = 0

    def node(self, value: Any, depth: int) -> Any:
        kind = type(value)
        if kind is str or kind is int or kind is bool or value is None:
            return value
        if kind is float:
            return value if value - value == 0.0 else _nonfinite(value)
        if kind is dict:
            return self.dict(value, depth)
        if kind is list:
            return self.list(value, depth)
        if kind is tuple:
            return {"$tuple": self.list(value, depth)}
        if kind is bytes:
            return {"$b": self.buffer(value, len(value))}
        return self.other(value, depth)

    def list(self, value: list[Any] | tuple[Any, ...], depth: int) -> list[Any]:
        if depth >= MAX_DEPTH:
            raise _EncodeError(ValueError, f"nesting is deeper than MAX_DEPTH={MAX_DEPTH} (a reference cycle?)")
        out = []
        index = 0
        try:
            for index, item in enumerate(value):  # noqa: B007 - the except clause reads index
                kind = type(item)
                if kind is str or kind is int or kind is bool or item is None:
                    out.append(item)
                else:
                    out.append(self.node(item, depth + 1))
        except _EncodeError as exc:
            exc.path.append(index)
            raise
        return out

    def dict(self, value: dict[Any, Any], depth: int) -> Any:
        if depth >= MAX_DEPTH:
            raise _EncodeError(ValueError, f"nesting is deeper than MAX_DEPTH={MAX_DEPTH} (a reference cycle?)")
        for key in value:
            if type(key) is not str or key[:1] == "$":
                return {"$d": self.pairs(value, depth)}
        out = {}
        key = None
        try:
            for key, item in value.items():
                kind = type(item)
                if kind is str or kind is int or kind is bool or item is None:
                    out[key] = item
                else:
                    out[key] = self.node(item, depth + 1)
        except _EncodeError as exc:
            exc.path.append(key)
            raise
        return out

    def pairs(self, value: dict[Any, Any], depth: int) -> list[list[Any]]:
        out = []
        key = None
        try:
            for key, item in value.items():
                if not _is_key(key):
                    raise _EncodeError(TypeError, f"has a key of type {_type_name(key)}")
                out.append([self.node(key, depth + 1), self.node(item, depth + 1)])
        except _EncodeError as exc:
            exc.path.append(key)
            raise
        return out

    def buffer(self, data: Any, nbytes: int) -> list[int]:
        offset = self.offset
        self.buffers.append(data)
        self.offset = offset + nbytes
        return [offset, nbytes]

    def other(self, value: Any, depth: int) -> Any:
        # Subclasses of the allowed types, then tensors and arrays; bool cannot be subclassed. The base type's
        # own conversion ignores a subclass's __str__/__int__ (``str(Enum member)`` is its name, not its value).
        if isinstance(value, int):
            return int.__int__(value)
        if isinstance(value, float):
            return self.node(float.__float__(value), depth)
        if isinstance(value, str):
            return str.__str__(value)
        if isinstance(value, bytes):
            return self.node(bytes.__bytes__(value), depth)
        if isinstance(value, tuple):
            return {"$tuple": self.list(value, depth)}
        if isinstance(value, list):
            return self.list(value, depth)
        if isinstance(value, dict):
            return self.dict(value, depth)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):
            return self.tensor(value)
        numpy = sys.modules.get("numpy")
        if numpy is not None and isinstance(value, numpy.ndarray):
            return self.array(value, numpy)
        raise _EncodeError(
            TypeError, f"has type {_type_name(value)}, which the control channel cannot send (it never pickles)"
        )

    def tensor(self, value: Any) -> dict[str, Any]:
        import torch

        name = str(value.dtype).removeprefix("torch.")
        if name not in _tensor_dtypes():
            raise _EncodeError(TypeError, f"is a tensor of dtype {value.dtype}: allowed {sorted(_tensor_dtypes())}")
        if value.device.type != "cpu":
            raise _EncodeError(TypeError, f"is a tensor on {value.device}: move it to the CPU first (.cpu())")
        if value.layout != torch.strided or value.is_nested:
            raise _EncodeError(TypeError, f"is a tensor with layout {value.layout}: allowed dense torch.strided")
        try:
            data = value.detach().resolve_conj().resolve_neg().contiguous()
            raw = data.reshape(-1).view(torch.uint8).numpy()  # zero-copy view; b"".join copies it once
        except Exception as exc:  # tensor subclasses (DTensor, fake tensors) that hold no plain CPU memory
            raise _EncodeError(TypeError, f"is a {_type_name(value)} whose data cannot be read: {exc}") from exc
        nbytes = data.numel() * data.element_size()
        return {"$t": [*self.buffer(raw, nbytes), name, list(data.shape)]}

    def array(self, value: Any, numpy: Any) -> dict[str, Any]:
        if type(value) is not numpy.ndarray or value.dtype.name not in NUMPY_DTYPES:
            raise _EncodeError(
                TypeError,
                f"is a {_type_name(value)} of dtype {value.dtype}: allowed numpy.ndarray of {list(NUMPY_DTYPES)}",
            )
        data = value if value.flags.c_contiguous else value.copy(order="C")  # ascontiguousarray makes 0-d 1-d
        if not data.dtype.isnative:
            data = data.astype(data.dtype.newbyteorder("="))
        return {
            "$n": [*self.buffer(data.reshape(-1).view(numpy.uint8), data.nbytes), data.dtype.name, list(data.shape)]
        }


def _nonfinite(value: float) -> dict[str, str]:
    return {"$f": "nan" if value != value else ("inf" if value > 0 else "-inf")}


def _is_key(key: Any) -> bool:
    if isinstance(key, tuple):
        return all(_is_key(item) for item in key)
    return isinstance(key, _KEY_TYPES)


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _path(path: list[Any]) -> str:
    return "body" + "".join(f"[{key!r}]" for key in reversed(path))


def encode(body: Any) -> bytes:
    """The payload bytes of ``body`` (see the module docstring for what is allowed).

    Raises:
        TypeError: ``body`` holds a value of another type, a dict key of another type, or a tensor or array of
            another dtype, device or layout; the message names the path inside the body, e.g.
            ``body['shard'][2]``, the offending type and the allowed types.
        ValueError: nesting deeper than :data:`MAX_DEPTH`, a payload over :data:`MAX_PAYLOAD_BYTES` or a JSON
            part over :data:`MAX_JSON_BYTES`, or an
            ``int`` with more digits than Python converts to text (``sys.get_int_max_str_digits``).
    """
    if body is None:
        return _NONE_PAYLOAD
    encoder = _Encoder()
    try:
        tree = encoder.node(body, 0)
    except _EncodeError as exc:
        if exc.error is TypeError:
            raise TypeError(f"{_path(exc.path)} {exc.reason}; allowed: {_ALLOWED}") from None
        raise exc.error(f"{_path(exc.path)}: {exc.reason}") from None
    text = _json(tree)
    if len(text) > MAX_JSON_BYTES:
        raise ValueError(
            f"body's JSON part is {len(text)} bytes, over MAX_JSON_BYTES={MAX_JSON_BYTES}: send bulk data as "
            "tensors or arrays, or in several messages"
        )
    size = _PREFIX_BYTES + len(text) + encoder.offset
    if size > MAX_PAYLOAD_BYTES:
        raise ValueError(f"body encodes to {size} bytes, over MAX_PAYLOAD_BYTES={MAX_PAYLOAD_BYTES}")
    prefix = MAGIC + len(text).to_bytes(4, "little")
    if not encoder.buffers:
        return prefix + text
    return b"".join((prefix, text, *encoder.buffers))


# ---------------------------------------------------------------------- decoding


class _Decoder:
    __slots__ = ("cursor", "data", "end", "start")

    def __init__(self, data: memoryview, start: int) -> None:
        self.data = data
        self.start = start
        self.end = len(data)
        self.cursor = start

    def node(self, node: Any, depth: int) -> Any:
        kind = type(node)
        if kind is list:
            return self.list(node, depth)
        if kind is dict:
            return self.dict(node, depth)
        return node

    def list(self, node: list[Any], depth: int) -> list[Any]:
        if depth >= MAX_DEPTH:
            raise PayloadError(f"nesting is deeper than MAX_DEPTH={MAX_DEPTH}")
        for index, item in enumerate(node):
            kind = type(item)
            if kind is list or kind is dict:
                node[index] = self.node(item, depth + 1)
        return node

    def dict(self, node: dict[str, Any], depth: int) -> Any:
        if depth >= MAX_DEPTH:
            raise PayloadError(f"nesting is deeper than MAX_DEPTH={MAX_DEPTH}")
        for key, item in node.items():
            if key[:1] == "$":
                if len(node) != 1:
                    raise PayloadError(f"tag {key!r} is not alone in its object: keys {sorted(node)[:5]}")
                return self.tagged(key, item, depth)
            kind = type(item)
            if kind is list or kind is dict:
                node[key] = self.node(item, depth + 1)
        return node

    def tagged(self, tag: str, value: Any, depth: int) -> Any:
        if tag == "$tuple" and type(value) is list:
            return tuple(self.list(value, depth))
        if tag == "$d" and type(value) is list:
            return self.pairs(value, depth)
        if tag == "$f" and value in _NONFINITE:
            return _NONFINITE[value]
        if tag == "$b":
            offset, nbytes = _ints(value, 2, tag)
            start = self.take(offset, nbytes)
            return bytes(self.data[start : start + nbytes])
        if tag == "$t":
            return self.tensor(value)
        if tag == "$n":
            return self.array(value)
        raise PayloadError(f"unknown tag or malformed tagged value {tag!r}: {_short(value)}")

    def pairs(self, value: list[Any], depth: int) -> dict[Any, Any]:
        out = {}
        for pair in value:
            if type(pair) is not list or len(pair) != 2:
                raise PayloadError(f"'$d' item is not a [key, value] pair: {_short(pair)}")
            key = self.node(pair[0], depth + 1)
            if not _is_key(key):
                raise PayloadError(f"'$d' key of type {type(key).__name__} is not allowed")
            out[key] = self.node(pair[1], depth + 1)
        return out

    def take(self, offset: int, nbytes: int) -> int:
        """Claim the next buffer; returns its absolute start."""
        start = self.start + offset
        if start != self.cursor or start + nbytes > self.end:
            raise PayloadError(
                f"buffer at offset {offset} ({nbytes} bytes) is out of place: expected offset "
                f"{self.cursor - self.start}, {self.end - self.cursor} bytes left"
            )
        self.cursor = start + nbytes
        return start

    def shaped(self, value: Any, tag: str, itemsizes: dict[str, int]) -> tuple[int, int, str, list[int]]:
        if type(value) is not list or len(value) != 4:
            raise PayloadError(f"{tag!r} value is not [offset, nbytes, dtype, shape]: {_short(value)}")
        offset, nbytes = _ints(value[:2], 2, tag)
        dtype, shape = value[2], value[3]
        if type(dtype) is not str or dtype not in itemsizes:
            raise PayloadError(f"{tag!r} dtype {_short(dtype)} is not allowed: allowed {sorted(itemsizes)}")
        if type(shape) is not list or len(shape) > _MAX_DIMS:
            raise PayloadError(f"{tag!r} shape {_short(shape)} is not a list of at most {_MAX_DIMS} sizes")
        numel = 1
        for size in _ints(shape, len(shape), tag):
            numel *= size
        if numel * itemsizes[dtype] != nbytes:
            raise PayloadError(f"{tag!r} shape {shape} of {dtype} needs {numel * itemsizes[dtype]} bytes, not {nbytes}")
        return self.take(offset, nbytes), nbytes, dtype, shape

    def tensor(self, value: Any) -> Any:
        import torch

        dtypes = _tensor_dtypes()
        start, nbytes, dtype, shape = self.shaped(value, "$t", {k: v.itemsize for k, v in dtypes.items()})
        out = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            memoryview(out.numpy())[:] = self.data[start : start + nbytes]  # the one copy
            if dtype == "bool" and bool(out.max() > 1):
                raise PayloadError("'$t' bool tensor holds bytes other than 0 and 1")
        return out.view(dtypes[dtype]).reshape(shape)

    def array(self, value: Any) -> Any:
        try:
            import numpy
        except ImportError as exc:
            raise PayloadError("payload holds a numpy array but numpy is not installed") from exc
        itemsizes = {name: numpy.dtype(name).itemsize for name in NUMPY_DTYPES}
        start, nbytes, dtype, shape = self.shaped(value, "$n", itemsizes)
        raw = numpy.frombuffer(self.data, numpy.uint8, nbytes, start) if nbytes else None
        if dtype == "bool" and raw is not None and raw.max() > 1:
            raise PayloadError("'$n' bool array holds bytes other than 0 and 1")
        out = numpy.empty(shape, dtype=dtype)
        if raw is not None:
            out.reshape(-1).view(numpy.uint8)[:] = raw
        return out


def _ints(value: Any, count: int, tag: str) -> list[int]:
    if (
        type(value) is not list
        or len(value) != count
        or not all(type(item) is int and item >= 0 for item in value)  # bool is not an int here
    ):
        raise PayloadError(f"{tag!r} expects {count} non-negative integers, got {_short(value)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def decode(payload: bytes | memoryview) -> Any:
    """The body that :func:`encode` turned into ``payload``; builds nothing but the allowed types.

    Raises:
        PayloadError: ``payload`` is over :data:`MAX_PAYLOAD_BYTES`, lacks :data:`MAGIC`, its JSON is over
            :data:`MAX_JSON_BYTES` or does not parse, holds a non-finite plain number or a bool buffer with bytes
            other than 0 and 1, or it holds an unknown or malformed tag, a disallowed dtype, a shape that does not
            match its byte count, a buffer out of place or out of bounds, trailing bytes, or nesting deeper than
            :data:`MAX_DEPTH`. Any other failure while decoding is re-raised as ``PayloadError`` (``__cause__``
            holds it).
    """
    if payload == _NONE_PAYLOAD:  # the controller's heartbeats and body-less commands
        return None
    size = len(payload)
    if size > MAX_PAYLOAD_BYTES:
        raise PayloadError(f"payload is {size} bytes, over MAX_PAYLOAD_BYTES={MAX_PAYLOAD_BYTES}")
    if size < _PREFIX_BYTES or payload[:4] != MAGIC:
        raise PayloadError(f"payload does not start with {MAGIC!r}: not a control-channel body ({size} bytes)")
    json_bytes = int.from_bytes(payload[4:_PREFIX_BYTES], "little")
    if json_bytes > MAX_JSON_BYTES:
        raise PayloadError(f"payload declares {json_bytes} bytes of JSON, over MAX_JSON_BYTES={MAX_JSON_BYTES}")
    start = _PREFIX_BYTES + json_bytes
    if start > size:
        raise PayloadError(f"payload declares {start - _PREFIX_BYTES} bytes of JSON, has {size - _PREFIX_BYTES}")
    try:
        text = str(payload[_PREFIX_BYTES:start], "utf-8")
        tree, end = _JSON_DECODER.raw_decode(text)
        if end != len(text):
            raise PayloadError(f"JSON has {len(text) - end} trailing characters")
        if type(tree) is not list and type(tree) is not dict:
            body = tree
        else:
            decoder = _Decoder(memoryview(payload), start)
            body = decoder.node(tree, 0)
            start = decoder.cursor
    except PayloadError:
        raise
    except Exception as exc:  # bad UTF-8 or JSON, RecursionError, MemoryError, ...
        raise PayloadError(f"payload does not decode: {type(exc).__name__}: {exc}") from exc
    if start != size:
        raise PayloadError(f"payload has {size - start} bytes after its last buffer")
    return body
