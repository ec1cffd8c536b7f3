"""`import rlsdk` defines things and starts nothing."""

from __future__ import annotations

import subprocess
import sys


def test_import_rlsdk_imports_no_torch_and_creates_no_process_group() -> None:
    code = (
        "import sys, rlsdk\n"
        "assert 'torch' not in sys.modules, 'import rlsdk pulled in torch'\n"
        "assert 'zmq' not in sys.modules\n"
        "import torch.distributed as dist\n"
        "assert not dist.is_initialized()\n"
        "assert rlsdk.Session.__name__ == 'Session'\n"
        "assert not dist.is_initialized()\n"
    )

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stderr


def test_unknown_public_name_raises_attribute_error() -> None:
    import rlsdk

    try:
        rlsdk.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")
