"""epsim's front door: the ``epsim`` console script and ``python -m epsim``.

It parses arguments, calls ``model``, ``sim``, ``runtime`` and ``calibrate``, and prints tables or
``--json``. It has no logic of its own.
"""

__version__ = "0.1.0"
