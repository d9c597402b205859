"""Keys, scopes, per-key limits, TLS and slow clients, against a live server with real clients:
httpx and the `openai` client over HTTPS with a CA file, tritonclient.grpc over TLS, and raw
TLS sockets for the slow client. Certificates are made here, at test time."""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kserve_server import LiveServer, serve, write_repository
from openai import DefaultHttpxClient, OpenAI
from tritonclient.utils import InferenceServerException
from websockets.sync.client import connect as ws_connect

from inferd.config import EngineConfig, ServerConfig
from inferd.gateway.kserve.grpc_server import GrpcServer, start_grpc_server, stop_grpc_server
from inferd.serve import uvicorn_options
from inferd.telemetry.metrics import parse_samples

pytestmark = pytest.mark.integration

KEYS = """
sk-user   name=user
sk-ops    admin name=ops
sk-slow   name=limited rpm=2
"""
READ_TIMEOUT_S = 1.0
MAX_BODY = 65536
USER = {"Authorization": "Bearer sk-user"}
OPS = {"Authorization": "Bearer sk-ops"}


@dataclass
class Certs:
    ca: Path
    cert: Path
    key: Path
    client_cert: Path  # a client certificate the same CA signed (mutual TLS)
    client_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: str, issuer: str, key: ec.EllipticCurvePrivateKey) -> Any:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    fmt = serialization.PrivateFormat.PKCS8
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption())
    )


def make_certs(folder: Path) -> Certs:
    """A CA, a server certificate it signs for 127.0.0.1 and localhost, and a client
    certificate it signs (PEM files)."""
    ca_key, key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = (
        _builder("inferd test CA", "inferd test CA", ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        _builder("localhost", "inferd test CA", key)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    client = _builder("test client", "inferd test CA", client_key).sign(ca_key, hashes.SHA256())
    names_out = ("ca.pem", "cert.pem", "key.pem", "client.pem", "client-key.pem")
    out = Certs(*(folder / n for n in names_out))
    for path, c in ((out.ca, ca), (out.cert, cert), (out.client_cert, client)):
        path.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    _write_key(out.key, key)
    _write_key(out.client_key, client_key)
    return out


@dataclass
class Secure:
    live: LiveServer
    grpc: GrpcServer
    certs: Certs

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.live.port}"

    def trust(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.certs.ca))

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, verify=self.trust(), timeout=30)


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    tmp = tmp_path_factory.mktemp("secure")
    certs = make_certs(tmp)
    (tmp / "keys").write_text(KEYS)
    root = write_repository(tmp / "repo")
    with serve(
        root,
        api_key_file=str(tmp / "keys"),
        ssl_keyfile=str(certs.key),
        ssl_certfile=str(certs.cert),
        read_timeout_s=READ_TIMEOUT_S,
        max_body_bytes=MAX_BODY,
        grpc_max_message_bytes=MAX_BODY,
    ) as live:
        grpc_server = live.call(start_grpc_server(live.state, "127.0.0.1", 0))
        try:
            yield Secure(live, grpc_server, certs)
        finally:
            live.call(stop_grpc_server(grpc_server, 1.0))


