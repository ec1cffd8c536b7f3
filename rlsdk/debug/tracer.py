"""Collective tracer: a ``traced`` c10d backend that records every collective and point-to-point call.

Why a backend and not a wrapper of the public ``torch.distributed`` functions: DDP's reducer and FSDP2 call the
process group from C++, so a Python function wrapper never sees their all-reduces (measured on torch 2.13). A
Python subclass of ``dist.ProcessGroup`` that c10d creates as the group itself is reached by those C++ callers
too. It holds a ``ProcessGroupGloo`` and forwards each method after appending one record to a bounded ring
buffer; the recording costs a few microseconds (no traceback: one ``sys._getframe`` walk whose per-code-object
decisions are cached).

Use ``install()`` once per process, then ``dist.init_process_group(backend="traced", ...)`` (or call
:func:`init_traced_process_group`). Subgroups created with ``new_group(backend="traced")`` get their own
sequence counters. :func:`snapshot` returns plain dicts (picklable, JSON-able) that the event thread of the
control channel sends to the controller while the main thread is blocked inside a collective.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import marshal
import os
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rlsdk.config.device import GLOO

if TYPE_CHECKING:
    from rlsdk.engine.train.shm_allreduce import SharedMemoryAllreduce

__all__ = [
    "BACKEND",
    "FIELDS",
    "Tracer",
    "get_tracer",
    "init_traced_process_group",
    "install",
    "internal_prefixes",
    "read_tail",
    "set_command",
    "snapshot",
    "thread_stacks",
]

BACKEND = "traced"
"""Name of the c10d backend the tracer registers."""

FIELDS = (
    "group",  # process group name ("0" is WORLD)
    "seq",  # per-group sequence number of collectives; p2p calls are counted apart
    "p2p",  # True for send/recv
    "op",  # c10d method name: allreduce, broadcast, allgather, _allgather_base, send, recv, barrier, ...
    "shapes",  # input tensor shapes, a tuple of tuples
    "dtypes",  # input tensor dtypes, a tuple of strings
    "reduce_op",  # SUM/MAX/... or None
    "root",  # broadcast/reduce/gather/scatter source or destination (group rank), p2p peer; else None
    "command",  # Session command running on this rank (None outside commands)
    "command_seq",  # that command's sequence number
    "site",  # "file:line" of the first frame outside torch and rlsdk internals
    "stack",  # up to 4 "file:line in function" frames above the call site, innermost first
    "t_start",  # time.monotonic() when the call was issued
    "t_end",  # when the call was seen completed (None: not completed when the snapshot was taken)
    "peer_seq",  # send/recv: 1-based count of this op kind between this rank and that peer in the group; else None
    "splits",  # all_to_all_single: (input split sizes, output split sizes), () for an even split; else None
    "sync",  # True: the issuing call waits for completion before returning (the thread is blocked while pending)
    "thread",  # threading.get_ident() of the issuing thread
    "index",  # 0-based position of the record among every record this process appended
)
"""Field names of a record, in order (records are lists internally and dicts in snapshots)."""

_T_END = FIELDS.index("t_end")
_ROOT = FIELDS.index("root")
_SYNC = FIELDS.index("sync")
_THREAD = FIELDS.index("thread")
_INDEX = FIELDS.index("index")
POLL_LIMIT = 512
"""Most new records one :meth:`Tracer.poll` returns (the newest ones): bounds the cost of a live check."""
TAIL_SLOTS = 16
"""Records mirrored into the crash-safe tail file."""
_TAIL_SLOT_BYTES = 1024
_STACK_DEPTH = 4
_get_ident = threading.get_ident
# What the tail keeps of a record: no stack (code objects), no completion time (unknown when the rank dies).
_TAIL_FIELDS = (*FIELDS[:11], "t_start", *FIELDS[14:])


def internal_prefixes() -> tuple[str, ...]:
    """File prefixes of the frames a call site skips: torch, rlsdk's tracer modules, accelerate, transformers."""
    import torch

    prefixes = [os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep]
    # typing_extensions: torch's deprecated aliases (reduce_scatter_tensor, all_gather_into_tensor) are wrapped
    # by its @deprecated, whose frame would otherwise be taken for the user's call site.
    for name in ("accelerate", "transformers", "typing_extensions"):
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None) if module is not None else None
        if path:
            package = os.path.basename(path) == "__init__.py"
            prefixes.append(os.path.dirname(path) + os.sep if package else path)
    return tuple(prefixes)


