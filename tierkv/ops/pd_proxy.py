"""``tierkv pd-proxy``: prefill/decode disaggregation over two vLLM OpenAI servers sharing one daemon.

A completion request goes first to the prefill instance (connector ``kv_role`` ``kv_producer``) with
one output token, which leaves the prompt's KV in tierkv, then unchanged to the decode instance
(``kv_consumer``), which loads that prefix and generates; the decode's response is relayed as it
arrives. A failed prefill is logged and the decode recomputes the prompt; an unreachable decode is a
502 with an OpenAI-style error. Everything else (``/v1/models``, ``/metrics``, ...) goes to the decode;
``/health`` is 200 only while both answer theirs. Standard library only.
"""

from __future__ import annotations

import http.client
import json
import logging
import signal
import sys
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import click

log = logging.getLogger("tierkv.pd_proxy")

COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
FORWARDED = ("Content-Type", "Accept", "Authorization", "X-Request-Id")  # request headers sent upstream
HEALTH_TIMEOUT_S = 10.0
UpstreamError = (OSError, http.client.HTTPException)  # refused, reset, timed out, malformed reply


def prefill_body(body: dict) -> dict:
    """The request the prefill instance gets: one output token, not streamed."""
    out = dict(body, max_tokens=1, stream=False)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    out.pop("min_tokens", None)  # above 1 it would make the one-token request invalid
    return out


def error_json(message: str, code: int) -> bytes:
    """One line of OpenAI's error shape."""
    return json.dumps({"error": {"message": message, "type": "pd_proxy_error", "code": code}}).encode() + b"\n"


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class Upstream:
    """One vLLM OpenAI server, by base URL (``http://host:port`` or ``https://...``)."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise click.BadParameter(f"{url!r} is not an http(s)://host:port URL")
        self.url, self.timeout = url.rstrip("/"), timeout
        self._https, self._host, self._port = parts.scheme == "https", parts.hostname, parts.port
        self._base = parts.path.rstrip("/")

    def open(self, method: str, path: str, body: bytes | None, headers: dict[str, str],
             timeout: float | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request; returns the connection (the caller closes it) and the response's head."""
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=timeout or self.timeout)
        try:
            conn.request(method, self._base + path, body=body, headers=headers)
            return conn, conn.getresponse()
        except BaseException:
            conn.close()
            raise

    def health(self) -> str | None:
        """None while ``/health`` answers 200, else why not."""
        try:
            conn, resp = self.open("GET", "/health", None, {}, timeout=min(self.timeout, HEALTH_TIMEOUT_S))
        except UpstreamError as exc:
            return _why(exc)
        with closing(conn):
            resp.read()
        return None if resp.status == 200 else f"HTTP {resp.status}"


class PDProxy(ThreadingHTTPServer):
    """The proxy's server: one thread per connection, so no request waits on another."""

    daemon_threads = True
    request_queue_size = 256

    def __init__(self, address: tuple[str, int], prefill: Upstream, decode: Upstream) -> None:
        self.prefill, self.decode = prefill, decode
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: PDProxy

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        log.debug("%s " + format, self.address_string(), *args)

    def _headers(self) -> dict[str, str]:
        return {h: v for h in FORWARDED if (v := self.headers.get(h)) is not None}

    def _reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        """``/health``: both instances; anything else: the decode's answer."""
        if self.path.split("?", 1)[0] == "/health":
            down = [f"{name} {up.url}: {why}" for name, up in (("prefill", self.server.prefill),
                                                               ("decode", self.server.decode))
                    if (why := up.health()) is not None]
            self._reply(503 if down else 200, error_json("pd-proxy: " + "; ".join(down), 503) if down else b"")
            return
        self._relay(None)

    def do_POST(self) -> None:
        """Completions: prefill, then decode; anything else: the decode's answer."""
        length = self.headers.get("Content-Length") or "0"
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower() or not length.isdigit():
            self.close_connection = True
            self._reply(411, error_json("pd-proxy: send the body with a Content-Length", 411))
            return
        raw = self.rfile.read(int(length))
        if self.path.split("?", 1)[0] in COMPLETIONS:
            try:
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise ValueError("not a JSON object")
            except ValueError as exc:
                self._reply(400, error_json(f"pd-proxy: the request body is not a JSON object: {exc}", 400))
                return
            self._prefill(body)
        self._relay(raw)

    def _prefill(self, body: dict) -> None:
        """Run the request's prefill on the prefill instance; a failure leaves the prompt to the decode."""
        up = self.server.prefill
        try:
            conn, resp = up.open("POST", self.path, json.dumps(prefill_body(body)).encode(),
                                 {**self._headers(), "Content-Type": "application/json"})
            with closing(conn):
                resp.read()
        except UpstreamError as exc:
            log.warning("pd-proxy: prefill %s failed (%s); the decode recomputes the prompt", up.url, _why(exc))
            return
        if not 200 <= resp.status < 300:
            log.warning("pd-proxy: prefill %s answered HTTP %d; the decode recomputes the prompt", up.url, resp.status)

    def _relay(self, raw: bytes | None) -> None:
        """Send the request as it came to the decode instance and relay its response as it arrives."""
        up = self.server.decode
        try:
            conn, resp = up.open(self.command, self.path, raw, self._headers())
        except UpstreamError as exc:
            msg = f"pd-proxy: decode {up.url} unreachable: {_why(exc)}"
            log.warning("%s", msg)
            self._reply(502, error_json(msg, 502))
            return
        with closing(conn):
            self.send_response(resp.status, resp.reason)
            self.send_header("Content-Type", resp.getheader("Content-Type") or "application/octet-stream")
            length = resp.getheader("Content-Length")
            self.send_header(*(("Content-Length", length) if length else ("Transfer-Encoding", "chunked")))
            self.end_headers()
            try:
                while piece := resp.read1(65536):
                    self.wfile.write(piece if length else b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.flush()
                if not length:
                    self.wfile.write(b"0\r\n\r\n")
            except UpstreamError as exc:  # the decode or the client went away mid-response
                log.warning("pd-proxy: relay from decode %s cut: %s", up.url, _why(exc))
                self.close_connection = True


def serve(prefill: str, decode: str, host: str = "127.0.0.1", port: int = 8100, timeout: float = 600.0) -> PDProxy:
    """A bound proxy (``port`` 0: any free port); run it with ``serve_forever()``."""
    return PDProxy((host, port), Upstream(prefill, timeout), Upstream(decode, timeout))


@click.command("pd-proxy")
@click.option("--prefill", required=True, help="Base URL of the prefill instance (kv_role kv_producer).")
@click.option("--decode", required=True, help="Base URL of the decode instance (kv_role kv_consumer).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8100, show_default=True, type=click.IntRange(0, 65535), help="0: any free port.")
@click.option("--timeout", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds to wait for an upstream to connect or send.")
def pd_proxy(prefill: str, decode: str, host: str, port: int, timeout: float) -> None:
    """Prefill/decode disaggregation: an OpenAI endpoint that prefills each completion request on the
    --prefill instance (its KV lands in tierkv) and generates it on the --decode one (which loads it)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    server = serve(prefill, decode, host, port, timeout)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    click.echo(f"pd-proxy on http://{host}:{server.server_address[1]}: prefill {prefill}, decode {decode}",
               err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
