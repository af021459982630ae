"""Diagnostics for graphtree: :func:`doctor` says whether CUDA graphs can run here and why not;
:func:`dump_on_error` keeps a durable dump of a call that failed, which :func:`load_dump` reads.

Example::

    from graphtree.debug import doctor
    print(doctor().render())
"""

from graphtree.debug.doctor import DoctorReport, doctor
from graphtree.debug.dump import Dump, DumpTooLarge, dump_on_error, load_dump, write_dump

__all__ = ["DoctorReport", "Dump", "DumpTooLarge", "doctor", "dump_on_error", "load_dump", "write_dump"]
