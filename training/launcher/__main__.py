"""``python -m training.launcher``: see :mod:`training.launcher.main`.

Also run as a script, ``python /platform-launcher/training/launcher/__main__.py``, in an image that
lacks this package (training.contract.LAUNCHER_ENTRY): Python then puts this file's folder first on
sys.path (the ``python <script>`` rule of the sys.path docs), where ``training`` is not found; the
folder that holds ``training/`` takes its place. Nothing else changes: not PYTHONPATH, not the
working directory, so the program's workers see their image as it is.
"""

import sys

if not __package__:  # run as a script, not with -m
    from pathlib import Path

    sys.path[0] = str(Path(__file__).resolve().parents[2])

from training.launcher.main import main  # after the path is set, when run as a script

sys.exit(main())
