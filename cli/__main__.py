import sys

from kvserve.cli.main import main

sys.exit(main())
