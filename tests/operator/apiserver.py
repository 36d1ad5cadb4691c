"""A real Kubernetes API server for custom resources in the test suite: etcd + apiextensions-apiserver.

The binaries come from tools/k8s_apiserver/build.sh (apiextensions-apiserver built from Debian's packaged Go
sources, etcd from Debian's etcd-server), cached under ~/.cache/kvserve-k8s/latest/bin, or from the folder
$KVSERVE_K8S_BIN. With KVSERVE_BUILD_APISERVER=1 (the default when CI=true; .ci/run builds first and sets it
to 0) a missing build is made (minutes). Where they
cannot be had the tests that need them skip with one line, except in CI (CI=true), where they fail.

The server serves CRDs and custom resources only: no core or apps kinds, no controllers, no /api. It runs
with a throw-away CA: its serving certificate and a client certificate in group system:masters (always
authorized by the delegating authorizer), its kubeconfig pointing at itself with lookups skipped, and the
webhook, policy and NamespaceLifecycle admission plugins off (nothing to call, no namespaces to look up).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import pathlib
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "tools" / "k8s_apiserver" / "build.sh"
CACHE = pathlib.Path(os.environ.get("KVSERVE_K8S_CACHE", pathlib.Path.home() / ".cache" / "kvserve-k8s"))
READY_TIMEOUT_S = 90.0
ADMISSION_OFF = (
    "NamespaceLifecycle,MutatingAdmissionPolicy,MutatingAdmissionWebhook,"
    "ValidatingAdmissionPolicy,ValidatingAdmissionWebhook"
)


class Unavailable(RuntimeError):
    """The binaries are not here and may not be built here."""


def _complete(folder: pathlib.Path) -> bool:
    return all(os.access(folder / name, os.X_OK) for name in ("apiextensions-apiserver", "etcd"))


def binaries() -> pathlib.Path:
    """The folder holding apiextensions-apiserver and etcd; builds them when allowed (see the module doc)."""
    given = os.environ.get("KVSERVE_K8S_BIN")
    if given:
        if not _complete(pathlib.Path(given)):
            raise Unavailable(f"KVSERVE_K8S_BIN={given} lacks apiextensions-apiserver or etcd")
        return pathlib.Path(given)
    cached = CACHE / "latest" / "bin"
    if _complete(cached):
        return cached
    build = os.environ.get("KVSERVE_BUILD_APISERVER", "1" if os.environ.get("CI") == "true" else "0")
    if build != "1":
        raise Unavailable(
            f"no apiextensions-apiserver/etcd in {cached}: run {BUILD_SCRIPT.relative_to(ROOT)} "
            "(or set KVSERVE_BUILD_APISERVER=1)"
        )
    done = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, check=False)
    if done.returncode != 0 or not _complete(cached):
        raise Unavailable(f"{BUILD_SCRIPT.name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return cached


def _load_prctl() -> Any:
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # loaded here: the child between fork and exec should take no loader lock


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies, however it dies (Linux PR_SET_PDEATHSIG)."""
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGTERM))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _certificates(folder: pathlib.Path) -> None:
    """ca.crt, server.crt/.key (127.0.0.1, localhost) and client.crt/.key (admin, group system:masters)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str, org: str | None = None) -> x509.Name:
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if org:
            attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        return x509.Name(attrs)

    def write_key(key: Any, path: pathlib.Path) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    def issue(subject: x509.Name, key: Any, issuer: x509.Name, issuer_key: Any, extensions: list) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
        )
        for ext, critical in extensions:
            builder = builder.add_extension(ext, critical=critical)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("kvserve-test-ca")
    ca = issue(ca_name, ca_key, ca_name, ca_key, [(x509.BasicConstraints(ca=True, path_length=None), True)])
    (folder / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    leaves = {
        "server": (
            name("127.0.0.1"),
            [
                (
                    x509.SubjectAlternativeName(
                        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                    ),
                    False,
                ),
                (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False),
            ],
        ),
        "client": (
            name("admin", "system:masters"),
            [(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)],
        ),
    }
    for leaf, (subject, extensions) in leaves.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = issue(
            subject, key, ca_name, ca_key, [(x509.BasicConstraints(ca=False, path_length=None), True), *extensions]
        )
        (folder / f"{leaf}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        write_key(key, folder / f"{leaf}.key")


class ApiError(RuntimeError):
    def __init__(self, status: int, body: Any):
        message = body.get("message") if isinstance(body, dict) else str(body)
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.body, self.message = status, body, message or ""


class ApiServer:
    """A running etcd + apiextensions-apiserver pair and a small synchronous JSON client for it."""

    def __init__(self, bin_dir: pathlib.Path, workdir: pathlib.Path):
        self.bin_dir, self.workdir = bin_dir, workdir
        self.port = _free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.etcd_port, self.etcd_peer_port = _free_port(), _free_port()
        self.etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        self.ca, self.cert, self.key = (str(workdir / n) for n in ("ca.crt", "client.crt", "client.key"))
        self.kubeconfig = workdir / "kubeconfig"
        self._etcd: subprocess.Popen | None = None
        self._server: subprocess.Popen | None = None
        self.context = ssl.create_default_context(cafile=self.ca if pathlib.Path(self.ca).exists() else None)

    # -- processes -------------------------------------------------------------------------------------

    def start(self) -> None:
        _certificates(self.workdir)
        self.context = ssl.create_default_context(cafile=self.ca)
        self.context.load_cert_chain(self.cert, self.key)
        self.kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "self", "cluster": {"server": self.url, "certificate-authority": self.ca}}],
                    "users": [{"name": "admin", "user": {"client-certificate": self.cert, "client-key": self.key}}],
                    "contexts": [{"name": "self", "context": {"cluster": "self", "user": "admin"}}],
                    "current-context": "self",
                }
            )
        )
        self.start_etcd()
        self.start_server()

    def start_etcd(self) -> None:
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        self._etcd = self._spawn(
            "etcd",
            [
                str(self.bin_dir / "etcd"),
                "--name=test",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}",
                "--unsafe-no-fsync",  # a throw-away store: durability buys nothing here
                "--log-level=warn",
            ],
        )
        self._wait(lambda: self._http_ok(f"{self.etcd_url}/health"), "etcd /health", self._etcd)

    def start_server(self) -> None:
        self._server = self._spawn(
            "apiserver",
            [
                str(self.bin_dir / "apiextensions-apiserver"),
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--tls-cert-file={self.workdir / 'server.crt'}",
                f"--tls-private-key-file={self.workdir / 'server.key'}",
                f"--client-ca-file={self.ca}",
                f"--cert-dir={self.workdir / 'certs'}",
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--authentication-skip-lookup",
                "--authentication-tolerate-lookup-failure",
                f"--disable-admission-plugins={ADMISSION_OFF}",
                # Priority and fairness reads its FlowSchemas from the flowcontrol API, which this server
                # does not serve: with it on, /readyz never turns ok.
                "--enable-priority-and-fairness=false",
                # Watches read etcd itself, so a watch from a compacted resourceVersion gets etcd's answer,
                # 410 Gone (the life-cycle tests compact etcd to make one); with the watch cache a short
                # history of events answers instead.
                "--watch-cache=false",
            ],
        )
        self._wait(self._ready, "apiextensions-apiserver /readyz", self._server)

    def stop_server(self) -> None:
        self._stop(self._server)
        self._server = None

    def stop(self) -> None:
        self._stop(self._server)
        self._stop(self._etcd)
        self._server = self._etcd = None

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it until it ends
        return subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent
        )

    def etcd_compact(self) -> int:
        """Compact etcd at its current revision (through its JSON gateway); returns that revision. A watch from
        an older resourceVersion then gets 410 Gone."""
        revision = self._etcd_call("/v3/kv/range", {"key": "AA=="})["header"]["revision"]
        self._etcd_call("/v3/kv/compaction", {"revision": revision, "physical": True})
        return int(revision)

    def _etcd_call(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.etcd_url + path, data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    @staticmethod
    def _stop(proc: subprocess.Popen | None) -> None:
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def log_tail(self, name: str = "apiserver", chars: int = 3000) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def _wait(self, ready: Any, what: str, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                name = "etcd" if proc is self._etcd else "apiserver"
                raise RuntimeError(f"{what}: exited {proc.returncode}:\n{self.log_tail(name)}")
            if ready():
                return
            time.sleep(0.2)
        try:
            checks = self.request("GET", "/readyz", query={"verbose": "1"}, raw=True, timeout=5)
        except (OSError, ApiError) as exc:
            checks = str(exc)
        raise RuntimeError(f"{what}: not ready after {READY_TIMEOUT_S} s:\n{checks}\n{self.log_tail()}")

    @staticmethod
    def _http_ok(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _ready(self) -> bool:
        try:
            # informer-sync never passes: the server's Service informer (for conversion webhooks) lists
            # core/v1 Services, which it does not serve. Every other check must pass.
            return self.request("GET", "/readyz", query={"exclude": "informer-sync"}, raw=True, timeout=5) == "ok"
        except (OSError, ApiError):
            return False

    # -- client ----------------------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
        raw: bool = False,
        timeout: float = 30.0,
    ) -> Any:
        """One call; the decoded JSON answer. Raises ApiError (with the server's Status) on HTTP >= 400."""
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.context) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                answer: Any = json.loads(text)
            except ValueError:
                answer = text
            raise ApiError(exc.code, answer) from None
        return text if raw else json.loads(text or "null")

    def apply_crd(self, crd: dict) -> dict:
        """Create (or replace) a CRD and wait until it is Established and its kind is served."""
        name = crd["metadata"]["name"]
        path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        try:
            live = self.request("GET", f"{path}/{name}")
            body = {**crd, "metadata": {**crd["metadata"], "resourceVersion": live["metadata"]["resourceVersion"]}}
            self.request("PUT", f"{path}/{name}", body)
        except ApiError as exc:
            if exc.status != 404:
                raise
            self.request("POST", path, crd)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            live = self.request("GET", f"{path}/{name}")
            conditions = {c["type"]: c["status"] for c in (live.get("status") or {}).get("conditions") or []}
            if conditions.get("Established") == "True" and conditions.get("NamesAccepted") == "True":
                group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
                version = next(v["name"] for v in crd["spec"]["versions"] if v.get("storage"))
                with contextlib.suppress(ApiError):
                    self.request("GET", f"/apis/{group}/{version}/{plural}", query={"limit": "1"})
                    return live
            time.sleep(0.1)
        raise RuntimeError(f"CRD {name} not established: {live.get('status')}")

    def collection(self, api_version: str, plural: str, namespace: str) -> str:
        return f"/apis/{api_version}/namespaces/{namespace}/{plural}"


@contextlib.contextmanager
def running() -> Iterator[ApiServer]:
    """Start etcd and the API server in a temporary folder; stop both and remove it at the end.
    Raises Unavailable where the binaries cannot be had."""
    bin_dir = binaries()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="kvserve-apiserver-"))
    server = ApiServer(bin_dir, workdir)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


_shared: ApiServer | None = None
_shared_error: str | None = None


def shared() -> ApiServer:
    """The one server of this test process (tests/operator and e2e/operator share it), started on first use
    and stopped when the process exits. Skips (fails in CI) where the binaries cannot be had."""
    global _shared, _shared_error
    import atexit

    import pytest

    if _shared is None and _shared_error is None:
        try:
            bin_dir = binaries()
        except Unavailable as exc:
            _shared_error = str(exc)
        else:
            workdir = pathlib.Path(tempfile.mkdtemp(prefix="kvserve-apiserver-"))
            server = ApiServer(bin_dir, workdir)
            atexit.register(lambda: (server.stop(), shutil.rmtree(workdir, ignore_errors=True)))
            server.start()
            _shared = server
    if _shared is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"real API server required in CI: {_shared_error}")
        pytest.skip(f"real API server unavailable: {_shared_error}")
    return _shared
