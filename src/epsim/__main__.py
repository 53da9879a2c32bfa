import sys

from epsim.cli import main

sys.exit(main())
