"""The FastAPI app: OpenAI's chat and text completion endpoints over drafttree's decoding methods.

    POST /v1/chat/completions   messages → reply (stream: true → server-sent events, OpenAI's chunks)
    POST /v1/completions        prompt (text or token ids) → continuation
    GET  /v1/models             the one model served
    GET  /health                active and waiting requests, bytes of decode state held

Every request is checked before it is queued (drafttree.apps.serve.protocol); a refusal is OpenAI's error
body with status 400 (bad value), 401 (API key), 404 (model or route), 413 (body too large) or 429
(queue full), never a traceback. Decoding runs on the scheduler's one worker thread; each request waits
on its own asyncio queue, fed from that thread with `loop.call_soon_threadsafe`. A client that goes away
(mid-stream or while waiting for a whole reply) cancels its job, which frees its state.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import sys
import threading
import traceback

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import DEFAULT_MAX_TOKENS, MAX_BODY_BYTES
from . import protocol as P
from .scheduler import Job, QueueFull, Scheduler, ShuttingDown
from .text import OutputText


class _SSEResponse(StreamingResponse):
    """A streaming response that runs `on_close` however it ends: finished, client gone, or cancelled."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except OSError:  # the client closed the connection while we were writing to it
            pass
        finally:
            self.on_close()


