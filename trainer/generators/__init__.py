"""The custom generator API (DESIGN 4.7), re-exported from its private modules."""

from trainer.generators.base import EngineClient as EngineClient
from trainer.generators.base import Generator as Generator
from trainer.generators.base import GeneratorInput as GeneratorInput
from trainer.generators.base import GeneratorOutput as GeneratorOutput
from trainer.generators.base import Trajectory as Trajectory
from trainer.generators.base import TrajectoryInput as TrajectoryInput

__all__ = [
    "EngineClient",
    "Generator",
    "GeneratorInput",
    "GeneratorOutput",
    "Trajectory",
    "TrajectoryInput",
]