class Tracer:
    """The per-process record buffer. One exists per process (:func:`get_tracer`).

    Args:
        capacity: records kept; older ones are dropped (a ring buffer), >= 1.
    """

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity!r} is invalid: allowed >= 1")
        self.records: deque[list[Any]] = deque(maxlen=capacity)
        self.capacity = capacity
        self.enabled = True
        self.command: tuple[str | None, int | None] = (None, None)
        self.rank = int(os.environ.get("RANK", "0"))
        self.groups: dict[str, dict[str, Any]] = {}
        self._seq: dict[tuple[str, bool], int] = {}
        self._peer_seq: dict[tuple[str, str, int], int] = {}
        self._internal: dict[Any, bool] = {}  # code object -> "inside torch/rlsdk internals"
        self._prefixes: tuple[str, ...] | None = None
        self.errors: list[str] = []
        self._tail: Any = None
        self._tail_index = -1
        # (record, Work) of the latest calls: completion is polled; holding Work keeps its tensors alive, so the
        # bound is small.
        self.polled: deque[tuple[list[Any], Any]] = deque(maxlen=64)
        # The latest synchronous call of each thread, polled at snapshot time however many calls came after: a
        # pending one means that thread is blocked in it, which the analyser's certainty rules rely on.
        self.blocking: dict[int, tuple[list[Any], Any]] = {}
        self._indices = itertools.count()
        self.count = 0
        """Records appended since the tracer was created (the next record's ``index``)."""
        self.last_command_seq: int | None = None
        """Sequence number of the latest command this rank started (it stays set after the command ends)."""
        self.command_history: deque[tuple[float, str | None, int | None]] = deque(maxlen=256)
        """(monotonic time, name, seq) of the latest command changes: which command a call recorded elsewhere (the
        Flight Recorder, :mod:`rlsdk.debug.flight_recorder`) belongs to, by its time."""

    # ------------------------------------------------------------------ recording (hot path)

    def _is_internal(self, code: Any) -> bool:
        internal = self._internal.get(code)
        if internal is None:
            if self._prefixes is None:
                self._prefixes = internal_prefixes()
            filename = code.co_filename
            internal = filename.startswith(self._prefixes) or filename.startswith("<")
            self._internal[code] = internal
        return internal

    def record(
        self,
        group: str,
        p2p: bool,
        op: str,
        tensors: Sequence[Any],
        reduce_op: str | None,
        root: int | None,
        sync: bool = False,
        splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    ) -> list[Any]:
        """Append one record and return it (the caller fills ``t_end`` on completion)."""
        key = (group, p2p)
        seq = self._seq.get(key, 0) + 1
        self._seq[key] = seq
        peer_seq = None
        if p2p and root is not None:
            # the k-th send from a to b pairs with b's k-th recv from a (analyze matches on it)
            peer_key = (group, op, root)
            peer_seq = self._peer_seq.get(peer_key, 0) + 1
            self._peer_seq[peer_key] = peer_seq
        frame = sys._getframe(2)
        is_internal = self._is_internal
        while frame is not None and is_internal(frame.f_code):
            frame = frame.f_back
        if frame is None:
            site = "?"
            stack: tuple[Any, ...] = ()
        else:
            site = f"{frame.f_code.co_filename}:{frame.f_lineno}"
            # Only references here; text is built at snapshot time, off the hot path.
            frames = []
            outer = frame.f_back
            while outer is not None and len(frames) < _STACK_DEPTH - 1:
                frames.append((outer.f_code, outer.f_lineno))
                outer = outer.f_back
            stack = (frame.f_code.co_name, *frames)
        command, command_seq = self.command
        index = next(self._indices)  # atomic: threads that record at once still get distinct indices
        self.count = index + 1
        rec = [
            group,
            seq,
            p2p,
            op,
            tuple(tuple(t.shape) for t in tensors),
            tuple(str(t.dtype)[6:] for t in tensors),
            reduce_op,
            root,
            command,
            command_seq,
            site,
            stack,
            time.monotonic(),
            None,
            peer_seq,
            splits,
            sync,
            _get_ident(),
            index,
        ]
        self.records.append(rec)
        if self._tail is not None:
            self._write_tail(rec)
        return rec

    def track(self, rec: list[Any], work: Any) -> None:
        """Remember ``work`` to learn when ``rec`` completes. Completion is polled (here, on the next call, and
        at snapshot time) rather than signalled by ``work.get_future().then(...)``: a Python callback on gloo's
        thread costs a GIL hand-off per collective (benchmarks/tracer_overhead.py), and gloo's send/recv
        have no future at all. ``t_end`` is therefore "seen completed by", not the exact completion time.

        Completed calls leave the window here, the newest and then the oldest ones: a Work holds its tensors, and
        at a real shape a window of FSDP2's gathered parameters and unsharded gradients would stay alive."""
        polled = self.polled
        if polled:
            last_rec, last_work = polled[-1]
            if last_rec[_T_END] is not None or last_work.is_completed():
                if last_rec[_T_END] is None:
                    _completed(last_rec, last_work, time.monotonic())
                polled.pop()
            while polled:
                old_rec, old_work = polled[0]
                if old_rec[_T_END] is None:
                    if not old_work.is_completed():
                        break
                    _completed(old_rec, old_work, time.monotonic())
                polled.popleft()
        polled.append((rec, work))
        if rec[_SYNC]:
            self.blocking[rec[_THREAD]] = (rec, work)

    # ------------------------------------------------------------------ crash-safe tail

    def open_tail(self, path: str) -> None:
        """Mirror the last :data:`TAIL_SLOTS` records (without stacks) into a memory-mapped file at ``path``.

        Gloo aborts a rank (SIGABRT) on a size mismatch within a millisecond of the collective starting, before
        any thread could ship the record; the page cache keeps what the mapping holds, so the controller can
        still read the dead rank's last collectives (:func:`read_tail`).
        """
        import mmap

        with open(path, "w+b") as file:
            file.truncate(TAIL_SLOTS * _TAIL_SLOT_BYTES)
            self._tail = mmap.mmap(file.fileno(), TAIL_SLOTS * _TAIL_SLOT_BYTES)

    def _write_tail(self, rec: list[Any]) -> None:
        try:
            data = marshal.dumps((self.rank, *rec[:11], rec[12], *rec[14:]))  # _TAIL_FIELDS
        except ValueError:
            return
        if len(data) > _TAIL_SLOT_BYTES - 4:
            return
        self._tail_index = index = (self._tail_index + 1) % TAIL_SLOTS
        offset = index * _TAIL_SLOT_BYTES
        tail = self._tail
        assert tail is not None
        tail[offset + 4 : offset + 4 + len(data)] = data
        tail[offset : offset + 4] = len(data).to_bytes(4, "little")

    # ------------------------------------------------------------------ reading (any thread)

    def _poll_completion(self) -> float:
        now = time.monotonic()
        for rec, work in [*self.polled, *self.blocking.values()]:
            if rec[_T_END] is None and work.is_completed():
                _completed(rec, work, now)  # completed at or before now
        return now

    def _state(self, now: float) -> dict[str, Any]:
        """Everything but the records: clock, command, groups, heads, threads (see :meth:`snapshot`)."""
        command, command_seq = self.command
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "now": now,
            "wall_time": time.time(),
            "command": command,
            "command_seq": command_seq,
            "last_command_seq": self.last_command_seq,
            "capacity": self.capacity,
            "count": self.count,
            "groups": dict(self.groups),
            # last sequence number per group: collectives, and p2p calls per (op, peer), also for records that
            # left the ring buffer (a rank is absent from seq N only if its head is below N)
            "heads": {group: seq for (group, p2p), seq in list(self._seq.items()) if not p2p},
            "peer_heads": {f"{group}|{op}|{peer}": n for (group, op, peer), n in list(self._peer_seq.items())},
            "main_thread": threading.main_thread().ident,
            "threads": {str(thread.ident): thread.name for thread in threading.enumerate()},
            "errors": list(self.errors[-5:]),
        }

    def snapshot(self) -> dict[str, Any]:
        """This rank's state as plain data: records (oldest first) with their short stacks, groups, the current
        command (and the latest one started: ``last_command_seq``), per-group heads, live threads, the clock."""
        now = self._poll_completion()
        records = []
        for rec in list(self.records):  # list(): a consistent copy while the main thread appends
            item = dict(zip(FIELDS, rec, strict=True))
            name, *frames = rec[11] or ("?",)
            item["stack"] = [f"{rec[10]} in {name}"] + [
                f"{code.co_filename}:{line} in {code.co_name}" for code, line in frames
            ]
            records.append(item)
        return {**self._state(now), "records": records}

    def poll(self, since: int | None = None, pending: Sequence[int] = ()) -> dict[str, Any]:
        """A cheap view for live checks: :meth:`snapshot`'s state without stacks, ``records`` holding only those
        with ``index >= since`` (at most :data:`POLL_LIMIT`, the newest) as lists in :data:`FIELDS` order
        (``stack`` empty, shapes as lists), and ``done``: ``[index, t_end, root]`` of the records listed in
        ``pending`` that completed since (a caller's copies of still-pending records)."""
        now = self._poll_completion()
        current = list(self.records)
        floor = since or 0
        records = [_plain(rec) for rec in current[-POLL_LIMIT:] if rec[_INDEX] >= floor]
        wanted = set(pending)
        done = [
            [rec[_INDEX], rec[_T_END], rec[_ROOT]]
            for rec in current
            if rec[_T_END] is not None and rec[_INDEX] in wanted
        ] if wanted else []  # fmt: skip
        return {**self._state(now), "records": records, "done": done}


