"""A reference reward server: any reward function of the registry (or `module:function`) served
over HTTP with the protocol of `reward=http` (workbench/rollout/remote.py), on the standard
library alone. An example to copy, and the faulty service the tests need.

    python -m workbench.rollout.reward_server --reward arith_exact --port 8000
    python -m workbench method=grpo reward=http reward.url=http://127.0.0.1:8000

    POST /score    {"items": [{"prompt": ..., "completion": "...", "answer": "42"}, ...]}
                -> {"scores": [1.0, ...]}        (with --info, also "info": [{...}, ...])
    GET  /health -> {"status": "ok", "reward": "arith_exact", "columns": ["answer"]}

`columns` are the row fields the function requires (rewards.required_columns); the client checks
every prompt row for them before any weights load. A function that reads token ids (`length`)
cannot be served: the protocol carries text. `--token-env NAME` makes the server require
`Authorization: Bearer <$NAME>` (401 otherwise).

Faults, for tests (each counts /score requests only, from 1):
    --delay S          sleep S seconds before answering each request
    --fail-first N     answer the first N requests with 500
    --wrong-count      answer one score fewer than items
    --bad-score X      answer X (nan, inf, a string) as the first score
    --die-after N      answer N requests, then close the next one's connection unanswered and stop
                       listening (later requests: connection refused)
    --echo-headers     answer 500 with the request's headers in the body (a careless service)

In a test, on a free port, in a thread of the test's process:

    with RewardServer("arith_exact", faults=Faults(fail_first=2)) as server:
        ... reward.url=server.url ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from workbench.core.errors import UserError
from workbench.rollout import rewards


@dataclass
class Faults:
    delay_s: float = 0.0
    fail_first: int = 0
    wrong_count: bool = False
    bad_score: str | None = None
    die_after: int | None = None
    echo_headers: bool = False


def _reward(name: str):
    """The function named, and the row fields it requires; UserError for one that cannot be served."""
    if name in ("http", "model", "judge"):
        raise UserError(f"--reward {name}: serve a function (a built-in or module:function); 'model', 'http' and "
                        "'judge' are reward nodes, not functions")
    fn = rewards._lookup(name, {})
    needs = rewards.required_columns(fn)
    if "completion_ids" in needs or name == "length":
        raise UserError(f"--reward {name}: it reads token ids, which the protocol does not carry (it sends text)")
    return fn, sorted(needs)


class RewardServer:
    """The server on `host:port` (port 0: a free one), answering in threads; `url` once started.
    `requests` counts the /score requests answered or refused."""

    def __init__(self, reward: str = "arith_exact", host: str = "127.0.0.1", port: int = 0,
                 faults: Faults | None = None, info: bool = False, token: str | None = None, quiet: bool = True):
        self.name = reward
        self.fn, self.columns = _reward(reward)
        self.faults = faults or Faults()
        self.info, self.token, self.quiet = info, token, quiet
        self.requests = 0
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True  # a handler sleeping in --delay must not hold the process
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> RewardServer:
        # a short poll: stop() returns (and a dead server refuses connections) within 0.1 s
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="reward-server", daemon=True)
        self._thread.start()
        return self

    def stop(self, wait: bool = True) -> None:
        """Stop listening: a later connection is refused. A handler stopping its own server does
        not wait (shutdown waits for the serving loop, which waits for nothing from a handler,
        but a thread need not block on it)."""
        def close():
            if self._thread is not None:
                self.httpd.shutdown()  # returns once serve_forever has left its loop
            self.httpd.server_close()

        if wait:
            close()
        else:
            threading.Thread(target=close, name="reward-server-stop", daemon=True).start()

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def score(self, items: list) -> dict:
        """The protocol's answer for `items` (faults aside)."""
        n = len(items)
        if n == 0:
            return {"scores": []}
        prompts = [it.get("prompt") for it in items]
        prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
        completions = [str(it.get("completion", "")) for it in items]
        fields = sorted({k for it in items for k in it} - {"prompt", "completion"})
        columns = {k: [it.get(k) for it in items] for k in fields}
        scores = [float(v) for v in self.fn(prompts=prompts, completions=completions, **columns)]
        out: dict = {"scores": scores}
        if self.info:
            out["info"] = [{"reward": self.name, "chars": len(c)} for c in completions]
        return out


