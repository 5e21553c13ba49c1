"""``tierkv pd-proxy`` without vLLM: stand-in upstreams made with http.server record what they get and
answer as vLLM's OpenAI server does (JSON, or SSE chunks over chunked transfer encoding)."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from _vllm_server import free_port
from click.testing import CliRunner

from tierkv.ops.cli import main
from tierkv.ops.pd_proxy import PDProxy, serve

CHUNKS = [b'data: {"choices": [{"text": "%d"}]}\n\n' % i for i in range(3)] + [b"data: [DONE]\n\n"]
WAIT_S = 5.0


class Upstream(ThreadingHTTPServer):
    """A stand-in vLLM server: records (path, body) of every POST; a streamed reply sends its first
    chunk, then waits until ``release`` is set (or ``WAIT_S``) before the rest."""

    daemon_threads = True

    def __init__(self, status: int = 200) -> None:
        self.bodies: list[tuple[str, bytes]] = []
        self.status = status
        self.release = threading.Event()
        self.released_in_time: bool | None = None
        super().__init__(("127.0.0.1", 0), _Fake)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Fake(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Upstream

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, code: int, obj: object) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._json(self.server.status, {"data": [{"id": "model"}]} if self.path == "/v1/models" else {})

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.bodies.append((self.path, raw))
        body = json.loads(raw)
        if not body.get("stream"):
            self._json(self.server.status, {"choices": [{"text": "done"}], "got": body})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i, chunk in enumerate(CHUNKS):
            if i == 1:
                self.server.released_in_time = self.server.release.wait(WAIT_S)
            time.sleep(0.05)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.write(b"0\r\n\r\n")


def _run(server: ThreadingHTTPServer) -> ThreadingHTTPServer:
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


@pytest.fixture
def upstreams() -> Iterator[tuple[Upstream, Upstream]]:
    prefill, decode = _run(Upstream()), _run(Upstream())
    yield prefill, decode
    for s in (prefill, decode):
        s.shutdown()
        s.server_close()


_PROXIES: list[PDProxy] = []


def _proxy(prefill: str, decode: str, timeout: float = 5.0) -> PDProxy:
    _PROXIES.append(_run(serve(prefill, decode, port=0, timeout=timeout)))
    return _PROXIES[-1]


@pytest.fixture(autouse=True)
def _stop_proxies() -> Iterator[None]:
    yield
    while _PROXIES:
        p = _PROXIES.pop()
        p.shutdown()
        p.server_close()


def _request(proxy: PDProxy, method: str, path: str, body: bytes | None = None) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=10)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type") or "", r.read()
    finally:
        conn.close()


def _closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_help_and_the_command_is_listed():
    r = CliRunner().invoke(main, ["pd-proxy", "--help"])
    assert r.exit_code == 0 and "--prefill" in r.output and "--decode" in r.output and "--timeout" in r.output
    assert "pd-proxy" in CliRunner().invoke(main, ["--help"]).output


def test_unreachable_decode_is_one_line_502_naming_it():
    decode = _closed_url()
    proxy = _proxy(_closed_url(), decode)
    status, ctype, body = _request(proxy, "POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 4}')
    assert status == 502 and ctype == "application/json"
    assert body.count(b"\n") == 1 and body.endswith(b"\n")
    err = json.loads(body)["error"]
    assert decode in err["message"] and "unreachable" in err["message"]
    assert err["type"] == "pd_proxy_error" and err["code"] == 502


def test_a_body_that_is_not_json_is_400(upstreams):
    prefill, decode = upstreams
    proxy = _proxy(prefill.url, decode.url)
    for raw in (b"prompt=hi", b"[1, 2]"):
        status, _, body = _request(proxy, "POST", "/v1/chat/completions", raw)
        assert status == 400 and body.count(b"\n") == 1 and json.loads(body)["error"]["code"] == 400
    assert prefill.bodies == decode.bodies == []


def test_health_needs_both_upstreams(upstreams):
    prefill, decode = upstreams
    assert _request(_proxy(prefill.url, decode.url), "GET", "/health")[0] == 200
    for p, d, down in ((_closed_url(), decode.url, "prefill"), (prefill.url, _closed_url(), "decode")):
        status, _, body = _request(_proxy(p, d), "GET", "/health")
        assert status == 503 and down in json.loads(body)["error"]["message"]


def test_stream_is_relayed_as_it_arrives_after_a_one_token_prefill(upstreams):
    prefill, decode = upstreams
    proxy = _proxy(prefill.url, decode.url)
    original = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=10)
    conn.request("POST", "/v1/chat/completions", body=original, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
    got = r.read1(65536)
    assert got == CHUNKS[0]  # the decode holds the rest until the client has this one
    assert _request(proxy, "GET", "/v1/models")[0] == 200  # meanwhile, other requests go on
    decode.release.set()
    got += r.read()
    conn.close()
    assert got == b"".join(CHUNKS) and decode.released_in_time is True
    assert decode.bodies == [("/v1/chat/completions", original)]
    (path, sent), = prefill.bodies
    assert path == "/v1/chat/completions"
    assert json.loads(sent) == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                "stream": False}


def test_non_streamed_reply_and_status_are_the_decodes(upstreams):
    prefill, decode = upstreams
    proxy = _proxy(prefill.url, decode.url)
    body = {"prompt": "hi", "max_tokens": 9, "max_completion_tokens": 9, "min_tokens": 3}
    status, ctype, raw = _request(proxy, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 200 and ctype == "application/json" and json.loads(raw)["got"] == body
    assert json.loads(prefill.bodies[0][1]) == {"prompt": "hi", "max_tokens": 1, "max_completion_tokens": 1,
                                                "stream": False}
    decode.status = 404
    assert _request(proxy, "POST", "/v1/completions", json.dumps(body).encode())[0] == 404


def test_a_failed_prefill_still_gets_the_decodes_reply(upstreams):
    _, decode = upstreams
    failing = _run(Upstream(status=500))
    hanging = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
    for url in (_closed_url(), failing.url, f"http://127.0.0.1:{hanging.getsockname()[1]}"):
        status, _, raw = _request(_proxy(url, decode.url, timeout=0.5), "POST", "/v1/completions",
                                  b'{"prompt": "hi", "max_tokens": 4}')
        assert status == 200 and json.loads(raw)["got"]["max_tokens"] == 4
    assert len(failing.bodies) == 1 and len(decode.bodies) == 3
    hanging.close()
    failing.shutdown()
    failing.server_close()


def test_the_command_serves_until_sigterm():
    decode = _closed_url()
    proc = subprocess.Popen([sys.executable, "-m", "tierkv", "pd-proxy", "--prefill", _closed_url(),
                             "--decode", decode, "--port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert line.startswith("pd-proxy on http://127.0.0.1:"), line
        port = int(line.split(":")[2])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/v1/completions", body=b'{"prompt": "hi"}')
        assert conn.getresponse().status == 502
        conn.close()
        assert "prefill" in proc.stderr.readline()  # one line per failed prefill
        assert decode in proc.stderr.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
