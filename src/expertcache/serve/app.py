"""The HTTP side: OpenAI-compatible routes over an :class:`~expertcache.serve.engine.Engine` (FastAPI).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` = server-sent
events), ``GET /health``, ``GET /metrics`` (Prometheus text format). Request bodies are validated here (not by
pydantic) so that every bad field gets a 400 naming it; every 4xx/5xx body is OpenAI's
``{"error": {"message", "type", "param", "code"}}``.

Extensions: every response (and the last stream chunk) carries an ``expertcache`` object — the request's share
of expert-cache hits, misses and bytes read (see the engine docstring), the policy, eviction and C; with
``"return_token_ids": true`` it also lists the generated token ids; ``"ignore_eos": true`` decodes past the
end-of-text token (fixed lengths for benchmarks); ``"expertcache": {"policy": "original"}`` routes that request's
rows with original top-K inside the shared batch (seed-reproducible output, see docs/SERVE.md).

Guards (:class:`Guard`, before any route runs): ``api_key`` requires ``Authorization: Bearer KEY`` on every
``/v1/*`` route (constant-time compare; the live view's event stream may pass it as ``?api_key=``); every POST
must be ``Content-Type: application/json`` (415) and, when a browser sends ``Origin``, come from the origin
the server is addressed as (``Host``; 403), so a page of another site can neither steer nor use the server;
with ``allowed_hosts`` (what ``expertcache serve`` sets when it listens on loopback) every request's ``Host`` must
name one of them (403), so a site whose DNS name is re-pointed at 127.0.0.1 (DNS rebinding: its pages then
count as same-origin) reaches nothing; bodies over ``max_request_bytes`` get 413 before they are read.
Prompts longer than ``max_prompt_tokens`` get 400, a text that cannot fit before it is tokenised; parsing and tokenising run in a worker thread, never on
the event loop.
"""


import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from expertcache.serve.defaults import (DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES,  # declared once (the CLI reads them)
                                        LOOPBACK_HOSTS)
from expertcache.serve.engine import Engine, QueueFull, Request, SamplingParams, ShuttingDown

__all__ = ["create_app", "ServeError", "SHIPPED_CHAT_TEMPLATE", "render_chat", "Guard", "SUPPORTED_FIELDS",
           "DEFAULT_MAX_REQUEST_BYTES", "DEFAULT_BODY_TIMEOUT", "LOOPBACK_HOSTS", "host_allowed", "json_body",
           "ClientGone"]

#: the Retry-After of every 503 (the server is draining: a client retries elsewhere or after a restart)
RETRY_AFTER_503 = "5"

# The shipped models were trained on plain text and have no chat template: this one (documented in
# docs/SERVE.md) writes each message as "Role: content" paragraphs and ends with "Assistant:".
SHIPPED_CHAT_TEMPLATE = "{role}: {content}\n\n"
SHIPPED_CHAT_STOP = "\n\nUser:"
ROLES = ("system", "user", "assistant", "developer", "tool")


