"""vLLM, both sides: what the trainer runs to start and drive it, and what runs inside it.

The trainer's side, public modules imported by name (``engines.vllm.serve``, ...):

- :mod:`engines.vllm.flags`: the engine's settings as ``vllm serve`` flags, one builder for
  both backends;
- :mod:`engines.vllm.serve`: ``engine.backend=vllm``, the ``vllm serve`` servers the trainer
  starts (their :class:`~engines.launch.ServerSpec`) and what it checks of them;
- :mod:`engines.vllm.inprocess`: ``engine.backend=vllm_inprocess``, vLLM's ``AsyncLLM`` in the
  trainer's process behind the trio-asyncio bridge; :mod:`engines.vllm.async_llm` builds and
  shuts it down off the trio thread; :mod:`engines.vllm.control` maps the control routes to
  ``AsyncLLM``'s methods.

Inside vLLM: this face is the ``vllm.general_plugins`` entry point, kept import-light (vLLM
loads it in its API server, its engine core and every worker, so nothing of the trainer's
side is imported here): :func:`register` names the engine class by module path and nothing
heavier than vLLM's factory is imported until a server is started with
``--weight-transfer-config '{"backend": "gloo"}'`` (:mod:`engines.vllm.gloo_engine`) or
``'{"backend": "disk"}'`` (:mod:`engines.vllm.disk_engine`).
"""

from engines.vllm._plugin import BACKENDS as BACKENDS
from engines.vllm._plugin import BUSY_LOOP_ENV as BUSY_LOOP_ENV
from engines.vllm._plugin import register as register

__all__ = ["BACKENDS", "BUSY_LOOP_ENV", "register"]
