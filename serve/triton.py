"""Serving a bundle on Triton Inference Server: ``serve`` runs it, ``write_repository`` writes a
model repository for a tritonserver someone else runs.

``serve`` runs the ``tritonserver`` binary that the ``nvidia-pytriton`` wheel ships (no Docker, no
GPU needed) on a repository of one model: ``config.pbtxt`` rendered from the guard manifest
(``aot.serve.config``) and a Python-backend ``model.py`` (``aot.serve.triton_model``). Triton speaks
the KServe v2 protocol over HTTP and gRPC, answers health and readiness probes, and exports
Prometheus metrics. The backend stub is the one built for this interpreter's Python version, and it
is pointed at this interpreter (first on PATH), its ``libpython``, and its site-packages and
PYTHONPATH folders, so the model sees the same aotpack and torch. tritonserver's HTTP and metrics
endpoints sit on loopback behind ``aot.serve.front``, which checks each request before
tritonserver allocates for it and counts refusals; gRPC is tritonserver's own. SIGTERM (or Ctrl-C)
makes tritonserver stop taking requests and finish those in flight (up to the drain timeout); once
drained it is stopped without waiting for the model's unload, and ``serve`` returns. A backend
process that dies takes the model with it while tritonserver stays ready: ``serve`` then answers
readiness 503, stops the server and raises ``EnvError`` (a non-zero exit, for a restart).
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aot.errors import EnvError, printable
from aot.serve.config import (
    DEFAULT_MAX_QUEUE_DELAY_US,
    ServingSpec,
    open_spec,
    render_config,
    serving_spec,
    wire_dtype,
)
from aot.serve.front import Front, Refused
from aot.serve.requests import RequestCheck
from aot.serve.triton_model import ENV_SITE_DIRS

STARTUP_TIMEOUT_S = 600.0  # loading a large bundle on CPU, or capturing graphs, takes a while
POLL_S = 0.1
UNLOADING = "All models are stopped, unloading models"  # tritonserver's line once every inference is done
STOP_GRACE_S = 0.3  # after the drain, before the unload is cut short
STUB_POLL_S = 0.5  # how often serve checks that the model's backend process is alive
LOG_LINES = 200  # tritonserver log lines kept for the error message
MODEL_VERSION = "1"

# The model.py Triton's Python backend runs: it finds aotpack in the environment of the stub's
# Python (the first python3 on PATH) or through AOTPACK_SITE_DIRS (site folders, whose .pth files
# count, so editable installs work), then the model class.
MODEL_PY = f'''"""Triton Python-backend model serving an aotpack bundle; see the repository's README.md."""

import os
import site

for _folder in filter(None, os.environ.get("{ENV_SITE_DIRS}", "").split(os.pathsep)):
    site.addsitedir(_folder)

