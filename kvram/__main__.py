import sys

from kvram.cli import main

sys.exit(main())
