"""Runs the zygote (main.py) from its cached bytecode, as the top-level package `zygote`.

Run as a script, zygote/main.py would be compiled from source at every start, and the compiler's
memory (~2.3 MB, freed but not returned) would stay in every process forked from it: each call's
fork copies those page-table entries and its exit tears them down again.
"""

import os
import sys

if __name__ == "__main__":
    # `zygote`, not `sandbox.zygote`: sandbox/__init__ (the service's clients) must not load here.
    # -I leaves the script's directory off sys.path; sandbox/ goes on it for this import only.
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, here)
    from zygote import main as zygote_main
    sys.path.remove(here)  # nothing of the service is importable from the calls
    zygote_main.main()
