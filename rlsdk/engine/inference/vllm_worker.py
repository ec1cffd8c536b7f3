"""rlsdk's vLLM worker extension: load published weights inside the server and checksum what was loaded.

Passed to the server as ``--worker-extension-cls rlsdk.engine.inference.vllm_worker.WeightSyncExtension``; vLLM
mixes it into its worker class, and the client calls its methods through the dev-mode ``/collective_rpc``
endpoint. This module is imported inside the vLLM worker process; it must not import vLLM at module level (the
controller imports it without vLLM) nor anything heavy from rlsdk.

What the checksum covers (see docs/howto/vllm.md): :func:`rlsdk.engine.weights.state_dict_checksum` over the tensors the
worker read from the published safetensors file and handed to vLLM's ``reload_weights``, under the trainer's
parameter names, tied-weight aliases restored from the file's metadata exactly as ``safetensors.torch.load_model``
restores them; it is recorded only after ``reload_weights`` returned. So equal checksums prove the server loaded
bit-identical bytes of the trainer's state dict. It cannot hash the in-memory served parameters: on CPU, vLLM
fuses projections (qkv, gate_up) and repacks every linear weight into an opaque oneDNN/SGL handle, leaving an
empty ``weight`` parameter behind. The per-update trainer-vs-engine logprob agreement metric is the end-to-end
check of the served weights.

In-place updates (:meth:`WeightSyncExtension.rlsdk_update_weights_inplace`, used by
:class:`~rlsdk.engine.inference.inplace_transfer.InPlaceWeightTransfer`): when the server's workers run
:class:`~rlsdk.engine.inference.vllm_plain_worker.PlainWeightSyncExtension`, :func:`keep_plain_cpu_weights` patched
vLLM's CPU GEMM dispatch before the model loaded, so every linear layer keeps its plain ``weight`` and runs
``torch.nn.functional.linear``. New weights then go through the model's own ``load_weights`` (its weight loaders
pick the slice of the fused qkv/gate_up parameters each tensor belongs in), with no
``process_weights_after_loading`` pass; each plain copy becomes a memory copy from the published file's mapping
into that slice (:func:`read_into_parameters`; the worker keeps the mapping across updates, and the trainer
rewrites the same file in place, so its pages stay mapped), and the checksum is computed from the served slices
as they are written, on threads beside the copy (:class:`ServedWeightsHasher`). There the checksum covers the
served memory, not only what was read.

Where weights may come from (:func:`allowed_weights_path`): only the directory ``RLSDK_VLLM_WEIGHTS_DIR`` names
(the Session sets it to its publish directory when it starts the server), symbolic links resolved; without it
(a server started by hand and attached by URL), only an rlsdk publish directory (``rlsdk-weights-*`` under
:func:`rlsdk.engine.publish_dir.default_root`) that this user owns and no one else may enter. Who may call these
methods at all is decided before they run: the server's bearer token (:mod:`rlsdk.engine.inference.vllm_auth`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

# The directory a server's worker extension loads published weights from (set in the server's environment).
WEIGHTS_DIR_ENV = "RLSDK_VLLM_WEIGHTS_DIR"


def allowed_weights_path(path: str) -> str:
    """The real path of the published weights file ``path`` once it is known to lie where this server may load from.

    Symbolic links are resolved first, so a link inside the directory that points out of it is refused. Allowed:
    a regular file under ``$RLSDK_VLLM_WEIGHTS_DIR``; without that variable, a regular file directly in an rlsdk
    publish directory (``rlsdk-weights-*`` under :func:`rlsdk.engine.publish_dir.default_root`, a real directory
    owned by this process's user with no group or other access, as ``PublishDir`` creates them).

    Raises:
        PermissionError: ``path`` resolves to a place outside the allowed directory, or to something that is
            not a regular file.
        FileNotFoundError: there is no such file.
    """
    import os
    import stat

    from rlsdk.engine.publish_dir import PREFIX, default_root

    real = os.path.realpath(path)
    allowed = os.environ.get(WEIGHTS_DIR_ENV)
    if allowed:
        root = os.path.realpath(allowed)
        if real == root or os.path.commonpath([real, root]) != root:
            raise PermissionError(
                f"weights path {path!r} (resolved: {real}) is outside {root}, the only directory this server loads "
                f"weights from ({WEIGHTS_DIR_ENV})"
            )
    else:
        parent = os.path.dirname(real)
        info = os.lstat(parent)
        if not (
            os.path.basename(parent).startswith(PREFIX)
            and os.path.dirname(parent) == os.path.realpath(default_root())
            and stat.S_ISDIR(info.st_mode)
            and info.st_uid == os.getuid()
            and stat.S_IMODE(info.st_mode) & 0o077 == 0
        ):
            raise PermissionError(
                f"weights path {path!r} (resolved: {real}) is not in a private rlsdk publish directory "
                f"({os.path.join(default_root(), PREFIX)}*, owned by uid {os.getuid()}, mode 0700); start the server "
                f"with {WEIGHTS_DIR_ENV} naming the directory it may load from"
            )
    if not stat.S_ISREG(os.stat(real).st_mode):
        raise PermissionError(f"weights path {path!r} (resolved: {real}) is not a regular file")
    return real


# Whether keep_plain_cpu_weights() patched vLLM in this process, and the layers its patch left to vLLM (non-2-D
# weights, which vLLM may still repack: an in-place update refuses to run when there are any).
_PLAIN_WEIGHTS: dict[str, Any] = {"active": False, "delegated": []}


def keep_plain_cpu_weights() -> bool:
    """Make vLLM's CPU linear layers keep plain weights (``F.linear``) instead of oneDNN/SGL-packed copies.

    Replaces ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` (called from the
    ``process_weights_after_loading`` of ``UnquantizedLinearMethod`` and ``UnquantizedEmbeddingMethod``, which
    import it from that module at call time) with a version that, for every 2-D weight, sets
    ``layer.cpu_linear = torch.nn.functional.linear`` and keeps ``layer.weight``, as vLLM's own fallback and its
    ``_cpu_skip_gemm_dispatch`` path do. Other layers go to vLLM's function unchanged and are recorded. Must run
    in the worker process before the model loads (vLLM imports the worker extension in ``init_worker``, before
    ``load_model``). Idempotent; returns False (and patches nothing) when vLLM is not installed or the platform
    is not CPU.
    """
    if _PLAIN_WEIGHTS["active"]:
        return True
    try:
        import torch
        import vllm.model_executor.layers.utils as layer_utils
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu():
        return False
    original = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch_plain(layer: Any, remove_weight: bool) -> None:
        weight = layer.weight
        if weight.is_meta or weight.ndim != 2:
            if not weight.is_meta:
                _PLAIN_WEIGHTS["delegated"].append(type(layer).__name__)
            original(layer, remove_weight)
            return
        layer.cpu_linear = torch.nn.functional.linear

    dispatch_plain.__wrapped__ = original  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_plain
    _PLAIN_WEIGHTS["active"] = True
    return True


def plain_weights_problem(model: Any) -> str | None:
    """Why new weights cannot be copied into ``model`` in place, or None when they can.

    In place needs :func:`keep_plain_cpu_weights` active before the model loaded, no layer left to vLLM's packing,
    every linear layer on ``F.linear`` and no emptied (packed-away) parameter.
    """
    import torch

    if not _PLAIN_WEIGHTS["active"]:
        return (
            "the server keeps packed weights (start it with --worker-extension-cls "
            "rlsdk.engine.inference.vllm_plain_worker.PlainWeightSyncExtension)"
        )
    if _PLAIN_WEIGHTS["delegated"]:
        return f"layers with non-2-D weights were left to vLLM's packing: {sorted(set(_PLAIN_WEIGHTS['delegated']))}"
    for name, module in model.named_modules():
        linear = module.__dict__.get("cpu_linear")
        if linear is not None and linear is not torch.nn.functional.linear:
            return f"{name} runs {getattr(linear, '__name__', linear)!r}, not F.linear on its plain weight"
    for name, param in model.named_parameters():
        if param.numel() == 0:
            return f"parameter {name} is empty (its weight was packed away)"
    return None


def read_published_weights(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, state_dict)`` of a file written by ``safetensors.torch.save_model``.

    ``tensors`` holds what the file stores; ``state_dict`` adds the tied names that ``save_model`` dropped (its
    metadata maps each dropped name to the name kept), so it has the keys of the trainer's ``state_dict()``.
    """
    from safetensors import safe_open

    tensors: dict[str, Any] = {}
    with safe_open(path, framework="pt") as handle:
        metadata = handle.metadata() or {}
        for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            tensors[name] = handle.get_tensor(name)
    state_dict = dict(tensors)
    for dropped, kept in metadata.items():
        if dropped not in state_dict and kept in tensors:
            state_dict[dropped] = tensors[kept]
    return tensors, state_dict


# safetensors dtype codes (the format's header) -> torch dtype names.
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


class PublishedFile:
    """A safetensors file mapped read-only, its tensors as views of the mapping: nothing is read until touched.

    Opening costs the header parse only. :meth:`read_into` copies a tensor's bytes from the file straight into a
    parameter (no intermediate tensor); :attr:`direct_bytes` counts what went that way. How:

    - ``keep_mapped=False``: with ``preadv``. The kernel copies from the page cache, which for a file touched once
      is faster than touching the mapping (one page fault per 4 KiB page before a byte is copied).
    - ``keep_mapped=True`` (the in-place vLLM sync): a plain memory copy out of the mapping, which the caller keeps
      across syncs. The trainer rewrites the published file in place (same inode and size, so on ``/dev/shm``
      the same pages, see ``rlsdk.engine.train.engine.publish_safetensors``), so after the first sync the mapping
      is already faulted in and each copy runs at memcpy speed, faster than ``preadv`` (benchmarks/vllm_sync.py).
      :meth:`still_maps` says whether a path still names the mapped file with the same header.

    Raises ``ValueError`` on a malformed file (header length, unknown dtype, data outside the file).
    """

    def __init__(self, path: str, *, keep_mapped: bool = False) -> None:
        import json
        import mmap
        import os
        import struct
        import warnings

        import torch

        self.path = path
        self.keep_mapped = keep_mapped
        self.direct_bytes = 0
        self._fd = os.open(path, os.O_RDONLY)
        try:
            stat = os.fstat(self._fd)
            size = stat.st_size
            self._identity = (stat.st_dev, stat.st_ino, size)
            if size < 8:
                raise ValueError(f"{path} has {size} bytes: not a safetensors file")
            (header_len,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
            if header_len > size - 8:
                raise ValueError(f"{path}: header length {header_len} exceeds the file ({size} bytes)")
            self._header = os.pread(self._fd, 8 + header_len, 0)
            header = json.loads(self._header[8:])
            self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
            data_start = 8 + header_len
            self._map = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            with warnings.catch_warnings():  # read-only mapping: rlsdk never writes through these views
                warnings.simplefilter("ignore", UserWarning)
                whole = torch.frombuffer(self._map, dtype=torch.uint8)
            self._base = whole.data_ptr()
            self.tensors: dict[str, Any] = {}
            self._regions: dict[tuple[int, int], str] = {}  # (file offset, bytes) -> name
            for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
                dtype_name = _SAFETENSORS_DTYPES.get(entry["dtype"])
                if dtype_name is None:
                    raise ValueError(f"{path}: tensor {name} has unsupported dtype {entry['dtype']!r}")
                begin, end = (data_start + int(offset) for offset in entry["data_offsets"])
                if not data_start <= begin <= end <= size:
                    raise ValueError(f"{path}: tensor {name} lies outside the file")
                tensor = whole[begin:end].view(getattr(torch, dtype_name)).reshape(entry["shape"])
                self.tensors[name] = tensor
                self._regions[(begin, end - begin)] = name
            self.nbytes = sum(nbytes for _, nbytes in self._regions)
        except BaseException:
            self.close()
            raise

    def still_maps(self, path: str) -> bool:
        """Whether ``path`` names the mapped file (same device, inode and size) with the same header bytes, so the
        views of the mapping show its current tensors. False when anything differs or cannot be checked."""
        import os

        if self._fd < 0 or getattr(self, "_map", None) is None:
            return False
        try:
            stat = os.stat(path)
            if (stat.st_dev, stat.st_ino, stat.st_size) != self._identity:
                return False
            return os.pread(self._fd, len(self._header), 0) == self._header
        except OSError:
            return False

    def state_dict(self) -> dict[str, Any]:
        """The file's tensors plus the tied names ``save_model`` dropped (as :func:`read_published_weights`)."""
        state_dict = dict(self.tensors)
        for dropped, kept in self.metadata.items():
            if dropped not in state_dict and kept in self.tensors:
                state_dict[dropped] = self.tensors[kept]
        return state_dict

    def read_into(self, dst: Any, src: Any) -> str | None:
        """``dst.copy_(src)`` straight from the file (``preadv``, or with :attr:`keep_mapped` a memory copy out of
        the mapping) when ``src`` is a contiguous view of it and ``dst`` a contiguous CPU tensor of the same dtype
        and shape; returns the file tensor's name when ``src`` was a whole one, ``""`` for part of one, and None
        (nothing done) when it does not apply."""
        import ctypes
        import os

        import torch

        if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)) or src.device.type != "cpu":
            return None
        if src.untyped_storage().data_ptr() != self._base or dst.device.type != "cpu":
            return None
        if dst.dtype != src.dtype or dst.shape != src.shape or not (dst.is_contiguous() and src.is_contiguous()):
            return None
        nbytes = src.numel() * src.element_size()
        offset = src.data_ptr() - self._base
        if nbytes == 0 or dst.untyped_storage().data_ptr() == self._base:
            return None
        if self.keep_mapped:
            torch.Tensor.copy_(dst, src)  # a memcpy: the torch-function mode is off inside its handler
            self.direct_bytes += nbytes
            return self._regions.get((offset, nbytes), "")
        buffer = memoryview((ctypes.c_char * nbytes).from_address(dst.data_ptr())).cast("B")
        done = 0
        while done < nbytes:  # preadv may return less than asked (e.g. at 2 GiB on Linux)
            count = os.preadv(self._fd, [buffer[done:]], offset + done)
            if count <= 0:
                raise OSError(f"{self.path}: read {done} of {nbytes} bytes at offset {offset}")
            done += count
        self.direct_bytes += nbytes
        return self._regions.get((offset, nbytes), "")

    def close(self) -> None:
        """Unmap and close (idempotent). A view still referenced elsewhere keeps the mapping until it is freed."""
        import os

        self.tensors = {}
        mapping = getattr(self, "_map", None)
        if mapping is not None:
            # A view still alive (BufferError) keeps the mapping until it is garbage-collected.
            with contextlib.suppress(BufferError):
                mapping.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_into_parameters(published: PublishedFile, on_written: Any) -> Any:
    """A ``TorchFunctionMode`` (a context manager) under which ``dst.copy_(src)`` with ``src`` a view of
    ``published`` reads the bytes from the file into ``dst`` (:meth:`PublishedFile.read_into`) instead of copying
    them through the mapping, then calls ``on_written(name, dst)`` for a whole file tensor. It keeps ``copy_``'s
    semantics (the bytes are in ``dst`` when the call returns); every other call runs unchanged, so a loader that
    transforms a tensor (a dtype change, a transpose) still works and reads through the mapping."""
    import torch
    from torch.overrides import TorchFunctionMode

    copy = torch.Tensor.copy_

    class ReadIntoParameters(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is copy and len(args) == 2 and not kwargs:
                name = published.read_into(args[0], args[1])
                if name is not None:
                    if name:
                        on_written(name, args[0])
                    return args[0]
            return func(*args, **(kwargs or {}))

    return ReadIntoParameters()


def _run_on_every_core() -> int:
    """Let the calling thread (and the threads it starts from now on) run on every core; return how many.

    vLLM's CPU worker binds its process to its OpenMP cores (one core of two here), so a hashing thread would
    otherwise share the core that copies the weights and the sync would cost copy + hash instead of about the
    larger of the two. During a weight update the server is paused, so the other cores (the API server's and the
    engine core's, both waiting on this RPC) are idle. Only this short-lived thread (and a BLAKE3 pool it would
    create for a BLAKE3 checksum) moves (new threads inherit the creator's affinity); the worker's threads keep
    vLLM's binding. Returns 1 and changes nothing when the platform cannot.
    """
    import os

    try:
        everywhere = set(range(os.cpu_count() or 1))
        os.sched_setaffinity(0, everywhere)  # pid 0: this thread only (Linux)
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return 1


class ServedWeightsHasher:
    """The checksum of the served weights, computed on a second thread while they are written.

    Hashes ``state_dict``'s names in sorted order (the order of
    :func:`~rlsdk.engine.weights.state_dict_checksum`, so the result equals the trainer's checksum of the same
    weights): for each name, the parameter slice its file tensor was written into (:meth:`written`, from
    :func:`read_into_parameters`), waiting for it until :meth:`finish`; a tensor not written whole into one slice
    (a tied alias the model skips, a tensor its loader transformed) is hashed from the file. So the checksum
    covers the served bytes of every tensor the model copied plainly. :attr:`order` is the order to load in
    (the hash order, so each wait is short). After ``run``: :attr:`checksum`, or :attr:`error`.
    """

    def __init__(self, published: PublishedFile, state_dict: dict[str, Any]) -> None:
        import threading

        self.published = published
        self.state_dict = state_dict
        self.order = sorted(state_dict)
        self._kept = {name: published.metadata.get(name, name) for name in self.order}
        self._served: dict[str, Any] = {}
        self._done = False
        self._aborted = False
        self._ready = threading.Condition()
        self.checksum: str | None = None
        self.error: BaseException | None = None
        self.threads = 1  # hashing threads used (more than 1 only for a BLAKE3 checksum)
        self.busy_s = 0.0  # time spent hashing (the rest of the thread's life it waited for written slices)

    def written(self, name: str, dst: Any) -> None:
        with self._ready:
            self._served[name] = dst
            self._ready.notify_all()

    def finish(self, *, abort: bool = False) -> None:
        """No more writes: hash what is left from the file, or with ``abort`` stop (no checksum)."""
        with self._ready:
            self._done = True
            self._aborted = abort
            self._ready.notify_all()

    def run(self) -> None:
        from rlsdk.engine.weights import BLAKE3_MAX_THREADS, CHECKSUM_ALGORITHM, StateDictHasher

        try:
            import time

            cores = _run_on_every_core()
            # Only BLAKE3 splits one update over threads; XXH3 (the default) hashes on this thread alone.
            self.threads = max(1, min(BLAKE3_MAX_THREADS, cores)) if CHECKSUM_ALGORITHM == "blake3" else 1
            hasher = StateDictHasher(max_threads=self.threads)
            for name in self.order:
                key = name if name in self.published.tensors else self._kept[name]
                with self._ready:
                    self._ready.wait_for(lambda key=key: key in self._served or self._done)
                    if self._aborted:
                        return
                    served = self._served.get(key)
                began = time.perf_counter()
                hasher.update(name, served if served is not None else self.state_dict[name])
                self.busy_s += time.perf_counter() - began
            self.checksum = hasher.checksum()
        except BaseException as exc:
            self.error = exc


class WeightSyncExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``reload_weights``, ``model_runner``, ...)."""

    def rlsdk_load_weights(self, path: str) -> dict[str, Any]:
        """Load the safetensors file at ``path`` into the served model; return the checksum of what was loaded.

        Never raises: an exception inside a collective RPC kills vLLM's engine core, so a failure comes back as
        ``{"error": ...}``. A failure after loading began clears the recorded checksum (the served weights may
        be partly new), so the next verification fails instead of passing on stale bookkeeping.
        """
        import time
        from concurrent.futures import ThreadPoolExecutor

        from rlsdk.engine.weights import state_dict_checksum

        start = time.perf_counter()
        try:
            tensors, state_dict = read_published_weights(allowed_weights_path(path))
        except Exception as exc:
            return {"error": f"reading {path}: {type(exc).__name__}: {exc}"}
        read_s = time.perf_counter() - start
        # The checksum runs on a second thread while vLLM loads (hashlib releases the GIL): sync latency is
        # max(hash, load) instead of their sum. Recorded only when both succeeded.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlsdk-checksum") as pool:
            pending = pool.submit(state_dict_checksum, state_dict)
            try:
                # Both tied names (e.g. lm_head.weight and model.embed_tokens.weight): vLLM then reports every
                # parameter as loaded instead of warning that the tied one was not.
                self.reload_weights(weights_iterator=iter(state_dict.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
            except Exception as exc:
                self._rlsdk_checksum = None
                return {"error": f"reload_weights from {path}: {type(exc).__name__}: {exc}"}
            load_s = time.perf_counter() - start - read_s
            try:
                checksum = pending.result()
            except Exception as exc:
                self._rlsdk_checksum = None
                return {"error": f"checksum of {path}: {type(exc).__name__}: {exc}"}
        return self._rlsdk_served(
            path,
            checksum,
            _nbytes(tensors),
            read_s=read_s,
            load_s=load_s,
            checksum_s=time.perf_counter() - start - read_s,
        )

    def rlsdk_update_weights_inplace(self, path: str) -> dict[str, Any]:
        """Write the weights in the safetensors file at ``path`` into the served model's parameters, in place.

        The model's own ``load_weights`` (vLLM's weight loaders: fused qkv/gate_up slices, tied embeddings) decides
        where every tensor goes; each plain copy of a whole file tensor into a contiguous parameter slice becomes a
        memory copy from the file's mapping straight into that slice (:func:`read_into_parameters`; the mapping is
        kept across updates while the trainer rewrites the same file, :meth:`_rlsdk_mapped_file`), and a second
        thread checksums each written slice as soon as it is written, in the checksum's name order
        (:class:`ServedWeightsHasher`). Nothing is re-processed. Needs plain weights (:func:`plain_weights_problem`).
        Returns what :meth:`rlsdk_load_weights` returns, plus ``direct_bytes`` (bytes copied straight into
        parameters), ``mapping_reused`` (the file was still mapped from the last update), ``hash_threads`` and
        ``hash_busy_s`` (hashing threads, and the time spent hashing rather than waiting for slices) and
        ``worker_s`` (the whole call). Never raises: ``{"error": ..., "loaded": bool}``, where ``loaded`` False
        means the served weights were not touched (e.g. the server keeps packed weights) and True that they may be
        partly new (the recorded checksum is then cleared).
        """
        import threading
        import time

        import torch

        start = time.perf_counter()
        try:
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            problem = plain_weights_problem(model)
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            return {"error": f"in-place update of {path} unavailable: {problem}", "loaded": False, "unsupported": True}
        try:
            published, reused = self._rlsdk_mapped_file(allowed_weights_path(path))
        except Exception as exc:
            return {"error": f"reading {path}: {type(exc).__name__}: {exc}", "loaded": False}
        try:
            read_s = time.perf_counter() - start
            try:
                expected = {name for name, _ in model.named_parameters()}
                state_dict = published.state_dict()
                hasher = ServedWeightsHasher(published, state_dict)
                hashing = threading.Thread(target=hasher.run, name="rlsdk-checksum", daemon=True)
                hashing.start()
            except Exception as exc:  # nothing written yet
                return {"error": f"in-place update of {path}: {type(exc).__name__}: {exc}", "loaded": False}
            try:
                from vllm.config import set_current_vllm_config

                items = ((name, state_dict[name]) for name in hasher.order)
                with (
                    torch.no_grad(),
                    set_current_vllm_config(self.vllm_config),  # type: ignore[attr-defined]
                    read_into_parameters(published, hasher.written),
                ):
                    loaded = model.load_weights(items)
                missing = expected - set(loaded or ())
                if missing:
                    raise RuntimeError(f"{len(missing)} parameters not in the file: {sorted(missing)[:5]}")
            except Exception as exc:
                self._rlsdk_checksum = None
                hasher.finish(abort=True)
                hashing.join()
                return {"error": f"in-place load_weights from {path}: {type(exc).__name__}: {exc}", "loaded": True}
            load_s = time.perf_counter() - start - read_s
            hasher.finish()
            hashing.join()
            if hasher.error is not None:
                self._rlsdk_checksum = None
                error = hasher.error
                return {"error": f"checksum of {path}: {type(error).__name__}: {error}", "loaded": True}
            checksum_s = time.perf_counter() - start - read_s
        except BaseException:
            self._rlsdk_forget_mapped_file()  # the next sync maps the file afresh
            raise
        return self._rlsdk_served(
            path,
            hasher.checksum,
            published.nbytes,
            direct_bytes=published.direct_bytes,
            read_s=read_s,
            load_s=load_s,
            checksum_s=checksum_s,
            worker_s=time.perf_counter() - start,
            inplace=True,
            mapping_reused=reused,
            hash_threads=hasher.threads,
            hash_busy_s=hasher.busy_s,
        )

    def _rlsdk_mapped_file(self, path: str) -> tuple[PublishedFile, bool]:
        """The published file at ``path``, mapped, and whether the mapping kept from the last in-place update was
        reused: it is when ``path`` still names that file (same device, inode, size and header bytes,
        :meth:`PublishedFile.still_maps`), which is what the trainer's in-place rewrite keeps; its pages are then
        already faulted in. Otherwise the old mapping is closed and the file mapped afresh. The mapping is kept
        until the next update of another file or the server exits (it keeps that file's pages in memory)."""
        cached: PublishedFile | None = getattr(self, "_rlsdk_mapped", None)
        if cached is not None and cached.still_maps(path):
            cached.path = path
            cached.direct_bytes = 0
            return cached, True
        self._rlsdk_forget_mapped_file()
        published = PublishedFile(path, keep_mapped=True)
        self._rlsdk_mapped = published
        return published, False

    def _rlsdk_forget_mapped_file(self) -> None:
        cached: PublishedFile | None = getattr(self, "_rlsdk_mapped", None)
        self._rlsdk_mapped = None
        if cached is not None:
            cached.close()

    def rlsdk_lora_loaded(self, path: str) -> dict[str, Any]:
        """After ``/v1/load_lora_adapter`` loaded the adapter directory at ``path`` (LoRA runs): confirm this worker
        holds an adapter and record the checksum of the adapter's tensors read from ``path``, under the trainer's
        names (:func:`rlsdk.engine.lora.read_adapter`), as the served checksum.

        vLLM reads the adapter itself, and keeps it merged and rescaled in its own layout (fused qkv, lora_b times
        the scaling), so the served tensors cannot be hashed under the trainer's names. The trainer publishes each
        version into a new directory it never changes (``rlsdk.engine.lora.publish_adapter``), so the tensors
        hashed here are the ones vLLM loaded. Never raises (see :meth:`rlsdk_load_weights`): ``{"error": ...}``,
        which also clears the recorded checksum.
        """
        import time

        start = time.perf_counter()
        try:
            adapters = sorted(self.list_loras())  # type: ignore[attr-defined]
            if not adapters:
                raise RuntimeError("the worker holds no LoRA adapter after /v1/load_lora_adapter")
            from rlsdk.engine.lora import read_adapter
            from rlsdk.engine.weights import state_dict_checksum

            tensors, _ = read_adapter(path)
            checksum = state_dict_checksum(tensors)
        except Exception as exc:
            self._rlsdk_checksum = None
            return {"error": f"LoRA adapter {path}: {type(exc).__name__}: {exc}"}
        return self._rlsdk_served(
            path, checksum, _nbytes(tensors), adapters=adapters, checksum_s=time.perf_counter() - start
        )

    def _rlsdk_served(self, path: str, checksum: str | None, nbytes: int, **details: Any) -> dict[str, Any]:
        """Record ``checksum`` of the weights from ``path`` as what this worker serves (:meth:`rlsdk_weight_info`),
        and answer the load with them: ``checksum``, ``path``, ``bytes`` and the load's own ``details``."""
        self._rlsdk_checksum = checksum
        self._rlsdk_path = path
        return {"checksum": checksum, "path": path, "bytes": nbytes, **details}

    def rlsdk_weight_info(self) -> dict[str, Any]:
        """The checksum of the last weights loaded through :meth:`rlsdk_load_weights` (None before the first)."""
        return {"checksum": getattr(self, "_rlsdk_checksum", None), "path": getattr(self, "_rlsdk_path", None)}


def _nbytes(tensors: Mapping[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
