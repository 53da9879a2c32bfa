"""The names of the exchange models ``epsim calibrate --exchange-fit`` chooses between (kept
apart from ``calibrate/comm_fit.py`` so that the CLI's flag table needs no pandas).

    in-step               an exchange's fixed cost per kind and world is the median over the
                          exchanges in the ranks sweep's decode steps of each one's share of a
                          median step (``step_s``; the calibration shapes launched as ``epsim
                          run`` does, each rank timed from its issue to the end of its wait, as
                          validation times them); the host holds too
                          (``efficiency.a2a_host_block_by_group_s`` and
                          ``a2a_host_block_fraction``, from the same steps' issuing calls); the
                          bandwidth is the all-to-all benchmark's; the default
    slowest               the slowest rank's time in the all-to-all benchmark (each exchange
                          issued after ~1 ms of compute), which holds the ranks' spread at an
                          exchange (the default before the in-step fit; docs/validation.md
                          compares the two)
    last-plus-straggler   what the last rank to arrive waits (``last_s``) plus the straggler the
                          ranks sweep measures in decode steps, with a part that grows with the
                          compute between exchanges (``efficiency.exchange_straggler_fraction``)
"""

EXCHANGE_FITS = ("in-step", "slowest", "last-plus-straggler")
DEFAULT_EXCHANGE_FIT = "in-step"
