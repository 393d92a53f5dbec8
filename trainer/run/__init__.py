"""One training run, assembled: :func:`train` builds every part from its config section (the
run directory, data, engines, workers, weight sync, trackers), runs the loop, and cleans up
within its bounds; Ctrl-C and SIGTERM end it through the same path."""

from trainer.run._train import train as train
from trainer.run._train import with_run_dir as with_run_dir

__all__ = [
    "train",
    "with_run_dir",
]
