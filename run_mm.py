"""Multi-model fusion host: check a deployment, serve it, or run its models over their data.

    python run_mm.py --mode validate_only | compile_only | predict | eval | serve --params P --variants NAME,COUNT ...

The logic lives in fusion/cli.py; this file is its command line.
"""

import sys

from fusion.cli import main

if __name__ == "__main__":
    sys.exit(main())
