"""``expertcache serve``: an OpenAI-compatible HTTP server over the offloaded runtime, with continuous batching."""

from __future__ import annotations

import argparse
import sys

from expertcache.cli.common import (add_routing_args, nonneg_float, nonneg_int, positive_float, positive_int,
                                   routing_from_args)
from expertcache.cli.generate import add_offload_args, add_routing_alias, dtype_from_args, offload_from_args
from expertcache.serve.defaults import (DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS,
                                        DEFAULT_MAX_REQUEST_BYTES, LOOPBACK_HOSTS, is_loopback)

API_KEY_ENV = "EXPERTCACHE_API_KEY"

DESCRIPTION = """\
Serve the model over the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions with stream: true,
/health, /metrics). Requests are batched continuously: they join and leave the running batch between decode
steps; every MoE layer of a decode step serves the union of the rows' experts from the one shared expert
cache. Loopback only by default; --api-key (or $EXPERTCACHE_API_KEY) requires `Authorization: Bearer KEY` on
every /v1/* route. --memory also holds the KV cache of --max-batch rows of the full context (8 rows of the
shipped models: 4.5 MiB). See docs/SERVE.md.

  expertcache serve --memory 12MiB --policy cache-prior --lam 0.2 --max-batch 8 --port 8000
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "granular", "prompt": "The kernel", "max_tokens": 32, "temperature": 0}'
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching over the offloaded runtime",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000; 0 = any free port)")
    s.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: the shipped name or the checkpoint folder's name)")
    s.add_argument("--max-batch", type=positive_int, default=8, help="rows decoded together at most (default: 8)")
    s.add_argument("--max-queue", type=nonneg_int, default=64,
                   help="requests waiting beyond the free batch rows; more get 429 (default: 64)")
    s.add_argument("--prefill-chunk", type=positive_int, default=128,
                   help="prompt tokens prefilled between two decode steps at most: the stall a new request puts "
                        "on running rows (default: 128)")
    s.add_argument("--prefill-delay", type=nonneg_float, default=0.0, metavar="F",
                   help="while rows decode, hold a new prompt until it waited F × the last prefill's time, so "
                        "prompts arriving one by one share one packed prefill (as vLLM's scheduler delay factor; "
                        "default: 0, prefill at once)")
    s.add_argument("--shutdown-grace", type=nonneg_float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM before they are cancelled (default: 30)")
    s.add_argument("--trace-dir", action="append", default=[], metavar="DIR",
                   help="a folder of routing traces (*.trace.safetensors) the live view's replay may open, besides "
                        "the shipped ones (repeatable)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every /v1/* route (default: $EXPERTCACHE_API_KEY; "
                        "none: no authentication, loopback only is advised)")
    s.add_argument("--header-timeout", type=positive_float, default=DEFAULT_HEADER_TIMEOUT, metavar="SECONDS",
                   help="a connection that has not sent a whole request head within this time is closed (default: %(default)s)")
    s.add_argument("--body-timeout", type=positive_float, default=DEFAULT_BODY_TIMEOUT, metavar="SECONDS",
                   help="a request body that has not arrived within this time gets 408 (default: %(default)s)")
    s.add_argument("--max-connections", type=positive_int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="client connections held at once, at most the file-descriptor limit - 64; beyond, the oldest "
                        "idle or half-sent one is closed, or the new one gets 503 (default: %(default)s)")
    s.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                   help="larger request bodies get 413 before they are read (default: 1 MiB)")
    s.add_argument("--max-prompt-tokens", type=positive_int, default=None, metavar="N",
                   help="longer prompts get 400 (default and upper bound: the model's context - 1); a text "
                        "that cannot fit is refused before it is tokenised")
    s.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a Host name clients may address this server as, besides localhost, 127.0.0.1 and ::1 "
                        "(repeatable; '*' = any). On loopback every other Host is refused (403), which stops DNS "
                        "rebinding; on another --host the check applies only when this is given")
    s.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    add_offload_args(p)
    add_routing_args(p, live=True)
    add_routing_alias(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from expertcache.cli.main import UsageError

    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"serve needs the 'serve' extra: pip install 'expertcache[serve]' ({exc})") from None
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if not args.host.strip() or any(c.isspace() for c in args.host):
        raise UsageError(f"--host {args.host!r}: give an address to listen on (127.0.0.1, ::1, or 0.0.0.0 for every "
                         "interface, said explicitly)")
    from expertcache.cli.common import device_from_args

    device_from_args(args)  # a bad --device fails before the socket and the model
    from pathlib import Path

    for d in args.trace_dir:
        if not Path(d).is_dir():
            raise UsageError(f"--trace-dir {d}: not a folder")
    import os

    api_key, source = (args.api_key, "--api-key") if args.api_key is not None else (os.environ.get(API_KEY_ENV),
                                                                                      f"${API_KEY_ENV}")
    if api_key is not None and (not api_key.strip() or any(c.isspace() for c in api_key)):
        # an empty $EXPERTCACHE_API_KEY is a mistake (a variable set from nothing), never "no authentication"
        raise UsageError(f"{source} must be a non-empty string without spaces (unset it to serve without a key)")
    for name in args.allowed_host:
        if name != "*" and (not name.strip() or any(c.isspace() or c in "/@?#" for c in name)):
            raise UsageError(f"--allowed-host {name!r}: give a host name or address (no scheme, path or spaces)")
    if api_key is None and not is_loopback(args.host):
        print(f"expertcache serve: warning: listening on {args.host} without an API key: anyone who can reach "
              f"this port can use and reconfigure the server (set --api-key or ${API_KEY_ENV})", file=sys.stderr,
              flush=True)
    from transformers import AutoConfig

    from expertcache.offload import BudgetError, OffloadedModel
    from expertcache.offload.runtime import resolve_model_path
    from expertcache.serve.app import create_app
    from expertcache.serve.engine import Engine
    from expertcache.serve.server import bind, serve_forever, tune_malloc

    path = resolve_model_path(args.model)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    context = int(getattr(config, "max_position_embeddings", 2048))
    if args.max_prompt_tokens is not None and args.max_prompt_tokens >= context:  # before the port: no bind, no load
        raise UsageError(f"--max-prompt-tokens {args.max_prompt_tokens}: the model's context is {context} tokens "
                         f"(at most {context - 1}, leaving room for one new token)")
    try:  # the port before the long load: a taken port fails in a second
        sock = bind(args.host, args.port)
    except OSError as exc:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    tune_malloc()
    offload = offload_from_args(args, context=context, batch=args.max_batch)
    try:
        rt = OffloadedModel.from_pretrained(path, offload, dtype=dtype_from_args(args),
                                            routing=routing_from_args(args), eviction=args.eviction, gamma=args.gamma,
                                            device=args.device)
    except BudgetError as exc:
        raise UsageError(f"{exc}; {what_fits(args, path, context)}") from None
    tok = None
    if (path / "tokenizer.json").is_file():
        from expertcache.models.loader import check_tokenizer_encodes
        from expertcache.train.tokenizer import load_tokenizer

        tok = load_tokenizer(path)
        check_tokenizer_encodes(tok, path / "tokenizer.json")  # not every request's 400 blaming the message
    name = args.served_model_name or (args.model if args.model in ("granular", "coarse") else path.name)
    engine = Engine(rt, tok, max_batch=args.max_batch, max_queue=args.max_queue,
                    prefill_chunk=args.prefill_chunk, prefill_delay=args.prefill_delay).start()
    app = create_app(engine, name, tokenizer=tok, aliases=(str(args.model),) if str(args.model) != name else (),
                     trace_dirs=tuple(args.trace_dir), api_key=api_key, max_request_bytes=args.max_request_bytes,
                     allowed_hosts=allowed_hosts(args.host, args.allowed_host),
                     max_prompt_tokens=args.max_prompt_tokens, body_timeout=args.body_timeout)
    host, port = sock.getsockname()[:2]
    print(f"expertcache serve: {name} [{rt.family.model_type}, C={rt.capacity}/{rt.num_experts} per layer, "
          f"{rt.routing.label()}+{rt.eviction}, max batch {args.max_batch}, context {context}] on "
          f"http://{host}:{port}/v1 (live view: http://{host}:{port}/)", file=sys.stderr, flush=True)
    try:
        serve_forever(app, sock, grace_s=args.shutdown_grace, log_level=args.log_level,
                      max_connections=args.max_connections, header_timeout=args.header_timeout)
    finally:
        summary = engine.shutdown(0)
        print(f"expertcache serve: stopped: {summary['finished']} request(s) finished, {summary['cancelled']} "
              f"cancelled", file=sys.stderr, flush=True)
    return 0


def allowed_hosts(host: str, extra: list[str]) -> tuple[str, ...] | None:
    """The Host names the server answers to: on loopback, localhost / 127.0.0.1 / ::1 plus ``extra``
    (--allowed-host); elsewhere None (any) unless ``extra`` names some."""
    if is_loopback(host) or extra:
        return (*LOOPBACK_HOSTS, host.strip("[]"), *extra)
    return None




def what_fits(args, path, context: int) -> str:
    """What this --memory holds instead: the largest --max-batch (the KV cache reserves --max-batch rows of the
    whole context), or the memory --max-batch rows need. Plans a one-row runtime to read the sizes."""
    from expertcache.offload import BudgetError, OffloadedModel
    from expertcache.offload.budget import AUTO, MINIMUM, format_bytes, parse_bytes

    need_1 = auto = None
    try:
        one = OffloadedModel.from_pretrained(path, offload_from_args(args, context=context, batch=1),
                                             dtype=dtype_from_args(args))
        plan = one.plan
        need_1, kv_row, auto = plan.minimum, plan.kv_bytes, plan.budget
    except BudgetError:
        pass
    if need_1 is None:
        return "it cannot hold even one row of the context: give more --memory"
    budget = parse_bytes(args.memory) if args.memory is not None else MINIMUM
    budget = auto if budget == AUTO else budget  # --memory auto: what the container leaves
    need = need_1 + (args.max_batch - 1) * kv_row
    fits = 1 + (budget - need_1) // kv_row if budget != MINIMUM else 1
    return (f"--max-batch {args.max_batch} needs at least {format_bytes(need)} ({format_bytes(kv_row)} of KV "
            f"cache per row); {format_bytes(budget)} holds --max-batch {fits} at most")
