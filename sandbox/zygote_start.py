"""Runs the zygote (zygote.py) from its cached bytecode.

Run as a script, zygote.py would be compiled from source at every start, and the compiler's
memory (~2.3 MB, freed but not returned) would stay in every process forked from it: each call's
fork copies those page-table entries and its exit tears them down again.
"""

import os
import sys

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import zygote
    sys.path.remove(here)  # nothing of the service is importable from the calls
    zygote.main()
