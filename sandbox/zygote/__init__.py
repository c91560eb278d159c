"""The zygote: the process tree that runs every call (main.py tells its parts). It runs as the
top-level package `zygote` (start.py), so it imports only the standard library, pyseccomp and
this package; the service imports its shared parts (state, wire, confine, cgroups) from here.
Nothing is imported by this file: the zygote loads only what it uses."""
