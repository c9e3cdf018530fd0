"""TLS at the server (vLLM's `--ssl-keyfile/--ssl-certfile/--ssl-ca-certs`), on a real `tokenpath
serve` with certificates made by the `openssl` command: the openai client verifying the server's
certificate against the test's own CA gets answers; one trusting only the system CAs, a plain-HTTP
client, and (with `--ssl-ca-certs`) a client without a certificate of that CA are all refused."""

from __future__ import annotations

import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

CHAT = "smollm2-135m-instruct"
TOKENPATH = str(Path(sys.executable).parent / "tokenpath")
pytestmark = pytest.mark.requires("openssl")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca_and_certs(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by it."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=tokenpath test CA",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "san.ext"]), ("client", [])):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-out", f"{name}.pem", *ext, cwd=d)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, server_factory):
    d = tmp_path_factory.mktemp("certs")
    _ca_and_certs(d)
    srv = server_factory("--model", CHAT, "--ssl-keyfile", str(d / "server.key"), "--ssl-certfile",
                         str(d / "server.pem"), "--ssl-ca-certs", str(d / "ca.pem"))
    return srv, d


def test_https_with_client_certificates(tls_server):
    srv, d = tls_server
    assert "tls: on (client certificates required)" in srv.output()
    assert f"listening on https://127.0.0.1:{srv.port}/v1" in srv.output()
    base = f"https://127.0.0.1:{srv.port}/v1"
    trust = ssl.create_default_context(cafile=str(d / "ca.pem"))
    trust_and_cert = ssl.create_default_context(cafile=str(d / "ca.pem"))
    trust_and_cert.load_cert_chain(str(d / "client.pem"), str(d / "client.key"))
    ok = httpx.Client(verify=trust_and_cert, timeout=120)
    with ok:
        client = openai.OpenAI(base_url=base, api_key="unused", http_client=ok, max_retries=0)
        resp = client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=2)
        assert resp.choices[0].finish_reason in ("stop", "length")
    # The system CAs do not know this server's certificate.
    with httpx.Client(timeout=30) as plain_trust:
        client = openai.OpenAI(base_url=base, api_key="unused", http_client=plain_trust, max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            client.models.list()
    # Trusting the server is not enough: the server asks for a client certificate.
    with httpx.Client(verify=trust, timeout=30) as no_cert, pytest.raises(httpx.HTTPError):
        no_cert.get(base + "/models")
    # Plain HTTP to the TLS port gets no answer.
    with httpx.Client(timeout=30) as http, pytest.raises(httpx.HTTPError):
        http.get(f"http://127.0.0.1:{srv.port}/health")


@pytest.mark.parametrize("flags, message", [
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", "k.pem", "--ssl-certfile", "missing.pem"], "no such file"),
])
def test_incomplete_tls_flags_are_refused(tmp_path, flags, message):
    (tmp_path / "k.pem").write_text("not a key")
    out = subprocess.run([TOKENPATH, "serve", "--port", "0", "--model", CHAT, *flags], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr
