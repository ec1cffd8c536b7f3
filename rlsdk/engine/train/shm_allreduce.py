"""All-reduce through shared memory for train ranks on one host (``launch.shm_allreduce``).

Gloo all-reduces over TCP, even between processes on one machine: every call pays socket round trips and a
thread wake-up on each side, and the ranks' skew adds to it every step. Ranks on one host can instead meet in one
memory segment: each copies its tensor into its slot, announces it with a counter, waits for the others'
counters, and reduces every slot into its own tensor.

- **Same result on every rank, bit for bit**: every rank reduces the slots in rank order (``slot 0 op slot 1 op
  ...``), elementwise, whatever its thread count.
- **Large tensors** go through in chunks of ``slot_bytes``; two sets of slots alternate, so a rank may write
  chunk k + 1 while a slower one still reads chunk k (one barrier per chunk, not two).
- **Waiting** spins with ``sched_yield`` (a rank that waits gives its core to any runnable thread: the engine,
  another rank on an oversubscribed machine), then sleeps in short naps once the wait passes a few
  milliseconds. A peer that died is noticed by its pid within ~0.1 s; a wait longer than the process group's
  timeout raises.
- **Where it applies**: every rank of the group on the same host (hostname and boot id), x86-64 (whose
  memory model orders a rank's slot writes before its counter write, and its counter read before its slot
  reads), dense CPU tensors, and the reduce ops SUM, AVG, PRODUCT, MIN, MAX on floating and integer dtypes.
  Anything else goes to gloo: the choice depends only on what every rank passes (dtype, device, layout, op),
  never on the rank, so all ranks take the same path.

The segment lives in ``/dev/shm`` only while the ranks attach: rank 0 unlinks it once every rank has mapped it,
so nothing is left behind when a rank is killed. Rank 0 creates it 0600 (``O_EXCL | O_NOFOLLOW``); the other ranks
map only what :func:`open_segment` accepts (prefix, no symbolic link, owner, mode, size), whatever the store says.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import socket
import stat
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from rlsdk.engine.publish_dir import default_root
from rlsdk.observe.logging import get_logger

logger = get_logger(__name__)

__all__ = ["SEGMENT_PREFIX", "SLOT_BYTES", "SharedMemoryAllreduce", "host_identity", "open_segment"]

SLOT_BYTES = 4 << 20
"""Bytes of one rank's slot: a tensor larger than this is reduced in chunks of this size."""
_FLAG_STRIDE = 64  # one cache line per rank's counter: no false sharing between writers
_HEADER_PER_RANK = 2 * _FLAG_STRIDE  # the counter line (counter, then 2 x (bytes, dtype, op)) and the pid line
_SPIN_S = 0.002  # spin (with sched_yield) this long before napping
_NAP_S = 50e-6
_PEER_CHECK_S = 0.1
_KEY = "rlsdk_shm_allreduce"
SEGMENT_PREFIX = "rlsdk-allreduce-"
"""File name prefix of the segments in :func:`~rlsdk.engine.publish_dir.default_root`."""

_REDUCERS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "SUM": torch.Tensor.add_,
    "AVG": torch.Tensor.add_,
    "PRODUCT": torch.Tensor.mul_,
    "MIN": lambda out, other: torch.minimum(out, other, out=out),
    "MAX": lambda out, other: torch.maximum(out, other, out=out),
}
_OPS = tuple(_REDUCERS)
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
)


def open_segment(path: str, nbytes: int) -> int:
    """Open the segment rank 0 published for mapping; returns the file descriptor.

    The path comes from the process group's store, so it is checked before anything is mapped: a file named
    ``rlsdk-allreduce-*`` directly in :func:`~rlsdk.engine.publish_dir.default_root`, opened without following a
    symbolic link (``O_NOFOLLOW``), a regular file of this user that no one else may read or write, of exactly the
    segment's size. A rank never maps another user's file, or one of this user's files it was pointed at.

    Raises:
        PermissionError: any check fails; the message names the path and the check.
    """
    root, name = os.path.split(path)
    if root != default_root() or not name.startswith(SEGMENT_PREFIX) or name in (".", ".."):
        raise PermissionError(
            f"shared-memory segment {path!r} refused: not a {SEGMENT_PREFIX}* file directly in {default_root()}"
        )
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise PermissionError(f"shared-memory segment {path!r} refused: {exc} (a symbolic link?)") from exc
    info = os.fstat(fd)
    problem = ""
    if not stat.S_ISREG(info.st_mode):
        problem = "not a regular file"
    elif info.st_uid != os.getuid():
        problem = f"owned by uid {info.st_uid}, not this user ({os.getuid()})"
    elif stat.S_IMODE(info.st_mode) & 0o077:
        problem = f"mode {oct(stat.S_IMODE(info.st_mode))} lets other users in"
    elif info.st_size != nbytes:
        problem = f"{info.st_size} bytes, the segment has {nbytes}"
    if problem:
        os.close(fd)
        raise PermissionError(f"shared-memory segment {path!r} refused: {problem}")
    return fd


