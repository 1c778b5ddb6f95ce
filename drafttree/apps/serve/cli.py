"""`drafttree serve`: load the model and its drafter once, warm up, and serve the OpenAI API with uvicorn."""
from __future__ import annotations

import argparse
import os
import sys
import threading

from ...compute import add_compute_argument, compute_of
from ...validate import InputError, check_int, check_positive_int
from . import DEFAULT_MAX_TOKENS, MAX_BODY_BYTES

API_KEY_ENV = "DRAFTTREE_API_KEY"


def add_parser(subparsers) -> argparse.ArgumentParser:
    from ...methods import METHODS

    s = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and text completions, "
                              "streaming, many clients at once)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name, checkpoint directory or .gguf file")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    add_compute_argument(s)
    s.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    s.add_argument("--method", default="caddtree-online", choices=list(METHODS),
                   help="decoding method of requests that do not name one in the body field `method`")
    s.add_argument("--drafter", default=None, help="drafter directory (default: the one shipped for the model)")
    s.add_argument("--budget", type=int, default=16, help="draft-tree nodes for method ddtree")
    from ...methods import add_weaver_args

    add_weaver_args(s)
    s.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set, else none)")
    s.add_argument("--max-concurrency", type=int, default=8, help="requests decoded at once; the rest wait in order")
    s.add_argument("--max-waiting", type=int, default=1024, help="requests allowed to wait; more get 429")
    s.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="larger request bodies get 413")
    s.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="max_tokens of requests that do not set it (cut to the context the prompt leaves)")
    s.add_argument("--no-warmup", action="store_true", help="skip the warm-up decode before serving")
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)
    return s


def check_serve_args(a) -> None:
    check_int("--port", a.port, 0, 65535)
    for name in ("max_concurrency", "max_waiting", "max_body_bytes", "default_max_tokens"):
        check_positive_int("--" + name.replace("_", "-"), getattr(a, name))
    if a.api_key is not None and not a.api_key.strip():
        raise InputError("--api-key must not be empty")


def available_methods(decoder, default: str) -> tuple[str, ...]:
    """Every method whose proposer can be built here, built now (the drafter loads once; the cost-aware
    methods share one cost model, profiled once per machine), so no request pays for it. Without a drafter
    for the model only the methods that need none are served ("ar", "lookup"), unless the default method
    needs one: then that is the error."""
    from ...methods import METHODS

    methods, missing = ["ar"], None
    for m in METHODS[1:]:
        try:
            decoder.proposer(m)
        except FileNotFoundError as e:
            if m == default:
                raise
            missing = e
            continue
        methods.append(m)
    if missing is not None:
        print(f"drafttree serve: only methods {', '.join(methods)}: {missing}", file=sys.stderr)
    return tuple(methods)


def warm_up(decoder, target, method: str) -> None:
    """One short decode: first calls pay one-off costs (allocations, kernel dispatch)."""
    from ...sampling import SamplingParams

    seq = decoder.sequence(method, target.encode_chat("Hi"), max_new_tokens=4, sampling=SamplingParams())
    try:
        while not seq.done:
            seq.step()
    finally:
        seq.close()


def cmd_serve(a) -> int:
    import uvicorn

    from ...load import load_target
    from ...methods import Decoder
    from .app import create_app

    check_serve_args(a)
    api_key = a.api_key if a.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if a.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"drafttree serve: warning: listening on {a.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    target = load_target(a.model, compute=compute_of(a), threads=a.threads)
    if target.tokenizer is None:
        raise InputError(f"{a.model} has no tokenizer files: the server reads and writes text")
    decoder = Decoder(target, drafter=a.drafter, budget=a.budget, weaver=getattr(a, "weaver", None),
                      weaver_width=getattr(a, "weaver_width", 8))
    methods = available_methods(decoder, a.method)
    if not a.no_warmup:
        warm_up(decoder, target, a.method)
    name = a.served_model_name or a.model
    app = create_app(target, decoder, model_id=name, methods=methods, default_method=a.method, api_key=api_key,
                     max_concurrency=a.max_concurrency, max_waiting=a.max_waiting, max_body_bytes=a.max_body_bytes,
                     default_max_tokens=a.default_max_tokens, worker_thread=False)
    print(f"drafttree serve: http://{a.host}:{a.port}/v1 serving {name} ({target.compute_label}); methods "
          f"{', '.join(methods)} (default {a.method}); {a.max_concurrency} requests decoded at once"
          f"{'; API key required' if api_key else ''}", file=sys.stderr)
    # The HTTP loop in a thread, the model's rounds here on the main thread that loaded it (Scheduler.run_here says
    # why); Ctrl-C reaches this thread, which stops both.
    server = uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level))

    def serve_http() -> None:
        try:
            server.run()
        finally:  # the HTTP loop ended (shut down, or it could not start): the rounds end too
            app.state.scheduler.stop()

    http = threading.Thread(target=serve_http, name="drafttree-http", daemon=True)
    http.start()
    try:
        app.state.scheduler.run_here()
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(30)
    return 0
