"""``python -m ctj_stack demo [--keep]``: the operator demo on a real cluster."""

from __future__ import annotations

import sys

from .demo import main

if __name__ == "__main__":
    if sys.argv[1:2] != ["demo"]:
        print("usage: python -m ctj_stack demo [--keep]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[2:]))
