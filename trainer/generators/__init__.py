"""The custom generator API (DESIGN 4.7), re-exported from its private modules."""

from trainer.generators.agent_loop import AgentLoopGenerator as AgentLoopGenerator
from trainer.generators.agent_loop import EnvStep as EnvStep
from trainer.generators.base import EngineClient as EngineClient
from trainer.generators.base import Generator as Generator
from trainer.generators.base import GeneratorInput as GeneratorInput
from trainer.generators.base import GeneratorOutput as GeneratorOutput
from trainer.generators.base import Trajectory as Trajectory
from trainer.generators.base import TrajectoryInput as TrajectoryInput

__all__ = [
    "AgentLoopGenerator",
    "EngineClient",
    "EnvStep",
    "Generator",
    "GeneratorInput",
    "GeneratorOutput",
    "Trajectory",
    "TrajectoryInput",
]
