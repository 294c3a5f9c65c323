"""`python -m viz`: render the gallery (see viz/gallery.py)."""

import sys

from viz.gallery import main

sys.exit(main())
