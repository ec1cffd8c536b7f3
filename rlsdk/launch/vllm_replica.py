"""Run one vLLM replica on a Slurm node and hand its endpoint back to the controller through a file.

The generated sbatch script (:func:`rlsdk.launch.slurm.sbatch_script`) starts this wrapper with srun on each
inference node::

    python -m rlsdk.launch.vllm_replica --replica 0 --endpoint-file DIR/replica-0.json --host NODE \\
        --start-timeout-s 300 -- env VLLM_SERVER_DEV_MODE=1 ... python -m vllm.entrypoints.openai.api_server ...

It picks a port free on the node, starts the server command with ``--host NODE --port PORT`` appended, polls
``http://NODE:PORT/health`` until it answers 200, then writes ``{"replica", "url", "host", "port", "job_id",
"pid"}`` to the endpoint file (atomically: a temporary file renamed), which the controller polls
(:meth:`rlsdk.launch.slurm.SlurmLauncher.wait_for_endpoint`). It then waits for the server and exits with its
exit code; SIGTERM and SIGINT are passed on to the server. A server that exits or is not healthy within
``--start-timeout-s`` writes ``{"replica", "job_id", "error"}`` instead, so the controller fails at once, and the
wrapper exits non-zero (the server's last lines are in the job's output).

The endpoint file lives under the run's output directory, which the compute nodes must share with the controller
(as they share the Python environment). The standard library and light rlsdk modules only (no torch, no vLLM): it
runs before anything heavy is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from rlsdk.procutil import free_port


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _say(line: str) -> None:
    # The job's output (tailed by the controller into the launcher log); this process has no rlsdk logging.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def write_endpoint(path: Path, record: dict[str, object]) -> None:
    """Write ``record`` as JSON to ``path`` atomically (the controller never reads half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlsdk.launch.vllm_replica", description=__doc__.split("\n")[0])
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--endpoint-file", type=Path, required=True)
    parser.add_argument("--host", required=True, help="this node's name or address, as the controller reaches it")
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the server command (without --host/--port)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no server command after --")
    port = free_port(args.host)
    url = f"http://{args.host}:{port}"
    log = f"rlsdk vllm replica {args.replica}"
    _say(f"{log}: starting the server at {url}")
    server = subprocess.Popen([*command, "--host", args.host, "--port", str(port)], stdin=subprocess.DEVNULL)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            server.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    record: dict[str, object] = {"replica": args.replica, "job_id": os.environ.get("SLURM_JOB_ID")}
    deadline = time.monotonic() + args.start_timeout_s
    while not _healthy(url):
        failure = None
        if server.poll() is not None:
            failure = f"the server exited during start-up (exit code {server.returncode})"
        elif time.monotonic() > deadline:
            failure = f"the server was not healthy within {args.start_timeout_s:.0f} s"
            server.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=15.0)
            server.kill()
        if failure is not None:
            _say(f"{log}: {failure}")
            write_endpoint(args.endpoint_file, {**record, "error": failure})  # the controller fails at once
            return server.returncode or 1
        time.sleep(0.5)
    record.update(url=url, host=args.host, port=port, pid=server.pid)
    write_endpoint(args.endpoint_file, record)
    _say(f"{log}: healthy at {url}; endpoint written to {args.endpoint_file}")
    return server.wait()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