def host_identity() -> str:
    """This machine's hostname and boot id: equal on two processes only if they share memory."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()}/{boot}"


class SharedMemoryAllreduce:
    """One process group's shared segment (see the module docstring). Build it with :meth:`create`.

    Args:
        buffer: the mapped segment (header, then two sets of ``size`` slots of ``slot_bytes``).
        rank, size: this process's rank in the group and the group size (>= 2).
        slot_bytes: bytes per slot, a positive multiple of 8.
        timeout_s: a wait longer than this raises RuntimeError (the process group's timeout).
    """

    def __init__(self, buffer: Any, rank: int, size: int, *, slot_bytes: int, timeout_s: float) -> None:
        if size < 2 or not 0 <= rank < size:
            raise ValueError(f"rank={rank!r}, size={size!r} is invalid: allowed size >= 2 and 0 <= rank < size")
        if slot_bytes < 8 or slot_bytes % 8:
            raise ValueError(f"slot_bytes={slot_bytes!r} is invalid: allowed a positive multiple of 8")
        header = size * _HEADER_PER_RANK
        need = header + 2 * size * slot_bytes
        if len(buffer) < need:
            raise ValueError(f"buffer of {len(buffer)} bytes is too small: rank slots need {need}")
        self.rank, self.size, self.slot_bytes, self.timeout_s = rank, size, slot_bytes, timeout_s
        self._buffer = buffer
        self._view = memoryview(buffer)
        self._counters = self._view[:header].cast("q")  # counter of rank r at index r * 16, its pid at r * 16 + 8
        self._stride = _HEADER_PER_RANK // 8
        self._slots = torch.frombuffer(buffer, dtype=torch.uint8, count=2 * size * slot_bytes, offset=header).view(
            2, size, slot_bytes
        )
        self._round = 0
        self._counters[rank * self._stride + _FLAG_STRIDE // 8] = os.getpid()
        self.calls = 0

    # ------------------------------------------------------------------ set-up

    @classmethod
    def create(
        cls, store: Any, rank: int, size: int, timeout: timedelta, *, slot_bytes: int = SLOT_BYTES
    ) -> SharedMemoryAllreduce | None:
        """Every rank of a new process group calls this with the group's c10d ``store``; returns the reducer, or
        None on every rank when it does not apply (one rank, other hosts, not x86-64; the reason is logged).

        Rank 0 creates the segment and publishes its path in the store; each rank maps it and says so; rank 0
        then unlinks the file (the mappings stay)."""
        if size < 2:
            return None
        store.set(f"{_KEY}/host/{rank}", f"{platform.machine()}|{host_identity()}")
        if rank == 0:
            hosts = {store.get(f"{_KEY}/host/{r}").decode() for r in range(size)}
            machine = platform.machine().lower()
            path = ""
            if len(hosts) != 1:
                reason = f"the ranks are on {len(hosts)} hosts"
            elif machine not in ("x86_64", "amd64"):
                reason = f"{machine} is not x86-64 (its memory model needs fences this code does not issue)"
            else:
                reason = ""
                path = os.path.join(default_root(), f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    os.ftruncate(fd, size * _HEADER_PER_RANK + 2 * size * slot_bytes)
                finally:
                    os.close(fd)
            if reason:
                logger.info("all-reduce on gloo, not shared memory: %s", reason)
            store.set(f"{_KEY}/path", path)
        else:
            path = store.get(f"{_KEY}/path").decode()
        if not path:
            return None
        try:
            fd = open_segment(path, size * _HEADER_PER_RANK + 2 * size * slot_bytes)
            try:
                buffer = mmap.mmap(fd, 0)
            finally:
                os.close(fd)
        finally:
            store.set(f"{_KEY}/mapped/{rank}", "1")
            if rank == 0:
                store.wait([f"{_KEY}/mapped/{r}" for r in range(size)], timeout)
                os.unlink(path)
        return cls(buffer, rank, size, slot_bytes=slot_bytes, timeout_s=timeout.total_seconds())

    # ------------------------------------------------------------------ the collective

    @staticmethod
    def supports(tensors: Any, reduce_op: str | None) -> bool:
        """Whether :meth:`allreduce` takes this call: one dense CPU tensor of a supported dtype and op. Depends
        only on what every rank passes, so every rank answers the same."""
        if reduce_op not in _REDUCERS or not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
            return False
        tensor = tensors[0]
        return (
            isinstance(tensor, torch.Tensor)
            and tensor.device.type == "cpu"
            and tensor.layout == torch.strided
            and tensor.dtype in _DTYPES
            and not tensor.is_conj()
            and not tensor.is_neg()
        )

    def allreduce(self, tensor: torch.Tensor, reduce_op: str) -> None:
        """Reduce ``tensor`` in place across the group (every rank calls it with the same shape and dtype).
        ``AVG`` divides the sum by the group size (integer dtypes: floor division, as gloo).

        Raises:
            ValueError: an op or tensor :meth:`supports` refuses.
            RuntimeError: a peer died, or the wait passed ``timeout_s``.
        """
        if not self.supports([tensor], reduce_op):
            raise ValueError(
                f"shared-memory all-reduce of a {tensor.dtype} {tensor.device} tensor with op {reduce_op} is "
                f"not supported: allowed dense CPU tensors of {[str(d) for d in _DTYPES]} and ops {list(_REDUCERS)}"
            )
        self.calls += 1
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = work.view(-1).view(torch.uint8) if work.numel() else work.view(torch.uint8)
        reduce = _REDUCERS[reduce_op]
        item = work.element_size()
        chunk = self.slot_bytes - self.slot_bytes % item
        call = (flat.numel(), _DTYPES.index(work.dtype), _OPS.index(reduce_op))
        for start in range(0, max(flat.numel(), 1), chunk):
            part = flat[start : start + chunk]
            parity = self._round % 2
            slots = self._slots[parity, :, : part.numel()]
            slots[self.rank].copy_(part)
            line = self.rank * self._stride + 1 + 3 * parity
            counters = self._counters  # what this rank passed, checked by every rank
            counters[line], counters[line + 1], counters[line + 2] = call
            self._round += 1
            self._counters[self.rank * self._stride] = self._round
            self._wait(self._round)
            if start == 0:
                self._check_calls(parity, call)
            out = part.view(work.dtype)
            out.copy_(slots[0].view(work.dtype))
            for peer in range(1, self.size):
                reduce(out, slots[peer].view(work.dtype))
        if reduce_op == "AVG":
            if work.is_floating_point():
                work.div_(self.size)
            else:
                work.floor_divide_(self.size)
        if work is not tensor:
            tensor.copy_(work)

    def _check_calls(self, parity: int, call: tuple[int, int, int]) -> None:
        """Raise on every rank (each sees every rank's call) when the ranks passed different byte counts, dtypes
        or ops: gloo would hang on the first two and silently mix the last."""
        calls = [
            tuple(self._counters[p * self._stride + 1 + 3 * parity : p * self._stride + 4 + 3 * parity])
            for p in range(self.size)
        ]
        if any(other != call for other in calls):
            described = {
                rank: f"{nbytes} bytes of {_DTYPES[dtype]}, {_OPS[op]}"
                for rank, (nbytes, dtype, op) in enumerate(calls)
            }
            raise RuntimeError(
                f"shared-memory all-reduce (chunk {self._round}): the ranks passed different tensors or ops: "
                f"{described}"
            )

    def _wait(self, target: int) -> None:
        counters, stride, size = self._counters, self._stride, self.size
        start = time.monotonic()
        next_check = start + _PEER_CHECK_S
        while True:
            for peer in range(size):
                if counters[peer * stride] < target:
                    break
            else:
                return
            now = time.monotonic()
            if now - start < _SPIN_S:
                os.sched_yield()
                continue
            if now >= next_check:
                self._check_peers(target, now - start)
                next_check = now + _PEER_CHECK_S
            time.sleep(_NAP_S)

    def _check_peers(self, target: int, waited_s: float) -> None:
        missing = [p for p in range(self.size) if self._counters[p * self._stride] < target]
        for peer in missing:
            pid = self._counters[peer * self._stride + _FLAG_STRIDE // 8]
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise RuntimeError(
                    f"shared-memory all-reduce (chunk {target}): rank {peer} (pid {pid}) has exited"
                ) from None
            except PermissionError:
                pass
        if waited_s > self.timeout_s:
            raise RuntimeError(
                f"shared-memory all-reduce (chunk {target}) timed out after {waited_s:.0f} s (process group "
                f"timeout {self.timeout_s:.0f} s): ranks {missing} never arrived"
            )
