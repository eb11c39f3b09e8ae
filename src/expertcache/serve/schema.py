"""Request schema and validation for the completion routes: a JSON body becomes prompt ids and
:class:`~expertcache.serve.engine.SamplingParams`, or a :class:`~expertcache.serve.errors.ServeError` (400/404)
naming the field. Validation is done here, not by pydantic, so that every bad field gets a 400 naming it."""

import json
from dataclasses import dataclass

from expertcache.inputs import check_text
from expertcache.jsonsafe import JSONError, loads
from expertcache.serve.engine import SamplingParams
from expertcache.serve.errors import ServeError

__all__ = ["Validator", "Parsed", "SUPPORTED_FIELDS", "SHIPPED_CHAT_TEMPLATE", "SHIPPED_CHAT_STOP", "ROLES",
           "render_chat", "check_fields", "check_message_fields", "parse_body", "parse_json"]

# The shipped models were trained on plain text and have no chat template: this one (documented in
# docs/SERVE.md) writes each message as "Role: content" paragraphs and ends with "Assistant:".
SHIPPED_CHAT_TEMPLATE = "{role}: {content}\n\n"
SHIPPED_CHAT_STOP = "\n\nUser:"
ROLES = ("system", "user", "assistant", "developer", "tool")

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
            given = body.get("messages" if chat else "prompt")
            if (isinstance(given, str) and given) or (chat and any(m.get("content") for m in given)):  # text given
                raise ServeError(500, "the server's tokenizer encodes this prompt to no tokens (a tokenizer "
                                 "problem, not the request's)", code="tokenizer_error")
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
        for s in stop:
            try:
                check_text(s, "a stop string")  # a lone surrogate: refused as in a prompt
            except ValueError as exc:
                raise _bad("stop", str(exc)) from None
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



def parse_json(raw: bytes, what: str = "the request body"):
    """A request body's JSON (:func:`expertcache.jsonsafe.loads`: depth-limited) or a 400 naming ``what``: not
    JSON, nested too deep, or a number Python will not read (an integer of more than 4,300 digits)."""
    try:
        return loads(raw, what)
    except JSONError as exc:
        raise ServeError(400, str(exc)[:300], code="invalid_json") from None
    except ValueError as exc:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        raise ServeError(400, f"{what}: a number in it cannot be read ({str(exc).split(';')[0][:120]})",
                         code="invalid_json") from None


def parse_body(validator: Validator, raw: bytes, chat: bool) -> Parsed:
    """JSON (depth-limited), validation and tokenisation of a completion request: run it in a worker thread (a
    large body never blocks the loop)."""
    return validator.parse(parse_json(raw), chat)
