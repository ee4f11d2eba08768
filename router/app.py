"""The router's HTTP edge: builds the FastAPI app (OpenAI routes, /health, /metrics), owns startup and shutdown,
and turns every APIError into OpenAI-shaped JSON."""

import contextlib
import logging
import time
from dataclasses import dataclass

import msgspec
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from pdserve.discovery.endpoints import Discovery, FileDiscovery, KubernetesDiscovery, StaticDiscovery
from pdserve.http.slow_clients import client_left
from pdserve.text.generation_defaults import GenerationDefaults
from pdserve.text.reasoning import ReasoningFormat
from pdserve.text.tokenizer import PromptTokenizer
from pdserve.wire.client import WorkerSession
from pdserve_router import openai_schema as schema
from pdserve_router.admission import Admission, authenticate, read_body_limited
from pdserve_router.config import RouterConfig
from pdserve_router.dispatch import Dispatcher
from pdserve_router.errors import APIError
from pdserve_router.hot_routes import RouterApp
from pdserve_router.metrics import RouterMetrics
from pdserve_router.policies import LocalPrefillRule, make_policy
from pdserve_router.prefix_index import PrefixIndex
from pdserve_router.responses_api_request import ResponsesRequest, as_responses_error, chat_request_of
from pdserve_router.serving import Serving
from pdserve_router.text_workers import TextWorkers
from pdserve_router.workers import WorkerPool

logger = logging.getLogger(__name__)


@dataclass
class RouterParts:
    """What the routes use, built once per app."""

    config: RouterConfig
    metrics: RouterMetrics
    admission: Admission
    pool: WorkerPool | None = None
    serving: Serving | None = None


def make_discovery(config: RouterConfig) -> Discovery:
    if config.discovery == "k8s":
        return KubernetesDiscovery(config.k8s_namespace, config.k8s_label_selector)
    if config.discovery == "file":
        return FileDiscovery(config.workers_file)
    return StaticDiscovery(config.worker_urls)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


_ERRORS = {
    400: "a field is malformed, out of range, or an OpenAI field this server does not implement (`param` names it)",
    401: "missing or wrong API key",
    404: "the model is not the one this router serves",
    408: "the request did not arrive whole within --request-read-timeout-s",
    413: "the body exceeds max_body_bytes",
    429: "too many requests in flight (for the router or the API key); see Retry-After",
}
_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def _openapi(request_type: type | None, statuses: tuple[int, ...]) -> tuple[dict, dict]:
    """The route's OpenAPI additions (request body, every 4xx it returns) and the component schemas they use."""
    types = [schema.ErrorResponse] + ([request_type] if request_type is not None else [])
    refs, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    extra: dict = {"responses": {str(status): {"description": _ERRORS[status], "content": {"application/json": {"schema": _ERROR_REF}}}
                                 for status in statuses}}
    if request_type is not None:
        extra["requestBody"] = {"required": True, "content": {"application/json": {"schema": refs[1]}}}
    return extra, components


