"""Distributed debugging: the collective tracer, its live analysis, the hang watchdog and a lint aid.

- :mod:`rlsdk.debug.tracer` (ranks): the ``traced`` c10d backend that records every collective.
- :mod:`rlsdk.debug.analyze` (controller, pure): first divergence between the ranks' records, report views.
- :mod:`rlsdk.debug.watchdog` (controller): collect traces and stacks when a command overruns; reports.
- :mod:`rlsdk.debug.lint`: collectives inside rank-conditional branches.
- :mod:`rlsdk.debug.harness`: run a function on traced ranks and diagnose it live (tests, experiments).

Importing this package imports none of them (nor torch).
"""
