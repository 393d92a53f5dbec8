"""Write ``vllm_routes.json``: the HTTP routes the trainer calls on ``vllm serve``, as vLLM declares them.

``tests/engines/test_vllm_route_conformance.py`` checks every request the trainer sends (and
the reference server's answers to the control routes) against this file, so it runs where
vLLM is not importable (CI, CPU machines). Regenerate it whenever the vLLM we follow changes.

What is dumped, from vLLM's own router objects (no engine: the routes are only declared):

- ``openapi``: ``app.openapi()`` of a FastAPI app that includes exactly the routers of
  :data:`ROUTERS` (the OpenAI completions, chat and models routes, ``/health``, the RL
  routes of ``VLLM_SERVER_DEV_MODE=1``, and the dev sleep and cache routes): every path and
  method, each query parameter with its schema, each request-body schema.
- ``raw_query_params``: query parameters a route reads from the raw request instead of
  declaring them (``/wake_up`` reads ``tags`` with ``query_params.getlist``), parsed out
  of the router source with :mod:`ast`; ``"getlist"`` means repeatable, ``"get"`` one value.
- ``responses``: the JSON object each route answers 200 with, where the router writes it
  as a literal (``JSONResponse(content={"status": "paused"})``): its keys and the JSON
  types of each value, parsed with :mod:`ast`. A value that is not a literal is typed from
  what the source says of it: a parameter's or an assignment's annotation, or the return
  annotation of the engine method (``EngineClient``) or config attribute (``ParallelConfig``)
  it comes from. A route with several 200 answers (``/weight_checker``: one per action)
  lists each; ``Response(status_code=200)`` is an empty body (``null``). Error answers
  (other status codes, ``HTTPException``) are not dumped.

How it was run (vLLM 0.33.0 on a CPU machine, nothing installed into the project's venv: the
same ``/tmp/vllm_site`` as ``dump_vllm_shapes.py``, which lists what was pip-installed there,
plus ``orjson``, which the completions router imports and that list lacks, installed beside
it; fastapi 0.165.0 came from ``/tmp/vllm_site``, pydantic from the project's venv; only the
router modules and what they import are loaded, which works without a GPU, in about 15 s)::

    pip install --no-deps --target /tmp/vllm_routes_extra orjson
    PYTHONPATH=/tmp/vllm_site:/tmp/vllm_routes_extra .venv/bin/python \\
        tests/engines/vllm_recorded/dump_vllm_routes.py

With vLLM installed normally, the last line alone (without ``PYTHONPATH``) does it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import textwrap
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("vllm_routes.json")

#: The router modules whose ``router`` the app includes (vLLM 0.33.0's paths).
ROUTERS = (
    "vllm.entrypoints.openai.completion.api_router",
    "vllm.entrypoints.openai.chat_completion.api_router",
    "vllm.entrypoints.openai.models.api_router",
    "vllm.entrypoints.serve.instrumentator.health",
    "vllm.entrypoints.rl.online.api_router",
    "vllm.entrypoints.serve.dev.sleep.api_router",
    "vllm.entrypoints.serve.dev.cache.api_router",
)

_SCALARS = {
    "bool": "boolean",
    "int": "integer",
    "float": "number",
    "str": "string",
    "None": "null",
    "NoneType": "null",
    "list": "array",
    "tuple": "array",
    "dict": "object",
}


def _split_top(text: str, sep: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == sep and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [*parts, current]


def annotation_types(annotation: Any) -> list[str]:
    """JSON types of a Python annotation (a type or its source text): ``"int | None"`` ->
    ``["integer", "null"]``; ``Annotated[X, ...]`` is ``X``. ``ValueError`` when unknown."""
    if isinstance(annotation, type):
        text = annotation.__name__
    elif isinstance(annotation, str):
        text = annotation
    else:
        text = repr(annotation).replace("typing.", "")
    out: list[str] = []
    for part in _split_top(text.replace(" ", ""), "|"):
        head, _, rest = part.partition("[")
        if head == "Annotated":
            out += annotation_types(_split_top(rest[:-1], ",")[0])
        elif head == "Optional":
            out += [*annotation_types(rest[:-1]), "null"]
        elif head in _SCALARS:
            out.append(_SCALARS[head])
        else:
            raise ValueError(f"no JSON type for annotation {text!r}")
    return sorted(set(out))


def _classes_reached() -> tuple[type, ...]:
    """Where a route's values come from: the engine client and the parallel config."""
    from vllm.config import ParallelConfig
    from vllm.engine.protocol import EngineClient

    return (EngineClient, ParallelConfig)


def _member_types(attr: str) -> list[str]:
    """JSON types of ``attr`` of the first class in :func:`_classes_reached` that has it:
    a method's or property's return annotation, or a field's annotation."""
    for cls in _classes_reached():
        try:
            member = inspect.getattr_static(cls, attr)
        except AttributeError:
            continue
        if isinstance(member, property):
            member = member.fget
        if callable(member):
            return annotation_types(inspect.signature(member).return_annotation)
        for klass in cls.__mro__:
            if attr in getattr(klass, "__annotations__", {}):
                return annotation_types(klass.__annotations__[attr])
    raise ValueError(f"{attr!r} is on none of {_classes_reached()}")


