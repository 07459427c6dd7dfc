import sys

from routing.http.server import main

sys.exit(main())
