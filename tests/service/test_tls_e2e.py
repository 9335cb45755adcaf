"""End-to-end tests of transport security (--tls_cert_file, --tls_key_file,
--tls_client_ca_file, --health_port) with certificates made here by the
openssl command and real grpcio clients: TLS works and plaintext to the TLS
port fails cleanly; mutual TLS refuses a client without a certificate and one
signed by another CA; a certificate rewritten in place is served to new
connections without a restart while an open stream goes on; the plaintext
health port answers probes; bad files stop the server at start-up with a
message; coalesce-cli connects over TLS.

    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/service/test_tls_e2e.py
"""

import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time

import grpc
import pytest

from e2e_support import SERVER, Client, Server, time_to_close, wait_for

PROMPT = [1, 403, 407, 261]


def openssl(*args, cwd):
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, "openssl %s\n%s" % (" ".join(args), r.stderr)


def make_ca(d, name):
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", name + ".key", "-out", name + ".pem", "-days", "2", "-subj", "/CN=" + name,
            cwd=d)


def make_cert(d, name, ca, server):
    """A key and a certificate signed by `ca`: for 127.0.0.1 and localhost
    when `server`, else a client's."""
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", name + ".key", "-out", name + ".csr", "-subj", "/CN=" + name, cwd=d)
    ext = os.path.join(d, name + ".ext")
    with open(ext, "w") as f:
        if server:
            f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
        else:
            f.write("extendedKeyUsage=clientAuth\n")
    openssl("x509", "-req", "-in", name + ".csr", "-CA", ca + ".pem", "-CAkey", ca + ".key",
            "-CAcreateserial", "-out", name + ".pem", "-days", "2", "-extfile", ext, cwd=d)


