"""python -m ringsync.store serve [--host H] [--port P]"""
import sys

from . import main

sys.exit(main())
