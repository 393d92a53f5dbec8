"""What a run reports: ``metrics.jsonl`` and the console (:class:`MetricsLogger`,
:class:`StepProgress`), ``train.log``, and the trackers (jsonl, tensorboard, wandb, mlflow).
Plots are :mod:`trainer.metrics.plots` (matplotlib, imported only there)."""

from trainer.metrics._logger import MetricsLogger as MetricsLogger
from trainer.metrics._logger import StepProgress as StepProgress
from trainer.metrics._logger import eval_line as eval_line
from trainer.metrics._logger import jsonable_row as jsonable_row
from trainer.metrics._logger import open_run_log as open_run_log
from trainer.metrics._logger import restore_metrics as restore_metrics
from trainer.metrics._logger import setup_run_logging as setup_run_logging
from trainer.metrics._logger import teardown_run_logging as teardown_run_logging
from trainer.metrics._repeats import RepeatedWarnings as RepeatedWarnings
from trainer.metrics._repeats import end_step as end_step
from trainer.metrics._summary import EVAL_SUMMARY_KEYS as EVAL_SUMMARY_KEYS
from trainer.metrics._summary import MISMATCH_WORST as MISMATCH_WORST
from trainer.metrics._summary import RUN_TOTALS as RUN_TOTALS
from trainer.metrics._summary import eval_summary as eval_summary
from trainer.metrics._summary import mismatch_summary as mismatch_summary
from trainer.metrics._summary import reward_summary as reward_summary
from trainer.metrics._summary import run_totals as run_totals
from trainer.metrics._trackers import TrackerSink as TrackerSink
from trainer.metrics._trackers import open_trackers as open_trackers

__all__ = [
    "EVAL_SUMMARY_KEYS",
    "MISMATCH_WORST",
    "RUN_TOTALS",
    "MetricsLogger",
    "RepeatedWarnings",
    "StepProgress",
    "TrackerSink",
    "end_step",
    "eval_line",
    "eval_summary",
    "jsonable_row",
    "mismatch_summary",
    "open_run_log",
    "open_trackers",
    "restore_metrics",
    "reward_summary",
    "run_totals",
    "setup_run_logging",
    "teardown_run_logging",
]
