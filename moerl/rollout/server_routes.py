"""SGLang 0.5.9 routes of the CPU reference server beyond generation and weight updates.

Installed by moerl.rollout.server.create_app through :func:`install_extra_routes`. Each route has the
path, methods, body fields (sglang io_struct) and answer shape of sglang/srt/entrypoints/http_server.py
(and v1_loads.py); what a CPU server cannot mean is said per route.

    GET /model_info, GET /server_info     aliases: the very handlers of /get_model_info, /get_server_info
                                          (SGLang's get_* routes are the deprecated aliases of these)
    GET /v1/models                        ModelList {"object": "list", "data": [ModelCard {id, object:
                                          "model", created, owned_by: "sglang", root, parent: null,
                                          max_model_len}]}; id = the served model path (SGLang's
                                          served_model_name defaults to model_path and follows
                                          /update_weights_from_disk)
    GET /v1/loads?dp_rank=&include=&format=  {timestamp, version, dp_rank_count: 1, loads: [{dp_rank: 0,
                                          num_running_reqs, num_waiting_reqs, num_used_tokens: 0,
                                          max_total_num_tokens, token_usage: 0.0, gen_throughput: 0.0,
                                          cache_hit_rate: 0.0, utilization, max_running_requests,
                                          num_total_reqs}], aggregate}; format=prometheus -> text
    POST /weights_checker {action}         CheckWeightsReqInput: "snapshot" (copy every parameter and
                                          buffer), "reset_tensors" (overwrite parameters with random
                                          values), "compare" (every tensor equal to the snapshot) ->
                                          {"success", "message"}, HTTP 200 | 400
    GET|POST /start_profile [ProfileReqInput]  torch.profiler (CPU activity) until /stop_profile; answers
                                          "Start profiling.\n"; output_dir (default
                                          $SGLANG_TORCH_PROFILER_DIR or /tmp), profile_prefix,
                                          with_stack, record_shapes honoured; num_steps / start_step /
                                          profile_by_stage / merge_profiles / profile_stages refused
                                          with HTTP 400 naming the field (no scheduler steps here)
    GET|POST /freeze_gc                    gc.collect() then gc.freeze() in the server process (SGLang freezes
                                          its processes without the collect; the collect keeps garbage out of
                                          the permanent generation); answers "Garbage collection frozen.\n"
    GET|POST /stop_profile                 writes ``[<prefix>-]<profile_id>-TP-0.trace.json.gz`` (Chrome
                                          trace, SGLang's name) into output_dir; answers "Stop
                                          profiling. This will take some time.\n"
    POST /update_weight_version {new_version, abort_all_requests?=true}  sets the weight_version (weights
                                          untouched), after aborting every request unless told not to;
                                          {"success": true, "message", "new_version"}
    POST /v1/completions, /v1/chat/completions   moerl.rollout.openai_api

Errors: a bad body answers HTTP 400 whose message names the field (SGLang's pydantic answers 422);
starting a running profiler or stopping none answers 400 with SGLang's message.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import datetime, timezone
from typing import Optional

import torch
from fastapi import Request  # module level: endpoint annotations resolve from globals

logger = logging.getLogger("moerl.rollout.server")

__all__ = ["install_extra_routes", "WeightsChecker", "CpuProfiler"]

PROFILE_FIELDS = ("output_dir", "start_step", "num_steps", "activities", "profile_by_stage", "with_stack",
                  "record_shapes", "merge_profiles", "profile_prefix", "profile_stages")
_WEIGHT_CHECK_ACTIONS = ("snapshot", "reset_tensors", "compare")


class WeightsChecker:
    """SGLang's /weights_checker (sglang.srt.utils.weight_checker.WeightChecker) on a torch module.

    ``handle(action)`` with action "snapshot" | "reset_tensors" | "compare"; runs under ``lock`` (the
    engine's model lock, so never during a generate batch). Raises ValueError for another action,
    for "compare" before "snapshot", and for a mismatch (naming each differing tensor with its max
    and mean absolute error, as SGLang's message does).
    """

    def __init__(self, model: torch.nn.Module, lock: threading.Lock):
        self.model, self.lock, self.snapshot = model, lock, None

    def _state(self):
        yield from self.model.named_parameters()
        yield from self.model.named_buffers()

    def handle(self, action: str) -> None:
        with self.lock, torch.no_grad():
            if action == "snapshot":
                self.snapshot = {n: t.detach().clone() for n, t in self._state()}
            elif action == "reset_tensors":
                for _, p in self.model.named_parameters():
                    if p.dtype.is_floating_point:
                        p.copy_(torch.rand(p.shape, dtype=torch.float32).to(p.dtype))
            elif action == "compare":
                if self.snapshot is None:
                    raise ValueError("no snapshot to compare with; call action 'snapshot' first")
                bad = []
                for n, t in self._state():
                    ref = self.snapshot.get(n)
                    if ref is None or ref.shape != t.shape or not torch.equal(ref, t):
                        diff = ((t.float() - ref.float()).abs() if ref is not None and ref.shape == t.shape
                                else None)
                        bad.append(f"name={n} " + (f"max_abs_err={float(diff.max())} mean_abs_err={float(diff.mean())}"
                                                   if diff is not None else "missing or reshaped"))
                if bad:
                    raise ValueError("check tensor equality failed:\n" + "\n".join(bad))
            else:
                raise ValueError(f"Unsupported action={action!r} (one of {list(_WEIGHT_CHECK_ACTIONS)})")


class CpuProfiler:
    """torch.profiler (CPU activity) behind SGLang's /start_profile and /stop_profile.

    torch's profiler records only the thread that started it, and the engine generates on its own
    scheduler thread; so while a profile is open every generate batch runs under its own
    ``torch.profiler.profile`` on that thread (the engine's ``_generate_rows`` is wrapped on the
    instance) and :meth:`stop` writes all their events as one Chrome trace (gzip JSON
    ``{"traceEvents": [...]}``), SGLang's file name. :meth:`start` takes ProfileReqInput fields.
    Raises ValueError naming the field for what a CPU server cannot honour, or with SGLang's
    message when starting twice / stopping none.
    """

    def __init__(self, engine):
        self.engine = engine
        self.lock = threading.Lock()
        self.active = False
        self.path: Optional[str] = None
        self.opts: dict = {}
        self.events: list = []
        self.batches = 0
        inner = engine._generate_rows

        def profiled_generate_rows(items):
            with self.lock:
                opts = dict(self.opts) if self.active else None
            if opts is None:
                return inner(items)
            import json as _json
            import tempfile

            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], **opts) as prof:
                rows = inner(items)
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                prof.export_chrome_trace(f.name)
                events = _json.load(open(f.name)).get("traceEvents", [])
            with self.lock:
                if self.active:
                    self.events.extend(events)
                    self.batches += 1
            return rows

        engine._generate_rows = profiled_generate_rows

    def start(self, body: dict) -> None:
        for k in ("start_step", "num_steps", "profile_stages"):
            if body.get(k) is not None:
                raise ValueError(f"{k} is not supported by the CPU reference server (it has no scheduler "
                                 f"steps); leave it null and call /stop_profile")
        for k in ("profile_by_stage", "merge_profiles"):
            if body.get(k):
                raise ValueError(f"{k}=true is not supported by the CPU reference server")
        acts = body.get("activities")
        if acts is not None and (not isinstance(acts, list) or any(a not in ("CPU", "GPU", "MEM", "RPD") for a in acts)):
            raise ValueError(f"activities must be a list of 'CPU', 'GPU', 'MEM', 'RPD', got {acts!r}")
        for k in ("output_dir", "profile_prefix"):
            if body.get(k) is not None and not isinstance(body[k], str):
                raise ValueError(f"{k} must be a string, got {body[k]!r}")
        for k in ("with_stack", "record_shapes"):
            if body.get(k) is not None and not isinstance(body[k], bool):
                raise ValueError(f"{k} must be a boolean, got {body[k]!r}")
        with self.lock:
            if self.active:
                raise ValueError("Profiling is already in progress. Call /stop_profile first.")
            out_dir = os.path.expanduser(body.get("output_dir") or os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp"))
            try:
                os.makedirs(out_dir, exist_ok=True)
            except OSError as e:
                raise ValueError(f"output_dir {out_dir!r} cannot be created: {e.strerror or e}") from None
            prefix = body.get("profile_prefix")
            self.path = os.path.join(out_dir, (f"{prefix}-" if prefix else "") + f"{time.time()}-TP-0.trace.json.gz")
            self.opts = {"record_shapes": body.get("record_shapes") is not False,
                         "with_stack": bool(body.get("with_stack")), "profile_memory": "MEM" in (acts or [])}
            self.events, self.batches, self.active = [], 0, True

    def stop(self) -> str:
        """Close the profile, write the trace; returns its path."""
        import gzip

        with self.lock:
            if not self.active:
                raise ValueError("Profiling is not in progress. Call /start_profile first.")
            self.active = False
            events, path = self.events, self.path
            self.events = []
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        logger.info("profile of %d generate batches written to %s", self.batches, path)
        return path


def _loads(engine, args: dict) -> dict:
    running, waiting = len(getattr(engine, "_running", ())), len(getattr(engine, "_pending", ()))
    cap = int(args.get("max_batch_size") or getattr(engine, "max_batch_size", 1) or 1)
    return {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting, "num_used_tokens": 0,
            "max_total_num_tokens": int(getattr(engine, "max_positions", None) or 0) * cap,
            "token_usage": 0.0, "gen_throughput": 0.0, "cache_hit_rate": 0.0,
            "utilization": round(running / cap, 4), "max_running_requests": cap,
            "num_total_reqs": running + waiting}


def install_extra_routes(app, engine, args: Optional[dict] = None) -> None:
    """Add the routes listed in the module docstring (and the OpenAI-compatible ones) to ``app``.

    Args:
        app: the FastAPI app of moerl.rollout.server.create_app, with /get_model_info and
            /get_server_info already registered (their handlers are reused for the aliases).
        engine: the ReferenceEngine served.
        args: the server arguments dict given to create_app (max_batch_size is read).
    Raises:
        RuntimeError: /get_model_info or /get_server_info is not registered yet.
    """
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from starlette.concurrency import run_in_threadpool

    from moerl import __version__ as version
    from moerl.rollout.openai_api import install_openai_routes

    args = dict(args or {})
    handlers = {getattr(r, "path", None): r.endpoint for r in app.routes if hasattr(r, "endpoint")}
    for old, new in (("/get_model_info", "/model_info"), ("/get_server_info", "/server_info")):
        if old not in handlers:
            raise RuntimeError(f"install_extra_routes needs {old} registered first")
        app.add_api_route(new, handlers[old], methods=["GET"])

    def bad(msg: str, status: int = 400):
        return JSONResponse({"error": {"message": msg}}, status_code=status)

    async def json_body(request: Request, allow_empty: bool = True):
        raw = await request.body()
        if not raw.strip():
            return {} if allow_empty else None
        try:
            return json.loads(raw)
        except ValueError:
            return None

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        # UpdateWeightVersionReqInput {new_version: str, abort_all_requests: bool = True}
        body = await json_body(request, allow_empty=False)
        if not isinstance(body, dict) or not isinstance(body.get("new_version"), str):
            return JSONResponse({"success": False, "message": "body needs new_version (a string)"}, status_code=400)
        if body.get("abort_all_requests", True):
            engine.abort(abort_all=True)
        engine.weight_version = body["new_version"]
        return {"success": True, "message": f"Weight version updated to {body['new_version']}",
                "new_version": body["new_version"]}

    @app.get("/v1/models")
    async def available_models():
        name = engine.model_path
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "sglang", "root": name, "parent": None,
                                            "max_model_len": getattr(engine, "max_positions", None)}]}

    @app.get("/v1/loads")
    async def get_loads(dp_rank: Optional[int] = None, include: Optional[str] = None,
                        format: Optional[str] = None):
        if dp_rank not in (None, 0):
            return bad(f"dp_rank={dp_rank}: this server has one DP rank (0)")
        sections = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
        if include is not None and any(s.strip() not in sections for s in include.split(",")):
            return bad(f"include={include!r}: sections are {sorted(sections)}")
        if format not in (None, "json", "prometheus"):
            return bad(f"format={format!r}: use 'json' or 'prometheus'")
        load = _loads(engine, args)
        if format == "prometheus":
            lines = []
            for k, v in load.items():
                if k in ("dp_rank", "num_total_reqs"):
                    continue
                lines += [f"# TYPE sglang_{k} gauge", f'sglang_{k}{{dp_rank="0"}} {v}']
            return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")
        return {"timestamp": datetime.now(timezone.utc).isoformat(), "version": version, "dp_rank_count": 1,
                "loads": [load],
                "aggregate": {"total_running_reqs": load["num_running_reqs"],
                              "total_waiting_reqs": load["num_waiting_reqs"], "total_reqs": load["num_total_reqs"],
                              "avg_token_usage": 0.0, "avg_throughput": 0.0, "avg_utilization": load["utilization"]}}

    checker = WeightsChecker(engine.model, engine._model_lock)

    @app.post("/weights_checker")
    async def weights_checker(request: Request):
        body = await json_body(request, allow_empty=False)
        if not isinstance(body, dict) or not isinstance(body.get("action"), str):
            return JSONResponse({"success": False, "message": "body needs action: one of "
                                 f"{list(_WEIGHT_CHECK_ACTIONS)}"}, status_code=400)
        try:
            await run_in_threadpool(checker.handle, body["action"])
        except ValueError as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        return JSONResponse({"success": True, "message": "Success."})

    profiler = CpuProfiler(engine)

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(request: Request):
        body = await json_body(request)
        if body is None:  # SGLang: an absent body means ProfileReqInput()
            body = {}
        if not isinstance(body, dict):
            return bad("the /start_profile body must be a JSON object (ProfileReqInput fields)")
        unknown = sorted(set(body) - set(PROFILE_FIELDS) - {"rid", "http_worker_ipc"})
        if unknown:
            return bad(f"unknown /start_profile field(s) {unknown}; ProfileReqInput has {list(PROFILE_FIELDS)}")
        try:
            profiler.start(body)
        except ValueError as e:
            return bad(str(e))
        return Response(content="Start profiling.\n", status_code=200)

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile():
        try:
            await run_in_threadpool(profiler.stop)
        except ValueError as e:
            return bad(str(e))
        return Response(content="Stop profiling. This will take some time.\n", status_code=200)

    @app.api_route("/freeze_gc", methods=["GET", "POST"])
    async def freeze_gc():
        await run_in_threadpool(_freeze_gc)
        return Response(content="Garbage collection frozen.\n", status_code=200)

    app.state.profiler = profiler
    app.state.weights_checker = checker
    install_openai_routes(app, engine)


def _freeze_gc() -> None:
    """Collect, then move every surviving object to the permanent generation (gc.freeze)."""
    import gc

    gc.collect()
    gc.freeze()