class ServeError(Exception):
    """An error with an HTTP status and an OpenAI error body."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
             404: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
             429: "rate_limit_error", 499: "request_cancelled", 503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------------------------
# request validation


def _bad(param: str, message: str) -> ServeError:
    return ServeError(400, f"{param}: {message}", param=param, code="invalid_value")


def _num(body: dict, key: str, default, lo: float, hi: float, *, integer: bool = False):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise _bad(key, f"must be {'an integer' if integer else 'a number'}, got {json.dumps(v)[:40]}")
    if not lo <= v <= hi:
        raise _bad(key, f"must be between {lo} and {hi}, got {v}")
    return v


@dataclass
class Parsed:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool


# Request fields of the OpenAI API reference (completions; chat completions) and what this server does with
# them. Supported: honoured. Every other field is accepted only with the value that means "the default
# behaviour" (what the server does anyway), else 400 naming it; a field in neither list is 400 too.
SUPPORTED_FIELDS = {
    "completions": ("model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
                    "stream_options", "user", "return_token_ids", "ignore_eos", "expertcache"),
    "chat": ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n",
             "stream", "stream_options", "user", "return_token_ids", "ignore_eos", "expertcache"),
}
_DEFAULT_ONLY = {  # field: (values meaning the default behaviour, what to say)
    "logprobs": ((None, False), "log probabilities are not returned by this server"),
    "top_logprobs": ((None,), "log probabilities are not returned by this server"),
    "echo": ((None, False), "echoing the prompt is not supported"),
    "best_of": ((None, 1), "only best_of = 1 is supported"),
    "suffix": ((None,), "suffix (insertion) is not supported"),
    "logit_bias": ((None, {}), "logit_bias is not supported"),
    "presence_penalty": ((None, 0, 0.0), "only 0 is supported"),
    "frequency_penalty": ((None, 0, 0.0), "only 0 is supported"),
    "tools": ((None, []), "tool calls are not supported"),
    "tool_choice": ((None, "none"), "tool calls are not supported"),
    "parallel_tool_calls": ((None, True, False), ""),  # without tools: nothing to do either way
    "functions": ((None, []), "function calls are not supported"),
    "function_call": ((None, "none"), "function calls are not supported"),
    "response_format": ((None, {"type": "text"}), "only {\"type\": \"text\"} is supported"),
    "modalities": ((None, ["text"]), "only [\"text\"] is supported"),
    "audio": ((None,), "audio output is not supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "this model does not reason"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "stored completions are not supported"),
    "metadata": ((None, {}), "metadata is only stored with store, which is not supported"),
    "service_tier": ((None, "auto", "default"), "only auto / default"),
    "prompt_cache_key": ((None,), "not supported"),
    "safety_identifier": ((None,), "not supported"),
    "verbosity": ((None,), "not supported"),
}


def _same(a, b) -> bool:
    """JSON equality with types (True is not 1, 1.0 is 1 only for numbers)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b and (isinstance(a, (int, float)) == isinstance(b, (int, float)))


def check_fields(body: dict, chat: bool) -> None:
    """400 naming the first field that is neither supported nor given its default-behaviour value."""
    supported = SUPPORTED_FIELDS["chat" if chat else "completions"]
    for k in body:
        if k in supported:
            continue
        if k in _DEFAULT_ONLY:
            ok, why = _DEFAULT_ONLY[k]
            v = body[k]
            if any(_same(v, x) for x in ok):
                continue
            raise ServeError(400, f"{k}: {json.dumps(v)[:40]} is not supported by this server ({why})", param=k,
                             code="unsupported_parameter")
        raise ServeError(400, f"{k}: unknown field for {'/v1/chat/completions' if chat else '/v1/completions'} "
                              f"(supported: {', '.join(supported)})", param=k, code="unknown_parameter")


# message fields beyond role and content: those honoured (name: a string, passed to nothing but accepted as the
# API allows it) and those accepted only with their default value; any other key is a 400 naming it
_MESSAGE_FIELDS = {"name": None}
_MESSAGE_DEFAULT_ONLY = {  # field: (roles, values meaning "none")
    "tool_calls": (("assistant",), (None, [])),
    "function_call": (("assistant",), (None,)),
    "refusal": (("assistant",), (None,)),
    "audio": (("assistant",), (None,)),
    "tool_call_id": (("tool",), None),  # a tool message names its call: a string
}


def check_message_fields(m: dict, i: int) -> None:
    """A chat message is as strict as the request: a key other than role, content, name (or a role's own field
    with its default value) is a 400 naming ``messages[i].key``."""
    for k, v in m.items():
        if k in ("role", "content"):
            continue
        param = f"messages[{i}].{k}"
        if k in _MESSAGE_FIELDS:
            if v is not None and not isinstance(v, str):
                raise _bad(param, "must be a string")
            continue
        if k in _MESSAGE_DEFAULT_ONLY:
            roles, ok = _MESSAGE_DEFAULT_ONLY[k]
            if m["role"] not in roles:
                raise ServeError(400, f"{param}: not a field of a {m['role']} message", param=param,
                                 code="unknown_parameter")
            if ok is None:
                if not isinstance(v, str):
                    raise _bad(param, "must be a string")
            elif not any(_same(v, x) for x in ok):
                raise ServeError(400, f"{param}: {json.dumps(v)[:40]} is not supported by this server (tool and "
                                      "function calls, refusals and audio are not)", param=param,
                                 code="unsupported_parameter")
            continue
        raise ServeError(400, f"{param}: unknown field of a chat message (supported: role, content, name)",
                         param=param, code="unknown_parameter")


