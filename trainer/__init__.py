"""An RL post-training trainer for LLMs whose step loop is written on trio.

Kept import-light on purpose: ``engines`` and ``sync`` import ``trainer.errors`` and
``trainer.deadline``, so this package must not import the loop (or torch) at import time.
"""
