"""`python -m expertcache`: the command line, as the `expertcache` script runs it."""
import sys

from .cli import main

sys.exit(main())