def _plain(rec: list[Any]) -> list[Any]:
    out = list(rec)
    out[4] = [list(shape) for shape in rec[4]]
    out[5] = list(rec[5])
    out[11] = []
    if rec[15] is not None:
        out[15] = [list(rec[15][0]), list(rec[15][1])]
    return out


def _completed(rec: list[Any], work: Any, now: float) -> None:
    rec[_T_END] = now
    if rec[3] == "recv_anysource" and rec[_ROOT] is None:
        # which peer the message came from: analyze pairs it with that peer's send (best effort)
        with contextlib.suppress(RuntimeError, AttributeError, ValueError):
            rec[_ROOT] = int(work._source_rank())


_TRACER: Tracer | None = None
_LOCK = threading.Lock()


def get_tracer() -> Tracer:
    """The process's tracer (created on first use)."""
    global _TRACER
    if _TRACER is None:
        with _LOCK:
            if _TRACER is None:
                _TRACER = Tracer(int(os.environ.get("RLSDK_TRACER_CAPACITY", "4096")))
    return _TRACER


def set_command(name: str | None, seq: int | None) -> None:
    """Tag later records with the Session command ``name`` / ``seq`` (``None``: between commands)."""
    tracer = get_tracer()
    tracer.command = (name, seq)
    tracer.command_history.append((time.monotonic(), name, seq))
    if seq is not None:
        tracer.last_command_seq = seq


