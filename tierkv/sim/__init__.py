"""Trace replay over the daemon's own policies, OPT, profiling and advice."""
