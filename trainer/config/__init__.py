"""The run's configuration: the typed tree (:class:`Config`, one attrs class per section),
loaded from YAML and ``key=value`` overrides and validated before anything starts
(:func:`load_config`, :func:`validate_cfg`), written back (:func:`to_dict`) and described
(:func:`help_text`)."""

from trainer.config._engine import EngineConfig as EngineConfig
from trainer.config._fields import ConfigWarning as ConfigWarning
from trainer.config._load import help_text as help_text
from trainer.config._load import load_config as load_config
from trainer.config._load import to_dict as to_dict
from trainer.config._schema import Config as Config
from trainer.config._schema import DataConfig as DataConfig
from trainer.config._validate import validate_cfg as validate_cfg

__all__ = [
    "Config",
    "ConfigWarning",
    "DataConfig",
    "EngineConfig",
    "help_text",
    "load_config",
    "to_dict",
    "validate_cfg",
]
