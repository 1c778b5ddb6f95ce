"""OpenAI-compatible request bodies, their checks, and the response and error bodies.

Structure (which fields, strings, lists, booleans) is checked by the pydantic models; values (integers,
ranges, finite numbers) by drafttree.validate, the same functions the command line uses, so a value the
CLI refuses the server refuses too, with the same words. Every refusal is an `ApiError`, which the app
turns into OpenAI's error body {"error": {"message", "type", "param", "code"}}.

Fields OpenAI defines that this server does not implement are refused when set to something that would
change the output (n > 1, logprobs, tools, penalties, ...); fields that only label a request (user,
metadata, store, ...) and unknown fields are accepted and ignored.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from ...sampling import SamplingParams
from ...validate import InputError, check_int, check_sampling, check_token_ids

MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 1000
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)  # what torch.Generator.manual_seed takes
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---- request bodies ------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # other fields: accepted, and refused below if they matter


class ContentPart(_Body):
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(_Body):
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Request(_Body):
    model: StrictStr
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    # numbers are checked by drafttree.validate (ints that are not bools, finite floats, ranges)
    max_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None  # extension (not in OpenAI's API): 0 = off
    seed: Any = None
    n: Any = None
    method: Any = None  # extension: the decoding method of this request


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: Any = None  # OpenAI's newer name for max_tokens


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]


# Set to anything but these values, a field asks for something this server does not do.
UNSUPPORTED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
    "function_call": (None, "none"), "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
}


def parse_json(body: bytes) -> dict:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, too-long integer literals
        raise bad_request(f"could not parse the JSON body of the request: {_short(e)}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(obj).__name__}", code="invalid_json")
    return obj


def parse_request(cls: type[_Request], obj: dict) -> _Request:
    try:
        req = cls.model_validate(obj)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _loc(err["loc"])
        raise bad_request(f"{param}: {err['msg']}" if param else err["msg"], param=param or None,
                          code="invalid_type" if err["type"] != "missing" else "missing_field") from None
    for name, allowed in UNSUPPORTED.items():
        value = (req.model_extra or {}).get(name)
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise bad_request(f"{name}={_short(value)} is not supported by this server", param=name,
                              code="unsupported_parameter")
    fmt = (req.model_extra or {}).get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_request("only response_format {\"type\": \"text\"} is supported", param="response_format",
                          code="unsupported_parameter")
    return req


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's names of union branches


def _loc(loc) -> str:
    """("messages", 0, "content", "str") -> "messages[0].content": union branch names are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in _TYPE_TAGS and not any(c in part for c in "[]()"):  # e.g. "list[int]"
            out += ("." if out else "") + part
    return out


