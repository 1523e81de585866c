"""``python -m treespec.cli``: the ``treespec`` command without the installed script."""

import sys

from . import main

sys.exit(main())
