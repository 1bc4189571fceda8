"""`python -m engine.loading REF`: build a generated model and print its directory.

The daemon runs this in a child process (engine.core.model_files.build_in_child) so that
it never imports torch itself. An empty REF is the demo model.
"""

from __future__ import annotations

import sys

from engine.loading.generated import build_generated
from policy.errors import UserError


def main(argv: list[str]) -> int:
    ref = argv[1] if len(argv) > 1 and argv[1] else None
    try:
        print(build_generated(ref))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
