"""The client of the inference engines: data plane and control plane over HTTP.

:class:`InferenceClient` (``generate``, ``generate_n``, and every control route) is one client
for the reference servers and for real ``vllm serve``; it is a :class:`ControlPlane` (one
control request fanned out to every server, bounded by ``control_plane_timeout_s``) with the
data plane added, and both are :class:`ControlRoutes` (the routes as methods, shared with the
in-process vLLM engine). :class:`RetryPolicy` is how a failed connection is retried;
:class:`Rotation` which engines take requests; ``ROUTE_FLAGS`` and :func:`probe` which ``vllm
serve`` flag each route needs; :func:`server_states` what each server says about itself.

Private modules: ``_inference`` (the data plane), ``_control_plane``, ``_route_methods``,
``_requests`` (one request and its failures), ``_rotation``, ``_routes``, ``_server_state``.
"""

from engines.client._control_plane import CONTROL_PLANE_TIMEOUT_ENV as CONTROL_PLANE_TIMEOUT_ENV
from engines.client._control_plane import (
    DEFAULT_CONTROL_PLANE_TIMEOUT_S as DEFAULT_CONTROL_PLANE_TIMEOUT_S,
)
from engines.client._control_plane import ControlPlane as ControlPlane
from engines.client._control_plane import bounded_control as bounded_control
from engines.client._control_plane import (
    resolve_control_plane_timeout as resolve_control_plane_timeout,
)
from engines.client._inference import DATA_CONNECTIONS_PER_SERVER as DATA_CONNECTIONS_PER_SERVER
from engines.client._inference import InferenceClient as InferenceClient
from engines.client._requests import DEFAULT_RETRY as DEFAULT_RETRY
from engines.client._requests import STEP_HEADER as STEP_HEADER
from engines.client._requests import RetryPolicy as RetryPolicy
from engines.client._requests import decode_json as decode_json
from engines.client._rotation import EngineState as EngineState
from engines.client._rotation import Rotation as Rotation
from engines.client._rotation import is_engine_failure as is_engine_failure
from engines.client._route_methods import ControlRoutes as ControlRoutes
from engines.client._route_methods import digests_checksum as digests_checksum
from engines.client._routes import DATA_PLANE_ROUTES as DATA_PLANE_ROUTES
from engines.client._routes import LORA_ROUTES as LORA_ROUTES
from engines.client._routes import PAUSE_ROUTES as PAUSE_ROUTES
from engines.client._routes import ROUTE_FLAGS as ROUTE_FLAGS
from engines.client._routes import SLEEP_ROUTES as SLEEP_ROUTES
from engines.client._routes import WEIGHT_TRANSFER_ROUTES as WEIGHT_TRANSFER_ROUTES
from engines.client._routes import probe as probe
from engines.client._server_state import LAST_CONTROL_CALLS as LAST_CONTROL_CALLS
from engines.client._server_state import server_states as server_states

__all__ = [
    "CONTROL_PLANE_TIMEOUT_ENV",
    "DATA_CONNECTIONS_PER_SERVER",
    "DATA_PLANE_ROUTES",
    "DEFAULT_CONTROL_PLANE_TIMEOUT_S",
    "DEFAULT_RETRY",
    "LAST_CONTROL_CALLS",
    "LORA_ROUTES",
    "PAUSE_ROUTES",
    "ROUTE_FLAGS",
    "SLEEP_ROUTES",
    "STEP_HEADER",
    "WEIGHT_TRANSFER_ROUTES",
    "ControlPlane",
    "ControlRoutes",
    "EngineState",
    "InferenceClient",
    "RetryPolicy",
    "Rotation",
    "bounded_control",
    "decode_json",
    "digests_checksum",
    "is_engine_failure",
    "probe",
    "resolve_control_plane_timeout",
    "server_states",
]
