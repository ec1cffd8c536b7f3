"""The collective tracer on CUDA: torch's own Flight Recorder buffer read as the tracer's records.

On CUDA the ranks run NCCL, not the ``traced`` gloo backend (:mod:`rlsdk.debug.tracer` wraps ``ProcessGroupGloo``
only). Torch already records every NCCL collective in a ring buffer, the Flight Recorder
(``TORCH_NCCL_TRACE_BUFFER_SIZE`` entries, set by the launcher with the tracer; see
:meth:`rlsdk.config.device.DevicePlan.rank_environment`), with the process group, the per-group sequence number,
the op, the input shapes and dtypes, the Python frames of the call and whether it completed. This module reads that
buffer from the rank's event thread (the main thread may be stuck in the collective) and turns each entry into a
record of :data:`rlsdk.debug.tracer.FIELDS`, so the same analyser, live check, report and notebook view work
unchanged (:func:`snapshot` and :func:`poll` answer the ``trace`` and ``trace_poll`` queries, see
:mod:`rlsdk.debug.rank`).

What the buffer does not hold, and what the records say instead:

- the Session command of a call: taken from the rank's command history (:attr:`Tracer.command_history`) by the
  entry's creation time;
- ``sync`` (the issuing thread waits for the call): NCCL calls return once enqueued, so every record is
  ``sync=False``. The analyser then never takes a rank as blocked *in* a collective; settled divergences are the
  mismatches at one sequence number and the calls whose peers have died or finished the command;
- the reduce op and a broadcast's root: ``None`` on every rank alike, so they never make two calls differ;
- point-to-point peers come from the profiling name (``nccl:send 0->1``, ``nccl:recv 1<-0``).

The dump comes as torch's pickle (the only form with stack frames). It is produced in this process by torch, and
read with an unpickler that refuses every class (:func:`load_dump`): only plain containers, strings and numbers.
On gloo the same buffer exists (``TORCH_FR_BUFFER_SIZE``) without point-to-point calls, which is how the tests run
this path on CPU.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rlsdk.debug.tracer import FIELDS, POLL_LIMIT, get_tracer, thread_stacks

__all__ = ["FlightRecorderView", "dump_bytes", "load_dump", "poll", "records_from_dump", "snapshot"]

_STACK_DEPTH = 4

# Flight Recorder op names (after the "nccl:"/"gloo:" prefix) -> the c10d method names the tracer records.
_TO_TRACER_OPS = {
    "all_reduce": "allreduce",
    "all_gather": "allgather",
    "_all_gather_base": "_allgather_base",
    "_allgather_base": "_allgather_base",
    "all_gather_into_tensor_coalesced": "allgather_into_tensor_coalesced",
    "ALLGATHER_coalesced": "allgather_coalesced",
    "all_to_all": "alltoall",
    "all_to_all_single": "alltoall_base",
    "alltoall_base": "alltoall_base",
}


class _PlainUnpickler(pickle.Unpickler):
    """Loads only what pickle builds without a class: dicts, lists, tuples, strings, bytes, numbers, None."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"Flight Recorder dump refers to {module}.{name}: only plain data is allowed")


def load_dump(data: bytes) -> dict[str, Any]:
    """A Flight Recorder dump (torch's pickle) as a dict, refusing any class reference.

    Raises:
        pickle.UnpicklingError: the bytes refer to a class or function, or are not a pickle.
        ValueError: the top level is not a dict.
    """
    dump = _PlainUnpickler(io.BytesIO(data)).load()
    if not isinstance(dump, dict):
        raise ValueError(f"Flight Recorder dump is a {type(dump).__name__}, expected a dict")
    return dump


def dump_bytes(device: str, *, stacks: bool = True) -> bytes:
    """This process's Flight Recorder buffer as torch pickles it, with the calls' stack frames if ``stacks`` (the
    costly part of a dump): the NCCL buffer on CUDA (``_dump_nccl_trace``), the generic one (gloo) otherwise."""
    import torch._C._distributed_c10d as c10d

    dump = getattr(c10d, "_dump_nccl_trace", None) if device == "cuda" else None
    if dump is None:
        dump = c10d._dump_fr_trace
    return bytes(dump(includeCollectives=True, includeStackTraces=stacks, onlyActive=False))


def _is_internal(filename: str, prefixes: tuple[str, ...]) -> bool:
    return filename.startswith(prefixes) or filename.startswith("<")


def _site_and_stack(frames: Sequence[Mapping[str, Any]], prefixes: tuple[str, ...]) -> tuple[str, list[str]]:
    """The first frame outside torch and rlsdk internals (innermost first, as torch lists them) and the frames
    above it, formatted as the tracer's ``site`` and snapshot ``stack``."""
    for position, frame in enumerate(frames):
        filename = str(frame.get("filename", "?"))
        if not _is_internal(filename, prefixes):
            chosen = frames[position : position + _STACK_DEPTH]
            stack = [f"{f.get('filename', '?')}:{f.get('line', 0)} in {f.get('name', '?')}" for f in chosen]
            return f"{filename}:{frame.get('line', 0)}", stack
    return "?", []


