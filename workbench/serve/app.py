"""The HTTP surface the Tinker SDK talks to (`/api/v1/...`), and the service state behind it.

Routes answer at once; the long calls (create_model, forward_backward, optim_step, the weight
saves and loads, asample) become futures (workbench/serve/futures.py) that the SDK polls with
`retrieve_future`. What the SDK's client config asks of a server is set so that a plain server
suffices: API-key auth (no JWT exchange), httpx transport, forward_backward chunks sent one after
another (never out of order), per-request polling.

A request the service cannot honour (a model it does not serve, a full-weights model, a loss it
does not have, a checkpoint it cannot read) fails its future with one line the SDK raises as
`RequestFailedError`; a malformed request is an HTTP 400 with the reason. The API key the SDK
sends (`X-API-Key`) is accepted and never stored or logged; with `serve.api_key_env` set, it
must equal that environment variable's value. The SDK's telemetry posts are accepted and dropped.

Starlette and uvicorn (installed with FastAPI, which the project's llama-cpp-python server
extra brings) are used directly: nothing here needs FastAPI's request models, the SDK's own
pydantic types validate nothing server-side, and the two big payloads are protobuf anyway.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import time
import uuid
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from workbench.core import atomic
from workbench.core.secrets import redact
from workbench.serve import losses, session, wire
from workbench.serve.futures import FutureStore, Result, ServeError
from workbench.telemetry import manifest
from workbench.telemetry.metrics import Tracker

CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False,
                 "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False, "sample_no_retries": False}
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Service:
    """Sessions, trained models, samplers and the run directory of one `python -m workbench.serve`."""

    def __init__(self, cfg, run, tokenizer, run_dir: Path, serve_cfg, log=print):
        self.cfg, self.run, self.tokenizer, self.serve = cfg, run, tokenizer, serve_cfg
        self.run_dir, self.log = run_dir, log
        self.names = {cfg.model.name} | ({cfg.model.hub_id} if cfg.model.get("hub_id") else set())
        self.base_name = cfg.model.hub_id or cfg.model.name
        self.max_position = int(cfg.model.arch.max_position)
        self.store = FutureStore(on_error=lambda kind, tb: log(f"{kind} failed:\n{tb}"))
        self.tracker = Tracker(run_dir, enabled=True, cfg=None)  # metrics.jsonl
        self.models: dict[str, session.TrainedModel] = {}
        self.samplers: dict[str, dict] = {}
        self.engines: dict[tuple, object] = {}  # sampling models by LoRA shape
        self.sessions: dict[str, dict] = {}
        self.events: list[dict] = []
        self.tokenizer_dir = run_dir / "tokenizer"
        tokenizer.save_pretrained(str(self.tokenizer_dir))  # what TrainingClient.get_tokenizer() loads
        self.started = time.time()
        self.write_manifest()

    # -- the run directory ------------------------------------------------------------------------
    def write_manifest(self) -> None:
        from omegaconf import OmegaConf

        body = redact({"kind": "workbench.serve (Tinker-compatible training service)", "started": self.started,
                       "versions": {**manifest.versions(), "tinker": _version("tinker")}, "git": manifest.git_sha(),
                       "hardware": manifest.hardware(), "serve": dict(self.serve), "served_model": self.base_name,
                       "sessions": self.sessions, "models": [m.info() for m in self.models.values()],
                       "events": self.events, "config": OmegaConf.to_container(self.cfg, resolve=True)})
        atomic.write_text(self.run_dir / "manifest.json", json.dumps(body, indent=1, default=str))

    def event(self, **row) -> None:
        self.events.append({"time": time.time(), **row})
        self.write_manifest()

    def folder(self, model_id: str, kind: str, name: str) -> Path:
        return self.run_dir / "checkpoints" / model_id.replace(":", "_") / kind / name

    def tinker_path(self, path: str) -> tuple[str, str, Path]:
        """(model id, kind, folder) of `tinker://<model_id>/<weights|sampler_weights>/<name>`."""
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not NAME.match(parts[2]):
            raise ServeError(f"{path!r} is not a checkpoint path of this service "
                             "(tinker://<model_id>/weights/<name> or .../sampler_weights/<name>)")
        folder = self.folder(parts[0], parts[1], parts[2])
        if not (folder / "meta.json").exists():
            raise ServeError(f"{path}: no such checkpoint in {self.run_dir}")
        return parts[0], parts[1], folder

    # -- models --------------------------------------------------------------------------------------
    def check_base(self, base_model: str | None) -> str:
        if base_model not in self.names:
            raise ServeError(f"base_model {base_model!r} is not served here; this service serves "
                             f"{' / '.join(sorted(self.names))} (started with model={self.cfg.model.name})")
        return self.base_name

    def new_model(self, model_id: str, lora: session.Lora) -> session.TrainedModel:
        if model_id in self.models:
            raise ServeError(f"model {model_id} exists already")
        if lora.train_unembed:
            self.log(f"{model_id}: train_unembed=True is not applied (adapters go on the decoder blocks only)")
        tm = session.TrainedModel(model_id, self.base_name, lora, self.run, self.serve.micro_batch_size)
        self.models[model_id] = tm
        self.event(event="create_model", model_id=model_id, lora=tm.info())
        return tm

    def model(self, model_id: str) -> session.TrainedModel:
        if model_id not in self.models:
            raise ServeError(f"no model {model_id!r} here (models: {', '.join(self.models) or 'none'})")
        return self.models[model_id]

    def engine(self, lora: session.Lora):
        key = lora.key()
        if key not in self.engines:
            self.engines[key] = session.build(self.run, lora)
        return self.engines[key]

    def info(self, model_id: str) -> dict:
        tm = self.model(model_id)
        return {"type": "get_info", "model_id": model_id, "model_name": self.base_name, "is_lora": True,
                "lora_rank": tm.lora.rank, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": self.cfg.model.arch.family, "model_name": self.base_name,
                               "tokenizer_id": str(self.tokenizer_dir)}}


def _version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


class BadRequest(Exception):
    pass


async def _body(request: Request) -> dict:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        raise BadRequest(f"{request.url.path}: the body is not JSON") from None
    if not isinstance(body, dict):
        raise BadRequest(f"{request.url.path}: the body is not a JSON object")
    return body


def _need(body: dict, *keys: str):
    missing = [k for k in keys if body.get(k) is None]
    if missing:
        raise BadRequest(f"missing {', '.join(missing)}")
    return [body[k] for k in keys]


def build_app(svc: Service) -> Starlette:
    store = svc.store
    api_key = os.environ.get(svc.serve.api_key_env) if svc.serve.api_key_env else None

    def future(kind: str, job, model_id: str | None = None, **extra) -> JSONResponse:
        return JSONResponse({"request_id": store.submit(kind, job), "model_id": model_id, **extra})

    def route(fn):
        async def handler(request: Request):
            if api_key is not None and not hmac.compare_digest(request.headers.get("x-api-key", ""), api_key):
                return JSONResponse({"error": "the API key does not match this service's"}, status_code=401)
            try:
                return await fn(request)
            except BadRequest as exc:
                return JSONResponse({"error": str(exc)}, status_code=400, headers={"x-should-retry": "false"})
            except ServeError as exc:
                return JSONResponse({"error": str(exc)}, status_code=400, headers={"x-should-retry": "false"})
        return handler

    async def client_config(request):
        return JSONResponse(CLIENT_CONFIG)

    async def dynamic_config(request):
        return JSONResponse({"refresh_interval_sec": 3600, "sample_cancel_enabled": False})

    async def healthz(request):
        return JSONResponse({"status": "ok"})

    async def capabilities(request):
        return JSONResponse({"supported_models": [{"model_name": svc.base_name, "max_context_length": svc.max_position,
                                                   "trainable": True, "sampleable": True}]})

    async def create_session(request):
        body = await _body(request)
        sid = f"session-{uuid.uuid4().hex[:12]}"
        svc.sessions[sid] = {"sdk_version": str(body.get("sdk_version")), "created": time.time()}
        svc.write_manifest()
        return JSONResponse({"type": "create_session", "session_id": sid})

    async def heartbeat(request):
        # a finished session answers 410, which the SDK reads as "finished" and stops its heartbeats
        if (svc.sessions.get((await _body(request)).get("session_id")) or {}).get("finished"):
            return JSONResponse({"error": "this session has finished"}, status_code=410,
                                headers={"x-should-retry": "false"})
        return JSONResponse({"type": "session_heartbeat"})

    async def finish_session(request):
        # ServiceClient.close(status): the session ends with the client's reason, in the manifest
        sid = request.path_params["sid"]
        if sid in svc.sessions:
            svc.sessions[sid]["finished"] = {"reason": ((await _body(request)).get("reason") or {}).get("type"),
                                             "at": time.time()}
            svc.write_manifest()
        return JSONResponse(None)

    async def telemetry(request):
        return JSONResponse({"status": "accepted"})  # the SDK's own reports, dropped unread

    async def create_model(request):
        body = await _body(request)
        sid, seq = _need(body, "session_id", "model_seq_id")
        model_id = f"{sid}:train:{seq}"
        base, lora_cfg = body.get("base_model"), body.get("lora_config")
        opt = (body.get("optimizer_config") or {}).get("type", "adamw")

        def job():
            svc.check_base(base)
            if lora_cfg is None:
                raise ServeError("full-weights training is not served: this service trains LoRA adapters only "
                                 "(use create_lora_training_client)")
            if opt != "adamw":
                raise ServeError(f"optimizer {opt!r} is not served; this service steps AdamW (optimizer type 'adamw')")
            lora = session.Lora(**{k: lora_cfg[k] for k in ("rank", "seed", "train_mlp", "train_attn", "train_unembed")
                                   if k in lora_cfg})
            svc.new_model(model_id, lora)
            return Result(body={"model_id": model_id, "type": "create_model"})
        return future("CreateModel", job, model_id)

    async def get_info(request):
        (model_id,) = _need(await _body(request), "model_id")
        return JSONResponse(svc.info(model_id))

    async def forward_backward(request):
        try:
            req = wire.decode_forward_backward(await request.body(), request.headers.get("content-encoding"))
        except ServeError as exc:
            raise BadRequest(str(exc)) from None
        tm = svc.model(req.model_id)
        losses.check(req.loss_fn, req.config, req.data)

        def job():
            t0 = time.time()
            outputs, metrics = tm.forward_backward(req)
            svc.tracker.log({"event": "forward" if req.forward_only else "forward_backward", "model_id": tm.model_id,
                             "seq_id": req.seq_id, "loss_fn": req.loss_fn, "loss_sum": metrics["loss:sum"],
                             "datums": len(req.data), "tokens": sum(len(d.tokens) for d in req.data),
                             "optimizer_step": tm.steps, "seconds": round(time.time() - t0, 4), "time": time.time()})
            sleep = float(svc.cfg.debug.step_sleep_s)  # fault injection: a slow step (the kill tests)
            if sleep > 0:
                time.sleep(sleep)
            return Result(proto=wire.encode_forward_backward(outputs, metrics))
        return future("Forward" if req.forward_only else "ForwardBackward", job, req.model_id)

    async def optim_step(request):
        body = await _body(request)
        (model_id,) = _need(body, "model_id")
        params = body.get("adam_params") or body.get("optim_params")
        if params is None:
            kind = (body.get("optimizer_params") or {}).get("type")
            raise ServeError(f"optim_step: {kind or 'these'} optimizer params are not served; send AdamParams")
        tm = svc.model(model_id)

        def job():
            t0 = time.time()
            out = tm.optim_step(params)
            svc.tracker.log({"event": "optim_step", "model_id": model_id, "step": tm.steps, "lr": out["lr"],
                             "grad_norm": out["grad_norm"], "skipped": bool(out.get("skipped")),
                             "seconds": round(time.time() - t0, 4), "time": time.time()})
            return Result(body={"metrics": {f"{k}:mean": float(v) for k, v in out.items()}})
        return future("OptimStep", job, model_id)

    async def save_weights(request):
        body = await _body(request)
        (model_id,) = _need(body, "model_id")
        tm = svc.model(model_id)
        name = body.get("path") or f"state-{tm.steps:06d}"
        if not NAME.match(name):
            raise ServeError(f"checkpoint name {name!r}: letters, digits, '.', '_' and '-' only")

        def job():
            folder = svc.folder(model_id, "weights", name)
            if folder.exists() and not body.get("overwrite", True):
                raise ServeError(f"checkpoint {name} exists (overwrite=True replaces it)")
            tm.save_state(folder)
            path = f"tinker://{model_id}/weights/{name}"
            svc.event(event="save_state", model_id=model_id, path=path, optimizer_steps=tm.steps, folder=str(folder))
            return Result(body={"path": path, "type": "save_weights"})
        return future("SaveWeights", job, model_id)

    async def load_weights(request):
        body = await _body(request)
        (path,) = _need(body, "path")
        with_optimizer = bool(body.get("optimizer"))
        if body.get("model_id") is not None:
            model_id = body["model_id"]
            svc.model(model_id)
        else:
            sid, seq = _need(body, "session_id", "model_seq_id")
            model_id = f"{sid}:train:{seq}"

        def job():
            _, kind, folder = svc.tinker_path(path)
            if kind != "weights":
                raise ServeError(f"{path}: sampler weights hold no optimizer state; load a save_state checkpoint "
                                 "(tinker://.../weights/<name>)")
            if model_id not in svc.models:  # create-via-load: the model the checkpoint was saved from
                meta = session.read_meta(folder)["lora"]
                if body.get("base_model"):
                    svc.check_base(body["base_model"])
                svc.new_model(model_id, session.Lora(**{k: meta[k] for k in ("rank", "seed", "train_mlp", "train_attn",
                                                                             "train_unembed")}))
            svc.models[model_id].load_state(folder, optimizer=with_optimizer)
            svc.event(event="load_state", model_id=model_id, path=path, optimizer=with_optimizer)
            return Result(body={"path": path, "model_id": model_id, "type": "load_weights"})
        return future("LoadWeights", job, model_id)

    async def save_for_sampler(request):
        body = await _body(request)
        (model_id,) = _need(body, "model_id")
        tm = svc.model(model_id)
        name = body.get("path")
        if name is not None and not NAME.match(name):
            raise ServeError(f"sampler weights name {name!r}: letters, digits, '.', '_' and '-' only")

        def job():
            if name is None:  # an unnamed snapshot for save_weights_and_get_sampling_client
                sid = f"sampler-{uuid.uuid4().hex[:12]}"
                svc.samplers[sid] = {"lora": tm.lora, "adapter": tm.adapter(), "model_path": None}
                svc.event(event="sampler_snapshot", model_id=model_id, sampler=sid, optimizer_steps=tm.steps)
                return Result(body={"path": None, "sampling_session_id": sid, "type": "save_weights_for_sampler"})
            folder = svc.folder(model_id, "sampler_weights", name)
            tm.save_adapter(folder)
            path = f"tinker://{model_id}/sampler_weights/{name}"
            svc.event(event="save_weights_for_sampler", model_id=model_id, path=path, optimizer_steps=tm.steps)
            return Result(body={"path": path, "type": "save_weights_for_sampler"})
        return future("SaveWeightsForSampler", job, model_id)

    async def create_sampling_session(request):
        body = await _body(request)
        path = body.get("model_path")
        sid = f"sampler-{uuid.uuid4().hex[:12]}"
        if path:
            _, kind, folder = svc.tinker_path(path)
            lora = session.Lora(**{k: v for k, v in session.read_meta(folder)["lora"].items()
                                   if k in ("rank", "train_mlp", "train_attn")})
            sub = "adapter_model.safetensors" if kind == "sampler_weights" else None
            if sub is None:
                raise ServeError(f"{path}: sample from sampler weights (save_weights_for_sampler), not a training state")
            # read now (in the request): a sampler is ready when its id is handed out
            svc.samplers[sid] = {"lora": lora, "adapter": session.load_adapter(svc.engine(lora), folder),
                                 "model_path": path}
        else:
            svc.check_base(body.get("base_model"))
            svc.samplers[sid] = {"lora": None, "adapter": None, "model_path": None}
        return JSONResponse({"type": "create_sampling_session", "sampling_session_id": sid})

    async def get_sampler(request):
        sid = request.path_params["sid"]
        if sid not in svc.samplers:
            return JSONResponse({"error": f"no sampler {sid!r}"}, status_code=404)
        return JSONResponse({"sampler_id": sid, "base_model": svc.base_name,
                             "model_path": svc.samplers[sid]["model_path"]})

    async def asample(request):
        body = await _body(request)
        prompt = [t for c in (body.get("prompt") or {}).get("chunks", []) for t in c.get("tokens", [])]
        sid = body.get("sampling_session_id")
        if sid is None:  # a one-off sample by base model or path
            svc.check_base(body.get("base_model"))
            spec = {"lora": None, "adapter": None}
        elif sid in svc.samplers:
            spec = svc.samplers[sid]
        else:
            raise ServeError(f"no sampling session {sid!r}")
        n = int(body.get("num_samples", 1))
        params = body.get("sampling_params") or {}
        unsupported = [k for k in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")
                       if body.get(k)] + [k for k in ("target_prompt_logprobs", "prompt_logprobs_last_n") if body.get(k)]
        if unsupported:
            raise ServeError(f"sample: {', '.join(unsupported)} not served (prompt_logprobs and token logprobs are)")

        def job():
            engine = svc.engine(spec["lora"] or session.Lora(rank=8))
            seqs, plp = session.sample(engine, spec["adapter"], svc.tokenizer, svc.run, prompt, n, params,
                                       bool(body.get("prompt_logprobs")), svc.max_position)
            return Result(proto=wire.encode_sample(seqs, plp))
        rid = store.submit("Sample", job)
        return JSONResponse({"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(n)]})

    async def retrieve_future(request):
        (rid,) = _need(await _body(request), "request_id")
        entry = await store.wait(rid, svc.serve.poll_s)
        if entry is None:
            return JSONResponse({"error": f"no future {rid!r} here (futures do not outlive a restart of the "
                                          "service)", "category": "user"})
        if not entry.done.is_set():
            return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"})
        if entry.error is not None:
            return JSONResponse({"error": entry.error, "category": entry.category})
        if entry.result.proto is not None:
            return Response(entry.result.proto, media_type="application/x-protobuf")
        return JSONResponse(entry.result.body)

    async def cancel_future(request):
        return JSONResponse(None)

    async def auth_token(request):
        return JSONResponse({"error": "this service takes API keys (X-API-Key), not token exchange"},
                            status_code=400, headers={"x-should-retry": "false"})

    async def not_served(request):
        return JSONResponse({"error": f"{request.method} {request.url.path} is not served by workbench.serve "
                                      "(see docs/guides/tinker.md for what is)"}, status_code=404,
                            headers={"x-should-retry": "false"})

    post = {"client/config": client_config, "client/dynamic_config": dynamic_config,
            "create_session": create_session, "session_heartbeat": heartbeat, "telemetry": telemetry,
            "create_model": create_model, "get_info": get_info, "forward_backward": forward_backward,
            "optim_step": optim_step, "save_weights": save_weights, "load_weights": load_weights,
            "save_weights_for_sampler": save_for_sampler, "create_sampling_session": create_sampling_session,
            "asample": asample, "retrieve_future": retrieve_future, "cancel_future": cancel_future,
            "auth/token": auth_token, "sessions/{sid}/finish": finish_session}
    get = {"healthz": healthz, "get_server_capabilities": capabilities, "samplers/{sid}": get_sampler}
    routes = [Route(f"/api/v1/{p}", route(f), methods=["POST"]) for p, f in post.items()]
    routes += [Route(f"/api/v1/{p}", route(f), methods=["GET"]) for p, f in get.items()]
    routes.append(Route("/{rest:path}", route(not_served), methods=["GET", "POST", "PUT", "DELETE"]))
    return Starlette(routes=routes)
