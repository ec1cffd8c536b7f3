"""Compatibility guard: a committed snapshot of the public config schema and public API, and a diff against it.

``python -m rlsdk.compat check`` compares the live surface with ``tests/compat/snapshot.json`` and exits 1 on an
incompatible change (a config field removed or renamed without a deprecation, a changed field type, a removed
Literal choice, a removed public name or parameter), naming how to deprecate instead. ``python -m rlsdk.compat
update`` rewrites the snapshot: run it deliberately, after an intended change, and commit the result.
"""

from rlsdk.compat.diff import CompatReport, compare
from rlsdk.compat.surface import api_surface, config_schema, snapshot

__all__ = ["CompatReport", "api_surface", "compare", "config_schema", "snapshot"]