def render_chat(messages: list[dict], tokenizer) -> tuple[str, bool]:
    """(prompt text, uses the shipped fallback template)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        from expertcache.models.chat import render_chat_template  # under a time bound: a looping template stops

        return render_chat_template(tokenizer, messages), False
    text = "".join(SHIPPED_CHAT_TEMPLATE.format(role=m["role"].capitalize(), content=m["content"]) for m in messages)
    return text + "Assistant:", True


class Validator:
    """Turns a JSON body into prompt ids and :class:`SamplingParams`, or raises :class:`ServeError` (400/404).
    ``max_prompt_tokens`` (default: context - 1) bounds the prompt; a text longer than that many of the
    tokenizer's longest tokens is refused before it is tokenised (exact: it cannot tokenise shorter)."""

    def __init__(self, model_ids: list[str], tokenizer, context: int | None, vocab: int,
                 max_prompt_tokens: int | None = None) -> None:
        self.model_ids, self.tok, self.context, self.vocab = model_ids, tokenizer, context, vocab
        limit = (context - 1) if context is not None else None
        if max_prompt_tokens is not None:
            limit = max_prompt_tokens if limit is None else min(limit, max_prompt_tokens)
        self.max_prompt_tokens = limit
        self.max_token_chars = None  # an upper bound on the characters one token covers (None: unknown)
        if tokenizer is not None:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is not None and backend.normalizer is None:  # no normalizer: pieces are text verbatim
                self.max_token_chars = max(len(t) for t in tokenizer.get_vocab())

    def _too_long(self, n: int, what: str, param: str) -> ServeError:
        return ServeError(400, f"the prompt has {n} {what}; this server takes at "
                               f"most {self.max_prompt_tokens} prompt tokens (the model's context is "
                               f"{self.context}: prompt + max_tokens must fit; --max-prompt-tokens)", param=param,
                          code="context_length_exceeded")

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        from expertcache.inputs import check_text

        try:
            check_text(text, "prompt")  # invalid UTF-8 / a lone surrogate: 400 naming it, not a 500 from the tokenizer
        except ValueError as exc:
            raise _bad(param, str(exc)) from None
        lim = self.max_prompt_tokens
        if self.tok is None:
            words = text.split()
            if lim is not None and len(words) > lim:
                raise self._too_long(len(words), "token ids", param)
            try:
                return [int(x) for x in words]
            except ValueError:
                raise _bad("prompt", "this model has no tokenizer: give space-separated token ids") from None
        if lim is not None and self.max_token_chars is not None and len(text) > lim * self.max_token_chars:
            raise ServeError(400, f"the prompt has {len(text)} characters, more than {lim} tokens of at most "
                                  f"{self.max_token_chars} characters each; this server takes at most {lim} prompt "
                                  f"tokens (the model's context is {self.context}; --max-prompt-tokens)",
                             param=param, code="context_length_exceeded")
        return self.tok(text, verbose=False).input_ids

    def parse(self, body, chat: bool) -> Parsed:
        if not isinstance(body, dict):
            raise ServeError(400, "the request body must be a JSON object", code="invalid_json")
        model = body.get("model")
        if not isinstance(model, str):
            raise _bad("model", "required, a string")
        if model not in self.model_ids:
            raise ServeError(404, f"the model {model!r} does not exist; this server serves {self.model_ids}",
                             param="model", code="model_not_found")
        check_fields(body, chat)
        extra_stop: list[str] = []
        if chat:
            prompt_ids, extra_stop = self._chat(body.get("messages"))
        else:
            prompt_ids = self._prompt(body.get("prompt"))
        if not prompt_ids:
            raise _bad("messages" if chat else "prompt", "the prompt is empty")
        P = len(prompt_ids)
        if self.max_prompt_tokens is not None and P > self.max_prompt_tokens:
            raise self._too_long(P, "tokens", "messages" if chat else "prompt")
        room = (self.context - P) if self.context is not None else 1 << 30
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _num(body, key, room if chat else min(16, room), 1, 1 << 31, integer=True)
        if max_tokens > room:
            raise ServeError(400, f"{key}={max_tokens} + {P} prompt tokens exceeds the model's context of "
                                  f"{self.context} tokens (at most {room} new tokens for this prompt)",
                             param=key, code="context_length_exceeded")
        if _num(body, "n", 1, 1, 1 << 31, integer=True) != 1:
            raise _bad("n", "only n = 1 is supported")
        temperature = _num(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _num(body, "top_p", 1.0, 0.0, 1.0)
        if top_p <= 0:
            raise _bad("top_p", "must be > 0")
        seed = _num(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)) or len(stop) > 4:
            raise _bad("stop", "must be a string or a list of at most 4 strings")
        if any(s == "" for s in stop):
            raise _bad("stop", "stop strings must not be empty")
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise _bad("user", "must be a string")
        stream = body.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise _bad("stream", "must be a boolean")
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise _bad("stream_options", "must be an object")
        for k in so:
            if k != "include_usage":
                raise _bad(f"stream_options.{k}", "unknown field (supported: include_usage)")
        if not isinstance(so.get("include_usage", False), bool):
            raise _bad("stream_options.include_usage", "must be a boolean")
        rti = body.get("return_token_ids", False)
        ignore_eos = body.get("ignore_eos", False)
        for k, v in (("return_token_ids", rti), ("ignore_eos", ignore_eos)):
            if not isinstance(v, bool):
                raise _bad(k, "must be a boolean")
        routing = self._routing(body.get("expertcache"))
        params = SamplingParams(max_tokens=int(max_tokens), temperature=float(temperature), top_p=float(top_p),
                                seed=seed, stop=list(stop) + [s for s in extra_stop if s not in stop],
                                ignore_eos=ignore_eos, routing=routing)
        return Parsed(prompt_ids, params, bool(stream), bool(so.get("include_usage", False)), rti)

    @staticmethod
    def _routing(ec) -> str | None:
        """The per-request routing override: ``{"policy": "original"}`` (or the server's own: no override)."""
        if ec is None:
            return None
        if not isinstance(ec, dict):
            raise _bad("expertcache", "must be an object, e.g. {\"policy\": \"original\"}")
        for k in ec:
            if k != "policy":
                raise _bad(f"expertcache.{k}", "unknown field (supported: policy)")
        pol = ec.get("policy")
        if pol is None:
            return None
        if pol != "original":
            raise _bad("expertcache.policy", f"only \"original\" can be chosen per request, got "
                                             f"{json.dumps(pol)[:40]} (the server's policy is set with "
                                             "POST /v1/expertcache/config)")
        return pol

    def _prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if self.max_prompt_tokens is not None and len(prompt) > self.max_prompt_tokens:
                raise self._too_long(len(prompt), "token ids", "prompt")
            if any(not 0 <= t < self.vocab for t in prompt):
                raise _bad("prompt", f"token ids must be in [0, {self.vocab})")
            return list(prompt)
        raise _bad("prompt", "must be a string, a list of token ids, or a list of one of those (n = 1 prompt)")

    def _chat(self, messages) -> tuple[list[int], list[str]]:
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "required, a non-empty list of {role, content} objects")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise _bad(f"messages[{i}]", f"must be an object with role in {ROLES}")
            check_message_fields(m, i)
            c = m.get("content")
            if isinstance(c, list):  # content parts: text only
                for j, part in enumerate(c):
                    if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                        raise _bad(f"messages[{i}].content[{j}]", "only text content parts "
                                                                  "({\"type\": \"text\", \"text\": ...}) are supported")
                    for k in part:
                        if k not in ("type", "text"):
                            raise ServeError(400, f"messages[{i}].content[{j}].{k}: unknown field of a text part "
                                                  "(supported: type, text)", param=f"messages[{i}].content[{j}].{k}",
                                             code="unknown_parameter")
                c = "".join(p["text"] for p in c)
            if not isinstance(c, str):
                raise _bad(f"messages[{i}].content", "must be a string or a list of text parts")
            clean.append({"role": m["role"], "content": c})
        try:
            text, fallback = render_chat(clean, self.tok)
        except Exception as exc:
            from jinja2.exceptions import TemplateError

            if not isinstance(exc, TemplateError):
                raise
            raise ServeError(400, f"messages: the model's chat template refused them ({type(exc).__name__}: "
                                  f"{str(exc)[:200]})", param="messages", code="chat_template_error") from None
        return self.encode(text, "messages"), ([SHIPPED_CHAT_STOP] if fallback else [])


