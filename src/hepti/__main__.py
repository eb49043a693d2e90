import sys

from hepti.cli import main

sys.exit(main())
