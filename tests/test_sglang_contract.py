"""Contract tests: every SGLang / sglang-router field, endpoint and flag moerl uses exists upstream.

The reference is the source of the SGLang release moerl pins (moerl.rollout.client.SGLANG_VERSION),
fetched as a wheel with ``pip download --no-deps`` (cached in $MOERL_WHEEL_CACHE, default
<tmp>/moerl_wheel_cache) and PARSED with ast, never installed or imported (SGLang needs CUDA):
io_struct.py (request classes), http_server.py (routes, /model_info keys), sampling_params.py,
tokenizer_manager.py (response and meta_info keys), schedule_batch.py (finish_reason keys),
server_args.py (launch flags). sglang-router's flags come from the installed sglang_router package's
own argparse. moerl's side comes from the declared lists in moerl.rollout.client, and a scan of
moerl's rollout code checks that it uses nothing outside those lists (so the lists cannot drift).
Skipped, with the reason, only when the wheel cannot be downloaded.
"""

from __future__ import annotations

import ast
import re
import zipfile
from pathlib import Path

import pytest

from moerl.rollout import client as api

REPO = Path(__file__).resolve().parents[1]
_FILES = {
    "io_struct": "sglang/srt/managers/io_struct.py",
    "http_server": "sglang/srt/entrypoints/http_server.py",
    "sampling_params": "sglang/srt/sampling/sampling_params.py",
    "tokenizer_manager": "sglang/srt/managers/tokenizer_manager.py",
    "schedule_batch": "sglang/srt/managers/schedule_batch.py",
    "server_args": "sglang/srt/server_args.py",
    "protocol": "sglang/srt/entrypoints/openai/protocol.py",
    "v1_loads": "sglang/srt/entrypoints/v1_loads.py",  # its APIRouter is included into http_server's app
}


@pytest.fixture(scope="module")
def sglang_src() -> dict[str, ast.Module]:
    """{short name: parsed module} of the pinned SGLang wheel."""
    from _wheels import cached_wheel

    with zipfile.ZipFile(cached_wheel("sglang", api.SGLANG_VERSION, "sglang")) as zf:
        return {k: ast.parse(zf.read(p).decode()) for k, p in _FILES.items()}


# ----------------------------------------------------------------------------- parsers of sglang source


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def class_fields(tree: ast.Module, name: str) -> set[str]:
    """Annotated fields of class ``name`` and of its bases defined in the same module."""
    classes = _classes(tree)
    if name not in classes:
        raise KeyError(f"class {name} not in sglang's io_struct.py")
    out: set[str] = set()
    stack = [classes[name]]
    while stack:
        c = stack.pop()
        out |= {n.target.id for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        stack += [classes[b.id] for b in c.bases if isinstance(b, ast.Name) and b.id in classes]
    return out


def routes(tree: ast.Module) -> set[str]:
    """Paths of @<app or router>.get/post/put/api_route decorators."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                if (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                        and d.func.attr in ("get", "post", "put", "api_route") and d.args
                        and isinstance(d.args[0], ast.Constant) and isinstance(d.args[0].value, str)):
                    out.add(d.args[0].value)
    return out


def function(tree: ast.Module, name: str):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise KeyError(name)


def dict_keys(node: ast.AST) -> set[str]:
    """String keys of every dict literal and of every ``x["key"] = ...`` under ``node``."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Dict):
            out |= {k.value for k in n.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str):
                    out.add(t.slice.value)
    return out


def response_keys(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(top-level keys of /generate response dicts: dict literals holding "meta_info";
    meta_info keys: the dict literal assigned to ``meta_info``, ``meta_info.update({...})`` and every
    ``meta_info["k"] = ...``)."""
    top, meta = set(), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Dict):
            keys = {k.value for k in n.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            if "meta_info" in keys:
                top |= keys
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "update"
                and isinstance(n.func.value, ast.Name) and n.func.value.id == "meta_info" and n.args):
            meta |= dict_keys(n.args[0])
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id == "meta_info" and isinstance(n.value, ast.Dict):
                    meta |= dict_keys(n.value)
                if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == "meta_info"
                        and isinstance(t.slice, ast.Constant)):
                    meta.add(t.slice.value)
    return top, meta


def subscript_keys(node: ast.AST, var: str) -> set[str]:
    """Keys of every ``var["key"] = ...`` under ``node``."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == var
                        and isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str)):
                    out.add(t.slice.value)
    return out