def build_router_app(config: RouterConfig, discovery: Discovery | None = None) -> FastAPI:
    """The router app; `discovery` overrides the one the config names (tests, `pdserve up`)."""
    tokenizer = PromptTokenizer(config.model_dir)
    text_workers = TextWorkers(config.text_threads)
    metrics = RouterMetrics(config.model_name, config.routing)
    parts = RouterParts(config, metrics, Admission(config.max_concurrent_requests, config.max_streams_per_api_key, config.retry_after_s))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        http = WorkerSession(config.internal_token)
        worker_discovery = discovery if discovery is not None else make_discovery(config)
        index = PrefixIndex(pending_ttl_s=config.pending_assignment_ttl_s)
        pool = WorkerPool(worker_discovery, http, index, metrics, config.health_interval_s, config.health_timeout_s,
                          config.eject_after_failures, config.eject_unresponsive_after_s)
        dispatcher = Dispatcher(pool, index, make_policy(config.routing, config.prefix_weight, config.load_weight),
                                metrics, config.max_attempts, config.first_token_timeout_s, config.retry_after_s,
                                tokenizer.detokenizer, config.max_migrations,
                                LocalPrefillRule(config.local_prefill_max_tokens, config.local_prefill_min_queue,
                                                 config.local_prefill_min_wait_ms / 1e3,
                                                 config.local_prefill_max_stall_ms / 1e3,
                                                 config.local_prefill_long_step_share),
                                config.prefill_fallback)
        parts.pool = pool
        parts.serving = Serving(
            tokenizer, dispatcher, metrics, config.model_name,
            lambda: config.max_model_len or pool.max_model_len(), config.max_n, config.max_tokens_limit, config.retry_after_s,
            text_workers, config.max_prompt_chars, GenerationDefaults.from_model_dir(config.model_dir),
            ReasoningFormat.for_model(tokenizer.tokenizer, tokenizer.chat_template) if config.separate_reasoning else None,
        )
        pool.start()
        try:
            yield
        finally:
            await pool.close()
            worker_discovery.close()
            await http.close()
            text_workers.close()

    app = RouterApp(title="pdserve router", lifespan=lifespan)
    app.state.parts = parts

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, error: APIError) -> JSONResponse:
        # 401s are not counted (anyone can produce them); 502s and 499s were counted where they happened.
        status_label = {429: "rate_limited", 503: "unavailable"}.get(error.status)
        if status_label is None and 400 <= error.status < 499 and error.status != 401:
            status_label = "rejected"
        if status_label is not None and request.url.path.startswith("/v1/"):
            metrics.count_request(status_label)
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(error.status_code, str(error.detail), code="not_found" if error.status_code == 404 else None))

    app.add_exception_handler(ClientDisconnect, client_left)

    @app.exception_handler(Exception)
    async def on_unexpected_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(error).__name__}", type="server_error"))

    def check_key(request: Request) -> str:
        return authenticate(request.headers.get("authorization"), config.api_keys)

    async def handle_generation(request: Request, kind: str) -> Response:
        arrival_s = time.monotonic()
        api_key = check_key(request)
        body = await read_body_limited(request, config.max_body_bytes)
        if parts.serving is None:
            raise APIError(503, "the router is starting", type="server_error", headers={"Retry-After": "1"})
        serving, responses_request = parts.serving, None
        if kind == "chat":
            parsed = schema.decode_request(body, schema.ChatCompletionRequest)
            plan = await serving.plan_chat(parsed)
        elif kind == "responses":
            responses_request = schema.decode_request(body, ResponsesRequest)
            try:
                parsed = chat_request_of(responses_request)
                plan = await serving.plan_chat(parsed)
            except APIError as error:
                raise as_responses_error(error) from None
        else:
            parsed = schema.decode_request(body, schema.CompletionRequest)
            plan = await serving.plan_completion(parsed)
        builder = serving.builder(kind, plan, responses_request)
        release = parts.admission.enter(api_key)
        try:
            return await serving.respond(parsed, plan, builder, request, arrival_s, release)
        except BaseException:
            release()
            raise

    generation_errors = (400, 401, 404, 408, 413, 429)
    completion_extra, completion_components = _openapi(schema.CompletionRequest, generation_errors)
    chat_extra, chat_components = _openapi(schema.ChatCompletionRequest, generation_errors)
    responses_extra, responses_components = _openapi(ResponsesRequest, generation_errors)
    tokenize_extra, tokenize_components = _openapi(schema.TokenizeRequest, (400, 401, 404, 408, 413))
    detokenize_extra, detokenize_components = _openapi(schema.DetokenizeRequest, (400, 401, 404, 408, 413))

    @app.post("/v1/completions", openapi_extra=completion_extra)
    async def completions(request: Request) -> Response:
        return await handle_generation(request, "completion")

    @app.post("/v1/chat/completions", openapi_extra=chat_extra)
    async def chat_completions(request: Request) -> Response:
        return await handle_generation(request, "chat")

    @app.post("/v1/responses", openapi_extra=responses_extra)
    async def responses(request: Request) -> Response:
        return await handle_generation(request, "responses")

    app.hot_posts.update({"/v1/completions": completions, "/v1/chat/completions": chat_completions,
                          "/v1/responses": responses})

    def model_card() -> dict:
        model = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "pdserve"}
        max_model_len = config.max_model_len or (parts.pool.max_model_len() if parts.pool else None)
        if max_model_len:
            model["max_model_len"] = max_model_len
        return model

    @app.get("/v1/models", openapi_extra=_openapi(None, (401,))[0])
    async def models(request: Request) -> dict:
        check_key(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", openapi_extra=_openapi(None, (401, 404))[0])
    async def model(request: Request) -> dict:
        check_key(request)
        model_id = request.path_params["model_id"]  # not a declared parameter: FastAPI would document a 422
        if model_id != config.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist; this router serves `{config.model_name}`.",
                           param="model", code="model_not_found")
        return model_card()

    async def text_request(request: Request, request_type: type) -> tuple:
        check_key(request)
        body = await read_body_limited(request, config.max_body_bytes)
        if parts.serving is None:
            raise APIError(503, "the router is starting", type="server_error", headers={"Retry-After": "1"})
        return parts.serving, schema.decode_request(body, request_type)

    @app.post("/tokenize", openapi_extra=tokenize_extra)
    async def tokenize(request: Request) -> dict:
        serving, parsed = await text_request(request, schema.TokenizeRequest)
        return await serving.tokenize(parsed)

    @app.post("/detokenize", openapi_extra=detokenize_extra)
    async def detokenize(request: Request) -> dict:
        serving, parsed = await text_request(request, schema.DetokenizeRequest)
        return await serving.detokenize(parsed)

    @app.get("/health")
    async def health() -> dict:
        workers = parts.pool.workers.values() if parts.pool else []
        return {
            "status": "ok",
            "workers": {w.url: ("ok" if w.routable else (w.health.status if w.admitted and w.health else "ejected")) for w in workers},
        }

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness (Kubernetes sends traffic only to a ready router): a prefill path to a decode rank, or a
        colocated worker, is routable now. /health stays liveness: a router with no workers is alive."""
        routable = parts.serving is not None and parts.serving.dispatcher.can_serve()
        return JSONResponse({"status": "ready" if routable else "no routable worker"}, 200 if routable else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    original_openapi = app.openapi

    def openapi_with_request_schemas() -> dict:
        document = original_openapi()
        document.setdefault("components", {}).setdefault("schemas", {}).update(
            {**completion_components, **chat_components, **responses_components, **tokenize_components,
             **detokenize_components})
        return document

    app.openapi = openapi_with_request_schemas
    return app
