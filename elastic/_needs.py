"""The project's own message where a part of it needs torch and this Python cannot import it."""
from __future__ import annotations

INSTALL = "pip install -c constraints.txt -e '.[torch]' (the constraints file pins torch==2.13.0, its CPU build)"


def torch_missing(module: str) -> ModuleNotFoundError:
    """What ``module`` raises where ``import torch`` fails (not installed, or blocked as
    ``sys.modules['torch'] = None`` does): what to install, and where."""
    return ModuleNotFoundError(f"{module} needs torch, which this Python cannot import: install it in the "
                               f"environment the program runs in: {INSTALL}", name="torch")