def snapshot() -> dict[str, Any]:
    """:meth:`Tracer.snapshot` of this process's tracer."""
    return get_tracer().snapshot()


def read_tail(path: str) -> list[dict[str, Any]]:
    """Records (oldest first, without stacks or completion times) from a tail file that a rank wrote with
    :meth:`Tracer.open_tail`; ``[]`` when the file is missing or empty. Readable after the rank died."""
    try:
        data = open(path, "rb").read()  # noqa: SIM115 - one short read
    except OSError:
        return []
    records = []
    for index in range(len(data) // _TAIL_SLOT_BYTES):
        offset = index * _TAIL_SLOT_BYTES
        size = int.from_bytes(data[offset : offset + 4], "little")
        if not 0 < size <= _TAIL_SLOT_BYTES - 4:
            continue
        try:
            rank, *fields = marshal.loads(data[offset + 4 : offset + 4 + size])
            item = dict(zip(_TAIL_FIELDS, fields, strict=True))
        except (ValueError, EOFError, TypeError):
            continue
        item.update(rank=rank, stack=[], t_end=None, from_tail=True)
        records.append(item)
    records.sort(key=lambda item: item["t_start"])
    return records


def thread_stacks() -> dict[str, list[str]]:
    """Formatted Python stacks of every thread of this process, by ``"name (ident)"``; any thread may call it."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return {
        f"{names.get(ident, '?')} ({ident})": [line.rstrip("\n") for line in traceback.format_stack(frame)]
        for ident, frame in sys._current_frames().items()
    }


# ---------------------------------------------------------------------- the c10d backend


_REDUCE_NAMES: dict[Any, str] = {}


def _reduce_name(opts: Any) -> str | None:
    op = getattr(opts, "reduceOp", None)
    if op is None:
        return None
    kind = getattr(op, "op", op)  # ReduceOp wraps RedOpType
    name = _REDUCE_NAMES.get(kind)
    if name is None:
        name = _REDUCE_NAMES[kind] = str(kind).rsplit(".", 1)[-1]
    return name


def _flat(tensors: Any) -> list[Any]:
    if isinstance(tensors, (list, tuple)):
        out: list[Any] = []
        for item in tensors:
            out.extend(_flat(item)) if isinstance(item, (list, tuple)) else out.append(item)
        return out
    return [tensors]


_WORKS_CLASS: type | None = None


def _works(works: list[Any]) -> Any:
    """One Work over ``works``: waiting waits for each; completed once each reports completion or once ``wait``
    returned. Also used alone: gloo's reduce-scatter Work never reports ``is_completed()`` (torch 2.13)."""
    global _WORKS_CLASS
    if _WORKS_CLASS is None:
        import torch.distributed as dist

        class _Works(dist.Work):  # type: ignore[misc]
            def __init__(self, works: list[Any]) -> None:
                super().__init__()
                self._works = works
                self._waited = False

            def wait(self, timeout: Any = None) -> bool:
                for work in self._works:
                    work.wait() if timeout is None else work.wait(timeout)
                self._waited = True
                return True

            def is_completed(self) -> bool:
                return self._waited or all(work.is_completed() for work in self._works)

            def is_success(self) -> bool:
                return all(work.is_success() for work in self._works)

        _WORKS_CLASS = _Works
    return _WORKS_CLASS(works)


def _coalesced(call: Callable[[Any, Any, Any], Any], outputs: Sequence[Any], inputs: Sequence[Any], opts: Any) -> Any:
    """Gloo's Python binding has no coalesced tensor collectives: issue one per (output, input) pair, in the same
    order on every rank, under one Work."""
    return _works([call(output, input, opts) for output, input in zip(outputs, inputs, strict=True)])


def _shm_work(shm: SharedMemoryAllreduce, tensors: Any, reduce_op: str) -> Any:
    """Reduce through shared memory now (synchronously) and return a completed Work whose future holds the
    tensors, as gloo's does: DDP's reducer reads the bucket from it."""
    import torch
    from torch._C._distributed_c10d import _create_work_from_future

    shm.allreduce(tensors[0], reduce_op)
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(list(tensors))
    return _create_work_from_future(future)


def _sync(opts: Any) -> bool:
    """Whether the caller waits for the call before returning: torch's public functions set ``asyncOp`` from
    their ``async_op`` argument; C++ callers (DDP's reducer) leave the default, True."""
    return not getattr(opts, "asyncOp", True)


_SYNC_P2P_CODES: frozenset[Any] | None = None


def _from_sync_p2p() -> bool:
    """Whether this send/recv comes from ``dist.send``/``dist.recv`` (which wait for it), not ``isend``/``irecv``
    or a batch: looks a few frames up for their code objects."""
    global _SYNC_P2P_CODES
    if _SYNC_P2P_CODES is None:
        import inspect

        import torch.distributed.distributed_c10d as c10d

        _SYNC_P2P_CODES = frozenset(inspect.unwrap(getattr(c10d, name)).__code__ for name in ("send", "recv"))
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code in _SYNC_P2P_CODES:
            return True
        frame = frame.f_back
    return False


def _splits(input_split: Any, output_split: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(int(n) for n in input_split or ()), tuple(int(n) for n in output_split or ())


def _make_group_class() -> type:
    import torch.distributed as dist

    class TracedProcessGroup(dist.ProcessGroup):  # type: ignore[misc]
        """A gloo process group that records each call before forwarding it (see the module docstring)."""

        def __init__(
            self, gloo: Any, rank: int, size: int, name: str, tracer: Tracer, shm: SharedMemoryAllreduce | None = None
        ) -> None:
            super().__init__(rank, size)
            self._gloo = gloo
            self._trace_name = name
            self._tracer = tracer
            self._shm = shm

        def _go(
            self,
            op: str,
            tensors: Any,
            reduce_op: str | None,
            root: int | None,
            call: Callable[[], Any],
            p2p: bool,
            sync: bool = False,
            splits: Any = None,
        ) -> Any:
            tracer = self._tracer
            if not tracer.enabled:
                return call()
            rec = tracer.record(self._trace_name, p2p, op, _flat(tensors), reduce_op, root, sync, splits)
            try:
                work = call()
            except BaseException as exc:
                rec[_T_END] = time.monotonic()
                tracer.errors.append(f"{op} seq {rec[1]}: {type(exc).__name__}: {exc}")
                raise
            tracer.track(rec, work)
            return work

        # Each method mirrors the C++ virtual with the same name; options objects pass through unchanged.
        def allreduce(self, tensors: Any, opts: Any = None) -> Any:
            opts = opts if opts is not None else dist.AllreduceOptions()
            reduce_op = _reduce_name(opts)
            shm = self._shm
            if shm is not None and shm.supports(tensors, reduce_op):
                assert reduce_op is not None
                return self._go(
                    "allreduce",
                    tensors,
                    reduce_op,
                    None,
                    lambda: _shm_work(shm, tensors, reduce_op),
                    False,
                    _sync(opts),
                )
            return self._go(
                "allreduce", tensors, reduce_op, None, lambda: self._gloo.allreduce(tensors, opts), False, _sync(opts)
            )

        def allreduce_coalesced(self, tensors: Any, opts: Any) -> Any:
            return self._go(
                "allreduce_coalesced",
                tensors,
                _reduce_name(opts),
                None,
                lambda: self._gloo.allreduce_coalesced(tensors, opts),
                False,
                _sync(opts),
            )

        def broadcast(self, tensors: Any, opts: Any = None) -> Any:
            opts = opts if opts is not None else dist.BroadcastOptions()
            return self._go(
                "broadcast",
                tensors,
                None,
                opts.rootRank,
                lambda: self._gloo.broadcast(tensors, opts),
                False,
                _sync(opts),
            )

        def reduce(self, tensors: Any, opts: Any) -> Any:
            return self._go(
                "reduce",
                tensors,
                _reduce_name(opts),
                opts.rootRank,
                lambda: self._gloo.reduce(tensors, opts),
                False,
                _sync(opts),
            )

        def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            opts = opts if opts is not None else dist.AllgatherOptions()
            return self._go(
                "allgather", inputs, None, None, lambda: self._gloo.allgather(outputs, inputs, opts), False, _sync(opts)
            )

        def _gather_into(self, op: str, output: Any, input: Any, opts: Any) -> Any:
            opts = opts if opts is not None else dist.AllgatherOptions()
            call = lambda: self._gloo._allgather_base(output, input, opts)  # noqa: E731
            return self._go(op, [input], None, None, call, False, _sync(opts))

        def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:
            return self._gather_into("_allgather_base", output, input, opts)

        def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            opts = opts if opts is not None else dist.AllgatherOptions()
            return self._go(
                "allgather_coalesced",
                inputs,
                None,
                None,
                lambda: self._gloo.allgather_coalesced(outputs, inputs, opts),
                False,
                _sync(opts),
            )

        def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            opts = opts if opts is not None else dist.AllgatherOptions()
            return self._go(
                "allgather_into_tensor_coalesced",
                inputs,
                None,
                None,
                lambda: _coalesced(self._gloo._allgather_base, outputs, inputs, opts),
                False,
                _sync(opts),
            )

        # torch 2.13 names: dist.all_gather_single / reduce_scatter_single / all_to_all_single (FSDP2 calls the
        # first two from Python) and the *_coalesced variants (functional collectives call them from C++).
        def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> Any:
            return self._gather_into("all_gather_single", output, input, opts)

        def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            opts = opts if opts is not None else dist.AllgatherOptions()
            return self._go(
                "all_gather_single_coalesced",
                inputs,
                None,
                None,
                lambda: _coalesced(self._gloo._allgather_base, outputs, inputs, opts),
                False,
                _sync(opts),
            )

        def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> Any:
            opts = opts if opts is not None else dist.ReduceScatterOptions()
            return self._go(
                "reduce_scatter_single",
                [input],
                _reduce_name(opts),
                None,
                lambda: _works([self._gloo._reduce_scatter_base(output, input, opts)]),
                False,
                _sync(opts),
            )

        def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            opts = opts if opts is not None else dist.ReduceScatterOptions()
            return self._go(
                "reduce_scatter_single_coalesced",
                inputs,
                _reduce_name(opts),
                None,
                lambda: _coalesced(self._gloo._reduce_scatter_base, outputs, inputs, opts),
                False,
                _sync(opts),
            )

        def all_to_all_single(
            self, output: Any, input: Any, output_split: Any, input_split: Any, opts: Any = None
        ) -> Any:
            if not isinstance(opts, dist.AllToAllOptions):  # the overload that takes a timeout
                timeout, opts = opts, dist.AllToAllOptions()
                if timeout is not None:
                    opts.timeout = timeout
            return self._go(
                "all_to_all_single",
                [input],
                None,
                None,
                lambda: self._gloo.alltoall_base(output, input, output_split, input_split, opts),
                False,
                _sync(opts),
                _splits(input_split, output_split),
            )

        def gather(self, outputs: Any, inputs: Any, opts: Any) -> Any:
            return self._go(
                "gather",
                inputs,
                None,
                opts.rootRank,
                lambda: self._gloo.gather(outputs, inputs, opts),
                False,
                _sync(opts),
            )

        def scatter(self, outputs: Any, inputs: Any, opts: Any) -> Any:
            return self._go(
                "scatter",
                outputs,
                None,
                opts.rootRank,
                lambda: self._gloo.scatter(outputs, inputs, opts),
                False,
                _sync(opts),
            )

        def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any) -> Any:
            return self._go(
                "reduce_scatter",
                outputs,
                _reduce_name(opts),
                None,
                lambda: self._gloo.reduce_scatter(outputs, inputs, opts),
                False,
                _sync(opts),
            )

        def _reduce_scatter_base(self, output: Any, input: Any, opts: Any) -> Any:
            return self._go(
                "_reduce_scatter_base",
                [input],
                _reduce_name(opts),
                None,
                lambda: _works([self._gloo._reduce_scatter_base(output, input, opts)]),
                False,
                _sync(opts),
            )

        def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any) -> Any:
            return self._go(
                "reduce_scatter_tensor_coalesced",
                inputs,
                _reduce_name(opts),
                None,
                lambda: _coalesced(self._gloo._reduce_scatter_base, outputs, inputs, opts),
                False,
                _sync(opts),
            )

        def alltoall_base(self, output: Any, input: Any, output_split: Any, input_split: Any, opts: Any) -> Any:
            return self._go(
                "alltoall_base",
                [input],
                None,
                None,
                lambda: self._gloo.alltoall_base(output, input, output_split, input_split, opts),
                False,
                _sync(opts),
                _splits(input_split, output_split),
            )

        def alltoall(self, outputs: Any, inputs: Any, opts: Any) -> Any:
            return self._go(
                "alltoall", inputs, None, None, lambda: self._gloo.alltoall(outputs, inputs, opts), False, _sync(opts)
            )

        def barrier(self, opts: Any = None) -> Any:
            opts = opts if opts is not None else dist.BarrierOptions()
            return self._go("barrier", [], None, None, lambda: self._gloo.barrier(opts), False, _sync(opts))

        def send(self, tensors: Any, dst: int, tag: int = 0) -> Any:
            sync = _from_sync_p2p()
            return self._go("send", tensors, None, dst, lambda: self._gloo.send(tensors, dst, tag), True, sync)

        def recv(self, tensors: Any, src: int, tag: int = 0) -> Any:
            sync = _from_sync_p2p()
            return self._go("recv", tensors, None, src, lambda: self._gloo.recv(tensors, src, tag), True, sync)

        def recv_anysource(self, tensors: Any, tag: int = 0) -> Any:
            sync = _from_sync_p2p()
            return self._go(
                "recv_anysource", tensors, None, None, lambda: self._gloo.recv_anysource(tensors, tag), True, sync
            )

        def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
            tracer = self._tracer
            if not tracer.enabled:
                return self._gloo.monitored_barrier(timeout, wait_all_ranks)
            # gloo's monitored barrier blocks in C++ and returns no Work: completion is known on return.
            rec = tracer.record(self._trace_name, False, "monitored_barrier", [], None, None, True)
            try:
                return self._gloo.monitored_barrier(timeout, wait_all_ranks)
            except BaseException as exc:
                tracer.errors.append(f"monitored_barrier seq {rec[1]}: {type(exc).__name__}: {exc}")
                raise
            finally:
                rec[_T_END] = time.monotonic()

        def getBackendName(self) -> str:
            return BACKEND

    return TracedProcessGroup


