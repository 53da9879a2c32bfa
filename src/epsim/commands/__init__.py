"""The ``epsim`` subcommands, one module each (``add_parser(subparsers)`` and ``run(args)``).

Add a command by writing its module and naming it here; ``epsim.cli`` does the rest.
"""

COMMANDS: tuple[str, ...] = (
    "describe",
    "step",
    "run",
    "balance",
    "predict",
    "sweep",
    "tune",
    "plan",
    "calibrate",
    "validate",
)