# ---------------------------------------------------------------------------------------------
# metrics


class Metrics:
    """Prometheus metrics in their own registry (several servers in one process stay apart)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("expertcache_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.queue = Gauge("expertcache_queue_length", "requests waiting to join the batch", registry=r)
        self.batch = Gauge("expertcache_batch_size", "rows in the running decode batch", registry=r)
        self.step_rows = Histogram("expertcache_decode_batch_rows", "rows per decode step",
                                   buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.tokens = Counter("expertcache_generated_tokens", "tokens generated (prefills' first tokens and decode "
                              "steps)", registry=r)
        self.tok_s = Gauge("expertcache_decode_tokens_per_second",
                           "decode tokens per second of compute over the last 32 decode steps", registry=r)
        self.hits = Counter("expertcache_expert_hits", "expert-cache hits (all layers)", registry=r)
        self.misses = Counter("expertcache_expert_misses", "expert-cache misses (all layers)", registry=r)
        self.bytes = Counter("expertcache_expert_bytes_read", "bytes read from the slow tier", registry=r)
        self.hit_rate = Gauge("expertcache_expert_hit_rate", "hits / (hits + misses) since start", registry=r)
        self.ttft = Histogram("expertcache_time_to_first_token_seconds", "submit to first token", registry=r)
        self._recent: list[tuple[int, float]] = []
        self._h = self._m = 0

    def on_step(self, rows: int, tokens: int, seconds: float, delta: dict) -> None:
        self.hits.inc(delta["hits"])
        self.misses.inc(delta["misses"])
        self.bytes.inc(delta["bytes_read"])
        self._h += delta["hits"]
        self._m += delta["misses"]
        if self._h + self._m:
            self.hit_rate.set(self._h / (self._h + self._m))
        self.tokens.inc(tokens)
        if rows:
            self.step_rows.observe(rows)
            self._recent = (self._recent + [(tokens, seconds)])[-32:]
            t = sum(s for _, s in self._recent)
            if t > 0:
                self.tok_s.set(sum(n for n, _ in self._recent) / t)

    def on_queue(self, waiting: int, rows: int) -> None:
        self.queue.set(waiting)
        self.batch.set(rows)


# ---------------------------------------------------------------------------------------------
# guards: authentication, origin, content type, body size


def _host_of(netloc: str, scheme: str) -> str:
    """``netloc`` lower-cased without the scheme's default port."""
    netloc = netloc.lower().strip()
    default = {"http": ":80", "https": ":443"}.get(scheme)
    return netloc[:-len(default)] if default and netloc.endswith(default) else netloc


