from __future__ import annotations

import sys
from pathlib import Path

# Test modules here share helpers by plain module name (a request stand-in, a worker on a real
# paged cache); pytest runs with --import-mode=importlib, which does not put this directory on sys.path.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