from aot.serve.triton_model import TritonPythonModel  # noqa: E402,F401
'''


@dataclass(frozen=True)
class TritonDist:
    """Where the nvidia-pytriton wheel keeps tritonserver, its libraries and the Python backend."""

    server: Path  # bin/tritonserver
    libs: Path  # nvidia_pytriton.libs: libtritonserver and the CUDA runtime it links
    backend: Path  # backends/python: libtriton_python.so, triton_python_backend_utils.py
    stub: Path  # triton_python_backend_stub for this Python version


def find_tritonserver() -> TritonDist:
    """The tritonserver of the installed nvidia-pytriton, without importing pytriton."""
    hint = "install it with `pip install 'aotpack[serve]'` (the nvidia-pytriton wheel ships tritonserver)"
    found = importlib.util.find_spec("pytriton")
    if found is None or not found.submodule_search_locations:
        raise EnvError(
            f"aotpack serve needs Triton Inference Server, and nvidia-pytriton is not installed; {hint}"
        )
    root = Path(next(iter(found.submodule_search_locations)))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    dist = TritonDist(
        server=root / "tritonserver" / "bin" / "tritonserver",
        libs=root.parent / "nvidia_pytriton.libs",
        backend=root / "tritonserver" / "backends" / "python",
        stub=root / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub",
    )
    for what, path in (("tritonserver", dist.server), ("the Python backend", dist.backend)):
        if not path.exists():
            raise EnvError(f"nvidia-pytriton at {root} has no {what} ({path}); reinstall it: {hint}")
    if not dist.stub.exists():
        raise EnvError(
            f"nvidia-pytriton has no Python backend stub for Python {version} ({dist.stub}); "
            "run aotpack under a Python it ships a stub for (3.8 to 3.13)"
        )
    return dist


def site_dirs() -> list[str]:
    """This interpreter's site folders, for the backend stub's interpreter to add."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


def server_env(dist: TritonDist) -> dict[str, str]:
    """tritonserver's environment: this Python's libpython first (the stub links libpython3.X and
    must get the one whose standard library it will read, not another install's), then the wheel's
    libraries; this interpreter's folder first on PATH (the stub's embedded Python takes the first
    ``python3`` on PATH as its executable, and with it its prefix, venv and site-packages: numpy is
    imported from there before ``model.py`` runs); for the model, this interpreter's site folders
    and PYTHONPATH folders (the stub's Python runs isolated and ignores PYTHONPATH)."""
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    paths = [p for p in (libdir, str(dist.libs), env.get("LD_LIBRARY_PATH", "")) if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(paths)
    bindir = os.path.dirname(sys.executable)
    if os.path.isfile(os.path.join(bindir, "python3")):
        env["PATH"] = os.pathsep.join(p for p in (bindir, env.get("PATH", "")) if p)
    given = [env.get("PYTHONPATH", ""), env.get(ENV_SITE_DIRS, "")]
    folders = site_dirs() + [os.path.abspath(d) for v in given for d in v.split(os.pathsep) if d]
    env[ENV_SITE_DIRS] = os.pathsep.join(dict.fromkeys(folders))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def check_name(name: str) -> str:
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        raise EnvError(f"model name {printable(name)[:60]!r} must be letters, digits, '-', '_' or '.'")
    return name


def write_model(
    repo: Path, spec: ServingSpec, bundle_param: str, device: str, max_queue_delay_us: int
) -> Path:
    """REPO/NAME/config.pbtxt and REPO/NAME/1/model.py; returns the model's folder."""
    folder = repo / check_name(spec.name)
    (folder / MODEL_VERSION).mkdir(parents=True, exist_ok=True)
    config = render_config(spec, {"bundle": bundle_param}, device, max_queue_delay_us)
    (folder / "config.pbtxt").write_text(config)
    (folder / MODEL_VERSION / "model.py").write_text(MODEL_PY)
    return folder


REPO_README = """# Triton model repository for the aotpack bundle `{name}`

`{name}/config.pbtxt` was rendered from the bundle's guard manifest: inputs and outputs with their
dtypes and shapes (-1: a dynamic size), `max_batch_size` {max_batch} from the batch dim
{batch_note}. `{name}/1/model.py` serves `{name}/1/{bundle}` through Triton's Python backend;
a request outside the bundle's guards gets the GuardError text as INVALID_ARG (HTTP 400, gRPC
INVALID_ARGUMENT).

With the tritonserver of aotpack's `serve` extra (the nvidia-pytriton wheel), from the
environment aotpack is installed in (activated, so that its `python3` is first on PATH):

    $(python -c 'import pytriton, os; print(os.path.dirname(pytriton.__file__))')/tritonserver/bin/tritonserver \\
        --model-repository=$PWD

No backend folder or `LD_LIBRARY_PATH` is needed:
{backend_note}

Any other tritonserver (an NGC container's) runs it with `tritonserver --model-repository=$PWD` and
its own Python backend, once aotpack is installed for the container's Python (below).

## How the backend's interpreter finds aotpack and torch

Triton's Python backend runs `model.py` in its stub, `triton_python_backend_stub`, which embeds
the Python it was built for (the NGC containers' stub: the container's Python; nvidia-pytriton's
wheel has one per version under `pytriton/tritonserver/python_backend_stubs/3.X/`). The embedded
Python runs isolated: it ignores `PYTHONPATH`, takes the first `python3` on tritonserver's `PATH`
as its executable and reads that one's standard library and site-packages (its virtualenv's, if it
is in one); the stub imports numpy from there before `model.py` runs. aotpack, torch and numpy<2
(nvidia-pytriton's stubs read tensors wrongly under numpy 2; the model then refuses to load) must
be installed for that same Python version; then either

- put the `bin` folder of that environment first on tritonserver's `PATH`:
  `PATH=/path/to/venv/bin:$PATH tritonserver ...`;
- and/or set `AOTPACK_SITE_DIRS` to further site folders (several: separated by `:`); `model.py`
  adds each after the environment's own with `site.addsitedir`, so editable installs (`.pth`
  files) work too:
  `AOTPACK_SITE_DIRS=$(python -c 'import site; print(site.getsitepackages()[0])') tritonserver ...`;
- or pack the environment with `conda-pack` and name the archive in `config.pbtxt`:
  `parameters {{ key: "EXECUTION_ENV_PATH" value: {{ string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" }} }}`.

The stub links `libpython3.X.so.1.0`: when several Pythons of that version are installed, put the
directory of the one aotpack is installed for first in `LD_LIBRARY_PATH`, or its standard library
and the stub's interpreter will not match. On a GPU node, render the repository with
`--device cuda` (instances of kind KIND_GPU, one per GPU Triton gives them).
"""


def write_repository(
    bundle: str | os.PathLike,
    out: str | os.PathLike,
    name: str | None = None,
    device: str = "cpu",
    max_queue_delay_us: int = DEFAULT_MAX_QUEUE_DELAY_US,
    force: bool = False,
    io_dtype: str = "",
) -> Path:
    """A Triton model repository at ``out`` serving ``bundle``: OUT/NAME/config.pbtxt,
    OUT/NAME/1/model.py, the bundle copied beside it (and its split weights file, if any), and a
    README on how the backend finds aotpack. Returns the model's folder."""
    from aot.loader import open_bundle

    src = Path(bundle)
    opened = open_bundle(src)
    try:
        spec = serving_spec(opened.manifest, opened.program(), name, io_dtype)
        weights = opened.external_path() if opened.manifest.external_weights else None
    finally:
        opened.close()
    repo = Path(out)
    folder = repo / check_name(spec.name)
    if folder.exists() and any(folder.iterdir()) and not force:
        raise EnvError(f"{folder} already exists and is not empty; remove it or pass --force")
    if folder.exists():
        shutil.rmtree(folder)
    target = f"{MODEL_VERSION}/{spec.name}.tpk"
    write_model(repo, spec, target, device, max_queue_delay_us)
    shutil.copyfile(src, folder / target)
    if weights is not None:  # split weights: found beside the bundle by their own name
        shutil.copyfile(weights, folder / MODEL_VERSION / weights.name)
    batch_note = (
        f"`{spec.batch_symbol}`, dynamic batching with preferred sizes {list(spec.preferred_batch_sizes)}"
        if spec.max_batch_size
        else f"(none, requests run one by one; {spec.batching})"
    )
    backend_note = _link_backend(folder)
    (repo / "README.md").write_text(
        REPO_README.format(
            name=spec.name,
            max_batch=spec.max_batch_size,
            batch_note=batch_note,
            bundle=f"{spec.name}.tpk",
            backend_note=backend_note,
        )
    )
    return folder


def _link_backend(folder: Path) -> str:
    """Make the model folder carry its own Python backend (tritonserver looks for a model's
    backend in its folder before the backend directory): links to the wheel's
    ``libtriton_python.so``, ``triton_python_backend_utils.py`` and the stub for this Python (links,
    so that their RPATHs still find the wheel's libraries), and ``model.py`` beside them, where
    the backend found there imports it from. Elsewhere the links dangle and tritonserver uses
    its own backend. Returns the README's sentence about it."""
    try:
        dist = find_tritonserver()
    except EnvError:
        return (
            "nvidia-pytriton was not installed when this repository was written, so it does not "
            "carry the backend; write it again after `pip install 'aotpack[serve]'`."
        )
    links = {
        "libtriton_python.so": dist.backend / "libtriton_python.so",
        "triton_python_backend_utils.py": dist.backend / "triton_python_backend_utils.py",
        "triton_python_backend_stub": dist.stub,
    }
    for name, target in links.items():
        (folder / name).symlink_to(Path(target).resolve())
    shutil.copyfile(folder / MODEL_VERSION / "model.py", folder / "model.py")
    return (
        f"`{folder.name}/` links the wheel's Python backend and its stub for Python "
        f"{sys.version_info.major}.{sys.version_info.minor}, which tritonserver finds in the model's folder."
    )


def request_check(bundle: str | os.PathLike, io_dtype: str = "") -> RequestCheck:
    """The bundle's contract on declared shapes (and wire dtypes, under ``io_dtype``)."""
    from aot.loader import open_bundle

    opened = open_bundle(bundle)
    try:
        guards = opened.manifest.guards
        wire = {i.name: wire_dtype(i.dtype, io_dtype) for i in guards.inputs}
        return RequestCheck(guards, wire)
    finally:
        opened.close()


# the ports TritonServer takes, and the line tritonserver logs when one is not free
PORTS = {"http_port": "HTTP", "grpc_port": "GRPC", "metrics_port": "Metrics"}
SERVICE_NOT_STARTED = {p: f"failed to start {what} service" for p, what in PORTS.items()}
PORT_ATTEMPTS = 3


def free_port() -> int:
    """A port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stub_processes(pid: int) -> list[int]:
    """The Python-backend stubs that tritonserver ``pid`` runs (its descendants of that name)."""
    parents, stubs = {}, []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parents[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"triton_python_backend_stub" in f.read(4096):
                    stubs.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    found = []
    for stub in stubs:
        ancestor, hops = parents.get(stub, 0), 0
        while ancestor > 1 and ancestor != pid and hops < 64:
            ancestor, hops = parents.get(ancestor, 0), hops + 1
        if ancestor == pid:
            found.append(stub)
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def watch_stubs(
    server: TritonServer, stubs: list[int], stopping: threading.Event, dead: threading.Event, why: list[str]
) -> None:
    """Until the server stops: when a stub dies (a request crashed it, or it was killed), the model
    is gone for good while tritonserver still says ready, so mark it dead (the front's readiness
    answers 503) and kill the server, so that ``serve`` exits non-zero and is restarted."""
    process = server.process
    if process is None or not os.path.isdir("/proc"):
        return
    while not stopping.wait(STUB_POLL_S) and process.poll() is None:
        stubs = stubs or stub_processes(process.pid)
        gone = [pid for pid in stubs if not _running(pid)]
        if gone and not stopping.is_set():
            why.append(f"pid {gone[0]} exited")
            dead.set()
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)  # its own session: the stubs go with it
            return


def _check_port(address: str, port: int, what: str) -> None:
    """``EnvError`` unless ``port`` is free on ``address``; 0 (any free port) always passes."""
    if not 0 <= port < 65536:
        raise EnvError(f"{what} port must be between 0 (any free port) and 65535, got {port}")
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError as e:
            raise EnvError(
                f"{what} port {port} on {address} is not free ({e.strerror}); pick another"
            ) from None


# tritonserver's error lines that are noise on a CPU-only host
_NOISE = ("CudaDriverHelper", "pinned memory", "CUDA driver")


def drained(log: list[str]) -> bool:
    """Whether a tritonserver that exited non-zero after SIGTERM had finished every inference: it
    also waits for idle keep-alive connections, and exits 1 when they outlast the drain timeout."""
    return any("Found 0 model versions that have in-flight inferences" in line for line in log[-20:])


def load_error(log: list[str], name: str) -> str:
    """The one line of tritonserver's log that says why the model did not load or the server
    stopped, without the Python traceback the backend appends."""
    keys = (f"failed to load '{name}'", "failed to load", "failed to start", "error: creating server")
    errors = [line for line in log if line[:1] == "E" and line[1:5].isdigit()]
    candidates = [line for key in keys for line in log if key in line]
    candidates += [line for line in errors if not any(n in line for n in _NOISE)]
    if not candidates:
        return log[-1].strip() if log else "no output"
    text = candidates[0].strip()
    if text[:1] in "EIW" and "] " in text:
        text = text.split("] ", 1)[1]
    text = text.strip('"').split("\\n", 1)[0]  # the log escapes the traceback's newlines
    return text.strip()


def _stop_with_parent() -> None:
    """In the child, before exec: SIGTERM when the thread that started it dies (Linux's
    PR_SET_PDEATHSIG), so a killed ``aotpack serve`` leaves no tritonserver behind."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class TritonServer:
    """A running tritonserver on one model repository. ``start`` returns once the model is ready;
    ``stop`` sends SIGTERM and waits for the drain; ``wait`` blocks until it exits."""

    def __init__(
        self,
        repo: Path,
        name: str,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        address: str = "127.0.0.1",
        drain_timeout: int = 30,
        echo: Callable[[str], None] | None = None,
        http_address: str | None = None,
        public_http_port: int | None = None,
        public_metrics_port: int | None = None,
    ):
        """``http_address``: where tritonserver's own HTTP and metrics endpoints listen [default:
        ``address``]; ``public_*_port``: the ports clients use, when fronts relay to ``http_port``
        and ``metrics_port``. A port of 0 is picked at ``start``, and picked again when another
        process took it before tritonserver could listen on it."""
        self.repo, self.name = Path(repo), name
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self._picked = [p for p in PORTS if getattr(self, p) == 0]
        self.address, self.drain_timeout, self.echo = address, drain_timeout, echo
        self.http_address = http_address or address
        self._public = (public_http_port, public_metrics_port)
        self.log: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self.stopping = False  # set on SIGTERM: once drained, the server is killed (see _read)
        self.process: subprocess.Popen | None = None
        self._backends: tempfile.TemporaryDirectory | None = None
        self._reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Where clients reach the HTTP endpoint."""
        host = "127.0.0.1" if self.address == "0.0.0.0" else self.address
        return f"http://{host}:{self.public_http_port}"

    @property
    def public_http_port(self) -> int:
        return self._public[0] or self.http_port

    @property
    def public_metrics_port(self) -> int:
        return self._public[1] or self.metrics_port

    @property
    def own_url(self) -> str:
        """tritonserver's own HTTP endpoint."""
        host = "127.0.0.1" if self.http_address == "0.0.0.0" else self.http_address
        return f"http://{host}:{self.http_port}"

    def _backend_directory(self, dist: TritonDist) -> Path:
        self._backends = tempfile.TemporaryDirectory(prefix="aotpack-triton-")
        python = Path(self._backends.name) / "python"
        python.mkdir()
        for f in dist.backend.iterdir():
            if f.is_file():
                shutil.copy2(f, python / f.name)
        shutil.copy2(dist.stub, python / "triton_python_backend_stub")
        return Path(self._backends.name)

    def command(self, dist: TritonDist, backends: Path) -> list[str]:
        return [
            str(dist.server),
            f"--model-repository={self.repo}",
            f"--backend-directory={backends}",
            f"--http-address={self.http_address}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.address}",
            f"--grpc-port={self.grpc_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            f"--metrics-address={self.http_address}",
            f"--metrics-port={self.metrics_port}",
            "--strict-readiness=true",
            "--exit-on-error=true",
            "--disable-auto-complete-config",
            f"--exit-timeout-secs={int(self.drain_timeout)}",
            "--log-verbose=0",
        ]

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.log.append(line)
            if self.echo is not None:
                self.echo(line)
            if self.stopping and UNLOADING in line:
                # drained: what is left is unloading the model (seconds for the stub's interpreter
                # to tear torch down, then tritonserver's one-second polls), which holds nothing;
                # the grace lets the last responses leave the frontends
                threading.Timer(STOP_GRACE_S, self._kill).start()

    def _kill(self) -> None:
        with contextlib.suppress(OSError):
            if self.process is not None and self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.own_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        dist = find_tritonserver()
        _check_port(self.http_address, self.http_port, "HTTP")
        _check_port(self.http_address, self.metrics_port, "metrics")
        _check_port(self.address, self.grpc_port, "gRPC")
        for attempt in range(1, PORT_ATTEMPTS + 1):
            for port in self._picked:
                setattr(self, port, free_port())
            try:
                self._start(dist, timeout)
                return
            except EnvError as e:
                # a port picked here was free, then another process listened on it first (a busy
                # host): pick again; a port the caller named is the caller's to change
                taken = any(SERVICE_NOT_STARTED[p] in line for p in self._picked for line in self.log)
                if not taken or attempt == PORT_ATTEMPTS:
                    raise e from None
                self.log.clear()

    def _start(self, dist: TritonDist, timeout: float) -> None:
        backends = self._backend_directory(dist)
        self.process = subprocess.Popen(
            self.command(dist, backends),
            env=server_env(dist),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches us, and we drain the server ourselves
            preexec_fn=_stop_with_parent,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.process.poll() is not None:
                self._reader.join(timeout=5)
                self.close()
                raise EnvError(
                    f"tritonserver stopped before model {self.name!r} was ready: "
                    f"{printable(load_error(list(self.log), self.name))}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise EnvError(
                    f"model {self.name!r} was not ready after {timeout:.0f} s; see tritonserver's log"
                )
            time.sleep(POLL_S)

    def stop(self) -> int:
        """SIGTERM: tritonserver refuses new requests, finishes those in flight, unloads and exits.
        Returns its exit status."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=self.drain_timeout + 30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.close()
        return code

    def wait(self) -> int:
        assert self.process is not None
        code = self.process.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self.close()
        return code

    def close(self) -> None:
        if self._backends is not None:
            self._backends.cleanup()
            self._backends = None


def _front(
    address: str,
    port: int,
    what: str,
    model: str,
    check: RequestCheck | None,
    alive: Callable[[], bool],
    refused: Refused,
) -> Front:
    """A front listening on ``port`` (0: any free port), its upstream not yet known."""
    try:
        return Front(address, port, 0, model, check, alive, refused)
    except OSError as e:
        raise EnvError(f"{what} port {port} on {address} is not free ({e.strerror}); pick another") from None


def serve(
    bundle: str | os.PathLike,
    name: str | None = None,
    device: str = "cpu",
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    address: str = "127.0.0.1",
    max_queue_delay_us: int = DEFAULT_MAX_QUEUE_DELAY_US,
    drain_timeout: int = 30,
    on_ready: Callable[[TritonServer, ServingSpec], None] | None = None,
    echo: Callable[[str], None] | None = None,
    io_dtype: str = "",
) -> int:
    """Serve ``bundle`` on tritonserver until SIGTERM or SIGINT; returns 0 after a clean drain.
    ``EnvError`` when the server cannot start or the model cannot load (the log's reason, one line).
    ``io_dtype`` "float32": half-precision inputs and outputs are float32 on the wire. A port of
    0 is any free port; ``on_ready`` sees the ports in use (``server.public_http_port``, ...)."""
    if device not in ("cpu", "cuda"):
        raise EnvError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise EnvError("--device cuda requested but torch sees no CUDA GPU; serve with --device cpu")
    spec = open_spec(bundle, name, io_dtype)
    check = request_check(bundle, io_dtype)
    _check_port(address, http_port, "HTTP")  # the gRPC port: TritonServer.start checks it
    _check_port(address, metrics_port, "metrics")
    stopping, dead, why = threading.Event(), threading.Event(), []
    refused, alive = Refused(), lambda: not dead.is_set()
    # the public ports are held from here on, so that nothing takes them while the model loads;
    # each front relays to tritonserver's own port once it is known
    fronts = [_front(address, http_port, "HTTP", spec.name, check, alive, refused)]
    try:
        fronts.append(_front(address, metrics_port, "metrics", spec.name, None, alive, refused))
    except EnvError:
        fronts[0].server_close()
        raise
    served: list[Front] = []
    with tempfile.TemporaryDirectory(prefix="aotpack-repo-") as tmp:
        repo = Path(tmp)
        write_model(repo, spec, str(Path(bundle).resolve()), device, max_queue_delay_us)
        server = TritonServer(
            repo,
            spec.name,
            0,  # tritonserver's own HTTP and metrics ports, behind the fronts: any free ones
            grpc_port,
            0,
            address,
            drain_timeout,
            echo,
            http_address="127.0.0.1",  # behind the fronts (aot.serve.front)
            public_http_port=fronts[0].server_address[1],
            public_metrics_port=fronts[1].server_address[1],
        )

        def on_signal(signum: int, frame: object) -> None:
            stopping.set()
            server.stopping = True
            if server.process is not None and server.process.poll() is None:
                server.process.send_signal(signal.SIGTERM)

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            try:
                server.start()
            except EnvError:
                if stopping.is_set():  # stopped while loading: nothing was served, nothing lost
                    return 0
                raise
            if stopping.is_set():  # the signal came before the server's process existed
                server.process.send_signal(signal.SIGTERM)
            else:
                fronts[0].upstream, fronts[1].upstream = server.http_port, server.metrics_port
                for front in fronts:
                    front.serve_in_thread()
                    served.append(front)
                stubs = stub_processes(server.process.pid)  # before the banner: a stub killed later is seen
                threading.Thread(
                    target=watch_stubs,
                    args=(server, stubs, stopping, dead, why),
                    name="aotpack-stub-watch",
                    daemon=True,
                ).start()
                if on_ready is not None:
                    on_ready(server, spec)
            code = server.wait()
        finally:
            for front in served:
                front.shutdown()
            for front in fronts:
                front.server_close()
            for s, handler in previous.items():
                signal.signal(s, handler)
            if server.process is not None and server.process.poll() is None:
                server.stop()
    if dead.is_set():
        raise EnvError(
            f"the backend process of model {spec.name!r} died ({why[0]}); the server stopped, so "
            "that an orchestrator restarts it (readiness answered 503 meanwhile)"
        )
    if stopping.is_set():
        if code == 0 or drained(list(server.log)):
            return 0
        raise EnvError(
            f"tritonserver exited with status {code} while draining, with requests still in flight after "
            f"the {drain_timeout} s drain timeout: {printable(load_error(list(server.log), spec.name))}"
        )
    raise EnvError(
        f"tritonserver exited with status {code}: {printable(load_error(list(server.log), spec.name))}"
    )
