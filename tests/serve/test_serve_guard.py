"""`specfire serve` at the transport: slow and half-sent requests time out (408), connections beyond
the open-file limit's room get 503 without a log flood, browsers' cross-site requests are refused
(Content-Type, Origin, Host), a client that hangs up mid-body is no server error, an empty API key
means no key, /v1/models names no path, a taken port is found before anything heavy is imported,
and SIGTERM ends the process without the interpreter's teardown."""
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse

import httpx
import pytest

from repo import REPO
from serving import free_port, start_server, stop

NAME = "tiny"
GOOD_ORIGIN = "http://good.example"


@pytest.fixture(scope="module")
def server(tinytok_ckpt, tmp_path_factory):
    """Short timeouts, one allowed origin, and SPECFIRE_API_KEY set but empty."""
    log = str(tmp_path_factory.mktemp("guard-log") / "server.log")
    proc, base = start_server([tinytok_ckpt, "--served-model-name", NAME, "--max-seq-len", "512",
                               "--header-timeout", "1", "--body-timeout", "1", "--allowed-origins", GOOD_ORIGIN], log,
                              env={"SPECFIRE_API_KEY": ""})
    yield {"base": base, "port": urllib.parse.urlsplit(base).port, "log": log, "ckpt": tinytok_ckpt}
    stop(proc)


