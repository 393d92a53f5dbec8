"""The CPU reference engine: continuous batching over a Hugging Face causal LM."""

from engines.local.engine import EngineAsleepError, LocalEngine, open_local_engine

__all__ = ["EngineAsleepError", "LocalEngine", "open_local_engine"]