def _op_and_peer(profiling_name: str, is_p2p: bool) -> tuple[str, int | None]:
    """``'nccl:all_reduce'`` -> ``('allreduce', None)``; ``'nccl:send 0->1'`` -> ``('send', 1)``;
    ``'nccl:recv 1<-0'`` -> ``('recv', 0)``."""
    _, _, text = profiling_name.partition(":")
    name, _, peers = (text or profiling_name).partition(" ")
    peer: int | None = None
    if is_p2p or name in ("send", "recv"):
        for arrow in ("->", "<-"):
            if arrow in peers:
                tail = peers.split(arrow, 1)[1].strip()
                peer = int(tail) if tail.lstrip("-").isdigit() else None
    return _TO_TRACER_OPS.get(name, name), peer


_TORCH_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
}


def _command_at(history: Sequence[tuple[float, str | None, int | None]], t: float) -> tuple[str | None, int | None]:
    """The command running at monotonic time ``t`` by the rank's command history (start time, name, seq)."""
    current: tuple[str | None, int | None] = (None, None)
    for start, name, seq in history:
        if start > t:
            break
        current = (name, seq)
    return current


def records_from_dump(
    dump: Mapping[str, Any],
    *,
    wall_minus_monotonic: float,
    now: float,
    history: Sequence[tuple[float, str | None, int | None]] = (),
    prefixes: tuple[str, ...] = (),
) -> list[list[Any]]:
    """The dump's entries as tracer records (lists in :data:`~rlsdk.debug.tracer.FIELDS` order), oldest first.

    ``wall_minus_monotonic``: ``time.time() - time.monotonic()`` now (entries carry wall-clock ns; the tracer's
    times are monotonic). ``now``: the monotonic time the dump was taken; a completed entry without a completion
    time was seen completed by then. ``history``: the rank's commands as (monotonic start, name, seq), oldest
    first. ``prefixes``: file prefixes of internal frames (torch, rlsdk), skipped when choosing the call site.
    A call counts as completed when torch marked it ``completed`` or ``retired`` it (gloo never marks
    ``completed``)."""
    records: list[list[Any]] = []
    peer_counts: dict[tuple[str, str, int], int] = {}
    for entry in dump.get("entries") or ():
        is_p2p = bool(entry.get("is_p2p"))
        group_name = entry.get("process_group") or (str(entry.get("pg_id", 0)), "")
        group = str(group_name[0]) or str(entry.get("pg_id", 0))
        op, peer = _op_and_peer(str(entry.get("profiling_name", "?")), is_p2p)
        peer_seq = None
        if is_p2p and peer is not None:
            key = (group, op, peer)
            peer_seq = peer_counts[key] = peer_counts.get(key, 0) + 1
        t_start = int(entry.get("time_created_ns") or 0) / 1e9 - wall_minus_monotonic
        done = entry.get("state") == "completed" or bool(entry.get("retired"))
        completed_ns = entry.get("time_discovered_completed_ns")
        t_end = None
        if done:
            t_end = completed_ns / 1e9 - wall_minus_monotonic if completed_ns else now
        site, stack = _site_and_stack(entry.get("frames") or (), prefixes)
        command, command_seq = _command_at(history, t_start)
        thread = entry.get("thread_id")
        records.append(
            [
                group,
                int((entry.get("p2p_seq_id") if is_p2p else entry.get("collective_seq_id")) or 0),
                is_p2p,
                op,
                tuple(tuple(int(n) for n in shape) for shape in entry.get("input_sizes") or ()),
                tuple(_TORCH_DTYPES.get(str(d), str(d).lower()) for d in entry.get("input_dtypes") or ()),
                None,  # reduce op: not in the buffer
                peer,
                command,
                command_seq,
                site,
                stack,
                t_start,
                t_end,
                peer_seq,
                None,
                False,  # sync: NCCL calls return once enqueued
                int(thread) if isinstance(thread, str) and thread.isdigit() else thread,
                int(entry.get("record_id", len(records))),
            ]
        )
    return records


_SITE, _STACK, _T_END, _INDEX = (FIELDS.index(name) for name in ("site", "stack", "t_end", "index"))