_GROUP_CLASS: type | None = None


def _create(common: Any, _backend_options: Any) -> Any:
    import torch
    import torch.distributed as dist

    global _GROUP_CLASS
    if _GROUP_CLASS is None:
        _GROUP_CLASS = _make_group_class()
    tracer = get_tracer()
    rank, size = common.group_rank, common.group_size
    gloo = dist.ProcessGroupGloo(common.store, rank, size, common.timeout)
    name = str(common.group_id)
    shm = None
    if _SHM_ALLREDUCE:
        from rlsdk.engine.train.shm_allreduce import SharedMemoryAllreduce

        shm = SharedMemoryAllreduce.create(common.store, rank, size, common.timeout)
    group = _GROUP_CLASS(gloo, rank, size, name, tracer, shm)
    # Un-overridden methods (and c10d's backend look-ups) reach gloo through the registered backend.
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    tracer.groups[name] = {"rank": rank, "size": size, "ranks": list(common.global_ranks_in_group or range(size))}
    return group


_SHM_ALLREDUCE = False


def install(*, shm_allreduce: bool | None = None) -> None:
    """Register the ``traced`` backend with c10d (idempotent). Import-time side effects are avoided on purpose:
    call this in the rank before creating the process group.

    ``shm_allreduce``: groups created from now on all-reduce through shared memory when all their ranks share a
    host (:mod:`rlsdk.engine.train.shm_allreduce`; the records are the same); None leaves the setting as is
    (off by default)."""
    import torch.distributed as dist

    global _SHM_ALLREDUCE
    if shm_allreduce is not None:
        _SHM_ALLREDUCE = shm_allreduce

    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    _accept_traced_monitored_barrier()


