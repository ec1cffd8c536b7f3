"""Each config field's documentation: the docstring right under the field in the class source.

torchtitan's ``job_config.py`` style: the text that says what a field does and what it allows sits next to the
field, not in a distant ``Attributes:`` list. Python keeps no such "attribute docstring" at run time, so
:func:`field_docs` reads it from the class's source with ``ast``. The generated config reference (docs/hooks.py,
through ``rlsdk.compat.surface``) and ``rlsdk run RECIPE --help`` (``rlsdk.config.cli``) show it, and a test fails
on a config field without one.
"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import sys
import textwrap


def field_docs(cls: type) -> dict[str, str]:
    """``{field name: its docstring}`` for class ``cls`` and its bases, each docstring's whitespace joined into one
    line. A field without a docstring, or a class without source (defined in a REPL, built in), has no entry."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is not object:
            docs.update(_own_field_docs(klass))
    return docs


@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    node = _class_node(cls)
    docs: dict[str, str] = {}
    for stmt, after in itertools.pairwise(node.body if node else []):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def _class_node(cls: type) -> ast.ClassDef | None:
    """The ``ClassDef`` of ``cls``: looked up in its module's tree (parsed once per module) for a top-level class,
    else parsed from the class's own source."""
    if "." not in cls.__qualname__:
        tree = _module_tree(cls.__module__)
        if tree is not None:
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
                    return node
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source file: defined by exec, in a REPL, or built in
        return None
    return next((node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)), None)


@functools.cache
def _module_tree(name: str) -> ast.Module | None:
    module = sys.modules.get(name)
    try:
        return ast.parse(inspect.getsource(module)) if module is not None else None
    except (OSError, TypeError, SyntaxError):
        return None