def _short(value, limit: int = 120) -> str:
    text = repr(value) if not isinstance(value, Exception) else str(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ---- checked settings ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What a request asks for, checked: everything the scheduler needs except the prompt."""

    method: str
    max_tokens: int | None  # None: as many as fit, up to the server's default
    sampling: SamplingParams
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool


def _checked(param: str, check, *args):
    """Run a drafttree.validate check; its InputError becomes a 400 naming `param`."""
    try:
        return check(*args)
    except InputError as e:
        raise bad_request(str(e), param=param, code="invalid_value") from None


def check_settings(req: _Request, methods, default_method: str, max_context: int) -> Settings:
    n = 1 if req.n is None else _checked("n", check_int, "n", req.n, 1)
    if n != 1:
        raise bad_request(f"n must be 1 (one choice per request), got {n}", param="n", code="unsupported_parameter")
    method = default_method if req.method is None else req.method
    if not isinstance(method, str) or method not in methods:
        raise bad_request(f"method must be one of {', '.join(methods)}, got {_short(method)}", param="method",
                          code="invalid_value")
    max_tokens, param = req.max_tokens, "max_tokens"
    if getattr(req, "max_completion_tokens", None) is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is not None:
        max_tokens = _checked(param, check_int, param, max_tokens, 1, max_context)
    temperature = 1.0 if req.temperature is None else req.temperature  # OpenAI's default; 0 = greedy
    top_p = 1.0 if req.top_p is None else req.top_p
    top_k = 0 if req.top_k is None else req.top_k
    _checked("temperature", check_sampling, temperature, 1.0, 0)
    _checked("top_p", check_sampling, 0.0, top_p, 0)
    _checked("top_k", check_sampling, 0.0, 1.0, top_k)
    seed = None if req.seed is None else _checked("seed", check_int, "seed", req.seed, *SEED_RANGE)
    sampling = SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=top_k, seed=seed)
    stops = () if req.stop is None else (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    if len(stops) > MAX_STOPS:
        raise bad_request(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop", code="invalid_value")
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", param="stop", code="invalid_value")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"stop strings are at most {MAX_STOP_CHARS} characters", param="stop", code="invalid_value")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", param="stream_options",
                          code="invalid_value")
    return Settings(method, max_tokens, sampling, stops, req.stream, include_usage)


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """The messages as encode_chat takes them: role (developer → system) and content as one string."""
    if not req.messages:
        raise bad_request("messages must not be empty", param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(req.messages):
        role = CHAT_ROLES.get(m.role)
        if role is None:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {_short(m.role)}",
                              param=f"messages[{i}].role", code="invalid_value")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}].content[{j}]: only text parts are supported",
                                      param=f"messages[{i}].content[{j}]", code="unsupported_parameter")
            content = "".join(part.text for part in m.content)
        else:
            content = m.content or ""
        out.append({"role": role, "content": content})
    return out


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The prompt as text or token ids; a list of several prompts is a batch, which is n > 1 in disguise."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise bad_request(f"one prompt per request (got a batch of {len(p)})", param="prompt",
                              code="unsupported_parameter")
        p = p[0]
    return p


def check_token_prompt(ids: list[int], vocab_size: int) -> list[int]:
    """Token ids of this model (drafttree.validate.check_token_ids: integers, non-empty, in [0, vocab))."""
    return _checked("prompt", check_token_ids, ids, vocab_size).tolist()


def fit_context(prompt_tokens: int, max_tokens: int | None, max_context: int, default_max_tokens: int,
                param: str) -> int:
    """max_tokens for this prompt: the request's, or the default cut to the room the prompt leaves (the
    engine shrinks a draft tree near the end of the context, so prompt + reply may fill it)."""
    if prompt_tokens == 0:
        raise bad_request("the prompt is empty (0 tokens)", param=param, code="invalid_value")
    room = max_context - prompt_tokens
    if max_tokens is None:
        max_tokens = min(default_max_tokens, room)
    if max_tokens < 1 or max_tokens > room:
        asked = max(max_tokens, 1)
        raise bad_request(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{prompt_tokens + asked} tokens ({prompt_tokens} in the {param}, {asked} in the completion). "
            "Please reduce the length of the prompt or of the completion.",
            param=param, code="context_length_exceeded")
    return max_tokens


# ---- response bodies -----------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_completion(id: str, created: int, model: str, text: str, finish_reason: str, use: dict, ext: dict) -> dict:
    return {"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": use, "drafttree": ext}


def chat_chunk(id: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
               ext: dict | None = None) -> dict:
    out = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    if ext is not None:
        out["drafttree"] = ext
    return out


def text_completion(id: str, created: int, model: str, text: str, finish_reason: str, use: dict, ext: dict) -> dict:
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": use, "drafttree": ext}


def text_chunk(id: str, created: int, model: str, text: str, finish_reason: str | None = None,
               ext: dict | None = None) -> dict:
    out = {"id": id, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if ext is not None:
        out["drafttree"] = ext
    return out


def usage_chunk(id: str, created: int, model: str, obj: str, use: dict) -> dict:
    """The extra last chunk of stream_options.include_usage: no choices, only usage."""
    return {"id": id, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "drafttree"}


def finite(obj):
    """JSON has no nan or inf: such a statistic becomes null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj) -> str:
    return json.dumps(finite(obj), ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def sse(obj) -> str:
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def now() -> int:
    return int(time.time())