def _infer_body() -> dict[str, object]:
    x = [[0.1, 0.2, 0.3, 0.4]]
    return {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": x}]}


def test_https_keys_and_scopes(secure: Secure) -> None:
    with secure.client() as c:
        r = c.post("/v2/models/classifier/infer", json=_infer_body())
        assert r.status_code == 401 and set(r.json()) == {"error"}  # KServe's error body
        assert "API key" in r.json()["error"]
        r = c.post("/v2/models/classifier/infer", json=_infer_body(), headers=USER)
        assert r.status_code == 200, r.text
        assert [o["name"] for o in r.json()["outputs"]] == ["probs"]
        assert "x-ratelimit-limit-requests" not in r.headers  # no limit set for this key
        r = c.post("/v2/repository/models/classifier/unload", headers=USER)
        assert r.status_code == 403 and "admin" in r.json()["error"]
        assert c.post("/v2/repository/models/classifier/load", headers=OPS).status_code == 200
        index = c.post("/v2/repository/index", headers=OPS).json()
        assert {"name": "classifier", "state": "READY"}.items() <= next(
            e for e in index if e["name"] == "classifier"
        ).items()
        ready = c.get("/v2/health/ready")  # probes need no key
        assert (ready.status_code, ready.json()) == (200, {"ready": True})
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
        httpx.get(f"http://127.0.0.1:{secure.live.port}/v2/health/live", timeout=5)
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
        httpx.get(f"{secure.url}/v2/health/live", timeout=5)


def test_openai_client_over_tls(secure: Secure) -> None:
    # The client type the SDK is built on (openai's own httpx fork, not `httpx`).
    http = DefaultHttpxClient(verify=secure.trust())
    client = OpenAI(base_url=f"{secure.url}/v1", api_key="sk-user", http_client=http)
    out = client.embeddings.create(model="embedder", input=["hello there"])
    assert len(out.data[0].embedding) == 8


def test_rate_limit_429_with_openai_headers(secure: Secure) -> None:
    limited = {"Authorization": "Bearer sk-slow"}
    with secure.client() as c:
        codes = [c.get("/v2/models/classifier", headers=limited) for _ in range(3)]
        assert [r.status_code for r in codes] == [200, 200, 429]
        assert codes[0].headers["x-ratelimit-limit-requests"] == "2"
        assert codes[1].headers["x-ratelimit-remaining-requests"] == "0"
        refused = codes[2]
        assert set(refused.json()) == {"error"}
        assert 1 <= int(refused.headers["retry-after"]) <= 30  # one request per 30 s
        assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
        r = c.post("/v1/embeddings", json={"model": "embedder", "input": "x"}, headers=limited)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        metrics = c.get("/metrics").text
    assert 'inferd_api_key_rate_limited_total{key="limited",limit="requests"} 2.0' in metrics
    assert 'inferd_requests_rejected_total{reason="rate_limited"}' in metrics
    assert "sk-slow" not in metrics


def _triton(secure: Secure) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(
        f"127.0.0.1:{secure.grpc.port}", ssl=True, root_certificates=str(secure.certs.ca)
    )


def _input(x: np.ndarray) -> triton.InferInput:
    inp = triton.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def test_grpc_over_tls_with_keys_and_scopes(secure: Secure) -> None:
    client = _triton(secure)
    assert client.is_server_live()  # open, like /v2/health
    x = np.ones((1, 4), dtype=np.float32)
    with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
        client.infer("classifier", [_input(x)])
    result = client.infer("classifier", [_input(x)], headers={"authorization": "Bearer sk-user"})
    assert result.as_numpy("probs").shape == (1, 3)
    with pytest.raises(InferenceServerException, match="PERMISSION_DENIED"):
        client.unload_model("classifier", headers={"authorization": "Bearer sk-user"})
    client.load_model("classifier", headers={"authorization": "Bearer sk-ops"})
    big = np.ones((1, MAX_BODY // 4 + 16), dtype=np.float32)  # over --max-body-bytes
    with pytest.raises(InferenceServerException, match="RESOURCE_EXHAUSTED"):
        client.infer("classifier", [_input(big)], headers={"authorization": "Bearer sk-user"})
    client.close()


def test_grpc_plain_channel_is_refused(secure: Secure) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{secure.grpc.port}")
    with channel, pytest.raises(grpc.FutureTimeoutError):
        grpc.channel_ready_future(channel).result(timeout=2)


def _tls_socket(secure: Secure) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", secure.live.port), timeout=10)
    return secure.trust().wrap_socket(raw, server_hostname="127.0.0.1")


class _Errors(logging.Handler):
    """Collects ERROR records of the loggers a failing request would write to."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _trickle(sock: ssl.SSLSocket, head: bytes, body: bytes) -> tuple[bool, int]:
    """Sends `head` whole, then `body` one byte at a time; (closed by the server, bytes sent).
    The socket stays open: a hostile client does not hang up."""
    sent = 0
    try:
        sock.sendall(head)
        for byte in body:
            sock.sendall(bytes([byte]))
            sent += 1
            sock.settimeout(0.25)  # also the pace: about four bytes a second
            try:
                if sock.recv(1024) == b"":
                    return True, sent
            except TimeoutError:
                continue
    except (ssl.SSLError, OSError):
        return True, sent  # a write or read failed: the server had closed the connection
    return False, sent


def _held(secure: Secure) -> float:
    """API-key slots and classic-model requests the server still holds."""
    with secure.client() as c:
        metrics = parse_samples(c.get("/metrics").text)
    key = metrics.get('inferd_api_key_requests_running{key="user"}', 0.0)
    return key + metrics['inferd_model_requests_inflight{model="classifier"}']


_SLOW_HEADERS = (
    b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n",
    b"X-Pad: " + b"a" * 200 + b"\r\n\r\n",
)
_SLOW_BODY = (
    b"POST /v2/models/classifier/infer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-user\r\n"
    b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n",
    b" " * 200,
)


@pytest.mark.parametrize("head, body", [_SLOW_HEADERS, _SLOW_BODY], ids=["headers", "body"])
def test_slow_client_is_cut_off_at_the_read_timeout(
    secure: Secure, head: bytes, body: bytes
) -> None:
    """Slowloris: the headers, or the body, one byte at a time, from a client that never hangs
    up. The server drops the connection once the request has not arrived within --read-timeout,
    long before the client would have finished, and holds nothing for it afterwards: no key
    slot, no request, no error from a half-received request."""
    errors = _Errors()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "inferd.gateway")]
    for log in loggers:
        log.addHandler(errors)
    sock = _tls_socket(secure)
    try:
        started = time.monotonic()
        closed, sent = _trickle(sock, head, body)
        elapsed = time.monotonic() - started
        # Released at once, though the client still holds its end (bounded wait: a busy loop).
        deadline = time.monotonic() + 3.0
        while _held(secure) and time.monotonic() < deadline:
            time.sleep(0.05)
        held = _held(secure)
    finally:
        sock.close()
        for log in loggers:
            log.removeHandler(errors)
    assert closed and sent < len(body), f"still open after {sent} bytes"
    # The bound is the timeout itself, plus slack for a loaded machine; the pace alone would
    # have taken most of a minute.
    assert elapsed < READ_TIMEOUT_S + 10
    assert held == 0
    assert not errors.records, [r.getMessage() for r in errors.records]


def test_a_whole_request_is_not_cut_off(secure: Secure) -> None:
    """A keep-alive connection whose requests arrive whole stays usable past the timeout."""
    with secure.client() as c:
        assert c.get("/v2/health/live").status_code == 200
        time.sleep(READ_TIMEOUT_S + 0.5)  # idle but under the 5 s keep-alive
        assert c.get("/v2/health/live").status_code == 200


def test_mutual_tls_requires_a_client_certificate(tmp_path: Path) -> None:
    """--ssl-ca-certs: HTTP and gRPC accept only clients with a certificate the CA signed."""
    certs = make_certs(tmp_path)
    root = write_repository(tmp_path / "repo")
    tls: dict[str, Any] = {"ssl_keyfile": str(certs.key), "ssl_certfile": str(certs.cert)}
    with serve(root, **tls, ssl_ca_certs=str(certs.ca)) as live:
        grpc_server = live.call(start_grpc_server(live.state, "127.0.0.1", 0))
        try:
            trust = ssl.create_default_context(cafile=str(certs.ca))
            url = f"https://127.0.0.1:{live.port}/v2/health/live"
            with pytest.raises(httpx.HTTPError):
                httpx.get(url, verify=trust, timeout=5)
            trust.load_cert_chain(str(certs.client_cert), str(certs.client_key))
            assert httpx.get(url, verify=trust, timeout=5).status_code == 200
            address = f"127.0.0.1:{grpc_server.port}"
            bare = triton.InferenceServerClient(address, ssl=True, root_certificates=str(certs.ca))
            with pytest.raises(InferenceServerException):
                bare.is_server_live()
            mutual = triton.InferenceServerClient(
                address,
                ssl=True,
                root_certificates=str(certs.ca),
                private_key=str(certs.client_key),
                certificate_chain=str(certs.client_cert),
            )
            assert mutual.is_server_live()
        finally:
            live.call(stop_grpc_server(grpc_server, 1.0))


def test_without_the_new_flags_uvicorn_runs_as_before() -> None:
    options = uvicorn_options(ServerConfig())
    assert options["timeout_keep_alive"] == 5 and options["limit_concurrency"] is None
    assert options["ssl_certfile"] is None and "http" not in options  # uvicorn's own protocol
    guarded = uvicorn_options(ServerConfig(read_timeout_s=2.5, limit_concurrency=100))
    assert guarded["http"].read_timeout_s == 2.5 and guarded["limit_concurrency"] == 100


def test_a_websocket_outlives_the_read_timeout(secure: Secure) -> None:
    """The read timeout covers a request's arrival; an upgraded WebSocket is not cut off."""
    uri = f"wss://127.0.0.1:{secure.live.port}/v1/completions/ws"
    with ws_connect(uri, ssl=secure.trust(), additional_headers=USER, open_timeout=10) as ws:
        time.sleep(READ_TIMEOUT_S + 0.5)
        ws.send('{"prompt": "hi"}')
        reply = json.loads(ws.recv(timeout=10))  # this server runs no LLM: 503, on the socket
        assert reply["status"] == 503 and ws.recv(timeout=10) == "[DONE]"


# -- the LLM routes on a real engine ---------------------------------------------------------------

LLM_KEYS = """
sk-user   name=user
sk-tokens name=tokens tpm=30
"""


@dataclass
class SecureLLM:
    url: str
    trust: ssl.SSLContext

    def post(self, path: str, body: dict[str, object], key: str | None) -> httpx.Response:
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        with httpx.Client(verify=self.trust, timeout=60) as c:
            return c.post(f"{self.url}{path}", json=body, headers=headers)


@pytest.fixture(scope="module")
def secure_llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureLLM]:
    """HTTPS, a key file with a per-key token limit, and inferd-tiny on a real engine core (the
    other tests here serve classic models only; the gateway's own tests use a fake engine)."""
    tmp = tmp_path_factory.mktemp("secure-llm")
    certs = make_certs(tmp)
    (tmp / "keys").write_text(LLM_KEYS)
    engine = EngineConfig.from_kwargs(dtype="float32", kv_cache_memory=8 << 20, max_model_len=256)
    with serve(
        None,
        engine=engine,
        api_key_file=str(tmp / "keys"),
        ssl_keyfile=str(certs.key),
        ssl_certfile=str(certs.cert),
    ) as live:
        trust = ssl.create_default_context(cafile=str(certs.ca))
        yield SecureLLM(f"https://127.0.0.1:{live.port}", trust)


def test_llm_routes_over_tls_take_keys_and_count_tokens_per_key(secure_llm: SecureLLM) -> None:
    body = {"prompt": "Hello there", "max_tokens": 8, "ignore_eos": True}
    refused = secure_llm.post("/v1/completions", body, key=None)
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    # The official client, over HTTPS with the test CA, with a key.
    http = DefaultHttpxClient(verify=secure_llm.trust)
    with OpenAI(base_url=f"{secure_llm.url}/v1", api_key="sk-user", http_client=http) as client:
        chat = client.chat.completions.create(
            model="inferd-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert chat.usage is not None and chat.usage.completion_tokens <= 4
    # 30 tokens a minute for this key: a few requests' prompts and outputs spend them.
    first = secure_llm.post("/v1/completions", body, key="sk-tokens")
    assert first.status_code == 200, first.text
    assert first.headers["x-ratelimit-limit-tokens"] == "30"
    # The bucket refills at half a token a second: far slower than these requests spend it.
    codes = [first.status_code]
    while codes[-1] == 200 and len(codes) < 10:
        limited = secure_llm.post("/v1/completions", body, key="sk-tokens")
        codes.append(limited.status_code)
    assert codes[-1] == 429, codes
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(limited.headers["retry-after"]) >= 1
    # The other key is not held back by this one's limit.
    assert secure_llm.post("/v1/completions", body, key="sk-user").status_code == 200
