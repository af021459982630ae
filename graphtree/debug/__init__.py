"""Diagnostics for graphtree: :func:`doctor` says whether CUDA graphs can run here and why not.

Example::

    from graphtree.debug import doctor
    print(doctor().render())
"""

from graphtree.debug.doctor import DoctorReport, doctor

__all__ = ["DoctorReport", "doctor"]
