"""Start-up hook of torchft_like: with TORCHFT_LIKE_AS_TORCHFT=1, `import
torchft` gives torchft_like (torchft_like.torchft_alias).

`torchft_like_as_torchft.pth` in site-packages imports this module at every
interpreter start only when the variable is set, so an unset variable costs
one dictionary lookup. Nothing heavy is imported here: torch and
torchft_like load at the first `import torchft`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Sequence

VARIABLE = "TORCHFT_LIKE_AS_TORCHFT"
ON, OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
_done = False


class _Deferred(importlib.abc.MetaPathFinder):
    """Installs the real alias at the first `torchft` import, then steps aside."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torchft" and not fullname.startswith("torchft."):
            return None
        sys.meta_path.remove(self)
        from torchft_like.torchft_alias import install_as_torchft

        install_as_torchft()
        return sys.meta_path[0].find_spec(fullname, path, target)  # type: ignore[attr-defined]


def install() -> None:
    """Called by the .pth file when the variable is set (twice where
    site-packages is reached twice, as through a venv's lib64 link)."""
    global _done
    value = os.environ.get(VARIABLE, "").strip().lower()
    if value in OFF or _done:
        return
    _done = True
    if value not in ON:
        sys.stderr.write(
            f"torchft_like: {VARIABLE}={os.environ[VARIABLE]!r} is not understood, so "
            f"`import torchft` is left alone: set it to 1 to run torchft code on torchft_like, "
            "or unset it\n"
        )
        return
    sys.meta_path.insert(0, _Deferred())
