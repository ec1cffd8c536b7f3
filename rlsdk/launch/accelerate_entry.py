"""``accelerate launch`` run in this process, dying with its parent and leaving without interpreter teardown.

Usage: ``python -m rlsdk.launch.accelerate_entry [accelerate launch arguments]``: the same parser and
``launch_command`` as ``python -m accelerate.commands.launch`` (so the same torchrun agent starts the same ranks),
with two differences:

- ``PR_SET_PDEATHSIG`` (SIGTERM) is set first, as :mod:`rlsdk.launch.pdeathsig` does for an exec'd command: the
  launcher dies with the controller, even a SIGKILLed one, and torchrun then takes its ranks down.
- rlsdk's file rendezvous (:mod:`rlsdk.launch.rendezvous`) is registered with torch's rendezvous registry, so
  ``--rdzv_backend rlsdk-file`` meets the ranks of one machine through files instead of a TCP store.
- Once the ranks have exited and ``launch_command`` returns (or raises: the traceback, with torchelastic's root
  cause summary, is printed as before and the exit code is 1), the process leaves with ``os._exit``. The
  interpreter's teardown of a process that imported torch (its module finalisation garbage collection) can take
  seconds after the ranks have already exited, and ``Session.close`` waits for this exit.
"""

from __future__ import annotations

import os
import sys
import traceback

from rlsdk.launch.pdeathsig import set_parent_death_signal


def main(argv: list[str]) -> int:
    parent = os.getppid()
    set_parent_death_signal()
    if os.getppid() != parent:  # the parent died before prctl took effect
        return 1
    from accelerate.commands.launch import launch_command, launch_command_parser

    from rlsdk.launch.rendezvous import register

    register()

    args = launch_command_parser().parse_args(argv)
    try:
        launch_command(args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
