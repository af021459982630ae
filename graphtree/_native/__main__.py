"""``python -m graphtree._native``: build (or find built) the native helpers; prints the library's path,
after a line ``compiled <seconds>`` when this run compiled them.

Run by :func:`graphtree._native._build_in_child`; also a way to build them ahead of time.
"""

import os
import time

from graphtree._native import build_here

if __name__ == "__main__":
    t0 = time.time()
    path = build_here()
    if os.path.getmtime(path) >= t0 - 1:  # (written by this run: compiled, not found in the cache)
        print(f"compiled {time.time() - t0:.1f}")
    print(path)
