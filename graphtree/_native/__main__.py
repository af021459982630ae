"""``python -m graphtree._native``: build (or find built) the native helpers; prints the library's path.

Run by :func:`graphtree._native._build_in_child`; also a way to build them ahead of time.
"""

from graphtree._native import build_here

if __name__ == "__main__":
    print(build_here())
