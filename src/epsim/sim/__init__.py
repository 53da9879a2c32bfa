"""epsim's simulator: how long a step takes on given hardware, and what a served benchmark sees.
It imports ``epsim.model`` only. Five parts, each a subpackage whose ``__init__`` is its face;
an arrow is "imports":

    hardware/   what a device can do, as data: profiles and their efficiency tables, measured
                kernel tables and kernel sets, the EP exchange modes (uses model only)
    step/       one forward step of every rank: the op graph compiled and costed (roofline and
                kernel tables), routing sampled, the engine walking compute and communication
                (uses hardware/)
    workload/   what a benchmark sends: datasets, request traces, measured results read back
                (uses model only)
    serving/    the serving loop: a benchmark client against continuous-batching dp ranks, the
                engines' schedulers and presets, metrics (uses workload/, hardware/, and step/
                through ``serving/step_time.py`` alone)
    search/     tuning and capacity planning over scenarios (uses the root and serving's
                metrics)

The root holds the composition: ``scenario.py`` (one deployment under one benchmark, what
``predict`` and ``sweep`` run) and ``replay.py`` (a measured benchmark replayed and compared),
which use hardware/, serving/ and workload/. ``tests/project/test_layering.py`` holds these arrows.
"""