def origin_allowed(origin: str | None, host: str | None, scheme: str = "http") -> bool:
    """A browser request's ``Origin`` is the origin the server is addressed as (``Host``). No Origin (a
    non-browser client, or a same-origin GET): allowed."""
    if origin is None:
        return True
    if not host or origin == "null":
        return False
    parts = urlsplit(origin)
    return bool(parts.netloc) and _host_of(parts.netloc, parts.scheme) == _host_of(host, scheme)


def host_allowed(host: str | None, allowed: tuple[str, ...] | None) -> bool:
    """Whether the ``Host`` header ``host`` (``name[:port]``, ``[v6][:port]``) names one of ``allowed``
    (None or ``"*"`` among them: any). ``localhost`` admits ``*.localhost`` too (RFC 6761: browsers resolve it
    to loopback themselves) and ``127.0.0.1`` the whole 127.0.0.0/8; a missing Host is refused."""
    if allowed is None or "*" in allowed:
        return True
    if not host:
        return False
    h = host.strip().lower()
    if h.startswith("["):
        name = h[1:h.find("]")] if "]" in h else h[1:]
    else:
        name = h.rsplit(":", 1)[0] if h.count(":") == 1 else h
    name = name.rstrip(".")
    names = {a.lower().strip("[]") for a in allowed}
    if name in names or ("localhost" in names and name.endswith(".localhost")):
        return True
    if "127.0.0.1" in names:
        import ipaddress

        try:
            return ipaddress.ip_address(name) in ipaddress.ip_network("127.0.0.0/8")
        except ValueError:
            return False
    return False


