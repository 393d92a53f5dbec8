"""The public names of each ``engines`` module, pinned (httpx's ``test_exported_members`` style).

A name added to or dropped from an ``__all__`` is an API change: update this list with it.
"""

from __future__ import annotations

import importlib

import pytest

PUBLIC_API: dict[str, list[str]] = {
    "engines": ["Completion", "SamplingParams"],
    "engines.bridge": ["Bridge", "open_bridge"],
    "engines.client": [
        "CONTROL_PLANE_TIMEOUT_ENV",
        "ControlPlane",
        "ControlRoutes",
        "DATA_CONNECTIONS_PER_SERVER",
        "DATA_PLANE_ROUTES",
        "DEFAULT_CONTROL_PLANE_TIMEOUT_S",
        "DEFAULT_RETRY",
        "EngineState",
        "InferenceClient",
        "LAST_CONTROL_CALLS",
        "LORA_ROUTES",
        "PAUSE_ROUTES",
        "ROUTE_FLAGS",
        "RetryPolicy",
        "Rotation",
        "SLEEP_ROUTES",
        "STEP_HEADER",
        "WEIGHT_TRANSFER_ROUTES",
        "bounded_control",
        "decode_json",
        "digests_checksum",
        "is_engine_failure",
        "probe",
        "resolve_control_plane_timeout",
        "server_states",
    ],
    "engines.devices": [
        "DEVICES",
        "DTYPES",
        "DeviceName",
        "DtypeName",
        "cuda_unavailable_reason",
        "resolve_device",
        "resolve_dtype",
    ],
    "engines.launch": [
        "API_KEY_ENV",
        "DEFAULT_SHUTDOWN_TIMEOUT_S",
        "DEFAULT_STARTUP_TIMEOUT_S",
        "KILL_WAIT_S",
        "LOG_TAIL_CHARS",
        "READY_PREFIX",
        "READY_RE",
        "WEIGHT_DIR_ENV",
        "WEIGHT_SYNC_HOSTS_ENV",
        "EngineProcess",
        "EngineProcesses",
        "EngineServerActor",
        "EngineUrls",
        "RayEngine",
        "ReferenceServers",
        "ServerSpec",
        "ServersSpec",
        "base_url",
        "launch_local_engines",
        "open_engine_processes",
        "open_ray_engines",
        "ready_line",
        "server_device",
        "server_env",
        "FORK_SERVER_READY",
        "ForkedPopen",
        "ForkedProcess",
        "fork_popen",
        "fork_process",
        "forkable",
        "list_children",
        "new_api_key",
        "ChildProcess",
        "open_child",
    ],
    "engines.launch.parent_death": ["EXIT_ORPHANED", "arm", "armed_signal", "command", "main"],
    "engines.launch.stdin_guard": ["main"],
    "engines.vllm.serve": [
        "DEFAULT_CPU_BUSY_LOOP_S",
        "TOKEN_IN_FLAG",
        "VllmServers",
        "check_server_config",
        "config_problems",
        "cpu_env",
        "gpu_groups",
        "require_vllm",
    ],
    "engines.local": ["EngineAsleepError", "LocalEngine", "open_local_engine"],
    "engines.model_cache": ["LOCK_TIMEOUT_S", "build_directory_atomically"],
    "engines.models": [
        "TINY_MODEL_CONFIG",
        "WORDS",
        "build_tiny_model",
        "load_tokenizer",
        "quiet_transformers",
        "resolve_model_path",
    ],
    "engines.vllm": ["BACKENDS", "BUSY_LOOP_ENV", "register"],
    "engines.process_group": [
        "BACKSTOP_S",
        "GroupBackend",
        "GroupHandle",
        "free_port",
        "join_group",
        "listening_socket",
        "require_cuda",
        "tcp_store",
    ],
    "engines.types": [
        "JSON",
        "Completion",
        "ControlPlaneClient",
        "EngineClient",
        "FinishReason",
        "JSONValue",
        "PauseMode",
        "PromptLogprob",
        "QueryParams",
        "QueryValue",
        "SamplingParams",
        "nth_sample_params",
    ],
    "engines.weight_transfer": [
        "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
        "DEFAULT_PACKED_NUM_BUFFERS",
        "IPC_INIT_FIELDS",
        "IPC_UPDATE_FIELDS",
        "NCCL_INIT_FIELDS",
        "NCCL_UPDATE_FIELDS",
        "dtype_name",
        "ipc_init_info",
        "ipc_update_info",
        "load_ipc_handles",
        "nccl_init_info",
        "packed_chunks",
        "parse_info",
        "pickle_ipc_handles",
        "tensor_update_info",
    ],
    "engines.vllm.inprocess": [
        "VLLM_AVAILABLE",
        "VLLMInProcessEngine",
        "completion_from_output",
        "completions_from_output",
        "open_vllm_inprocess_client",
        "to_vllm_sampling_kwargs",
    ],
    "engines.vllm.control": [
        "PROBE_METHODS",
        "VLLM_ROUTES",
        "VLLM_URL",
        "AsyncLLMLike",
        "Route",
        "VLLMClasses",
        "VLLMOutput",
        "VLLMSample",
        "load_vllm_classes",
        "probe_asyncllm",
    ],
    "engines.vllm.flags": [
        "ENGINE_ARG_FLAGS",
        "MAX_LORA_RANKS",
        "RUNTIME_LORA_ENV",
        "VLLM_SERVE_MODULE",
        "VLLM_TRANSPORTS",
        "VllmSettings",
        "WeightTransferBackend",
        "flag_clashes",
        "max_lora_rank_for",
    ],
    "engines.vllm.async_llm": [
        "DEFAULT_VLLM_SHUTDOWN_TIMEOUT_S",
        "DEFAULT_VLLM_STARTUP_TIMEOUT_S",
        "build_async_llm",
        "open_async_llm",
        "shutdown_async_llm",
    ],
}


@pytest.mark.parametrize("module_name", sorted(PUBLIC_API))
def test_all_is_the_pinned_public_api_and_every_name_exists(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert sorted(module.__all__) == sorted(PUBLIC_API[module_name])
    assert len(set(module.__all__)) == len(module.__all__), "a name listed twice"
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{module_name}.__all__ names what it does not define: {missing}"
    for name in module.__all__:
        assert not name.startswith("_"), f"{module_name}.__all__ exports a private name {name}"


def test_the_route_methods_are_written_once_for_both_control_planes() -> None:
    """HTTP's ``ControlPlane`` and the in-process vLLM engine take the routes from one class."""
    from engines.client import ControlPlane, ControlRoutes, InferenceClient
    from engines.vllm.inprocess import VLLMInProcessEngine

    routes = (
        "pause",
        "resume",
        "sleep",
        "wake_up",
        "is_paused",
        "is_sleeping",
        "reset_prefix_cache",
    )
    for cls in (ControlPlane, InferenceClient, VLLMInProcessEngine):
        assert issubclass(cls, ControlRoutes)
        for name in routes:
            assert getattr(cls, name) is getattr(ControlRoutes, name), f"{cls.__name__}.{name}"
