"""``python -m ctj_stack demo [--keep] [--rounds N] [--hangs M] [--json FILE]``: the operator
demo on a real cluster (with --rounds/--hangs, the recovery benchmark)."""

from __future__ import annotations

import sys

from .demo import main

if __name__ == "__main__":
    if sys.argv[1:2] != ["demo"]:
        print("usage: python -m ctj_stack demo [--keep] [--rounds N] [--hangs M] [--json FILE]",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    sys.exit(main(sys.argv[2:]))
