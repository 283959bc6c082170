"""``python -m dsv4.server [options]`` runs ``dsv4 serve``."""

import sys

from dsv4.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
