"""``python -m training.launcher``: see :mod:`training.launcher.main`."""

import sys

from training.launcher.main import main

sys.exit(main())