def metric(base, name, **labels):
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"specfire:{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def raw(port, data: bytes, timeout: float = 10.0) -> bytes:
    """Send `data` on a fresh connection and read until the server closes it (or `timeout`)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(data)
        s.settimeout(timeout)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return got


COMPLETION = {"prompt": "hi", "max_tokens": 2, "temperature": 0}


# ---- the flags -------------------------------------------------------------------------------------

def test_access_flags():
    from specfire.serve.guard import Access

    a = Access.from_flags(["http://A.example/", '["http://b.example:3000"]'], ["*.corp.example,api.example"],
                          "0.0.0.0")
    assert a.origins == ("http://a.example", "http://b.example:3000")
    assert a.origin_ok("http://a.example") and a.origin_ok("HTTP://B.example:3000/")
    assert not a.origin_ok("http://b.example") and not a.origin_ok("null")
    assert [a.host_ok(h) for h in ("x.corp.example:80", "corp.example", "api.example", "evil", "localhost:1",
                                   "[::1]", "8.8.8.8")] == [True, False, True, False, True, True, True]
    assert Access.from_flags(None, None, "0.0.0.0").hosts is None           # any Host off loopback
    assert Access.from_flags(None, None, "localhost").hosts == ()
    assert Access.from_flags(None, ["*"], "127.0.0.1").hosts is None
    assert Access.from_flags(["*"], None, "::1").origin_ok("http://anything")
    for origins, hosts, flag in ((["localhost:3000"], None, "--allowed-origins 'localhost:3000'"),
                                 (None, ["a.example:80"], "--allowed-hosts 'a.example:80'"),
                                 (["[1, 2]"], None, "--allowed-origins '[1, 2]'")):
        with pytest.raises(ValueError, match=re.escape(flag)):
            Access.from_flags(origins, hosts, "127.0.0.1")


def test_connection_budget_stays_under_the_file_limit():
    from specfire.serve.transport import MAX_CONNECTIONS_CAP, FileBudget

    for nofile in (256, 1024, 4096, 65536):
        b = FileBudget(nofile)
        n = b.max_connections(None)
        assert 1 <= n <= MAX_CONNECTIONS_CAP and n + b.refusing + 3 * b.accept_burst + 16 <= nofile
        assert b.max_connections(n) == n
        with pytest.raises(ValueError, match=f"--max-connections {b.most_connections + 1} .*ulimit -n {nofile}"):
            b.max_connections(b.most_connections + 1)
    with pytest.raises(ValueError, match="--max-connections must be >= 1"):
        FileBudget(1024).max_connections(0)


# ---- timeouts ---------------------------------------------------------------------------------------

def test_half_sent_headers_get_408(server):
    got = raw(server["port"], b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Ty")
    assert got.startswith(b"HTTP/1.1 408 "), got
    assert b"--header-timeout" in got


def test_silent_connection_is_closed(server):
    """A connection that sends nothing is closed at the header deadline, unanswered."""
    with socket.create_connection(("127.0.0.1", server["port"])) as s:
        s.settimeout(8)
        assert s.recv(100) == b""          # the server's close, not this side's timeout


def test_stalled_body_gets_408(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 500\r\n\r\n")
    got = raw(server["port"], head + b'{"prompt": "h')
    assert got.startswith(b"HTTP/1.1 408 "), got
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert b"--body-timeout" in got


def test_kept_alive_connection_times_out_on_its_next_request(server):
    """The header deadline also covers a second request on a kept-alive connection."""
    with socket.create_connection(("127.0.0.1", server["port"])) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        s.settimeout(10)
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            first += s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        s.sendall(b"GET /health HTTP/1.1\r\nHo")
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 408 "), got


def test_client_leaving_mid_body_is_no_server_error(server):
    before_500 = metric(server["base"], "http_errors_total", status="500")
    before = metric(server["base"], "http_client_disconnects_total")
    with socket.create_connection(("127.0.0.1", server["port"])) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "' + b"x" * 20)
        time.sleep(0.2)
    deadline = time.time() + 10
    while metric(server["base"], "http_client_disconnects_total") < before + 1:
        assert time.time() < deadline, "the disconnect was not counted"
        time.sleep(0.1)
    assert metric(server["base"], "http_errors_total", status="500") == before_500
    with open(server["log"]) as f:
        log = f.read()
    assert "Traceback" not in log and "internal error" not in log, log


# ---- what a browser may do ---------------------------------------------------------------------------

@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None])
def test_post_needs_a_json_content_type(server, ctype):
    headers = {"Content-Type": ctype} if ctype else {}
    gen = metric(server["base"], "generation_tokens_total")
    r = httpx.post(server["base"] + "/v1/completions", content=json.dumps(COMPLETION), headers=headers,
                   timeout=30)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert "application/json" in err["message"] and err["code"] == "unsupported_media_type"
    assert metric(server["base"], "generation_tokens_total") == gen
    r = httpx.post(server["base"] + "/v1/completions", content=json.dumps(COMPLETION), timeout=30,
                   headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


def test_foreign_origin_is_refused(server):
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(server["base"] + path, json=COMPLETION, headers={"Origin": "http://evil.example"}, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
        assert "--allowed-origins" in r.json()["error"]["message"]
    r = httpx.get(server["base"] + "/v1/models", headers={"Origin": "null"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_allowed_origin_gets_cors(server):
    pre = httpx.options(server["base"] + "/v1/completions", headers={
        "Origin": GOOD_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization"})
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == GOOD_ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "content-type" in pre.headers["access-control-allow-headers"]
    r = httpx.post(server["base"] + "/v1/completions", json=COMPLETION, headers={"Origin": GOOD_ORIGIN}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD_ORIGIN
    bad = httpx.options(server["base"] + "/v1/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert bad.status_code == 403 and "access-control-allow-origin" not in bad.headers


@pytest.mark.parametrize("host,ok", [("evil.example", False), ("evil.example:8000", False),
                                     ("localhost", True), ("app.localhost:1", True), ("127.0.0.1", True),
                                     ("[::1]:8000", True), ("10.1.2.3:80", True)])
def test_loopback_server_checks_host(server, host, ok):
    """Bound to 127.0.0.1 with no --allowed-hosts: a DNS name that is not local (a rebound one) is refused."""
    r = httpx.get(server["base"] + "/v1/models", headers={"Host": host})
    assert r.status_code == (200 if ok else 403), r.text
    if not ok:
        assert r.json()["error"]["code"] == "host_not_allowed" and "--allowed-hosts" in r.text


# ---- the API key and the model's name ----------------------------------------------------------------

def test_empty_api_key_means_no_key(server):
    for headers in ({}, {"Authorization": "Bearer anything"}):
        r = httpx.post(server["base"] + "/v1/completions", json=COMPLETION, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
    with open(server["log"]) as f:
        assert "the API key is empty (SPECFIRE_API_KEY='')" in f.read()


@pytest.mark.parametrize("key", [" sk-key", "sk-key ", "sk-key\t", "sk-\u00e9", "sk-\nkey"])
def test_api_key_no_client_can_send_is_refused(key):
    from specfire.serve.guard import check_api_key

    with pytest.raises(ValueError, match="API key"):
        check_api_key(key)
    assert check_api_key("") is None and check_api_key(None) is None and check_api_key("sk a") == "sk a"


def test_api_key_is_checked_at_start(tmp_path):
    """SPECFIRE_API_KEY with a trailing space: one line, before the port and the model."""
    e = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "SPECFIRE_API_KEY": "sk-key "}
    p = subprocess.run([sys.executable, "-m", "specfire.cli", "serve", str(tmp_path / "no-such-model"), "--port",
                        str(free_port())], capture_output=True, text=True, timeout=120, env=e)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == ["specfire: error: the API key (--api-key / SPECFIRE_API_KEY) has "
                                             "leading or trailing whitespace, which no Authorization header can "
                                             "carry; remove it"], p.stderr


def test_models_names_no_path(server):
    m = httpx.get(server["base"] + "/v1/models").json()["data"][0]
    assert m["id"] == NAME and m["root"] == NAME
    assert server["ckpt"] not in json.dumps(m) and os.sep not in json.dumps(m)


# ---- the open-file limit ----------------------------------------------------------------------------

def test_connection_flood_under_a_file_limit(tinytok_ckpt, tmp_path):
    """260 sockets that send half a request, against `ulimit -n 256`: /health answers (503 while
    they stay, 200 once their header deadline closes them), the refused ones read a 503, and the
    log does not grow per failed accept. Past the refusing share a connection is closed unanswered
    (a reset), by design: a flood socket or a probe that lands in a burst of those is one."""
    log = str(tmp_path / "server.log")

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    proc, base = start_server([tinytok_ckpt, "--max-seq-len", "512", "--header-timeout", "5"], log, preexec_fn=limit)
    port = urllib.parse.urlsplit(base).port
    socks = []
    try:
        for _ in range(260):
            s = socket.create_connection(("127.0.0.1", port))
            socks.append(s)
            try:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
            except (ConnectionResetError, BrokenPipeError):     # closed unanswered: it reads b"" below
                pass
        for _ in range(20):     # a probe reset in a burst past the refusing share: the next one is answered
            try:
                r = httpx.get(base + "/health", timeout=3)
                break
            except httpx.ReadError:
                time.sleep(0.1)
        else:
            pytest.fail("/health was closed unanswered 20 times in a row")
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "too_many_connections" and "--max-connections" in r.text
        deadline = time.time() + 30

        def healthy() -> bool:
            try:
                return httpx.get(base + "/health", timeout=3).status_code == 200
            except httpx.TransportError:    # a connection refused while the flood is shed: not yet
                return False
        while not healthy():
            assert time.time() < deadline, "/health never recovered"
            time.sleep(0.2)
        r = httpx.post(base + "/v1/completions", json=COMPLETION, timeout=30)
        assert r.status_code == 200
        answers = set()
        for s in socks:
            s.settimeout(5)
            try:
                answers.add(s.recv(12))
            except (TimeoutError, ConnectionResetError):
                answers.add(b"")
        assert b"HTTP/1.1 408" in answers and b"HTTP/1.1 503" in answers, answers
    finally:
        for s in socks:
            s.close()
        stop(proc)
    with open(log) as f:
        lines = f.read().splitlines()
    assert len(lines) < 10 and not any("Traceback" in ln for ln in lines), lines[:20]


# ---- start and stop -----------------------------------------------------------------------------------

# specfire's own package without its __init__ (which imports the engine), and the server's heavy
# packages made unimportable: `serve` must reach its port check without any of them
NO_HEAVY = textwrap.dedent("""
    import argparse, importlib.machinery, sys, types
    pkg = types.ModuleType("specfire")
    pkg.__path__ = [{root!r} + "/specfire"]
    sys.modules["specfire"] = pkg
    for name in {missing!r}:
        sys.modules[name] = None          # not installed

    class Block:
        def find_spec(self, name, path=None, target=None):
            top = name.split(".")[0]
            if top in ("torch", "fastapi", "starlette", "uvicorn", "prometheus_client", "transformers"):
                return importlib.machinery.ModuleSpec(name, self)
        def create_module(self, spec):
            raise ImportError(spec.name + " imported before the port was checked")
        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, Block())
    from specfire.serve import http
    p = argparse.ArgumentParser()
    http.add_arguments(p)
    try:
        http.main(p.parse_args(["/no/such/model", "--port", "{port}"]))
    except Exception as e:
        print(type(e).__name__ + ": " + str(e))