class FlightRecorderView:
    """Answers the tracer's queries (:meth:`snapshot`, :meth:`poll`, as :class:`~rlsdk.debug.tracer.Tracer`
    does) from the Flight Recorder buffer of ``device`` ('cuda': NCCL; 'cpu': gloo's, for tests).

    Stack frames make a dump several times costlier, and the live check polls about once a second. So a poll
    dumps without them and fills call sites from earlier dumps; only when a call it could not place is still
    pending at the next poll (a possible hang, which the live check needs two polls to confirm anyway) does it
    dump with frames. Sites are kept per record (``index``: torch's record id), at most four buffers' worth."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._prefixes: tuple[str, ...] | None = None
        self._lock = threading.Lock()
        self._sites: dict[int, tuple[str, list[str]]] = {}
        self._unplaced: set[int] = set()  # pending at the last poll, without a site
        self.dumps_with_stacks = 0

    def _records(self, *, stacks: bool) -> tuple[list[list[Any]], float]:
        from rlsdk.debug.tracer import internal_prefixes

        if self._prefixes is None:
            self._prefixes = internal_prefixes()
        data = dump_bytes(self.device, stacks=stacks)
        self.dumps_with_stacks += stacks
        now = time.monotonic()
        offset = time.time() - now
        tracer = get_tracer()
        records = records_from_dump(
            load_dump(data),
            wall_minus_monotonic=offset,
            now=now,
            history=list(tracer.command_history),
            prefixes=self._prefixes,
        )
        for rec in records:
            key = rec[_INDEX]  # torch's record id: unique in the process's lifetime
            if rec[_SITE] != "?":
                self._sites[key] = (rec[_SITE], rec[_STACK])
            elif key in self._sites:
                rec[_SITE], rec[_STACK] = self._sites[key]
        if len(self._sites) > 4 * max(len(records), 1):
            floor = min(rec[_INDEX] for rec in records) if records else 0
            self._sites = {key: value for key, value in self._sites.items() if key >= floor}
        return records, now

    def _state(self, records: list[list[Any]], now: float) -> dict[str, Any]:
        tracer = get_tracer()
        command, command_seq = tracer.command
        heads: dict[str, int] = {}
        peer_heads: dict[str, int] = {}
        groups: dict[str, dict[str, Any]] = {}
        for rec in records:
            group, seq, p2p, op, root, peer_seq = rec[0], rec[1], rec[2], rec[3], rec[7], rec[14]
            groups.setdefault(group, {"ranks": []})
            if p2p and root is not None:
                key = f"{group}|{op}|{root}"
                peer_heads[key] = max(peer_heads.get(key, 0), int(peer_seq or 0))
            elif not p2p:
                heads[group] = max(heads.get(group, 0), seq)
        return {
            "rank": tracer.rank,
            "pid": os.getpid(),
            "now": now,
            "wall_time": time.time(),
            "command": command,
            "command_seq": command_seq,
            "last_command_seq": tracer.last_command_seq,
            "capacity": int(
                os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or os.environ.get("TORCH_FR_BUFFER_SIZE") or 0
            ),
            "count": (records[-1][-1] + 1) if records else 0,
            "groups": groups,
            "heads": heads,
            "peer_heads": peer_heads,
            "main_thread": threading.main_thread().ident,
            "threads": {str(thread.ident): thread.name for thread in threading.enumerate()},
            "errors": [],
            "source": "flight_recorder",
        }

    def snapshot(self) -> dict[str, Any]:
        """Every entry as a record dict (with its stack), plus the rank's state, as :meth:`Tracer.snapshot`."""
        with self._lock:
            records, now = self._records(stacks=True)
        items = []
        for rec in records:
            item = dict(zip(FIELDS, rec, strict=True))
            item["stack"] = list(rec[11]) or [f"{rec[10]} in ?"]
            items.append(item)
        return {**self._state(records, now), "records": items}

    def poll(self, since: int | None = None, pending: Sequence[int] = ()) -> dict[str, Any]:
        """As :meth:`Tracer.poll`: records with ``index >= since`` (the newest :data:`POLL_LIMIT`) as lists
        without stacks, ``done`` for the ``pending`` indices that completed, and ``sites``: ``[index, site]`` of
        the ``pending`` indices whose call site is known now."""
        with self._lock:
            records, now = self._records(stacks=False)
            unplaced = {r[_INDEX] for r in records if r[_T_END] is None and r[_SITE] == "?"}
            if unplaced & self._unplaced:
                records, now = self._records(stacks=True)
                unplaced = {r[_INDEX] for r in records if r[_T_END] is None and r[_SITE] == "?"}
            self._unplaced = unplaced
        floor = since or 0
        rows = []
        for rec in records[-POLL_LIMIT:]:
            if rec[-1] >= floor:
                row = list(rec)
                row[4] = [list(shape) for shape in rec[4]]
                row[5] = list(rec[5])
                row[11] = []
                rows.append(row)
        wanted = set(pending)
        done = [[rec[-1], rec[13], rec[7]] for rec in records if rec[13] is not None and rec[-1] in wanted]
        # call sites found since the controller got these records (it holds them without one: see the class doc)
        sites = [[rec[-1], rec[_SITE]] for rec in records if rec[-1] in wanted and rec[_SITE] != "?"]
        return {**self._state(records, now), "records": rows, "done": done, "sites": sites}


_VIEW: FlightRecorderView | None = None


def _view() -> FlightRecorderView:
    global _VIEW
    if _VIEW is None:
        _VIEW = FlightRecorderView(os.environ.get("RLSDK_DEVICE", "cpu"))
    return _VIEW


def snapshot() -> dict[str, Any]:
    """:meth:`FlightRecorderView.snapshot` of this process (device from ``RLSDK_DEVICE``), with every thread's
    stack."""
    state = _view().snapshot()
    state["stacks"] = thread_stacks()
    return state


def poll(since: int | None = None, pending: Sequence[int] = ()) -> dict[str, Any]:
    """:meth:`FlightRecorderView.poll` of this process."""
    return _view().poll(since, pending)