def _rss_bytes() -> int | None:
    """This process's resident memory (Linux), for /health."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _json(status: int, body: dict) -> JSONResponse:
    return JSONResponse(P.finite(body), status_code=status)


def create_app(target, decoder, *, model_id: str | None = None, methods=None, default_method: str = "caddtree-online",
               api_key: str | None = None, max_concurrency: int = 8, max_waiting: int = 1024,
               max_body_bytes: int = MAX_BODY_BYTES, default_max_tokens: int = DEFAULT_MAX_TOKENS,
               worker_thread: bool = True) -> FastAPI:
    """The app serving `target` through `decoder` (drafttree.methods.Decoder: `.sequence(method, ...)`).
    `worker_thread` False: the caller runs the rounds (`app.state.scheduler.run_here()`, as `drafttree serve` does)."""
    if methods is None:
        from ...methods import METHODS as methods
    methods = tuple(methods)
    if default_method not in methods:
        raise ValueError(f"default method {default_method!r} is not one of {methods}")
    if target.tokenizer is None:
        raise ValueError(f"model {target.name!r} has no tokenizer files: the server needs one to read and write text")
    model_id = model_id or target.name
    max_context = int(target.model.config.max_position_embeddings)
    vocab_size = int(target.model.config.vocab_size)
    # Prompts are encoded one at a time on the thread pool; the worker decodes replies meanwhile without a
    # lock (a fast tokenizer's encode and decode only read it), so a huge prompt never stalls the streams.
    encode_lock = threading.Lock()
    if hasattr(decoder, "prepare"):  # a fake decoder in tests has none
        decoder.prepare(methods)  # every method's proposer now (drafter, cost model), not on a request
    scheduler = Scheduler(decoder, max_concurrency=max_concurrency, max_waiting=max_waiting, worker_thread=worker_thread)
    created = P.now()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            await run_in_threadpool(scheduler.stop)

    app = FastAPI(title="drafttree", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler
    app.state.model_id = model_id

    # ---- errors: OpenAI's body, never a traceback ------------------------------------------------

    @app.exception_handler(P.ApiError)
    async def _api_error(request, exc: P.ApiError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg, code = f"no route {request.method} {request.url.path}", "not_found"
        elif exc.status_code == 405:
            msg, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            msg, code = str(exc.detail), None
        return _json(exc.status_code, P.error_body(msg, code=code))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        return _json(400, P.error_body(f"invalid request: {exc.errors()[0].get('msg', 'invalid value')}"))

    @app.exception_handler(Exception)
    async def _server_error(request, exc: Exception):
        print(f"drafttree serve: error on {request.url.path}:\n{traceback.format_exc()}", file=sys.stderr)
        return _json(500, P.error_body(f"internal error ({type(exc).__name__})", type="server_error"))

    # ---- shared steps ----------------------------------------------------------------------------

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise P.ApiError(401, "You didn't provide an API key: send the header 'Authorization: Bearer YOUR_KEY'",
                             param=None, code="invalid_api_key")
        if not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise P.ApiError(401, "Incorrect API key provided", code="invalid_api_key")

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise P.ApiError(413, f"the request body is {int(declared)} bytes; at most {max_body_bytes} are accepted",
                             code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise P.ApiError(413, f"the request body is over {max_body_bytes} bytes", code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse(request: Request, cls):
        authorize(request)
        req = P.parse_request(cls, P.parse_json(await read_body(request)))
        if req.model != model_id:
            raise P.ApiError(404, f"The model `{req.model}` does not exist; this server serves `{model_id}`",
                             param="model", code="model_not_found")
        return req, P.check_settings(req, methods, default_method, max_context)

    def encode(fn, *args):
        with encode_lock:
            try:
                return [int(t) for t in fn(*args)]
            except Exception as e:  # e.g. a chat template that refuses this sequence of roles
                raise P.bad_request(f"the prompt could not be tokenized ({type(e).__name__}: {e})",
                                    code="invalid_value") from None

    def submit(prompt_ids: list[int], settings: P.Settings, param: str):
        import torch

        max_tokens = P.fit_context(len(prompt_ids), settings.max_tokens, max_context, default_max_tokens, param)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(event):
            loop.call_soon_threadsafe(queue.put_nowait, event)

        job = Job(settings.method, torch.tensor(prompt_ids, dtype=torch.long), max_tokens, settings.sampling,
                  OutputText(target.tokenizer, settings.stops), deliver)
        try:
            scheduler.submit(job)
        except ShuttingDown as e:
            raise P.ApiError(503, str(e), type="server_error", code="unavailable") from None
        except QueueFull as e:
            raise P.ApiError(429, f"the server is busy: {e}; retry later", type="rate_limit_error",
                             code="rate_limit_exceeded") from None
        return job, queue

    def extension(settings: P.Settings, event: dict) -> dict:
        stats = event.get("stats") or {}
        out = {"method": settings.method}
        for k in ("tau", "rounds", "mean_tree_size", "tokens_per_s", "prefill_s", "total_s"):
            if k in stats:
                out[k] = stats[k]
        out.update(event.get("timing") or {})
        return out

    async def collect(request: Request, job: Job, queue: asyncio.Queue) -> tuple[str, dict]:
        """The whole reply; a client that disconnects meanwhile cancels the job."""

        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            queue.put_nowait({"type": "disconnect"})

        watcher = asyncio.create_task(watch())
        parts = []
        try:
            while True:
                event = await queue.get()
                if event["type"] == "text":
                    parts.append(event["text"])
                elif event["type"] == "done":
                    return "".join(parts), event
                elif event["type"] == "error":
                    raise P.ApiError(500, event["message"], type="server_error")
                else:  # disconnect: nobody will read the reply
                    raise P.ApiError(499, "client closed the request")
        finally:
            watcher.cancel()
            scheduler.cancel(job)

    def stream(job: Job, queue: asyncio.Queue, settings: P.Settings, rid: str, prompt_tokens: int, chat: bool):
        made = P.now()
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text=None, finish_reason=None, ext=None, role=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
                return P.sse(P.chat_chunk(rid, made, model_id, delta, finish_reason, ext))
            return P.sse(P.text_chunk(rid, made, model_id, text or "", finish_reason, ext))

        async def events():
            if chat:
                yield chunk(role=True)
            while True:
                event = await queue.get()
                if event["type"] == "text":
                    yield chunk(event["text"])
                elif event["type"] == "done":
                    yield chunk(None, event["finish_reason"], extension(settings, event))
                    if settings.include_usage:
                        yield P.sse(P.usage_chunk(rid, made, model_id, obj,
                                                  P.usage(prompt_tokens, event["completion_tokens"])))
                    break
                else:
                    yield P.sse(P.error_body(event["message"], type="server_error"))
                    break
            yield P.SSE_DONE

        return _SSEResponse(events(), on_close=lambda: scheduler.cancel(job))

    # ---- routes ----------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        h = scheduler.health()
        ok = h["worker_alive"]
        return _json(200 if ok else 503, {"status": "ok" if ok else "error: the decode worker is not running",
                                          "model": model_id, **h, "rss_bytes": _rss_bytes()})

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [P.model_card(model_id, created)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        authorize(request)
        if name != model_id:
            raise P.ApiError(404, f"The model `{name}` does not exist", param="model", code="model_not_found")
        return P.model_card(model_id, created)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, settings = await parse(request, P.ChatCompletionRequest)
        messages = P.chat_messages(req)
        ids = await run_in_threadpool(encode, target.encode_chat, messages)
        job, queue = submit(ids, settings, "messages")
        rid = P.new_id("chatcmpl")
        if settings.stream:
            return stream(job, queue, settings, rid, len(ids), chat=True)
        text, done = await collect(request, job, queue)
        return _json(200, P.chat_completion(rid, P.now(), model_id, text, done["finish_reason"],
                                            P.usage(len(ids), done["completion_tokens"]), extension(settings, done)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, settings = await parse(request, P.CompletionRequest)
        prompt = P.completion_prompt(req)
        if isinstance(prompt, str):
            ids = await run_in_threadpool(encode, target.encode, prompt)
        else:
            ids = P.check_token_prompt(prompt, vocab_size)
        job, queue = submit(ids, settings, "prompt")
        rid = P.new_id("cmpl")
        if settings.stream:
            return stream(job, queue, settings, rid, len(ids), chat=False)
        text, done = await collect(request, job, queue)
        return _json(200, P.text_completion(rid, P.now(), model_id, text, done["finish_reason"],
                                            P.usage(len(ids), done["completion_tokens"]), extension(settings, done)))

    return app
