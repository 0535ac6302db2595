"""Run as a file (``python benchmarks/X.py``), a script finds benchmarks/ first on sys.path
instead of the repository root, so ``benchmarks.*`` would not import (and ``butter`` would
come from wherever it is installed rather than from this tree). A script that imports
``benchmarks.*`` therefore starts with

    if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
        import _repo_root  # noqa: F401

which imports this module (found next to the script) and puts the root where
``python -m benchmarks.X`` would have it. Under ``-m`` the script's ``__package__`` is
"benchmarks" and nothing happens.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == HERE:
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