def read(d, name):
    with open(os.path.join(d, name), "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """ca1 signs the server's certificate and client1's; ca2 signs server2's
    (for rotation) and client2's."""
    d = str(tmp_path_factory.mktemp("pki"))
    make_ca(d, "ca1")
    make_ca(d, "ca2")
    make_cert(d, "server1", "ca1", server=True)
    make_cert(d, "server2", "ca2", server=True)
    make_cert(d, "client1", "ca1", server=False)
    make_cert(d, "client2", "ca2", server=False)
    return d


def tls_server(pki, d, client_ca=False, extra=()):
    """A server whose certificate and key are copies in `d` (so a test may
    rewrite them)."""
    shutil.copy(os.path.join(pki, "server1.pem"), os.path.join(d, "cert.pem"))
    shutil.copy(os.path.join(pki, "server1.key"), os.path.join(d, "key.pem"))
    flags = ["--tls_cert_file=%s/cert.pem" % d, "--tls_key_file=%s/key.pem" % d,
             "--tls_reload_interval=1s", "--batch_window=0"] + list(extra)
    if client_ca:
        flags.append("--tls_client_ca_file=%s/ca1.pem" % pki)
    return Server(flags)


def connect(pb, server, pki, ca="ca1", client=None):
    creds = grpc.ssl_channel_credentials(
        root_certificates=read(pki, ca + ".pem"),
        private_key=read(pki, client + ".key") if client else None,
        certificate_chain=read(pki, client + ".pem") if client else None)
    return Client(server, creds, wait_ready=False).bind(pb)


def generate_ok(client):
    return client.generate(client.request(ids=PROMPT, max_new_tokens=8), timeout=15)


def new_connection_generates(pb, server, pki, **who):
    """A generation on a new connection (so through a new handshake) of a
    client of `who` (connect's ca, client): its result."""
    c = connect(pb, server, pki, **who)
    try:
        return generate_ok(c)
    finally:
        c.close()


def test_tls_serves_and_plaintext_to_it_fails_cleanly(pb, pki, tmp_path):
    server = tls_server(pki, str(tmp_path))
    try:
        assert "gRPC over TLS" in server.log()
        c = connect(pb, server, pki)
        res = generate_ok(c)
        assert res.code is None and len(res.ids) == 8, res
        c.close()
        plain = grpc.insecure_channel(server.address)
        call = plain.unary_unary("/coalesce.v1.Generator/GetModelInfo")
        with pytest.raises(grpc.RpcError) as e:
            call(b"", timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        plain.close()
        # A client that does not trust the server's CA is refused too.
        other = connect(pb, server, pki, ca="ca2")
        res = generate_ok(other)
        assert res.code == grpc.StatusCode.UNAVAILABLE, res
        other.close()
        # The server is unharmed.
        c = connect(pb, server, pki)
        assert generate_ok(c).code is None
        c.close()
    finally:
        server.kill()


def test_mutual_tls_refuses_clients_without_a_certificate_from_its_ca(pb, pki, tmp_path):
    server = tls_server(pki, str(tmp_path), client_ca=True)
    try:
        assert "gRPC over mutual TLS" in server.log()
        good = connect(pb, server, pki, client="client1")
        assert generate_ok(good).code is None
        for who in (None, "client2"):
            bad = connect(pb, server, pki, client=who)
            res = generate_ok(bad)
            assert res.code == grpc.StatusCode.UNAVAILABLE, (who, res)
            bad.close()
        assert generate_ok(good).code is None
        good.close()
    finally:
        server.kill()


def test_a_rewritten_certificate_is_served_without_a_restart(pb, pki, tmp_path):
    d = str(tmp_path)
    server = tls_server(pki, d)
    try:
        old = connect(pb, server, pki, ca="ca1")
        long = old.request(ids=PROMPT, max_new_tokens=300)
        result = {}
        t = threading.Thread(target=lambda: result.update(res=old.generate(long)))
        t.start()
        assert generate_ok(connect(pb, server, pki, ca="ca2")).code == grpc.StatusCode.UNAVAILABLE
        # cert-manager's way: the key and the certificate replaced in place.
        for src, dst in (("server2.key", "key.pem"), ("server2.pem", "cert.pem")):
            tmp = os.path.join(d, dst + ".new")
            shutil.copy(os.path.join(pki, src), tmp)
            os.replace(tmp, os.path.join(d, dst))
        deadline = time.monotonic() + 20
        while True:
            c = connect(pb, server, pki, ca="ca2")
            res = generate_ok(c)
            c.close()
            if res.code is None or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert res.code is None, "the new certificate was not picked up: %s" % res
        t.join()
        assert result["res"].code is None and len(result["res"].ids) == 300
        old.close()
    finally:
        server.kill()


def test_an_unusable_rewrite_keeps_the_last_good_certificate(pb, pki, tmp_path):
    """A certificate written before its key (the new certificate with the old
    key), a garbage file and a deleted file each once broke every new
    handshake until the files were right again. Each is now logged, naming
    the problem, while new connections keep the last good pair; the right
    pair is then served at once."""
    d = str(tmp_path)
    server = tls_server(pki, d)
    try:
        def replace(name, data):
            tmp = os.path.join(d, name + ".new")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, os.path.join(d, name))

        def still_served(words):
            """After the server looked at the files (1 s), the log says why the
            change was not taken, and a client of the old CA still connects."""
            assert wait_for(lambda: words in server.log(start), 10), server.log(start)
            res = new_connection_generates(pb, server, pki, ca="ca1")
            assert res.code is None, (words, res)

        start = server.log_len()
        replace("cert.pem", read(pki, "server2.pem"))  # the key is still server1's
        still_served("is not the key of --tls_cert_file=")
        start = server.log_len()
        replace("cert.pem", b"-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n")
        still_served("no PEM certificate in it")
        start = server.log_len()
        os.remove(os.path.join(d, "cert.pem"))
        still_served("cannot read it")
        for line in server.log().splitlines():
            if "not into a pair that can be served" in line:
                assert "still get the certificate loaded at" in line, line
        # The whole new pair: served to the next handshakes.
        replace("key.pem", read(pki, "server2.key"))
        replace("cert.pem", read(pki, "server2.pem"))
        assert wait_for(lambda: "new connections get the certificate now in" in server.log(),
                        10), server.log()
        assert new_connection_generates(pb, server, pki, ca="ca2").code is None
    finally:
        server.kill()


def test_an_unusable_client_ca_keeps_the_last_good_one(pb, pki, tmp_path):
    d = str(tmp_path)
    shutil.copy(os.path.join(pki, "ca1.pem"), os.path.join(d, "ca.pem"))
    server = tls_server(pki, d, extra=["--tls_client_ca_file=%s/ca.pem" % d])
    try:
        start = server.log_len()
        with open(os.path.join(d, "ca.pem"), "wb") as f:
            f.write(b"not a certificate")
        assert wait_for(lambda: "not into a CA bundle that can be used" in server.log(start),
                        10), server.log(start)
        assert new_connection_generates(pb, server, pki, client="client1").code is None
    finally:
        server.kill()


def test_a_connection_that_never_finishes_its_handshake_is_closed(pb, pki, tmp_path):
    """A TCP connection that never starts its TLS handshake, and one that
    finishes it but never sends the HTTP/2 preface, once held a descriptor and
    memory for 120 s (gRPC's default handshake timeout) and 40 s (keepalive).
    With --handshake_timeout=1s both are closed after about a second."""
    server = tls_server(pki, str(tmp_path), extra=["--handshake_timeout=1s"])
    try:
        host, port = server.address.rsplit(":", 1)
        silent = socket.create_connection((host, int(port)))
        context = ssl.create_default_context(cafile=os.path.join(pki, "ca1.pem"))
        context.set_alpn_protocols(["h2"])
        quiet = context.wrap_socket(socket.create_connection((host, int(port))),
                                    server_hostname="localhost")
        assert quiet.selected_alpn_protocol() == "h2"
        times = [time_to_close(s, 8)[0] for s in (silent, quiet)]
        print("TLS connections closed after %s s" % ["%.2f" % t if t else t for t in times])
        for t in times:
            assert t is not None and t < 4, times
        silent.close()
        quiet.close()
        assert new_connection_generates(pb, server, pki).code is None
    finally:
        server.kill()


def test_the_plaintext_health_port_answers_probes(pb, pki, tmp_path):
    server = tls_server(pki, str(tmp_path), client_ca=True, extra=["--health_port=0"])
    try:
        m = re.search(r"health service in plaintext on [0-9.]+:(\d+)", server.log())
        assert m, server.log()
        with grpc.insecure_channel("127.0.0.1:" + m.group(1)) as ch:
            check = ch.unary_unary(
                "/grpc.health.v1.Health/Check",
                request_serializer=pb.health.HealthCheckRequest.SerializeToString,
                response_deserializer=pb.health.HealthCheckResponse.FromString)
            for name in ("", "coalesce.v1.Generator"):
                r = check(pb.health.HealthCheckRequest(service=name), timeout=5)
                assert r.status == pb.health.HealthCheckResponse.SERVING
            # Only health: the Generator is not served there.
            info = ch.unary_unary("/coalesce.v1.Generator/GetModelInfo")
            with pytest.raises(grpc.RpcError) as e:
                info(b"", timeout=5)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert server.stop() == 0
    finally:
        server.kill()


def test_plaintext_is_the_default_and_says_so(pb):
    server = Server(["--batch_window=0"])
    try:
        assert "gRPC in plaintext" in server.log()
    finally:
        server.kill()


@pytest.mark.parametrize("flags,words", [
    (["--tls_cert_file=CERT"], "--tls_cert_file and --tls_key_file go together"),
    (["--tls_client_ca_file=CA"], "--tls_client_ca_file needs --tls_cert_file"),
    (["--tls_cert_file=CERT", "--tls_key_file=/nonexistent/key.pem"],
     "--tls_key_file=/nonexistent/key.pem: cannot read it"),
    (["--tls_cert_file=CA", "--tls_key_file=KEY"], "is not the key of --tls_cert_file="),
    (["--tls_cert_file=KEY", "--tls_key_file=KEY"], "no PEM certificate in it"),
    (["--tls_cert_file=CERT", "--tls_key_file=CERT"], "no PEM private key in it"),
])
def test_bad_tls_files_stop_the_server_at_start_up(pki, flags, words):
    sub = {"CERT": os.path.join(pki, "server1.pem"), "KEY": os.path.join(pki, "server1.key"),
           "CA": os.path.join(pki, "ca1.pem")}
    flags = [re.sub(r"=(CERT|KEY|CA)$", lambda m: "=" + sub[m.group(1)], f) for f in flags]
    r = subprocess.run([SERVER, "--model=synthetic:tiny", "--port=0", "--metrics_port=-1"] + flags,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert words in r.stderr, r.stderr


def test_the_cli_connects_over_mutual_tls(pb, pki, tmp_path):
    server = tls_server(pki, str(tmp_path), client_ca=True)
    cli = os.path.join(os.path.dirname(SERVER), "coalesce-cli")
    try:
        base = [cli, "--server=" + server.address, "--prompt=Once upon a time",
                "--max_new_tokens=4", "--tls_ca_file=%s/ca1.pem" % pki]
        ok = subprocess.run(base + ["--tls_cert_file=%s/client1.pem" % pki,
                                    "--tls_key_file=%s/client1.key" % pki],
                            capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and ok.stdout.startswith("Once upon a time"), ok.stderr
        refused = subprocess.run(base, capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0
        half = subprocess.run(base + ["--tls_cert_file=%s/client1.pem" % pki],
                              capture_output=True, text=True, timeout=60)
        assert half.returncode == 2 and "go together" in half.stderr
    finally:
        server.kill()


def test_mutual_tls_names_the_tenant_by_its_certificate(pb, pki, tmp_path):
    """With --api_keys_file, a client certificate's subject may name the
    tenant instead of a key; an unknown subject is UNAUTHENTICATED."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": [{"name": "one", "client_cert_subject": "CN=client1"}]}))
    server = tls_server(pki, str(tmp_path), client_ca=True,
                        extra=["--api_keys_file=%s" % keys])
    try:
        good = connect(pb, server, pki, client="client1")
        res = generate_ok(good)
        assert res.code is None, res
        assert good.metrics().get("coalesce_tenant_requests_total", tenant="one", status="ok") == 1
        good.close()
        # Same CA, another subject: no tenant has it.
        make_cert(pki, "client3", "ca1", server=False)
        stranger = connect(pb, server, pki, client="client3")
        res = generate_ok(stranger)
        assert res.code == grpc.StatusCode.UNAUTHENTICATED, res
        assert 'no tenant has the client certificate subject "CN=client3"' in res.details
        stranger.close()
    finally:
        server.kill()

