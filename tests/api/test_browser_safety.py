"""Browser-facing safety (issue 23, item 5) over real HTTP: a web page in the operator's browser
can neither rebind DNS onto the loopback server, nor POST across sites, nor read responses without
an allowed origin, nor frame the dashboard; the API docs need a key when auth is on."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest
from tests.api.sim_server import SimServer
from tests.simulated_replica import SimulatedReplica

from tokenpath.api.settings import ApiSettings
from tokenpath.cli import build_parser
from tokenpath.gateway import Gateway, GatewayStore
from tokenpath.server.config import build_config

KEY = "tp-" + "k" * 43


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    srv = SimServer(SimulatedReplica("r0"), config=ApiSettings(allowed_hosts=["gpu-box.lan"],
                                                               allowed_origins=["https://app.example.com"]))
    yield srv.start()
    srv.stop()


@pytest.fixture(scope="module")
def keyed_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    gw = Gateway(GatewayStore(tmp_path_factory.mktemp("gw") / "gateway.sqlite3"), static_keys=[KEY])
    srv = SimServer(SimulatedReplica("r0"), guard=gw)
    yield srv.start()
    srv.stop()


def _raw(url: str, request: bytes) -> bytes:
    """One request with exactly these bytes (httpx would set Host itself)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", "gpu-box.lan", "LOCALHOST:8000"])
def test_loopback_names_and_allowed_hosts_pass(url: str, host: str):
    r = httpx.get(f"{url}/health", headers={"host": host})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host", ["evil.example.com", "127.0.0.1.nip.io", "attacker:80", ""])
def test_other_host_headers_are_refused(url: str, host: str):
    r = _raw(url, f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    assert r.startswith(b"HTTP/1.1 403"), r[:200]
    assert b"host_not_allowed" in r and b"--allowed-hosts" in r


def test_cross_site_bodyless_post_is_refused(url: str):
    """What a page's `fetch(url, {method: 'POST', mode: 'no-cors'})` sends: no preflight, an Origin."""
    r = httpx.post(f"{url}/reset_prefix_cache", headers={"origin": "https://evil.example.com"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site_request"
    r = httpx.post(f"{url}/reset_prefix_cache", headers={"sec-fetch-site": "cross-site"})
    assert r.status_code == 403
    r = httpx.post(f"{url}/v1/completions", headers={"origin": "null", "content-type": "text/plain"},
                   content=b'{"model": "sim", "prompt": "x", "max_tokens": 1}')
    assert r.status_code == 403
    # Same-origin pages, allowed origins and clients that send no Origin (curl, SDKs) pass.
    assert httpx.post(f"{url}/reset_prefix_cache", headers={"origin": url}).status_code == 200
    assert httpx.post(f"{url}/reset_prefix_cache", headers={"origin": "https://app.example.com"}).status_code == 200
    assert httpx.post(f"{url}/reset_prefix_cache").status_code == 200


def test_cors_is_default_deny_and_allows_listed_origins(url: str):
    pre = {"access-control-request-method": "POST", "access-control-request-headers": "content-type,authorization"}
    r = httpx.options(f"{url}/v1/completions", headers={"origin": "https://evil.example.com", **pre})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    r = httpx.options(f"{url}/v1/completions", headers={"origin": "https://app.example.com", **pre})
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "https://app.example.com"
    assert "authorization" in r.headers["access-control-allow-headers"]
    r = httpx.post(f"{url}/v1/completions", headers={"origin": "https://app.example.com"},
                   json={"model": "sim", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.com"
    r = httpx.get(f"{url}/v1/models", headers={"origin": "https://evil.example.com"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers  # the page cannot read it


def test_dashboard_cannot_be_framed_and_runs_only_its_own_script(url: str):
    r = httpx.get(f"{url}/dashboard")
    assert r.status_code == 200 and r.headers["x-frame-options"] == "DENY"
    csp = r.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "script-src 'sha256-" in csp and "unsafe-eval" not in csp


def test_docs_need_a_key_when_auth_is_on(keyed_url: str, url: str):
    for path in ("/docs", "/redoc", "/openapi.json"):
        r = httpx.get(keyed_url + path)
        assert r.status_code == 401 and "--public-docs" in r.json()["error"]["message"], path
        assert httpx.get(keyed_url + path, headers={"authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(url + path).status_code == 200  # auth off: open (loopback only)


def test_public_docs_opens_them_with_auth_on(tmp_path):
    gw = Gateway(GatewayStore(tmp_path / "gateway.sqlite3"), static_keys=[KEY])
    srv = SimServer(SimulatedReplica("r0"), guard=gw, config=ApiSettings(public_docs=True))
    url = srv.start()
    try:
        assert httpx.get(url + "/openapi.json").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401  # the API itself still needs the key
    finally:
        srv.stop()


def test_serve_flags():
    cfg = build_config(build_parser().parse_args(
        ["serve", "--allowed-hosts", "a.lan,b.lan", "--allowed-hosts", "c.lan", "--allowed-origins", "*",
         "--public-docs"]))
    assert cfg.allowed_hosts == ["a.lan", "b.lan", "c.lan"] and cfg.allowed_origins == ["*"] and cfg.public_docs
    cfg = build_config(build_parser().parse_args(["serve"]))
    assert (cfg.allowed_hosts, cfg.allowed_origins, cfg.public_docs) == ([], [], False)