def init_defaults(tree: ast.Module, cls: str) -> dict:
    """{argument: literal default} of ``cls.__init__`` (non-literal defaults are left out)."""
    init = next(n for n in _classes(tree)[cls].body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args.args[len(init.args.args) - len(init.args.defaults):]
    out = {}
    for a, d in zip(args, init.args.defaults):
        try:
            out[a.arg] = ast.literal_eval(d)
        except ValueError:
            pass
    return out


def server_flags(tree: ast.Module) -> dict[str, bool]:
    """{--flag: takes_no_value} of every parser.add_argument in server_args.py."""
    out = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument":
            names = [a.value for a in n.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
            action = next((k.value.value for k in n.keywords if k.arg == "action" and isinstance(k.value, ast.Constant)),
                          None)
            for f in names:
                out[f] = action in ("store_true", "store_false")
    return out


# ----------------------------------------------------------------------------- request side


def test_generate_and_sampling_fields_exist(sglang_src):
    gen = class_fields(sglang_src["io_struct"], "GenerateReqInput")
    assert api.GENERATE_REQUEST_FIELDS <= gen, sorted(api.GENERATE_REQUEST_FIELDS - gen)
    init = function(sglang_src["sampling_params"], "__init__")
    sp = {a.arg for a in init.args.args + init.args.kwonlyargs} - {"self"}
    assert "sampling_seed" in sp and "temperature" in sp
    assert api.SAMPLING_PARAM_FIELDS <= sp, sorted(api.SAMPLING_PARAM_FIELDS - sp)


def test_every_endpoint_and_its_fields_exist(sglang_src):
    paths = routes(sglang_src["http_server"])
    assert "/generate" in paths and "/update_weights_from_disk" in paths  # the parser works
    for path, (cls, fields) in api.SGLANG_ENDPOINTS.items():
        assert path in paths, f"{path} is not an endpoint of sglang {api.SGLANG_VERSION}"
        if cls is not None:
            have = class_fields(sglang_src["io_struct"], cls)
            assert fields <= have, f"{path}: {sorted(fields - have)} not in sglang {cls}"
    with pytest.raises(KeyError):
        class_fields(sglang_src["io_struct"], "NoSuchReqInput")


# ----------------------------------------------------------------------------- response side


def test_response_fields_exist(sglang_src):
    top, meta = response_keys(sglang_src["tokenizer_manager"])
    assert {"text", "output_ids", "meta_info"} <= top and {"id", "finish_reason"} <= meta  # the parser works
    assert api.GENERATE_RESPONSE_FIELDS <= top, sorted(api.GENERATE_RESPONSE_FIELDS - top)
    assert api.META_INFO_FIELDS <= meta, sorted(api.META_INFO_FIELDS - meta)
    finish = set()
    for n in ast.walk(sglang_src["schedule_batch"]):
        if isinstance(n, ast.FunctionDef) and n.name == "to_json":
            finish |= dict_keys(n)
    assert api.FINISH_REASON_FIELDS <= finish, sorted(api.FINISH_REASON_FIELDS - finish)
    model_info = dict_keys(function(sglang_src["http_server"], "model_info"))
    assert api.MODEL_INFO_FIELDS <= model_info, sorted(api.MODEL_INFO_FIELDS - model_info)
    out = class_fields(sglang_src["io_struct"], "UpdateWeightFromDiskReqOutput")
    assert api.UPDATE_RESPONSE_FIELDS <= out


def _literal_default(tree: ast.Module, cls: str, field: str) -> tuple[tuple, object]:
    """(values of ``field: Literal[...]``, its default) in class ``cls``."""
    for n in _classes(tree)[cls].body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == field:
            ann = n.annotation
            assert isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) == "Literal", ast.dump(ann)
            elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
            return tuple(e.value for e in elts), (n.value.value if isinstance(n.value, ast.Constant) else None)
    raise KeyError(f"{cls}.{field}")


def _response_content(tree: ast.Module, func: str) -> dict:
    """The constant ``content={...}`` dict an http_server endpoint answers with."""
    for n in ast.walk(function(tree, func)):
        if isinstance(n, ast.keyword) and n.arg == "content" and isinstance(n.value, ast.Dict):
            return {k.value: v.value for k, v in zip(n.value.keys, n.value.values)
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    raise KeyError(f"no content={{...}} in {func}")


def test_pause_and_continue_generation_contract(sglang_src):
    """/pause_generation's ``mode`` takes exactly moerl's PAUSE_MODES (default "abort"),
    /continue_generation has no field of its own (moerl sends {}), and both answer the
    {"message", "status"} moerl declares."""
    io = sglang_src["io_struct"]
    modes, default = _literal_default(io, "PauseGenerationReqInput", "mode")
    assert modes == api.PAUSE_MODES and default == api.DEFAULT_PAUSE_MODE == "abort"
    assert api.SGLANG_ENDPOINTS["/pause_generation"] == ("PauseGenerationReqInput", frozenset({"mode"}))
    assert api.SGLANG_ENDPOINTS["/continue_generation"] == ("ContinueGenerationReqInput", frozenset())
    for func, cls in (("pause_generation", "PauseGenerationReqInput"), ("continue_generation",
                                                                        "ContinueGenerationReqInput")):
        # FastAPI reads the request class from the body: SGLang needs a JSON body (moerl sends one)
        annotations = {ast.unparse(a.annotation) for a in function(sglang_src["http_server"], func).args.args
                       if a.annotation is not None}
        assert any(cls in a for a in annotations), (func, annotations)
    assert class_fields(io, "ContinueGenerationReqInput") == class_fields(io, "BaseReq")
    for func in ("pause_generation", "continue_generation"):
        content = _response_content(sglang_src["http_server"], func)
        assert set(content) == api.PAUSE_RESPONSE_FIELDS and content["status"] == "ok", content
    # abort mode is handled by the tokenizer manager (abort_all until idle), the others by the scheduler
    tm = function(sglang_src["tokenizer_manager"], "pause_generation")
    assert any(isinstance(n, ast.Constant) and n.value == "abort" for n in ast.walk(tm))
    assert "abort_request" in {n.attr for n in ast.walk(tm) if isinstance(n, ast.Attribute)}


# ----------------------------------------------------------------------------- moerl's code stays inside the lists

_SCANNED = ["moerl/rollout/client.py", "moerl/rollout/weight_sync.py", "moerl/rollout/launcher.py",
            "moerl/rollout/sglang_launcher.py", "moerl/rollout/placement.py", "moerl/train/rollout.py",
            "moerl/rollout/manager.py"]
_PATH_RE = re.compile(r"^/[a-z_]+(/\{[a-z_]+\})?$")


def _declared_fields() -> set[str]:
    out = set(api.SAMPLING_PARAM_FIELDS | api.GENERATE_RESPONSE_FIELDS | api.META_INFO_FIELDS
              | api.FINISH_REASON_FIELDS | api.UPDATE_RESPONSE_FIELDS | api.MODEL_INFO_FIELDS)
    for _, fields in api.SGLANG_ENDPOINTS.values():
        out |= fields
    return out


def _request_field_names() -> set[str]:
    out = set(api.GENERATE_REQUEST_FIELDS)
    for _, fields in api.SGLANG_ENDPOINTS.values():
        out |= fields
    # sampling_params literals are recognised by these keys
    return (out - {"rid"}) | {"temperature", "max_new_tokens", "sampling_seed", "stop_token_ids"}


def test_moerl_rollout_code_uses_only_declared_endpoints_and_fields():
    """Endpoint paths and request-payload keys in moerl's rollout code are all declared."""
    declared = _declared_fields()
    request_keys = _request_field_names()
    endpoints = set(api.SGLANG_ENDPOINTS) | set(api.ROUTER_ENDPOINTS)
    seen_paths, payloads = set(), 0
    for rel in _SCANNED:
        path = REPO / rel
        if not path.exists():
            continue
        tree = ast.parse(path.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and _PATH_RE.match(n.value):
                seen_paths.add(n.value)
                assert n.value in endpoints, f"{rel}: endpoint {n.value} is not in moerl's SGLang contract"
            keys = None
            if isinstance(n, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in n.keys):
                keys = {k.value for k in n.keys}
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "dict":
                keys = {k.arg for k in n.keywords if k.arg}
            if keys and keys & request_keys:  # a request payload (or sampling params) literal
                payloads += 1
                undeclared = keys - declared
                assert not undeclared, f"{rel}: payload keys {sorted(undeclared)} are not in moerl's SGLang contract"
    assert "/generate" in seen_paths and payloads >= 3  # the scan found moerl's requests


def test_reference_server_implements_only_sglang_names(sglang_src, tmp_path):
    """The CPU reference server accepts SGLang's names and answers with SGLang's keys."""
    from moerl.rollout import server as ref
    from moerl.rollout.testing import make_tiny_moe_checkpoint

    gen = class_fields(sglang_src["io_struct"], "GenerateReqInput")
    implemented = set(ref._REQUEST_KEYS) | set(ref._REQUEST_NOOP)
    assert implemented <= gen, sorted(implemented - gen)
    init = function(sglang_src["sampling_params"], "__init__")
    sp = {a.arg for a in init.args.args} - {"self"}
    sp_impl = set(ref._SAMPLING_DEFAULTS) | set(ref._SAMPLING_NOOP)
    assert sp_impl <= sp, sorted(sp_impl - sp)

    make_tiny_moe_checkpoint(str(tmp_path), seed=0)
    engine = ref.ReferenceEngine(str(tmp_path))
    try:
        app = ref.create_app(engine)
        ours = {r.path for r in app.routes if getattr(r, "path", "").startswith("/")
                and not r.path.startswith(("/docs", "/openapi", "/redoc"))}
        upstream = routes(sglang_src["http_server"]) | routes(sglang_src["v1_loads"])
        assert ours - upstream == set(), f"reference-server endpoints missing in sglang: {sorted(ours - upstream)}"
        out = engine.generate({"input_ids": [4, 5, 6], "return_logprob": True, "rid": "x",
                               "sampling_params": {"max_new_tokens": 3, "sampling_seed": 1}})
        from fastapi.testclient import TestClient

        client = TestClient(app)
        for path, func, body in (("/pause_generation", "pause_generation", {"mode": "retract"}),
                                 ("/continue_generation", "continue_generation", {})):
            r = client.post(path, json=body)  # the very answer SGLang gives
            assert r.status_code == 200 and r.json() == _response_content(sglang_src["http_server"], func)
    finally:
        engine.close()
    top, meta = response_keys(sglang_src["tokenizer_manager"])
    assert set(out) <= top, set(out) - top
    assert set(out["meta_info"]) <= meta, set(out["meta_info"]) - meta
    assert set(out["meta_info"]["finish_reason"]) <= api.FINISH_REASON_FIELDS


def test_generate_fields_served_are_sglang_fields(sglang_src, tmp_path):
    """Every /generate field the reference server accepts and every key it answers with (meta_info
    with all log-prob options, stream chunks with "index", finish reasons of stop strings) exists in
    sglang's io_struct.py / sampling_params.py / tokenizer_manager.py / schedule_batch.py, and the
    sampling defaults are SGLang's: the server cannot drift from SGLang unseen."""
    from moerl.rollout import engine as eng
    from moerl.rollout.testing import make_tiny_moe_checkpoint

    gen = class_fields(sglang_src["io_struct"], "GenerateReqInput")
    assert set(eng._REQUEST_KEYS) <= gen, sorted(set(eng._REQUEST_KEYS) - gen)
    assert {"stream", "logprob_start_len", "top_logprobs_num", "token_ids_logprob"} <= set(eng._REQUEST_KEYS)
    defaults = init_defaults(sglang_src["sampling_params"], "SamplingParams")
    for key, value in eng._SAMPLING_DEFAULTS.items():
        assert key in defaults and defaults[key] == value, (key, value, defaults.get(key))
    assert {"stop", "frequency_penalty", "presence_penalty", "repetition_penalty"} <= set(eng._SAMPLING_DEFAULTS)
    top, meta = response_keys(sglang_src["tokenizer_manager"])
    assert eng.META_INFO_KEYS <= meta, sorted(eng.META_INFO_KEYS - meta)
    chunk_top = top | subscript_keys(function(sglang_src["tokenizer_manager"], "_handle_batch_request"), "result")
    assert "index" in chunk_top

    make_tiny_moe_checkpoint(str(tmp_path), seed=0)
    engine = eng.ReferenceEngine(str(tmp_path))
    try:
        from fastapi.testclient import TestClient

        from moerl.rollout.server import create_app

        body = {"input_ids": [[4, 5, 6], [7, 8, 9]], "return_logprob": True, "logprob_start_len": 0,
                "top_logprobs_num": 2, "token_ids_logprob": [4], "return_text_in_logprobs": True,
                "return_routed_experts": True, "rid": "c",
                "sampling_params": {"max_new_tokens": 4, "sampling_seed": 1, "stop": ["zz"],
                                    "frequency_penalty": 0.1, "presence_penalty": 0.1, "repetition_penalty": 1.0}}
        outs = engine.generate(body)
        for out in outs:
            assert set(out) <= top and set(out["meta_info"]) == eng.META_INFO_KEYS, set(out["meta_info"])
        r = TestClient(create_app(engine)).post("/generate", json={**body, "stream": True})
        import json

        chunks = [json.loads(b[6:]) for b in r.text.split("\n\n") if b.startswith("data: {")]
        assert chunks and all(set(c) <= chunk_top and set(c["meta_info"]) <= eng.META_INFO_KEYS for c in chunks)
        stopped = engine.generate({"input_ids": [4, 5, 6], "sampling_params": {
            "max_new_tokens": 8, "temperature": 0.0, "stop": [engine.tokenizer.decode([t]) for t in range(3, 43)]}})
    finally:
        engine.close()
    assert isinstance(stopped["meta_info"]["finish_reason"]["matched"], str)
    finish = set()
    for n in ast.walk(sglang_src["schedule_batch"]):
        if isinstance(n, ast.ClassDef) and n.name == "FINISH_MATCHED_STR":
            finish |= dict_keys(n)
    assert set(stopped["meta_info"]["finish_reason"]) == finish == {"type", "matched"}


# ----------------------------------------------------------------------------- launch flags


def test_router_flags_parse_with_installed_sglang_router(tmp_path):
    """moerl's router command line parses with sglang_router's own argparse, values intact."""
    from sglang_router.launch_router import parse_router_args
    import sglang_router.version

    from moerl.rollout.launcher import RolloutCluster

    assert sglang_router.version.__version__ == api.SGLANG_ROUTER_VERSION
    c = RolloutCluster("unused", num_servers=2, base_port=21010, router_port=21000, router_policy="round_robin",
                       server_command=lambda i, p: ["true"], extra_worker_urls=["http://10.0.0.2:30000"])
    argv = c._router_argv()
    assert argv[1:3] == ["-m", "sglang_router.launch_router"]
    args = parse_router_args(argv[3:])
    assert args.worker_urls == ["http://127.0.0.1:21010", "http://127.0.0.1:21011", "http://10.0.0.2:30000"]
    assert (args.host, args.port, args.policy) == ("127.0.0.1", 21000, "round_robin")
    with pytest.raises(SystemExit):  # the parser really rejects unknown flags
        parse_router_args(argv[3:] + ["--no-such-router-flag"])


def _check_against_server_args(argv: list[str], flags: dict[str, bool]) -> None:
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    k = 3
    while k < len(argv):
        f = argv[k]
        assert f.startswith("--") and f in flags, f"{f} is not a flag of sglang {api.SGLANG_VERSION} launch_server"
        if flags[f]:
            k += 1
        else:
            assert k + 1 < len(argv) and not argv[k + 1].startswith("--"), f"{f} needs a value"
            k += 2


def test_sglang_server_command_lines_use_real_flags(sglang_src):
    from moerl.rollout.sglang_launcher import SGLangServerSpec, plan_node_servers

    flags = server_flags(sglang_src["server_args"])
    assert "--tp-size" in flags and flags["--enable-memory-saver"] and not flags["--port"]
    specs = plan_node_servers("/models/qwen3-moe", [4, 5, 6, 7], tp_size=2, ep_size=2, base_port=31000,
                              mem_fraction_static=0.7, enable_memory_saver=True, weight_version="3",
                              tokenizer_path="/models/tok")
    assert [s.port for s in specs] == [31000, 31001]
    assert [s.env() for s in specs] == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    argv = specs[1].argv(python="python")
    _check_against_server_args(argv, flags)
    opt = dict(zip(argv[3::1], argv[4::1]))
    assert opt["--model-path"] == "/models/qwen3-moe" and opt["--port"] == "31001" and opt["--host"] == "127.0.0.1"
    assert opt["--tp-size"] == "2" and opt["--ep-size"] == "2" and opt["--dp-size"] == "1"
    assert float(opt["--mem-fraction-static"]) == 0.7 and opt["--weight-version"] == "3"
    assert "--enable-memory-saver" in argv and "--enable-deterministic-inference" in argv
    plain = SGLangServerSpec("m", 30000, [0], enable_memory_saver=False, deterministic=False).argv()
    assert "--enable-memory-saver" not in plain
    _check_against_server_args(plain, flags)
    with pytest.raises(AssertionError):  # the checker rejects a flag SGLang does not have
        _check_against_server_args(plain + ["--no-such-flag", "1"], flags)


def test_sglang_spec_validation_names_the_field():
    from moerl.rollout.sglang_launcher import SGLangServerSpec, plan_node_servers

    with pytest.raises(ValueError, match="tp_size . dp_size"):
        SGLangServerSpec("m", 30000, [0, 1, 2], tp_size=2).validate()
    with pytest.raises(ValueError, match="ep_size"):
        SGLangServerSpec("m", 30000, [0, 1], tp_size=2, ep_size=4).validate()
    with pytest.raises(ValueError, match="mem_fraction_static"):
        SGLangServerSpec("m", 30000, [0], mem_fraction_static=1.5).validate()
    with pytest.raises(ValueError, match="multiple"):
        plan_node_servers("m", [0, 1, 2], tp_size=2)


def test_sglang_backend_without_sglang_names_the_install(monkeypatch):
    import importlib.util

    from moerl.rollout import sglang_launcher as sl

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    assert not sl.sglang_available()
    with pytest.raises(RuntimeError, match=r"Dockerfile.*sglang\[all\]==" + re.escape(api.SGLANG_VERSION)):
        sl.require_sglang()
    with pytest.raises(RuntimeError, match="not installed"):
        sl.launch_sglang_rollout("m", rollout_gpu_ids=[0], router_port=21000)


def test_recipe_dry_run_commands_pass_the_wheel_check(sglang_src):
    """The GPU recipe's dry run (no process started) yields server command lines whose flags all
    exist in sglang's server_args.py (this file's own parser), and the library check agrees."""
    from moerl.config.loader import load_config
    from moerl.rollout.sglang_launcher import check_server_argv, dry_run

    cfg = load_config(REPO / "configs" / "qwen3_30b_a3b.yaml",
                      ["rollout.backend=sglang", "rollout.gpu_ids=[0,1,2,3]", "rollout.server_tp_size=2",
                       "rollout.server_ep_size=2", "rollout.placement=colocated", "rollout.host=auto"])
    plan = dry_run(cfg, nnodes=2, model_path="/models/q")
    servers = [e for e in plan if "sglang.launch_server" in e["argv"]]
    assert [(e["node"], e["env"]["CUDA_VISIBLE_DEVICES"]) for e in servers] == [(0, "0,1"), (0, "2,3"), (1, "0,1"), (1, "2,3")]
    flags = server_flags(sglang_src["server_args"])
    for e in servers:
        _check_against_server_args(e["argv"], flags)
        check_server_argv(e["argv"], flags)
        assert "--enable-memory-saver" in e["argv"]  # colocated needs SGLang's memory saver
    router = plan[-1]["argv"]
    from sglang_router.launch_router import parse_router_args

    args = parse_router_args(router[3:])
    assert args.worker_urls == ["http://NODE0_ADDRESS:30000", "http://NODE0_ADDRESS:30001",
                                "http://NODE1_ADDRESS:30000", "http://NODE1_ADDRESS:30001"]
    with pytest.raises(ValueError, match="--no-such-flag"):
        check_server_argv(servers[0]["argv"] + ["--no-such-flag", "1"], flags)
    # routing replay R3 asks SGLang to return routed experts (a real flag of the pinned version)
    r3 = dry_run(load_config(REPO / "configs" / "qwen3_30b_a3b.yaml",
                             ["rollout.backend=sglang", "rollout.gpu_ids=[0,1]", "moe.routing_replay=r3"]))
    argv = [e for e in r3 if "sglang.launch_server" in e["argv"]][0]["argv"]
    assert "--enable-return-routed-experts" in argv and "--enable-return-routed-experts" not in servers[0]["argv"]
    check_server_argv(argv, flags)
    with pytest.raises(ValueError, match="rollout.host=auto"):  # loopback servers on two nodes
        dry_run(load_config(REPO / "configs" / "qwen3_30b_a3b.yaml",
                            ["rollout.backend=sglang", "rollout.gpu_ids=[0,1]"]), nnodes=2)
    with pytest.raises(ValueError, match="needs a value"):
        check_server_argv(servers[0]["argv"] + ["--port"], flags)
