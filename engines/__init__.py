"""Inference engines and the client that drives them over vLLM's HTTP protocol."""

from engines.types import Completion, SamplingParams

__all__ = ["Completion", "SamplingParams"]
