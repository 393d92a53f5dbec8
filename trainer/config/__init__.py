"""The run's configuration: the typed tree (:class:`Config`, one attrs class per section),
loaded from YAML and ``key=value`` overrides and validated before anything starts
(:func:`load_config`, :func:`validate_cfg`), planned (:class:`RunPlan`: every decision
the run acts on, made once), written back (:func:`to_dict`) and described
(:func:`help_text`)."""

from trainer.config._config import Config as Config
from trainer.config._cov import loss_options as loss_options
from trainer.config._engine import EngineConfig as EngineConfig
from trainer.config._fields import ConfigWarning as ConfigWarning
from trainer.config._load import help_text as help_text
from trainer.config._load import load_config as load_config
from trainer.config._load import to_dict as to_dict
from trainer.config._plan import ROLLOUT_LOGPROBS_MODE as ROLLOUT_LOGPROBS_MODE
from trainer.config._plan import CpuThreads as CpuThreads
from trainer.config._plan import EngineBackend as EngineBackend
from trainer.config._plan import EnginePlacement as EnginePlacement
from trainer.config._plan import RoleDevice as RoleDevice
from trainer.config._plan import RunPlan as RunPlan
from trainer.config._plan import Strategy as Strategy
from trainer.config._plan import Timeouts as Timeouts
from trainer.config._plan import WorkerBackend as WorkerBackend
from trainer.config._plan import cpu_threads as cpu_threads
from trainer.config._plan import plan_run as plan_run
from trainer.config._schema import DataConfig as DataConfig
from trainer.config._serve import TINY_MODEL_NAME as TINY_MODEL_NAME
from trainer.config._serve import ServeConfig as ServeConfig
from trainer.config._validate import validate_cfg as validate_cfg

__all__ = [
    "ROLLOUT_LOGPROBS_MODE",
    "TINY_MODEL_NAME",
    "Config",
    "ConfigWarning",
    "CpuThreads",
    "DataConfig",
    "EngineBackend",
    "EngineConfig",
    "EnginePlacement",
    "RoleDevice",
    "RunPlan",
    "ServeConfig",
    "Strategy",
    "Timeouts",
    "WorkerBackend",
    "cpu_threads",
    "help_text",
    "load_config",
    "loss_options",
    "plan_run",
    "to_dict",
    "validate_cfg",
]
