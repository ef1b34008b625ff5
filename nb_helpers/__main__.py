import sys

from nb_helpers.cli import main

sys.exit(main())
