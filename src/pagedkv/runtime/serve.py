"""``pagedkv serve MODEL``: the OpenAI-compatible server (``pagedkv.runtime.server``) over a model, on uvicorn.

    pagedkv serve qwen2.paged.onnx --tokenizer qwen2-dir              # http://127.0.0.1:8000/v1
    curl -s localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 16}'

MODEL and the engine flags are ``pagedkv generate``'s (a rewritten ``.onnx`` or an engine; ``--backend``,
``--num-blocks``, ``--max-num-seqs``...). The server binds 127.0.0.1 unless ``--host`` says otherwise, prints
its URL once it listens (``--port 0`` picks a free port), and answers 429 once ``--max-pending`` requests are in
flight. Ctrl-C stops it: requests still running end as aborted. Needs the serve extra
(``pip install 'pagedkv[serve]'``: starlette, uvicorn, pydantic, prometheus-client).
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import sys
from pathlib import Path

from pagedkv.userio import UsageError

SERVE_EXTRA = "pip install 'pagedkv[serve]'"
SERVE_MODULES = ("starlette", "uvicorn", "pydantic", "prometheus_client")
DEFAULT_PORT = 8000


def why_serve_unavailable() -> str | None:
    """None when the serve extra is installed, else what is missing and how to get it."""
    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    return f"serving needs {', '.join(missing)} ({SERVE_EXTRA})" if missing else None


# ---- the CLI ---------------------------------------------------------------------------------------------
def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedkv.runtime.generate import add_engine_arguments, add_model_arguments

    add_model_arguments(parser)
    http = parser.add_argument_group("server")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    http.add_argument("--port", type=int, default=DEFAULT_PORT, help="0: any free port (printed)")
    http.add_argument("--served-model-name", default=None, help="the `model` clients name (default: the file's "
                                                                 "name without its suffix)")
    http.add_argument("--max-pending", type=int, default=256,
                      help="requests in flight (running + queued) before new ones get 429")
    http.add_argument("--seed", type=int, default=0, help="base seed of requests that bring none")
    http.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                      help="uvicorn's log level (info: one line per request)")
    add_engine_arguments(parser)


def served_name(model) -> str:
    name = Path(model).name
    for suffix in (".onnx", ".engine", ".plan", ".trt"):
        if name.lower().endswith(suffix):
            return name[:-len(suffix)]
    return name


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as exc:
        raise UsageError(f"--host/--port: cannot bind {host}:{port} ({exc.strerror or exc})") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def run_serve(args) -> int:
    reason = why_serve_unavailable()
    if reason:
        raise UsageError(reason)
    import uvicorn

    from pagedkv.runtime.api import Worker
    from pagedkv.runtime.generate import open_llm
    from pagedkv.runtime.server import create_app
    from pagedkv.userio import check_input_file, check_int

    check_input_file(args.model, "model")
    check_int("--port", args.port, low=0, high=65535)
    check_int("--max-pending", args.max_pending, low=1)
    sock = bind(args.host, args.port)
    with open_llm(args, seed=args.seed) as llm:
        worker = Worker(llm.engine, max_pending=args.max_pending)
        name = args.served_model_name or served_name(args.model)
        app = create_app(worker, model_name=name, close_worker=True)
        host, port = sock.getsockname()[:2]
        where = f"[{host}]" if ":" in host else host
        print(f"pagedkv serve: {name!r} on http://{where}:{port}/v1 ({llm.backend} backend, "
              f"{', '.join(str(n) for n in llm.executor.manager.num_blocks)} KV blocks, "
              f"context {llm.engine.max_model_len} tokens, tokenizer "
              f"{'yes' if llm.tokenizer is not None else 'none: token ids only'})", flush=True)
        if host not in ("127.0.0.1", "::1", "localhost"):
            print(f"pagedkv serve: listening on {host}, reachable beyond this machine (no authentication)",
                  file=sys.stderr, flush=True)
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)
        try:
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:  # Ctrl-C: uvicorn shut down gracefully, then re-raised the signal
            pass
        finally:
            worker.close()
            sock.close()
    return 0
