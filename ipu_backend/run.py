"""``python -m ipu_backend.run``: the ``ipu-run`` launcher (:mod:`ipu_backend.distributed.launcher`)."""

import sys

from ipu_backend.distributed.launcher import main

if __name__ == "__main__":
    sys.exit(main())
