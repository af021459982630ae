"""``python -m graphtree``: the same as the ``graphtree`` command (see :mod:`graphtree.cli`)."""

from graphtree.cli import main

raise SystemExit(main())
