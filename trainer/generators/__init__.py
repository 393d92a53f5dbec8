"""The custom generator API (DESIGN 4.7), re-exported from its private modules."""

from trainer.generators._base import EngineClient as EngineClient
from trainer.generators._base import Generator as Generator
from trainer.generators._base import GeneratorInput as GeneratorInput
from trainer.generators._base import GeneratorOutput as GeneratorOutput
from trainer.generators._base import Trajectory as Trajectory
from trainer.generators._base import TrajectoryInput as TrajectoryInput
from trainer.generators._base import check_generator_kwargs as check_generator_kwargs
from trainer.generators.agent_loop import AgentLoopGenerator as AgentLoopGenerator
from trainer.generators.agent_loop import EnvStep as EnvStep

__all__ = [
    "AgentLoopGenerator",
    "EngineClient",
    "EnvStep",
    "Generator",
    "GeneratorInput",
    "GeneratorOutput",
    "Trajectory",
    "TrajectoryInput",
    "check_generator_kwargs",
]
