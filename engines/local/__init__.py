"""The CPU reference engine: continuous batching over a Hugging Face causal LM."""

from engines.local.engine import LocalEngine, open_local_engine
from engines.local.requests import EngineAsleepError

__all__ = ["EngineAsleepError", "LocalEngine", "open_local_engine"]