class _Typer:
    """JSON types of an expression in one route function, from its source."""

    def __init__(self, fn: ast.AsyncFunctionDef | ast.FunctionDef) -> None:
        self.fn = fn
        self.params = {a.arg: a.annotation for a in fn.args.args if a.annotation is not None}

    def assigned(self, name: str) -> list[list[str]]:
        """The JSON types of every value (or annotation) assigned to ``name`` in the function."""
        found: list[list[str]] = []
        for node in ast.walk(self.fn):
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
                found.append(annotation_types(ast.unparse(node.annotation)))
            elif isinstance(node, ast.Assign | ast.NamedExpr):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(getattr(t, "id", None) == name for t in targets):
                    found.append(self.types(node.value))
        return found

    def types(self, node: ast.expr) -> list[str]:
        match node:
            case ast.Constant(value=value):
                return annotation_types(type(value).__name__)
            case ast.JoinedStr():
                return ["string"]
            case ast.Dict() | ast.DictComp():
                return ["object"]
            case ast.List() | ast.ListComp() | ast.Tuple():
                return ["array"]
            case ast.UnaryOp(op=ast.Not()) | ast.Compare():
                return ["boolean"]
            case ast.IfExp(body=body, orelse=orelse):
                return sorted(set(self.types(body)) | set(self.types(orelse)))
            case ast.Await(value=value):
                return self.types(value)
            case ast.Call(func=ast.Name(id=("bool" | "int" | "str" | "len") as f)):
                return ["boolean"] if f == "bool" else ["string"] if f == "str" else ["integer"]
            case ast.Call(func=ast.Name(id="sorted" | "list")):
                return ["array"]
            case ast.Call(func=ast.Attribute(attr="getlist")):
                return ["array"]
            case ast.Call(func=ast.Attribute(attr=attr)) | ast.Attribute(attr=attr):
                return _member_types(attr)
            case ast.Name(id=name) if name in self.params:
                return annotation_types(ast.unparse(self.params[name]))
            case ast.Name(id=name):
                found = sorted({t for types in self.assigned(name) for t in types})
                if not found:
                    raise ValueError(f"{self.fn.name}: {name!r} is never assigned")
                return found
        raise ValueError(f"{self.fn.name}: cannot type {ast.unparse(node)!r}")


def _route_of(fn: ast.AsyncFunctionDef | ast.FunctionDef) -> tuple[str, str] | None:
    """``("POST", "/pause")`` for a function decorated ``@router.post("/pause", ...)``."""
    for deco in fn.decorator_list:
        if (
            isinstance(deco, ast.Call)
            and isinstance(deco.func, ast.Attribute)
            and deco.func.attr in ("get", "post", "put", "delete", "patch")
            and deco.args
            and isinstance(deco.args[0], ast.Constant)
        ):
            return deco.func.attr.upper(), deco.args[0].value
    return None


def _is_200(call: ast.Call) -> bool:
    for kw in call.keywords:
        if kw.arg == "status_code":
            code = ast.unparse(kw.value)
            return code in ("200", "HTTPStatus.OK.value", "HTTPStatus.OK")
    return True


def parse_router_source(source: str) -> dict[str, dict[str, Any]]:
    """Per ``"METHOD /path"``: the raw query params it reads and its 200 JSON answers."""
    out: dict[str, dict[str, Any]] = {}
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        route = _route_of(fn)
        if route is None:
            continue
        typer = _Typer(fn)
        raw_query: dict[str, str] = {}
        answers: list[dict[str, list[str]] | None] = []
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr in ("get", "getlist")
                and isinstance(func.value, ast.Attribute)
                and func.value.attr == "query_params"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                raw_query[node.args[0].value] = func.attr
            name = getattr(func, "id", None)
            if name in ("JSONResponse", "Response") and _is_200(node):
                content = next((kw.value for kw in node.keywords if kw.arg == "content"), None)
                answer = None
                if isinstance(content, ast.Dict) and name == "JSONResponse":
                    answer = {
                        ast.literal_eval(k): typer.types(v)
                        for k, v in zip(content.keys, content.values)
                        if k is not None
                    }
                elif name == "JSONResponse" and content is not None:
                    continue  # not a literal object (a pydantic model_dump: the route's schema)
                if answer not in answers:
                    answers.append(answer)
        out[f"{route[0]} {route[1]}"] = {"raw_query_params": raw_query, "responses": answers}
    return out


def vllm_routes() -> dict[str, Any]:
    """The dump of the installed vLLM, as written to ``vllm_routes.json``."""
    import vllm
    from fastapi import FastAPI

    app = FastAPI()
    raw_query: dict[str, dict[str, str]] = {}
    responses: dict[str, list[dict[str, list[str]] | None]] = {}
    routers: dict[str, list[str]] = {}
    for module_name in ROUTERS:
        module = importlib.import_module(module_name)
        app.include_router(module.router)
        parsed = parse_router_source(textwrap.dedent(inspect.getsource(module)))
        routers[module_name] = sorted(parsed)
        for route, info in parsed.items():
            if info["raw_query_params"]:
                raw_query[route] = info["raw_query_params"]
            if info["responses"]:
                responses[route] = info["responses"]
    return {
        "vllm_version": vllm.__version__,
        "routers": routers,
        "raw_query_params": raw_query,
        "responses": responses,
        "openapi": app.openapi(),
    }


def main() -> None:
    OUT.write_text(json.dumps(vllm_routes(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
