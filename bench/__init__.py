"""checkpointq's benchmark suite: ``python -m bench`` (``--quick`` for CI, ``--help``).

Every measurement runs against its own private ``redis-server`` on a free loopback port and
compares our code with the plain Redis commands it stands on, in the same run, so the report
quotes ratios that survive a noisy machine better than absolute times do.
"""
