"""`python -m dropless.cli ...` runs the `dropless` command."""
import sys

from dropless.cli.main import main

sys.exit(main())
