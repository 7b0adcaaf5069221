"""CPU reference rollout server with SGLang's native HTTP API (FastAPI + uvicorn + transformers).

It answers the subset of SGLang 0.5.x's native API that RL needs, with SGLang's request and response
shapes, so that the launcher, sglang-router, the client and weight sync are the same code for this
server and for real SGLang on GPUs.

Run:  python -m moerl.rollout.server --model-path DIR --host 127.0.0.1 --port P --num-threads 1
      [--tokenizer-path DIR] [--max-batch-size 256] [--log-file F] [--log-level info]

Modules: this one is the HTTP layer (FastAPI app, routes, request log, CLI ``main``);
moerl.rollout.engine holds the generation engine (:class:`ReferenceEngine`: request normalisation,
scheduling, decode loop, sampling; /generate semantics are documented there) and
moerl.rollout.engine_weights the weight-update handlers it inherits (:class:`WeightMapper`,
:func:`load_safetensors_dir`, update_weights_from_disk / tensor / distributed). Every name of those
modules that was importable from here stays importable from here.

Endpoints (SGLang names; see http_server.py / io_struct.py of sglang):
    POST /generate                    GenerateReqInput subset (moerl.rollout.engine): stop strings,
                                      penalties, stream (server-sent events), logprob_start_len,
                                      top_logprobs_num, token_ids_logprob as in SGLang
    POST /update_weights_from_disk    {model_path, load_format?, weight_version?, abort_all_requests?}
    POST /update_weights_from_tensor  {serialized_named_tensors, load_format?, flush_cache?,
                                       weight_version?, abort_all_requests?}
    POST /init_weights_update_group   {master_address, master_port, rank_offset, world_size,
                                       group_name?, backend? (gloo only here)}
    POST /update_weights_from_distributed {names, dtypes, shapes, group_name?, flush_cache?,
                                       weight_version?, load_format? (null | auto | flattened_bucket),
                                       abort_all_requests?}
    POST /destroy_weights_update_group {group_name?}
    Also (moerl.rollout.server_routes, moerl.rollout.openai_api): GET /model_info, /server_info (aliases),
    /v1/models, /v1/loads, POST /weights_checker, /start_profile, /stop_profile, and the OpenAI-compatible
    POST /v1/completions, /v1/chat/completions (non-streaming; chat applies the tokenizer's template).
    GET|POST /flush_cache, GET /health, GET /health_generate, GET /get_model_info,
    GET /get_weight_version, GET /get_server_info, POST /abort_request {rid, abort_all}
    POST /release_memory_occupation, /resume_memory_occupation {tags: null | [weights, kv_cache,
        cuda_graph]}  (CPU: nothing is freed; /generate answers 503 while any tag is released)
    POST /pause_generation {mode?: "abort" (default) | "retract" | "in_place"} -> {"message":
        "Generation paused successfully.", "status": "ok"} once no batch runs or, for "in_place", the
        running one is suspended (an empty body means
        the default; a bad mode: HTTP 400 naming ``mode`` and the allowed values, where SGLang's
        pydantic body answers 422); POST /continue_generation -> {"message": "Generation continued
        successfully.", "status": "ok"}. Semantics (and the difference from SGLang for "retract":
        the running batch finishes instead of being retracted):
        :meth:`ReferenceEngine.pause_generation`. While paused /generate requests wait in the queue,
        weight updates and /abort_request work, /health_generate answers 200 without generating
        (SGLang's waits until its health-check timeout, then answers 503). sglang-router does not forward these two
        endpoints: call every server (RolloutCluster.pause_generation / continue_generation).
    --request-log FILE: one JSON line per request (arrival and answer), see
        _install_request_log_and_memory
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time
from typing import Optional

import torch
from fastapi import Request  # module level: the endpoint annotations are resolved from globals

# Re-exported: tests, tools and moerl.cli import these from moerl.rollout.server.
from moerl.rollout.common import DEFAULT_PAUSE_MODE, DEFAULT_WEIGHT_VERSION, PAUSE_MODES, check_pause_mode  # noqa: F401
from moerl.rollout.engine import (  # noqa: F401
    _GREEDY_EPS, _REQUEST_IGNORED, _REQUEST_KEYS, _REQUEST_NOOP, _SAMPLING_DEFAULTS, _SAMPLING_NOOP, ReferenceEngine,
    SamplingSpec, _is_int, _is_num, _Item, _Request, _RowSampler, _RowStop, parse_sampling_params)
from moerl.rollout.engine_weights import _EXPERT_RE, WeightMapper, load_safetensors_dir  # noqa: F401

logger = logging.getLogger("moerl.rollout.server")


# ----------------------------------------------------------------------------- HTTP


# SGLang's memory-occupation tags (sglang.srt.constants GPU_MEMORY_TYPE_*).
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
# Body fields copied into the request log (small ones only; never tensors).
_LOGGED_FIELDS = ("rid", "tags", "weight_version", "model_path", "abort_all", "group_name", "flush_cache",
                  "mode")


def _install_request_log_and_memory(app, engine: "ReferenceEngine", request_log: Optional[str]) -> None:
    """Add the request log and SGLang's /release_memory_occupation, /resume_memory_occupation.

    Request log (``--request-log FILE``; off when None): one JSON line per HTTP request on arrival
    ``{"t", "pid", "event": "recv", "method", "path", <small body fields: rid, tags, weight_version,
    model_path, ...>}`` and one when answered ``{..., "event": "done", "status", "weight_version"}``
    (the engine's version after the call), appended and flushed line by line so that it survives a
    SIGKILL. Tests read it to check the order of control calls (e.g. release/resume around training,
    weight restore before the first /generate of a restarted server).

    Memory occupation (SGLang ReleaseMemoryOccupationReqInput / ResumeMemoryOccupationReqInput,
    body ``{"tags": [..] | null}``, null = all of weights, kv_cache, cuda_graph): on CPU nothing is
    freed; the server tracks which tags are released. While any tag is released /generate is
    refused (HTTP 503), and weight updates are refused while "weights" is released (HTTP 400), as
    on a GPU server whose memory is gone. Unknown tags -> HTTP 400 naming them.
    """
    import json as _json

    from fastapi.responses import JSONResponse

    released: set = set()
    app.state.released_memory_tags = released
    lock = threading.Lock()
    log_file = open(request_log, "a", buffering=1) if request_log else None

    def write(rec: dict) -> None:
        if log_file is not None:
            with lock:
                log_file.write(_json.dumps(rec) + "\n")
                log_file.flush()

    async def guard(scope, receive, send, app_next) -> None:
        """The request log and the released-memory refusals around one HTTP request (pure ASGI: a Starlette
        ``@app.middleware("http")`` (BaseHTTPMiddleware) cost 14% of the server's CPU in the async demo,
        tools/bench_async.py + py-spy: a task group, memory streams and a streamed copy of every answer)."""
        path, method = scope["path"], scope["method"]
        if log_file is None and not released:  # the common case: nothing to record or refuse
            await app_next(scope, receive, send)
            return
        rec: dict = {"t": time.time(), "pid": os.getpid(), "event": "recv", "method": method, "path": path}
        if log_file is not None and method in ("POST", "PUT"):
            try:
                small = int(dict(scope.get("headers") or ()).get(b"content-length") or 0) <= 256 * 1024
            except ValueError:
                small = False
            if small:  # read it here, hand the app the same messages
                msgs, more = [], True
                while more:
                    msg = await receive()
                    msgs.append(msg)
                    more = msg["type"] == "http.request" and msg.get("more_body", False)
                pending = list(msgs)

                async def receive(_receive=receive):  # noqa: F811 - replays what was read, then the server's
                    return pending.pop(0) if pending else await _receive()

                if msgs[-1]["type"] == "http.request":  # not cut by a disconnect (replayed to the app as well)
                    try:
                        body = _json.loads(b"".join(m.get("body", b"") for m in msgs))
                    except ValueError:
                        body = None
                    if isinstance(body, dict):
                        rec.update({k: body[k] for k in _LOGGED_FIELDS if k in body})
        write(rec)
        status = [None]

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                # before the answer's last bytes leave: a client that has its answer finds the record
                write({**rec, "t": time.time(), "event": "done", "status": status[0],
                       "weight_version": engine.weight_version})
            await send(message)

        if released and path == "/generate":
            resp = JSONResponse({"error": {"message": f"memory of {sorted(released)} is released; call "
                                                      f"/resume_memory_occupation first"}}, status_code=503)
        elif "weights" in released and path.startswith("/update_weights"):
            resp = JSONResponse({"success": False, "message": "weights memory is released; call "
                                 "/resume_memory_occupation with tags ['weights'] first"}, status_code=400)
        else:
            resp = None
        await (resp(scope, receive, send_status) if resp is not None else app_next(scope, receive, send_status))

    class _Guard:
        def __init__(self, app):  # Starlette before 0.41.3 passes it by keyword (app=...)
            self.app_next = app

        async def __call__(self, scope, receive, send) -> None:
            if scope["type"] != "http":
                await self.app_next(scope, receive, send)
            else:
                await guard(scope, receive, send, self.app_next)

    app.add_middleware(_Guard)

    def tags_of(body) -> list:
        tags = (body or {}).get("tags") if isinstance(body, dict) else None
        if tags is None:
            return list(MEMORY_TAGS)
        if not isinstance(tags, list) or any(t not in MEMORY_TAGS for t in tags):
            raise ValueError(f"tags must be null or a list of {list(MEMORY_TAGS)}, got {tags!r}")
        return tags

    async def _json_body(request: Request):
        try:
            return await request.json()
        except ValueError:
            return None

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request):
        try:
            tags = tags_of(await _json_body(request))
        except ValueError as e:
            return JSONResponse({"error": {"message": str(e)}}, status_code=400)
        def release() -> None:
            with engine._model_lock:  # after the running batch, as SGLang waits for an idle scheduler
                released.update(tags)

        from starlette.concurrency import run_in_threadpool

        await run_in_threadpool(release)
        return JSONResponse(None, status_code=200)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request):
        try:
            tags = tags_of(await _json_body(request))
        except ValueError as e:
            return JSONResponse({"error": {"message": str(e)}}, status_code=400)
        released.difference_update(tags)
        return JSONResponse(None, status_code=200)


def create_app(engine: ReferenceEngine, server_args: Optional[dict] = None):
    """FastAPI app exposing ``engine`` with SGLang's native endpoints (see module docstring)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from starlette.concurrency import run_in_threadpool

    app = FastAPI(title="moerl reference rollout server")
    args = dict(server_args or {})
    _install_request_log_and_memory(app, engine, args.pop("request_log", None))

    def error(msg: str, status: int = 400):
        return JSONResponse({"error": {"message": msg}}, status_code=status)

    async def body_of(request: Request):
        try:
            return await request.json()
        except Exception:
            return None

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        """SGLang /generate (http_server.generate_request): the JSON result, or with ``stream: true``
        server-sent events ``data: {chunk}\\n\\n`` ... ``data: [DONE]\\n\\n`` (chunks: see
        ReferenceEngine.stream_updates; a client that goes away aborts its items, as SGLang's
        create_abort_task does). Bad input: HTTP 400 {"error": {"message"}} naming the field; with
        stream true SGLang answers 200 and sends that error object as an event before [DONE], and so
        does this server."""
        import json as _json

        from fastapi.responses import StreamingResponse

        def sse(obj) -> bytes:
            return b"data: " + _json.dumps(obj).encode() + b"\n\n"

        async def error_events(message: str):
            yield sse({"error": {"message": message}})
            yield b"data: [DONE]\n\n"

        async def events(req):
            loop = asyncio.get_running_loop()
            wake = asyncio.Event()
            req.notify = lambda: loop.call_soon_threadsafe(wake.set)
            wake.set()  # events may have come before the listener
            done = False
            try:
                while not done:
                    await wake.wait()
                    wake.clear()
                    try:
                        chunks, done = engine.stream_updates(req)
                    except RuntimeError as e:
                        yield sse({"error": {"message": str(e)}})
                        done = True
                        break
                    for c in chunks:
                        yield sse(c)
                yield b"data: [DONE]\n\n"
            finally:
                req.notify = None
                if not done:
                    for it in req.items:
                        engine.abort(it.rid)

        body = await body_of(request)
        stream = isinstance(body, dict) and bool(body.get("stream"))
        try:
            req = engine.submit(body)
        except ValueError as e:
            if stream:
                return StreamingResponse(error_events(str(e)), media_type="text/event-stream")
            return error(str(e))
        except RuntimeError as e:
            return error(str(e), 503)
        if stream:
            return StreamingResponse(events(req), media_type="text/event-stream")
        try:
            await asyncio.wrap_future(req.future)
        except RuntimeError as e:
            return error(str(e), 500)
        return JSONResponse(engine.response(req))

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await body_of(request)
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            return JSONResponse({"success": False, "message": "body needs model_path (a directory)"},
                                status_code=400)
        if body.get("abort_all_requests"):
            engine.abort(abort_all=True)
        ok, msg = await run_in_threadpool(engine.update_weights_from_disk, body["model_path"],
                                          body.get("load_format"), body.get("weight_version"))
        return JSONResponse({"success": ok, "message": msg, "num_paused_requests": 0},
                            status_code=200 if ok else 400)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body = await body_of(request)
        if not isinstance(body, dict):
            return JSONResponse({"success": False, "message": "body must be a JSON object"}, status_code=400)
        if body.get("abort_all_requests"):
            engine.abort(abort_all=True)
        ok, msg = await run_in_threadpool(
            engine.update_weights_from_tensor, body.get("serialized_named_tensors"),
            body.get("load_format"), bool(body.get("flush_cache", True)), body.get("weight_version"))
        return JSONResponse({"success": ok, "message": msg}, status_code=200 if ok else 400)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await body_of(request)
        need = ("master_address", "master_port", "rank_offset", "world_size")
        if not isinstance(body, dict) or any(k not in body for k in need):
            return JSONResponse({"success": False, "message": f"body needs {list(need)} (+ group_name, backend)"},
                                status_code=400)
        ok, msg = await run_in_threadpool(
            engine.init_weights_update_group, body["master_address"], body["master_port"], body["rank_offset"],
            body["world_size"], body.get("group_name", "weight_update_group"), body.get("backend", "nccl"))
        return JSONResponse({"success": ok, "message": msg}, status_code=200 if ok else 400)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        body = await body_of(request) or {}
        ok, msg = await run_in_threadpool(engine.destroy_weights_update_group,
                                          body.get("group_name", "weight_update_group"))
        return JSONResponse({"success": ok, "message": msg}, status_code=200 if ok else 400)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await body_of(request)
        if not isinstance(body, dict) or any(k not in body for k in ("names", "dtypes", "shapes")):
            return JSONResponse({"success": False, "message": "body needs names, dtypes, shapes (+ group_name)"},
                                status_code=400)
        if body.get("load_format") not in (None, "auto", "flattened_bucket"):
            return JSONResponse({"success": False, "message": f"load_format={body['load_format']!r} is not "
                                 f"supported by the reference server (use null or 'flattened_bucket')"},
                                status_code=400)
        if body.get("abort_all_requests"):
            engine.abort(abort_all=True)
        ok, msg = await run_in_threadpool(
            engine.update_weights_from_distributed, body["names"], body["dtypes"], body["shapes"],
            body.get("group_name", "weight_update_group"), body.get("weight_version"), body.get("load_format"))
        return JSONResponse({"success": ok, "message": msg}, status_code=200 if ok else 400)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        # SGLang http_server.pause_generation: body PauseGenerationReqInput {"mode"}, default "abort";
        # answers {"message": "Generation paused successfully.", "status": "ok"} once paused.
        raw = await request.body()
        body = await body_of(request) if raw.strip() else {}
        if not isinstance(body, dict):
            return error('the /pause_generation body must be a JSON object {"mode": ...}')
        try:
            mode = check_pause_mode(body.get("mode", DEFAULT_PAUSE_MODE))
        except ValueError as e:
            return error(str(e))
        await run_in_threadpool(engine.pause_generation, mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation():
        engine.continue_generation()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        # No cross-request cache here (the KV cache lives within one generate call).
        return Response(content="Cache flushed.\n", status_code=200)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        if engine.paused:  # a paused server is healthy but generates nothing until continued
            return Response(status_code=200)
        try:
            await run_in_threadpool(engine.generate, {
                "input_ids": [engine.pad_id], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
            return Response(status_code=200)
        except Exception:
            logger.exception("health_generate failed")
            return Response(status_code=503)

    @app.get("/get_model_info")
    async def get_model_info():
        return engine.model_info()

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": engine.weight_version}

    @app.get("/get_server_info")
    async def get_server_info():
        from moerl import __version__ as version

        return {**args, "model_path": engine.model_path, "tokenizer_path": engine.tokenizer_path,
                "weight_version": engine.weight_version, "engine": "moerl-reference",
                "internal_states": [{}], "version": version}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await body_of(request) or {}
        engine.abort(rid=body.get("rid") or None, abort_all=bool(body.get("abort_all", False)))
        return Response(status_code=200)

    from moerl.rollout.server_routes import install_extra_routes  # info aliases, profiler, OpenAI API

    install_extra_routes(app, engine, args)
    return app


def _dtype_arg(value: str) -> str:
    """--dtype spellings as the recipe's dtype keys take them (moerl.config.schema.normalize_dtype)."""
    from moerl.config.schema import normalize_dtype

    return normalize_dtype(value)


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moerl serve", description="moerl CPU reference rollout server "
                                "(SGLang native HTTP API)")
    p.add_argument("--model-path", required=True, help="HF model directory")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer directory (default: model path)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--dtype", default="auto", type=_dtype_arg, choices=["auto", "float32", "bfloat16"],
                   help="dtype the model is loaded and served in, as SGLang's --dtype (weight updates are "
                   "cast to it; recipe key rollout.dtype); auto = float32 on this CPU reference server; "
                   "bf16 / fp32 are accepted spellings")
    p.add_argument("--max-batch-size", type=int, default=256, help="most rows in one generate batch")
    p.add_argument("--switch-interval-ms", type=float, default=0.5, help="Python GIL switch interval")
    p.add_argument("--log-file", default=None, help="append logs here instead of stderr")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--request-log", default=None, help="append one JSON line per HTTP request "
                   "(arrival and answer) to this file (tests read the order of control calls)")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Every ``moerl serve`` argument, before the model is loaded or a socket opened.

    Raises:
        moerl.errors.CLIError: --num-threads / --max-batch-size < 1, --switch-interval-ms <= 0, a
            --log-file / --request-log whose directory does not exist, or that is a directory itself.
        moerl.errors.PortError: --port outside 1..65535, or taken on --host.
        moerl.errors.ModelError: --model-path not a model directory (config.json, readable safetensors), or
            --tokenizer-path (default: the model path) without tokenizer files.
    """
    from moerl.checkpoint.input_checks import check_hf_model_dir, hf_tensor_shapes
    from moerl.errors import CLIError, ModelError, PortError, check_port
    from moerl.rollout.launcher import port_is_free

    for flag, value in (("--num-threads", args.num_threads), ("--max-batch-size", args.max_batch_size)):
        if value < 1:
            raise CLIError(f"{flag} must be >= 1, got {value}", key=flag, hint=f"give {flag} 1 or more")
    if not args.switch_interval_ms > 0:
        raise CLIError(f"--switch-interval-ms must be > 0, got {args.switch_interval_ms}", key="--switch-interval-ms",
                       hint="leave it at the default 0.5")
    for flag, path in (("--log-file", args.log_file), ("--request-log", args.request_log)):
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise CLIError(f"{flag} {path}: directory {os.path.dirname(os.path.abspath(path))} does not exist",
                           key=flag, file=path, hint=f"create the directory or give {flag} a path in an existing one")
        if path is not None and os.path.isdir(path):
            raise CLIError(f"{flag} {path} is a directory", key=flag, file=path,
                           hint=f"give {flag} a file path (e.g. {os.path.join(path, 'serve.log')})")
        if path is not None and os.path.exists(path) and not os.access(path, os.W_OK):
            raise CLIError(f"{flag} {path} is not writable", key=flag, file=path, hint=f"give {flag} a file you can write")
    check_port(args.port, "--port")
    try:
        free = port_is_free(args.host, args.port)
    except OSError as e:  # e.g. a --host that is not an address of this machine
        raise PortError(f"--host {args.host} --port {args.port} cannot be bound: {e}", key="--host",
                        hint="give --host an address of this machine (e.g. 127.0.0.1 or 0.0.0.0)") from None
    if not free:
        raise PortError(f"--port {args.port} on {args.host} is already in use", key="--port",
                        hint="choose another --port or stop what holds it")
    check_hf_model_dir(args.model_path, "--model-path", model_types=None)
    hf_tensor_shapes(args.model_path, "--model-path")  # weights present and readable (headers only)
    tok = args.tokenizer_path or args.model_path
    tok_flag = "--tokenizer-path" if args.tokenizer_path else "--model-path (its tokenizer)"
    from moerl.data.tokenizer import TOKENIZER_FILES

    if not os.path.isdir(tok) or not any(os.path.isfile(os.path.join(tok, n)) for n in TOKENIZER_FILES):
        raise ModelError(f"{tok_flag}: no tokenizer ({' / '.join(TOKENIZER_FILES)}) in {tok}",
                         key="--tokenizer-path", file=tok, hint="give --tokenizer-path a tokenizer directory")


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``python -m moerl.rollout.server`` / ``moerl serve``; blocks until stopped.

    Raises:
        moerl.errors.InputError: a bad argument (:func:`check_args`), before the model is loaded; the
            entry points turn it into one line and exit code 2.
    """
    import uvicorn

    args = build_arg_parser().parse_args(argv)
    check_args(args)
    logging.basicConfig(filename=args.log_file, level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.num_threads)
    # The HTTP event loop shares the GIL with the generate thread; hand it over more often than the
    # default 5 ms so that requests keep arriving (and joining batches) while a batch runs.
    sys.setswitchinterval(args.switch_interval_ms / 1000.0)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    logger.info("loading %s with %d threads", args.model_path, args.num_threads)
    dtype = "float32" if args.dtype == "auto" else args.dtype  # the CPU reference server's auto
    engine = ReferenceEngine(args.model_path, args.tokenizer_path, max_batch_size=args.max_batch_size,
                             dtype=dtype)
    app = create_app(engine, {"host": args.host, "port": args.port, "num_threads": args.num_threads,
                              "dtype": dtype,
                              "max_batch_size": args.max_batch_size, "tp_size": 1, "dp_size": 1,
                              "request_log": args.request_log})
    logger.info("serving on http://%s:%d", args.host, args.port)
    # keep idle connections open longer than sglang-router's pool keeps them (reqwest: 90 s), so the
    # router never sends on a connection this server is closing (uvicorn's default is 5 s)
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False,
                log_level=args.log_level, timeout_keep_alive=120)
    return 0


if __name__ == "__main__":
    from moerl.errors import run_entry

    raise SystemExit(run_entry("moerl serve", main))