def _accept_traced_monitored_barrier() -> None:
    """Let ``dist.monitored_barrier`` run on traced groups: torch rejects every backend name but gloo's before it
    calls the group's own ``monitored_barrier``, which a traced group forwards to gloo. Other groups take
    torch's function unchanged. Code that imported the function by name before :func:`install` keeps torch's
    (call ``group.monitored_barrier(timeout, wait_all_ranks=...)`` there)."""
    import functools

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.monitored_barrier
    if getattr(original, "_rlsdk_traced", False):
        return

    @functools.wraps(original)
    def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
        pg = c10d._get_default_group() if group is None else group
        if c10d._rank_not_in_group(pg) or dist.get_backend(pg) != BACKEND:
            return original(group, timeout, wait_all_ranks)
        if timeout is None:
            timeout = c10d._get_default_timeout(GLOO)
        elif isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    monitored_barrier._rlsdk_traced = True  # type: ignore[attr-defined]
    c10d.monitored_barrier = monitored_barrier
    dist.monitored_barrier = monitored_barrier


def init_traced_process_group(
    timeout_s: float | None = None, *, record: bool = True, shm_allreduce: bool = False, store: Any = None
) -> None:
    """Create the default (WORLD) process group on the ``traced`` backend from the torchrun environment.

    Call it before the rank's ``Accelerator`` (:func:`rlsdk.config.device.accelerator_kwargs`): accelerate then uses
    the existing group (it refuses the backend name itself). ``timeout_s`` is the process-group timeout (``None``:
    torch's default). ``record=False`` turns the recording off (the group only forwards, and all-reduces through
    shared memory with ``shm_allreduce``, see :func:`install`). ``store``: the c10d store the ranks meet through (e.g.
    :func:`rlsdk.launch.rendezvous.rank_store`); ``None`` = ``env://`` (``MASTER_ADDR``/``MASTER_PORT``).
    """
    import torch.distributed as dist

    install(shm_allreduce=shm_allreduce)
    get_tracer().enabled = record
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if store is None:
        dist.init_process_group(backend=BACKEND, init_method="env://", **kwargs)
    else:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend=BACKEND, store=store, rank=rank, world_size=world_size, **kwargs)
    tracer = get_tracer()
    tracer.rank = dist.get_rank()
    tail_dir = os.environ.get("RLSDK_TRACE_DIR")
    if tail_dir:
        os.makedirs(tail_dir, exist_ok=True)
        tracer.open_tail(os.path.join(tail_dir, f"rank_{tracer.rank}.tail"))