class Guard:
    """ASGI middleware run before any route: see the module docstring. Refusals are OpenAI error bodies."""

    def __init__(self, app, *, api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 query_key_paths: tuple[str, ...] = (), on_refused=None,
                 allowed_hosts: tuple[str, ...] | None = None, body_timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
        self.app, self.max_request_bytes, self.body_timeout = app, max_request_bytes, body_timeout
        self.allowed_hosts = None if allowed_hosts is None else tuple(allowed_hosts)
        self.api_key = None if api_key is None else api_key.encode()
        self.query_key_paths = set(query_key_paths)
        self.on_refused = on_refused

    def _key_ok(self, scope, headers: dict) -> bool:
        auth = headers.get(b"authorization", b"")
        given = auth[7:].strip() if auth[:7].lower() == b"bearer " else None
        if given is None and scope["path"] in self.query_key_paths:  # EventSource cannot send headers
            q = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key")
            given = q[0].encode("latin-1", "replace") if q else None
        return given is not None and hmac.compare_digest(given, self.api_key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for k, v in scope["headers"]:
            headers.setdefault(k.lower(), v)
        path = scope["path"]
        e = None
        host = headers.get(b"host", b"").decode("latin-1")
        if not host_allowed(host, self.allowed_hosts):
            e = ServeError(403, f"Host {host[:80]!r} is not a name this server answers to (it listens on loopback: "
                                "use localhost or 127.0.0.1, or start it with --allowed-host NAME)",
                           code="host_not_allowed")
        elif self.api_key is not None and (path == "/v1" or path.startswith("/v1/")) and scope["method"] != "OPTIONS" \
                and not self._key_ok(scope, headers):
            e = ServeError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' (the server's --api-key)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        elif scope["method"] == "POST":
            origin = headers.get(b"origin")
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            length = headers.get(b"content-length")
            if not origin_allowed(None if origin is None else origin.decode("latin-1"),
                                  headers.get(b"host", b"").decode("latin-1"), scope.get("scheme", "http")):
                e = ServeError(403, f"cross-origin request refused: Origin {origin.decode('latin-1')[:80]} is not "
                                    "this server", code="cross_origin")
            elif ctype != b"application/json":
                e = ServeError(415, f"Content-Type must be application/json, got {ctype.decode('latin-1')[:60]!r}",
                               code="unsupported_media_type")
            elif length is not None and (not length.isdigit() or int(length) > self.max_request_bytes):
                e = ServeError(413, f"the request body has {length.decode('latin-1')[:20]} bytes; this server takes "
                                    f"at most {self.max_request_bytes} (--max-request-bytes)",
                               code="request_too_large")
        if e is None:
            if scope["method"] in ("POST", "PUT", "PATCH"):
                receive = self._bounded(receive)
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse

        if self.on_refused is not None:
            self.on_refused(path, e.status)
        await JSONResponse(e.body(), status_code=e.status, headers=e.headers)(scope, receive, send)


    def _bounded(self, receive):
        """``receive`` for a request with a body, counting its bytes as they arrive (chunked bodies have no
        Content-Length): past ``max_request_bytes`` it raises 413, past ``body_timeout`` seconds since the
        first read 408, and a client gone mid-body raises :class:`ClientGone` (499, logged quietly)."""
        limit, n, deadline = self.max_request_bytes, 0, None

        async def bounded():
            nonlocal n, deadline
            if deadline is None:
                deadline = time.monotonic() + self.body_timeout
            if deadline == float("inf"):
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise ServeError(408, f"the request body did not arrive within {self.body_timeout:g} s "
                                      "(--body-timeout)", code="request_timeout") from None
            if msg["type"] == "http.disconnect":
                raise ClientGone()
            if msg["type"] == "http.request":
                n += len(msg.get("body", b""))
                if n > limit:
                    raise ServeError(413, f"the request body exceeds {limit} bytes (--max-request-bytes)",
                                     code="request_too_large")
                if not msg.get("more_body", False):
                    deadline = float("inf")  # read: later receives wait for a disconnect, untimed
            return msg

        return bounded


class ClientGone(ServeError):
    """The client closed the connection before its request body arrived: nobody reads the answer (HTTP 499,
    counted, never a traceback)."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the connection before its request body arrived",
                         code="client_closed_request")


async def json_body(request, what: str = "the request body"):
    """The request's JSON body (bounded and timed by :class:`Guard`), parsed in a worker thread with
    :func:`expertcache.jsonsafe.loads` (nesting depth limited): 400 naming ``what`` if it is not JSON."""
    from expertcache.jsonsafe import JSONError, loads

    raw = await request.body()
    try:
        return await asyncio.to_thread(loads, raw, what)
    except JSONError as exc:
        raise ServeError(400, str(exc)[:300], code="invalid_json") from None


# ---------------------------------------------------------------------------------------------
# the app


def create_app(engine: Engine, model_id: str, *, tokenizer=None, aliases: tuple[str, ...] = (),
               metrics: Metrics | None = None, liveview: bool = True, trace_dirs: tuple = (),
               api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               max_prompt_tokens: int | None = None, allowed_hosts: tuple[str, ...] | None = None,
               body_timeout: float = DEFAULT_BODY_TIMEOUT):
    """FastAPI app serving ``engine`` under the model name ``model_id`` (``aliases`` are accepted too).
    ``liveview`` adds the page at ``/`` and its routes (:mod:`expertcache.serve.liveview`; ``trace_dirs``: more
    routing traces the replay may open). ``api_key``, ``max_request_bytes``, ``max_prompt_tokens``,
    ``allowed_hosts`` (None: any Host): the guards and limits of the module docstring.
    ``app.state.shutting_down`` (set by :func:`begin_shutdown`) makes new requests 503."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    metrics = metrics or engine.metrics or Metrics()
    engine.metrics = metrics
    rt = engine.rt
    vocab = int(rt.config.vocab_size)
    validator = Validator([model_id, *aliases], tokenizer, engine.context, vocab, max_prompt_tokens)
    app = FastAPI(title="expertcache", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.shutting_down = False
    app.state.api_key_required = api_key is not None
    app.add_middleware(Guard, api_key=api_key, max_request_bytes=max_request_bytes, body_timeout=body_timeout,
                       query_key_paths=("/v1/expertcache/events",), allowed_hosts=allowed_hosts,
                       on_refused=lambda route, status: metrics.requests.labels(route_label(route), str(status)).inc())
    created = int(time.time())

    def err(e: ServeError, route: str) -> JSONResponse:
        metrics.requests.labels(route, str(e.status)).inc()
        headers = e.headers
        if e.status == 503 and not headers:  # draining or stopped: when to come back (another instance, maybe)
            headers = {"Retry-After": RETRY_AFTER_503}
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    def route_label(path: str) -> str:
        """The metrics label of a path: a route's own path, else one label for all others (a client must not
        grow the metrics, and the server's memory, by asking for ever new paths)."""
        if path in known_paths:
            return path
        return "/v1/models/{id}" if path.startswith("/v1/models/") else "(other)"

    known_paths: set = set()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        return err(ServeError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None),
                   route_label(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc):
        return err(ServeError(400, f"invalid request: {exc.errors()[:1]}"), route_label(request.url.path))

    @app.exception_handler(ServeError)
    async def _serve_error(request, exc):  # raised by the Guard's body reader or a route: its own status and body
        return err(exc, route_label(request.url.path))

    @app.exception_handler(Exception)
    async def _any(request, exc):  # pragma: no cover - a bug; still an OpenAI-style body
        return err(ServeError(500, f"internal error: {type(exc).__name__}: {exc}"), route_label(request.url.path))

    def policy() -> dict:
        return dict(policy=rt.routing.label(), eviction=rt.eviction, capacity=rt.capacity,
                    num_experts=rt.num_experts, moe_layers=len(rt.layers))

    def ec_object(info: dict, want_ids: bool) -> dict:
        acc = info["hits"] + info["misses"]
        d = dict(hits=round(info["hits"], 3), misses=round(info["misses"], 3),
                 low_computes=round(info.get("low_computes", 0.0), 3),  # misses computed at 4 bits (--resident-quant)
                 bytes_read=int(round(info["bytes_read"])), hit_rate=(info["hits"] / acc) if acc else None,
                 forwards=info["forwards"], mean_batch=round(info["mean_batch"], 3), ttft_s=info["ttft_s"],
                 **policy())
        if want_ids:
            d["token_ids"] = info["token_ids"]
        return d

    def usage(info: dict) -> dict:
        return dict(prompt_tokens=info["prompt_tokens"], completion_tokens=info["completion_tokens"],
                    total_tokens=info["prompt_tokens"] + info["completion_tokens"])

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return JSONResponse({"status": "failed", "error": str(engine.error)}, status_code=500)
        if app.state.shutting_down or not engine.accepting:
            return JSONResponse({"status": "shutting_down"}, status_code=503, headers={"Retry-After": RETRY_AFTER_503})
        return {"status": "ok", "model": model_id, "batch": engine.batch_size(), "queue": engine.queue_length()}

    @app.get("/metrics")
    async def metrics_route():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        metrics.on_queue(engine.queue_length(), engine.batch_size())
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_object() -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "expertcache",
                "expertcache": policy()}

    @app.get("/v1/models")
    async def models():
        metrics.requests.labels("/v1/models", "200").inc()
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{name:path}")
    async def model_retrieve(name: str):
        if name not in validator.model_ids:
            return err(ServeError(404, f"the model {name!r} does not exist; this server serves "
                                       f"{validator.model_ids}", param="model", code="model_not_found"),
                       "/v1/models/{id}")
        metrics.requests.labels("/v1/models/{id}", "200").inc()
        return model_object()

    def parse_request(raw: bytes, chat: bool) -> Parsed:
        """JSON (depth-limited), validation and tokenisation: run in a worker thread (a large body never blocks
        the loop)."""
        from expertcache.jsonsafe import JSONError, loads

        try:
            body = loads(raw, "the request body")
        except JSONError as exc:
            raise ServeError(400, str(exc)[:300], code="invalid_json") from None
        return validator.parse(body, chat)

    async def handle(request: HTTPRequest, chat: bool):
        route = request.url.path
        try:
            if app.state.shutting_down:
                raise ServeError(503, "the server is shutting down", code="shutting_down")
            raw = await request.body()  # bounded, timed by the Guard
            p = await asyncio.to_thread(parse_request, raw, chat)
            if app.state.shutting_down:
                raise ServeError(503, "the server is shutting down", code="shutting_down")
        except ServeError as e:
            return err(e, route)

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_event(kind, payload):
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
            except RuntimeError:  # the loop is gone (server stopped): nobody is listening
                pass

        req = Request(p.prompt_ids, p.params, on_event)
        try:
            engine.submit(req)
        except QueueFull as e:
            return err(ServeError(429, str(e), code="queue_full", headers={"Retry-After": "1"}), route)
        except ShuttingDown as e:
            return err(ServeError(503, str(e), code="shutting_down"), route)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"

        if not p.stream:
            checked = time.monotonic()
            try:
                while True:
                    try:
                        kind, payload = await asyncio.wait_for(events.get(), timeout=0.25)
                    except asyncio.TimeoutError:
                        kind = None
                    if time.monotonic() - checked >= 0.25:  # tokens may keep coming: check on a clock
                        checked = time.monotonic()
                        if await request.is_disconnected():
                            req.cancel()
                            return err(ServeError(499, "client disconnected"), route)
                    if kind == "error":
                        return err(ServeError(payload[0], payload[1]), route)
                    if kind == "done":  # the text pieces are in info["text"] too
                        info = payload
                        break
            finally:
                if req.finish_reason is None:
                    req.cancel()
            out = {"message": {"role": "assistant", "content": info["text"]}} if chat else {"text": info["text"]}
            choice = {"index": 0, **out, "finish_reason": info["finish_reason"], "logprobs": None}
            metrics.requests.labels(route, "200").inc()
            if info["ttft_s"] is not None:
                metrics.ttft.observe(info["ttft_s"])
            return {"id": rid, "object": obj, "created": int(time.time()), "model": model_id, "choices": [choice],
                    "usage": usage(info), "expertcache": ec_object(info, p.return_token_ids)}

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant"} if role else {}
                if delta_text is not None:
                    delta["content"] = delta_text
                c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                c = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
            return {"id": rid, "object": chunk_obj, "created": int(time.time()), "model": model_id, "choices": [c]}

        def sse(d: dict) -> str:
            return f"data: {json.dumps(d)}\n\n"

        async def stream():
            status = "200"
            try:
                if chat:
                    yield sse(chunk("", None, role=True))
                while True:
                    kind, payload = await events.get()
                    if kind == "text":
                        yield sse(chunk(payload, None))
                    elif kind == "error":
                        status = str(payload[0])
                        yield sse(ServeError(payload[0], payload[1]).body())
                        break
                    else:
                        info = payload
                        last = chunk(None if chat else "", info["finish_reason"])
                        last["usage"] = usage(info)
                        last["expertcache"] = ec_object(info, p.return_token_ids)
                        yield sse(last)
                        if p.include_usage:
                            yield sse({**chunk(None, None), "choices": [], "usage": usage(info)})
                        if info["ttft_s"] is not None:
                            metrics.ttft.observe(info["ttft_s"])
                        break
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or we are done): leave the batch at the next step
                if req.finish_reason is None:
                    req.cancel()
                    status = "499"
                metrics.requests.labels(route, status).inc()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await handle(request, chat=True)

    if liveview:
        from expertcache.serve.liveview import install_liveview

        install_liveview(app, engine, trace_dirs=trace_dirs)
    known_paths.update(r.path for r in app.routes if "{" not in getattr(r, "path", "{"))
    return app


def begin_shutdown(app, grace_s: float) -> int:
    """New requests get 503; waiting ones are cancelled; running ones get ``grace_s`` to finish."""
    app.state.shutting_down = True
    return app.state.engine.begin_shutdown(grace_s)
