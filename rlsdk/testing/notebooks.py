"""Execute a notebook top to bottom with a real Jupyter kernel (nbclient), leaving no Session process behind.

Needs the ``notebook`` extra (``nbclient``, ``nbformat``, ``ipykernel``, ``ipywidgets``)::

    run = execute_notebook("notebooks/quickstart.ipynb", cwd=tmp_path, fetch={"history": "history"})
    assert run.values["history"][-1]["engine_version"] == 5
    assert run.open_sessions == 0          # the notebook closed every Session it started

Whatever happens (a failing cell, a timeout), every ``rlsdk.Session`` still open in the kernel is closed before the
kernel shuts down, and the kernel's child processes (train ranks, launchers, servers) are waited for and, past
``reap_timeout_s``, killed and reported.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run in the kernel after the notebook: counts the Sessions the notebook left open, then closes them.
_CLOSE_SESSIONS = """\
import gc as _rlsdk_gc
from rlsdk.session import Session as _RlsdkSession
_rlsdk_open = [_s for _s in _rlsdk_gc.get_objects() if issubclass(type(_s), _RlsdkSession) and not _s.closed]
for _s in _rlsdk_open:
    await _s.close()
print(len(_rlsdk_open))
"""


class LeftoverProcessError(RuntimeError):
    """Processes started from the notebook's kernel outlived it (they were killed; the message lists them)."""


@dataclass
class NotebookRun:
    """An executed notebook: ``notebook`` (nbformat node, with outputs), ``values`` fetched from the kernel as
    JSON, and ``open_sessions``: how many Sessions were still open after the last cell (then closed)."""

    notebook: Any
    values: dict[str, Any] = field(default_factory=dict)
    open_sessions: int = 0
    seconds: float = 0.0
    cleanup_error: str | None = None


def _stdout(cell: Any) -> str:
    return "".join(out.get("text", "") for out in cell.get("outputs", []) if out.get("name") == "stdout")


def execute_notebook(
    path: str | Path,
    *,
    cwd: str | Path,
    fetch: Mapping[str, str] | None = None,
    cell_timeout_s: float = 300.0,
    kernel_name: str = "python3",
    reap_timeout_s: float = 20.0,
) -> NotebookRun:
    """Execute the notebook at ``path`` in directory ``cwd``; return it with outputs and the ``fetch`` values.

    ``fetch`` maps a name to a Python expression evaluated in the kernel after the last cell; its value must be
    JSON-serialisable. Raises nbclient's ``CellExecutionError`` (naming the cell and its traceback) when a cell
    fails, and :class:`LeftoverProcessError` when processes started by the kernel outlive it.
    """
    import time

    import nbformat
    import psutil
    from nbclient import NotebookClient

    start = time.perf_counter()
    notebook = nbformat.read(str(path), as_version=4)
    client = NotebookClient(
        notebook,
        timeout=int(cell_timeout_s),
        kernel_name=kernel_name,
        resources={"metadata": {"path": str(cwd)}},
    )
    run = NotebookRun(notebook=notebook)
    descendants: list[psutil.Process] = []

    def run_extra(code: str) -> str:
        cell = nbformat.v4.new_code_cell(code)
        notebook.cells.append(cell)
        try:
            client.execute_cell(cell, len(notebook.cells) - 1)
        finally:
            notebook.cells.pop()
        return _stdout(cell)

    with client.setup_kernel():
        kernel_pid = client.km.provisioner.process.pid  # type: ignore[union-attr]
        try:
            for index, cell in enumerate(notebook.cells):
                client.execute_cell(cell, index)
            client.set_widgets_metadata()  # what a saved notebook keeps of the widgets (nbclient's execute() does it)
            for name, expression in (fetch or {}).items():
                out = run_extra(f"import json as _json\nprint(_json.dumps({expression}))")
                run.values[name] = json.loads(out.strip().splitlines()[-1])
        finally:
            try:
                run.open_sessions = int(run_extra(_CLOSE_SESSIONS).strip().splitlines()[-1])
            except Exception as exc:  # the kernel died or hangs: the reaping below still cleans up
                run.open_sessions = -1
                run.cleanup_error = repr(exc)
            try:
                descendants = psutil.Process(kernel_pid).children(recursive=True)
            except psutil.NoSuchProcess:
                descendants = []
    _, alive = psutil.wait_procs(descendants, timeout=reap_timeout_s)
    if alive:
        names = [f"{p.pid} {_cmdline(p)}" for p in alive]
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        raise LeftoverProcessError(f"{len(alive)} processes outlived the kernel of {path} (killed): {names}")
    run.seconds = time.perf_counter() - start
    return run


def _cmdline(proc: Any) -> str:
    try:
        return " ".join(proc.cmdline())[:160]
    except Exception:
        return "?"
