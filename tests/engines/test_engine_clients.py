"""Every engine client implements its protocol (engines.types) with the protocol's own
signatures (more only as optional keywords), so callers typed against the protocol never
fall back to ``Any``."""

from __future__ import annotations

import inspect

import pytest

from engines.client import InferenceClient
from engines.local.inprocess import InProcessClient
from engines.types import ControlPlaneClient, EngineClient
from engines.vllm.inprocess import VLLMInProcessEngine
from sync.transfer import routes_of

IMPLEMENTERS = {
    InferenceClient: ControlPlaneClient,
    VLLMInProcessEngine: ControlPlaneClient,
    InProcessClient: EngineClient,
}


def _members(protocol: type) -> list[str]:
    return sorted(
        name
        for klass in protocol.__mro__
        if klass not in (object,) and getattr(klass, "_is_protocol", False)
        for name, value in vars(klass).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))
    )


def _parameters(function: object) -> list[tuple[str, object, object]]:
    signature = inspect.signature(function)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


@pytest.mark.parametrize("client", list(IMPLEMENTERS), ids=lambda c: c.__name__)
def test_a_client_has_every_member_of_its_protocol_with_its_parameters(client: type) -> None:
    protocol = IMPLEMENTERS[client]
    members = _members(protocol)
    assert {"generate", "pause", "sleep", "wake_up"} <= set(members)
    for name in members:
        theirs = getattr(protocol, name)
        assert hasattr(client, name) or name == "urls", f"{client.__name__} lacks {name}"
        if inspect.isfunction(theirs):
            ours, wanted = _parameters(getattr(client, name)), _parameters(theirs)
            assert ours[: len(wanted)] == wanted, f"{client.__name__}.{name}"
            extra = inspect.signature(getattr(client, name)).parameters.values()
            for p in list(extra)[len(wanted) :]:  # more is fine where a caller may omit it
                assert p.kind is p.KEYWORD_ONLY and p.default is not p.empty, (name, p)


def test_only_clients_of_the_control_routes_are_driven_by_the_route_transports() -> None:
    assert _members(ControlPlaneClient) == sorted(
        {*_members(EngineClient), "control", "control_one", "get_world_size"}
    )
    plain = InProcessClient.__new__(InProcessClient)
    with pytest.raises(TypeError, match="InProcessClient takes no control routes"):
        routes_of(plain)
