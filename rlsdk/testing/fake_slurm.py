"""A fake Slurm for tests: ``sbatch``, ``srun``, ``scontrol`` and ``scancel`` that run everything on this machine.

``install_fake_slurm(bin_dir)`` writes the four commands into ``bin_dir``; put it first on ``PATH`` (pytest's
``monkeypatch.setenv``) and :class:`rlsdk.launch.slurm.SlurmLauncher` submits to it unchanged. What it does:

- ``sbatch [--wait] [--parsable] SCRIPT``: reads the ``#SBATCH`` lines (``--nodes``, ``--output``, ``--job-name``),
  prints a job id, and runs SCRIPT with bash, its output into ``--output`` (``%j`` = the job id), with
  ``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST`` (one ``127.0.0.1`` per node: every simulated node is this machine),
  ``SLURM_JOB_NUM_NODES``/``SLURM_NNODES`` and ``SLURM_SUBMIT_DIR`` set. With ``--wait`` it exits with the
  script's exit code; otherwise it returns at once and the job runs on.
- ``srun --nodes=N --ntasks-per-node=1 [--kill-on-bad-exit=1] [--label] CMD...``: starts CMD once per node with
  ``SLURM_NODEID``/``SLURM_PROCID`` = node index, ``SLURM_LOCALID=0``, ``SLURMD_NODENAME``, ``SLURM_STEP_ID``;
  with ``--kill-on-bad-exit`` a failing task ends the others; exits with the worst exit code.
- ``scontrol show hostnames LIST``: one host per line of a comma-separated list (no bracket ranges).
- ``scancel ID``: SIGTERM to that job's process group.

Only what rlsdk's launcher uses is implemented. It is a simulation: one machine, loopback addresses, no
resource limits, no accounting.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path


def install_fake_slurm(bin_dir: Path) -> Path:
    """Write ``sbatch``, ``srun``, ``scontrol`` and ``scancel`` into ``bin_dir``; returns ``bin_dir``."""
    bin_dir = bin_dir.resolve()
    bin_dir.mkdir(parents=True, exist_ok=True)
    state = bin_dir / "state"
    state.mkdir(exist_ok=True)
    for name in ("sbatch", "srun", "scontrol", "scancel"):
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m rlsdk.testing.fake_slurm "{state}" {name} "$@"\n')
        path.chmod(0o755)
    return bin_dir


def _next_job_id(state: Path) -> str:
    counter = state / "next_job_id"
    job_id = int(counter.read_text()) if counter.exists() else 1000
    counter.write_text(str(job_id + 1))
    return str(job_id)


def _directives(script: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in script.read_text().splitlines():
        match = re.match(r"#SBATCH\s+--([\w-]+)(?:=(.*))?$", line.strip())
        if match:
            found[match.group(1)] = (match.group(2) or "").strip()
    return found


def sbatch(state: Path, args: list[str]) -> int:
    wait = "--wait" in args
    script = Path([a for a in args if not a.startswith("--")][-1])
    options = _directives(script)
    nodes = int(options.get("nodes", "1"))
    job_id = _next_job_id(state)
    output = Path(options.get("output", "slurm-%j.out").replace("%j", job_id))
    env = dict(os.environ)
    env.update(
        {
            "SLURM_JOB_ID": job_id,
            "SLURM_JOB_NAME": options.get("job-name", script.name),
            "SLURM_JOB_NODELIST": ",".join(["127.0.0.1"] * nodes),
            "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_NNODES": str(nodes),
            "SLURM_SUBMIT_DIR": os.getcwd(),
        }
    )
    sys.stdout.write(f"{job_id}\n" if "--parsable" in args else f"Submitted batch job {job_id}\n")
    sys.stdout.flush()
    with output.open("ab") as out:
        job = subprocess.Popen(
            ["bash", str(script)], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
    (state / f"{job_id}.pgid").write_text(str(job.pid))
    if not wait:
        return 0

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return job.wait()


def srun(args: list[str]) -> int:
    options: dict[str, str] = {}
    while args and args[0].startswith("--"):
        key, _, value = args.pop(0)[2:].partition("=")
        options[key] = value
    nodes = int(options.get("nodes", os.environ.get("SLURM_NNODES", "1")))
    hosts = os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1").split(",")
    kill_on_bad_exit = options.get("kill-on-bad-exit", "0") not in ("", "0")
    tasks: list[subprocess.Popen[bytes]] = []
    for node in range(nodes):
        env = dict(os.environ)
        env.update(
            {
                "SLURM_NODEID": str(node),
                "SLURM_PROCID": str(node),
                "SLURM_LOCALID": "0",
                "SLURM_NTASKS": str(nodes),
                "SLURM_STEP_ID": "0",
                "SLURMD_NODENAME": hosts[node % len(hosts)],
            }
        )
        tasks.append(subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL))

    def stop_all(sig: int) -> None:
        for task in tasks:
            if task.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    task.send_signal(sig)

    def on_signal(signum: int, _frame: object) -> None:
        stop_all(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while True:
        codes = [task.poll() for task in tasks]
        if all(code is not None for code in codes):
            break
        if kill_on_bad_exit and any(code not in (None, 0) for code in codes):
            stop_all(signal.SIGTERM)
            deadline = time.monotonic() + 10.0
            while any(task.poll() is None for task in tasks) and time.monotonic() < deadline:
                time.sleep(0.1)
            stop_all(signal.SIGKILL)
        time.sleep(0.1)
    codes = [task.wait() for task in tasks]
    return next((code for code in codes if code != 0), 0)


def scontrol(args: list[str]) -> int:
    if args[:2] != ["show", "hostnames"] or len(args) != 3:
        sys.stderr.write(f"fake scontrol: only 'show hostnames LIST' is supported, got {args}\n")
        return 2
    sys.stdout.write("".join(f"{host}\n" for host in args[2].split(",") if host))
    return 0


def scancel(state: Path, args: list[str]) -> int:
    pgid_file = state / f"{args[0]}.pgid"
    if not pgid_file.exists():
        sys.stderr.write(f"fake scancel: no job {args[0]}\n")
        return 1
    with contextlib.suppress(ProcessLookupError):
        os.killpg(int(pgid_file.read_text()), signal.SIGTERM)
    return 0


def main(argv: list[str]) -> int:
    state, command, args = Path(argv[0]), argv[1], argv[2:]
    if command == "sbatch":
        return sbatch(state, args)
    if command == "srun":
        return srun(args)
    if command == "scontrol":
        return scontrol(args)
    if command == "scancel":
        return scancel(state, args)
    raise SystemExit(f"fake slurm: unknown command {command}")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
