"""``aotpack serve`` and ``aotpack triton-repo`` at the command line, without starting a server:
refusals are one line and a non-zero exit; the repository is complete; nothing of aot.serve is
imported until a serving verb runs."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from aot.errors import EnvError
from tests.conftest import HANG_GUARD_S
from tests.serve.test_config import parse
from tests.test_cli import _one_line_error, aotpack


def test_serve_refuses_a_missing_bundle(tmp_path):
    _one_line_error(aotpack("serve", str(tmp_path / "nope.tpk")), 1, "does not exist")


def test_serve_refuses_a_gpu_it_does_not_have(bundles):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    _one_line_error(
        aotpack("serve", str(bundles("branchy")), "--device", "cuda"), 1, "torch sees no CUDA GPU"
    )


def test_serve_refuses_a_port_in_use(bundles):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = aotpack("serve", str(bundles("branchy")), "--address", "127.0.0.1", "--http-port", str(port))
    _one_line_error(r, 1, f"HTTP port {port} on 127.0.0.1 is not free")


def test_serve_refuses_a_port_out_of_range(bundles):
    r = aotpack("serve", str(bundles("branchy")), "--metrics-port", "70000")
    _one_line_error(r, 1, "metrics port must be between 0 (any free port) and 65535, got 70000")


def _fake_start(monkeypatch, failures: list[str]) -> list[tuple[int, int, int]]:
    """TritonServer.start with tritonserver stood in: each launch logs the next of ``failures``
    and fails ("" succeeds); returns the ports each launch was given."""
    from aot.serve import triton

    launches = []

    def launch(self, dist, timeout):
        launches.append((self.http_port, self.grpc_port, self.metrics_port))
        line = failures[len(launches) - 1]
        if line:
            self.log.append(line)
            raise EnvError(f"tritonserver stopped before model {self.name!r} was ready: {line}")

    monkeypatch.setattr(triton, "find_tritonserver", lambda: None)
    monkeypatch.setattr(triton.TritonServer, "_start", launch)
    return launches


def test_a_picked_port_another_process_took_first_is_picked_again(monkeypatch, tmp_path):
    from aot.serve.triton import TritonServer

    taken = "E1129 failed to start HTTP service: Address already in use"
    launches = _fake_start(monkeypatch, [taken, taken, ""])
    server = TritonServer(tmp_path, "m", 0, 0, 0)
    server.start()
    assert len(launches) == 3 and all(0 not in ports for ports in launches)
    assert len({ports[0] for ports in launches}) > 1  # picked afresh: not the port that was taken
    assert (server.http_port, server.grpc_port, server.metrics_port) == launches[-1]
    assert server.public_http_port == server.http_port


def test_a_port_the_caller_named_is_not_picked_again(monkeypatch, tmp_path):
    from aot.serve.triton import TritonServer, free_port

    launches = _fake_start(monkeypatch, ["E1129 failed to start GRPC service: in use", ""])
    named = free_port()
    with pytest.raises(EnvError, match="failed to start GRPC service"):
        TritonServer(tmp_path, "m", 0, named, 0).start()
    assert len(launches) == 1 and launches[0][1] == named


def test_a_port_taken_on_every_pick_gives_up_with_tritonservers_reason(monkeypatch, tmp_path):
    from aot.serve.triton import PORT_ATTEMPTS, TritonServer

    launches = _fake_start(monkeypatch, ["E1129 failed to start Metrics service: in use"] * PORT_ATTEMPTS)
    with pytest.raises(EnvError, match="failed to start Metrics service"):
        TritonServer(tmp_path, "m", 0, 0, 0).start()
    assert len(launches) == PORT_ATTEMPTS


def test_serve_without_pytriton_says_what_to_install(monkeypatch):
    import importlib.util

    from aot.serve import triton

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pytriton" else real(name, *a)
    )
    with pytest.raises(EnvError, match=r"pip install 'aotpack\[serve\]'"):
        triton.find_tritonserver()


def test_triton_repo_writes_config_model_bundle_and_readme(tmp_path, bundles):
    out = tmp_path / "repo"
    r = aotpack("triton-repo", str(bundles("branchy")), "-o", str(out), "--max-queue-delay-us", "100")
    assert r.returncode == 0, r.stderr
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "README.md",
        "branchy/1/branchy.tpk",
        "branchy/1/model.py",
        "branchy/config.pbtxt",
        "branchy/libtriton_python.so",  # the wheel's Python backend, linked (see write_repository)
        "branchy/model.py",
        "branchy/triton_python_backend_stub",
        "branchy/triton_python_backend_utils.py",
    ]
    config = parse((out / "branchy/config.pbtxt").read_text())
    assert config.max_batch_size == 16 and config.dynamic_batching.max_queue_delay_microseconds == 100
    assert config.parameters["bundle"].string_value == "1/branchy.tpk"
    assert (out / "branchy/1/branchy.tpk").read_bytes() == bundles("branchy").read_bytes()
    model_py = (out / "branchy/1/model.py").read_text()
    compile(model_py, "model.py", "exec")
    assert (
        "AOTPACK_SITE_DIRS" in model_py and "from aot.serve.triton_model import TritonPythonModel" in model_py
    )
    readme = (out / "README.md").read_text()
    assert "AOTPACK_SITE_DIRS" in readme and "PYTHONPATH" in readme and "EXECUTION_ENV_PATH" in readme
    # a second run does not overwrite without --force
    _one_line_error(aotpack("triton-repo", str(bundles("branchy")), "-o", str(out)), 1, "already exists")
    again = aotpack("triton-repo", str(bundles("branchy")), "-o", str(out), "--force", "--name", "branchy")
    assert again.returncode == 0, again.stderr


def test_triton_repo_refuses_a_bad_name(tmp_path, bundles):
    r = aotpack("triton-repo", str(bundles("branchy")), "-o", str(tmp_path), "--name", "../up")
    _one_line_error(r, 1, "model name")


def test_serving_is_imported_only_by_the_serving_verbs():
    code = (
        "import sys, aot.loader, aot.cli\n"
        "from aot.cli.commands import cli\n"
        "assert {'serve', 'triton-repo'} <= set(cli.commands)\n"
        "bad = [m for m in sys.modules if m.startswith(('aot.serve', 'tritonclient', 'pytriton', 'ray'))]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert r.returncode == 0, r.stderr


def test_triton_repo_copies_split_weights(tmp_path):
    import torch

    import aot.loader
    from aot.codegen import generate
    from aot.packager import pack
    from aot.serve.triton import write_repository
    from aot.tracer import load_model_file, trace
    from tests.conftest import model_path

    bundle = tmp_path / "split.tpk"
    pack(
        generate(trace(load_model_file(model_path("branchy"))), ("sm_80",), fuse=False),
        bundle,
        split_weights=True,
    )
    folder = write_repository(bundle, tmp_path / "repo")
    weights = [p.name for p in (folder / "1").iterdir() if p.suffix == ".safetensors"]
    assert len(weights) == 1 and (tmp_path / weights[0]).is_file()
    copied = aot.loader.load(folder / "1" / "branchy.tpk")
    x = torch.randn(2, 12, 16)
    torch.testing.assert_close(copied(x), aot.loader.load(bundle)(x), atol=0, rtol=0)
