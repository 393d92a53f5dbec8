"""An RL post-training trainer for LLMs whose step loop is written on trio.

Kept import-light on purpose: ``engines`` and ``sync`` import ``trainer.vocabulary`` and
``trainer.errors``, so this package imports nothing (not the loop, not torch) when imported.
Start at ``trainer.loop._steps`` (the run, step by step) and ``trainer.vocabulary`` (deadlines,
stages and operations, faults).
"""

__all__: list[str] = []
