"""Contract: every route, body field and answer key that the reference server's weight-update,
control and OpenAI-compatible endpoints accept exists in SGLang 0.5.9 (parsed from its wheel with
ast, never imported; the wheel comes from the fixture of tests/test_sglang_contract.py)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from test_sglang_contract import class_fields, dict_keys, function, routes, sglang_src  # noqa: E402,F401

from moerl.rollout import openai_api, server_routes  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

#: route -> sglang io_struct / protocol request class of its body
BODY_CLASS = {
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/weights_checker": "CheckWeightsReqInput",
    "/start_profile": "ProfileReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
}


@pytest.fixture(scope="module")
def upstream(sglang_src):
    return sglang_src


def _body_keys(func: ast.AST) -> set[str]:
    """String keys read from a request body: ``body.get("k")``, ``body["k"]``, ``"k" in body``."""
    out = set()
    for n in ast.walk(func):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get"
                and isinstance(n.func.value, ast.Name) and n.func.value.id == "body" and n.args
                and isinstance(n.args[0], ast.Constant)):
            out.add(n.args[0].value)
        if (isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == "body"
                and isinstance(n.slice, ast.Constant)):
            out.add(n.slice.value)
    return out


def _handlers(path: str) -> dict[str, ast.AST]:
    """{route path: handler function} of the FastAPI decorators in one moerl module."""
    tree = ast.parse(Path(path).read_text())
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                if (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.args
                        and isinstance(d.args[0], ast.Constant) and isinstance(d.args[0].value, str)):
                    out[d.args[0].value] = node
    return out


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from moerl.rollout.server import ReferenceEngine, create_app
    from moerl.rollout.testing import make_tiny_moe_checkpoint

    path = str(tmp_path_factory.mktemp("contract"))
    make_tiny_moe_checkpoint(path, seed=0)
    engine = ReferenceEngine(path)
    yield create_app(engine)
    engine.close()


def test_every_served_route_exists_upstream(upstream, app):
    upstream_routes = routes(upstream["http_server"]) | routes(upstream["v1_loads"])
    ours = {r.path for r in app.routes if getattr(r, "path", "").startswith("/")
            and not r.path.startswith(("/docs", "/openapi", "/redoc"))}
    assert ours - upstream_routes == set()
    for p in ("/model_info", "/server_info", "/v1/models", "/v1/loads", "/weights_checker", "/start_profile", "/freeze_gc",
              "/stop_profile", "/v1/completions", "/v1/chat/completions"):
        assert p in ours and p in upstream_routes, p


def test_every_body_field_read_exists_upstream(upstream):
    handlers = {**_handlers(str(REPO / "moerl/rollout/server.py")), **_handlers(server_routes.__file__)}
    tree = ast.parse(Path(server_routes.__file__).read_text())
    handlers["/start_profile"] = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "start")
    for route, cls in BODY_CLASS.items():
        fields = class_fields(upstream["io_struct"], cls)
        read = _body_keys(handlers[route])
        assert read, route
        assert read <= fields, (route, sorted(read - fields))
    assert set(server_routes.PROFILE_FIELDS) <= class_fields(upstream["io_struct"], "ProfileReqInput")


def test_openai_fields_exist_upstream(upstream):
    proto = upstream["protocol"]
    comp, chat = class_fields(proto, "CompletionRequest"), class_fields(proto, "ChatCompletionRequest")
    tree = ast.parse(Path(openai_api.__file__).read_text())
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    shared = set()
    for name in ("_sampling", "_common"):
        shared |= _body_keys(funcs[name])
    shared |= set(openai_api._UNSUPPORTED)
    # keys the validation loops check by name (tuples of string constants inside _sampling)
    for n in ast.walk(funcs["_sampling"]):
        if isinstance(n, ast.For) and isinstance(n.iter, ast.Tuple):
            for e in n.iter.elts:
                if isinstance(e, ast.Constant) and isinstance(e.value, str):
                    shared.add(e.value)
                elif isinstance(e, ast.Tuple) and isinstance(e.elts[0], ast.Constant):
                    shared.add(e.elts[0].value)
    assert shared <= comp | chat, sorted(shared - (comp | chat))
    assert (shared - {"stop_token_ids"}) - set(openai_api._UNSUPPORTED) <= comp & chat | {"max_completion_tokens"}
    assert _body_keys(funcs["completion_to_generate"]) <= comp
    assert _body_keys(funcs["chat_to_generate"]) <= chat


def test_answers_use_upstream_keys(upstream, app):
    from fastapi.testclient import TestClient

    proto, io = upstream["protocol"], upstream["io_struct"]
    client = TestClient(app)
    body = client.post("/v1/completions", json={"prompt": "12", "max_tokens": 2, "logprobs": 0}).json()
    assert set(body) <= class_fields(proto, "CompletionResponse")
    assert set(body["choices"][0]) <= class_fields(proto, "CompletionResponseChoice")
    assert set(body["choices"][0]["logprobs"]) <= class_fields(proto, "LogProbs")
    assert set(body["usage"]) <= class_fields(proto, "UsageInfo")
    models = client.get("/v1/models").json()
    assert set(models) <= class_fields(proto, "ModelList")
    assert set(models["data"][0]) <= class_fields(proto, "ModelCard")
    loads = client.get("/v1/loads").json()
    get_loads = function(upstream["v1_loads"], "get_loads")
    assert set(loads) <= dict_keys(get_loads)
    assert set(loads["loads"][0]) <= class_fields(io, "GetLoadsReqOutput") | {"num_total_reqs"}
    assert set(loads["loads"][0]) >= {"num_running_reqs", "num_waiting_reqs", "max_running_requests"}
    assert set(loads["aggregate"]) == dict_keys(function(upstream["v1_loads"], "_compute_aggregate"))
    info_keys = dict_keys(function(upstream["http_server"], "model_info"))
    assert set(client.get("/model_info").json()) <= info_keys
    r = client.post("/weights_checker", json={"action": "snapshot"}).json()
    assert set(r) <= class_fields(io, "CheckWeightsReqOutput")
