"""What the project runs inside real vLLM: its ``vllm.general_plugins`` entry point.

Kept import-light: vLLM loads the entry point in its API server, its engine core and every
worker, so :func:`register` names the engine class by module path and nothing heavier than
vLLM's factory is imported until a server is started with ``--weight-transfer-config
'{"backend": "gloo"}'`` (:mod:`engines.vllm.gloo_engine`) or ``'{"backend": "disk"}'``
(:mod:`engines.vllm.disk_engine`).
"""

from engines.vllm._plugin import BACKENDS as BACKENDS
from engines.vllm._plugin import BUSY_LOOP_ENV as BUSY_LOOP_ENV
from engines.vllm._plugin import register as register

__all__ = ["BACKENDS", "BUSY_LOOP_ENV", "register"]
