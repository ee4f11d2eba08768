import sys

from pdserve.cli.main import main

sys.exit(main())
