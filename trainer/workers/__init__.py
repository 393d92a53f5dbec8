"""Policy and reference workers, and the worker groups that run them.

``trainer.workers.group.WorkerGroup`` is what the loop drives; ``trainer.workers.local``
runs the workers in threads of this process (``workers.backend=local``),
``trainer.workers.ray_group`` as Ray actors (``workers.backend=ray``). Nothing is imported
here: importing the package (for ``trainer.workers.ray_cluster``, say) costs no torch and no Ray.
"""

__all__: list[str] = []
