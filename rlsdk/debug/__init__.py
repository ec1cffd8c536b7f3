"""Distributed debugging: the collective tracer, its live analysis, the hang watchdog and a lint aid.

- :mod:`rlsdk.debug.tracer` (ranks): the ``traced`` c10d backend that records every collective.
- :mod:`rlsdk.debug.analyze` (controller, pure): the root cause of the ranks' divergence, report views; built on
  :mod:`~rlsdk.debug.collectives` (one group's collectives), :mod:`~rlsdk.debug.p2p` (posted sends and receives),
  :mod:`~rlsdk.debug.rootcause` (who waits on whom, departing call sequences) and :mod:`~rlsdk.debug.divergence`.
- :mod:`rlsdk.debug.watchdog` (controller): collect traces and stacks when a command overruns; reports.
- :mod:`rlsdk.debug.lint`: collectives inside rank-conditional branches.
- :mod:`rlsdk.debug.harness`: run a function on traced ranks and diagnose it live (tests, experiments).

Importing this package imports none of them (nor torch).
"""
