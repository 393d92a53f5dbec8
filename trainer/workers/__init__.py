"""Policy and reference workers, and the worker groups that run them.

``WorkerGroup`` is what the loop drives; ``LocalWorkerGroup`` runs the workers in threads of
this process (``workers.backend=local``), ``trainer.workers.ray_group.RayWorkerGroup`` as
Ray actors (``workers.backend=ray``; imported only by runs that use Ray).
"""

from trainer.workers.group import WorkerGroup as WorkerGroup
from trainer.workers.local import LocalWorkerGroup as LocalWorkerGroup

__all__ = ["LocalWorkerGroup", "WorkerGroup"]
