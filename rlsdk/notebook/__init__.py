"""Notebook tooling: promoting a notebook to a recipe, and executing notebooks with a real kernel."""

from rlsdk.notebook.promote import PromoteError, promote_notebook, write_recipe

__all__ = ["PromoteError", "promote_notebook", "write_recipe"]