""")


def test_port_in_use_is_found_before_heavy_imports():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        p = subprocess.run([sys.executable, "-c", NO_HEAVY.format(root=REPO, port=port, missing=())],
                           capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == (f"SpecfireError: cannot listen on 127.0.0.1:{port}: the port is already in use "
                                f"(choose another --port)"), p.stdout + p.stderr


def test_missing_server_package_is_named():
    p = subprocess.run([sys.executable, "-c", NO_HEAVY.format(root=REPO, port=free_port(), missing=("uvicorn",))],
                       capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == ("MissingPackage: 'specfire serve' needs the Python package uvicorn, which is not "
                                "installed: pip install fastapi uvicorn"), \
        p.stdout + p.stderr


def test_sigterm_skips_the_interpreter_teardown(tinytok_ckpt, tmp_path):
    """An exit handler that would take 60 s never runs: once the server has stopped and the model
    is freed, the process ends at once (torch's teardown took seconds)."""
    launcher = [sys.executable, "-c", "import atexit, sys, time; atexit.register(time.sleep, 60); "
                                      "from specfire.cli import main; sys.exit(main(sys.argv[1:]))"]
    log = str(tmp_path / "server.log")
    proc, base = start_server([tinytok_ckpt, "--max-seq-len", "512"], log, launcher=launcher)
    try:
        assert httpx.post(base + "/v1/completions", json=COMPLETION, timeout=30).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        stop(proc)
    with open(log) as f:
        assert f.read().rstrip().endswith("server stopped")
