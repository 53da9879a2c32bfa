"""The step executors: the program every rank runs, and two ways to run it.

    program.py  ``Program`` (what the compiled step hands over), ``Timeline`` (what comes back),
                the semantics both executors implement, the executor's steps (``LaunchPlan``,
                ``plan_steps``) and the fast, vectorised executor (``run_fast``)
    walk.py     the fast executor's walk, compiled with numba
    exact.py    the exact executor (simpy), every op of every rank (``run_exact``)

Imports ``epsim.model`` only.
"""

from .exact import run_exact
from .program import CATEGORIES, LaunchPlan, Program, Timeline, plan_steps, run_fast

__all__ = ["CATEGORIES", "LaunchPlan", "Program", "Timeline", "plan_steps", "run_exact", "run_fast"]
