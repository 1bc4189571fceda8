"""`python -m engine.loading REF`: build a model directory (demo, `dummy:`, GGUF) and print it.

The daemon runs this in a child process (engine.core.model_files.build_in_child) so that
it never imports torch itself. Progress goes to stderr; the last stderr line of a failure
is the error.
"""

from __future__ import annotations

import sys

from base.errors import UserError
from engine.core.model_files import DEFAULT_MODEL
from engine.loading.generated import build_model_dir


def main(argv: list[str]) -> int:
    ref = argv[1] if len(argv) > 1 and argv[1] else DEFAULT_MODEL
    try:
        print(build_model_dir(ref))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