def _handler(server: RewardServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # the request line only, never headers
            if not server.quiet:
                super().log_message(fmt, *args)

        def _send(self, status: int, body) -> None:
            data = (body if isinstance(body, str) else json.dumps(body)).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if not isinstance(body, str) else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.split("?")[0].rstrip("/") == "/health":
                self._send(200, {"status": "ok", "reward": server.name, "columns": server.columns})
            else:
                self._send(404, {"error": f"no {self.path}: GET /health, POST /score"})

        def do_POST(self):
            if self.path.split("?")[0].rstrip("/") != "/score":
                return self._send(404, {"error": f"no {self.path}: POST /score"})
            f = server.faults
            with server._lock:
                server.requests += 1
                k = server.requests
            if f.die_after is not None and k > f.die_after:
                self.close_connection = True
                self.connection.close()  # unanswered: the client reads a closed connection
                server.stop(wait=False)
                return None
            # the body is read before any answer: a socket closed with unread data is reset, and
            # the client would see a reset instead of the status
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if f.delay_s:
                time.sleep(f.delay_s)
            if server.token is not None and self.headers.get("Authorization") != f"Bearer {server.token}":
                return self._send(401, {"error": "missing or wrong Authorization header"})
            if f.echo_headers:
                return self._send(500, f"cannot score; Authorization was {self.headers.get('Authorization')!r}, "
                                       f"the request's headers {dict(self.headers)}")
            if k <= f.fail_first:
                return self._send(500, f"injected failure {k} of {f.fail_first} (--fail-first)")
            try:
                items = json.loads(body or b"{}").get("items")
                if not isinstance(items, list):
                    raise ValueError('the body has no "items" list')
            except (ValueError, AttributeError) as exc:
                return self._send(400, {"error": f"bad request: {exc}"})
            try:
                out = server.score(items)
            except Exception as exc:  # noqa: BLE001 - the caller reads why, as the protocol's 500
                return self._send(500, {"error": f"reward function {server.name!r} raised: {type(exc).__name__}: {exc}"})
            if f.wrong_count:
                out["scores"] = out["scores"][:-1]
            if f.bad_score is not None and out["scores"]:
                bad = f.bad_score.lower()
                out["scores"][0] = {"nan": math.nan, "inf": math.inf}.get(bad, f.bad_score)
            return self._send(200, json.dumps(out))  # json.dumps writes NaN as the protocol must refuse it

    return Handler


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.rollout.reward_server",
                                 description="Serve a reward function over HTTP for reward=http.")
    ap.add_argument("--reward", default="arith_exact", help="a built-in reward or package.module:function")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    ap.add_argument("--info", action="store_true", help="answer an info object per completion")
    ap.add_argument("--token-env", help="require 'Authorization: Bearer <value of this environment variable>'")
    ap.add_argument("--verbose", action="store_true", help="log each request line")
    ap.add_argument("--delay", type=float, default=0.0, help="fault: seconds to wait before each answer")
    ap.add_argument("--fail-first", type=int, default=0, help="fault: answer the first N requests with 500")
    ap.add_argument("--wrong-count", action="store_true", help="fault: one score fewer than items")
    ap.add_argument("--bad-score", help="fault: this value (nan, inf, a string) as the first score")
    ap.add_argument("--die-after", type=int, help="fault: stop answering after N requests")
    ap.add_argument("--echo-headers", action="store_true", help="fault: 500 with the request's headers in the body")
    a = ap.parse_args(argv)
    token = None
    if a.token_env:
        token = os.environ.get(a.token_env)
        if not token:
            print(f"error: --token-env {a.token_env}: the variable is not set", file=sys.stderr)
            return 2
    faults = Faults(a.delay, a.fail_first, a.wrong_count, a.bad_score, a.die_after, a.echo_headers)
    try:
        server = RewardServer(a.reward, a.host, a.port, faults, a.info, token, quiet=not a.verbose)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the port is taken, the host is not this machine's
        print(f"error: cannot listen on {a.host}:{a.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"serving reward {a.reward!r} at {server.url} (POST /score, GET /health); Ctrl-C stops", flush=True)
    server.start()
    try:
        while server._thread.is_alive():  # a join with a timeout lets Ctrl-C through
            server._thread.join(0.5)
    except KeyboardInterrupt:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
