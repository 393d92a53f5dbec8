"""The step loop: the strategy (``trainer.strategy``: sync or fully-async) that runs the steps,
the stages of one step, the run context the stages share, and the weight versions the engines
serve. :func:`run_training` is the entry; the assembly of the parts is ``trainer.run``'s."""

from trainer.loop._context import RunContext as RunContext
from trainer.loop._context import Strategy as Strategy
from trainer.loop._engine_recovery import open_engine_recovery as open_engine_recovery
from trainer.loop._kl_in_reward import kl_controller as kl_controller
from trainer.loop._prompt_stream import PromptStream as PromptStream
from trainer.loop._rollout_versions import VersionedEngine as VersionedEngine
from trainer.loop._steps import resync_engines as resync_engines
from trainer.loop._steps import run_training as run_training
from trainer.loop._strategy import FullyAsyncStrategy as FullyAsyncStrategy
from trainer.loop._strategy import SyncStrategy as SyncStrategy
from trainer.loop._strategy import make_strategy as make_strategy
from trainer.loop._versions import WeightVersions as WeightVersions

__all__ = [
    "FullyAsyncStrategy",
    "PromptStream",
    "RunContext",
    "Strategy",
    "SyncStrategy",
    "VersionedEngine",
    "WeightVersions",
    "kl_controller",
    "make_strategy",
    "open_engine_recovery",
    "resync_engines",
    "run_training",
]
