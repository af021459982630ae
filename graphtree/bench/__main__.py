"""``python -m graphtree.bench``: run the benchmarks (see :func:`graphtree.bench.main`).

Example::

    $ python -m graphtree.bench --quick --scenarios overhead
"""

import sys

from graphtree.bench import main

if __name__ == "__main__":
    sys.exit(main())
