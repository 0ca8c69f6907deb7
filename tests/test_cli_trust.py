"""Trust and damage through the command line, run in process (each case is one CLI call that stops
at its first check): every verb that reads a bundle takes ``--trust`` and honours ``$AOTPACK_TRUST``;
key files that would block are refused at once; a signature that fails without a trust list is a
warning line; a damaged bundle is one "corrupt or truncated" line; option values out of range are
usage errors. Each pins the exit code and the first line of stderr."""

from __future__ import annotations

import copy
import os
import threading

import pytest

from aot import schema
from aot.cli import main
from aot.packager.sign import sign_bundle
from aot.signing import fingerprint, read_public_key, write_key_pair
from tests.hostile_util import (
    crc_patched,
    manifest_bytes,
    manifest_of,
    read_entries,
    with_manifest_text,
    write_entries,
    zip_layout,
)

pytest.importorskip("cryptography")

CORRUPT = "the bundle is corrupt or truncated: rebuild or re-copy it"


@pytest.fixture(autouse=True)
def _no_server_trust(monkeypatch):
    """``--trust`` sets ``$AOTPACK_TRUST`` for the command's process: this one, here."""
    monkeypatch.setenv("AOTPACK_TRUST", "")


@pytest.fixture(scope="module")
def key(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "ours"
    write_key_pair(path)
    return path


@pytest.fixture
def unsigned(tmp_path, built):
    path = tmp_path / "b.tpk"
    path.write_bytes(built("branchy").read_bytes())
    return path


def cli(capsys, *args: str) -> tuple[int, list[str]]:
    """Exit code and stderr lines of ``aotpack ARGS``."""
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize(
    "verb, exit_code",
    [
        (["load", "{b}"], 1),
        (["generate", "{b}", "--prompt-ids", "1,2", "--max-new-tokens", "1"], 1),
        (["inspect", "{b}"], 1),
        (["guards", "{b}"], 1),
        (["diff", "{b}", "{b}"], 4),
        (["check", "model.py", "--against", "{b}"], 4),
        (["serve", "{b}"], 1),
        (["triton-repo", "{b}", "-o", "{tmp}/repo"], 1),
    ],
)
def test_every_verb_that_reads_a_bundle_refuses_an_unsigned_one_under_trust(
    capsys, monkeypatch, unsigned, key, tmp_path, verb, exit_code
):
    args = [a.format(b=unsigned, tmp=tmp_path) for a in verb]
    fp = fingerprint(read_public_key(f"{key}.pub"))
    refusal = (
        f"error: {unsigned}: the bundle is not signed, and this loader trusts only bundles signed by "
        f"{fp}; sign it with `aotpack sign {unsigned} --key KEY`"
    )
    assert cli(capsys, *args, "--trust", f"{key}.pub") == (exit_code, [refusal])
    monkeypatch.setenv("AOTPACK_TRUST", f"{key}.pub")
    assert cli(capsys, *args) == (exit_code, [refusal])
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("verb", ["tune", "verify"])
def test_the_gpu_verbs_take_trust_too(capsys, unsigned, key, tmp_path, verb):
    code, lines = cli(capsys, verb, str(unsigned), "--trust", str(tmp_path / "missing.pub"))
    assert (code, lines[0]) == (
        1,
        f"error: trusted key {tmp_path / 'missing.pub'}: cannot be read (No such file or directory); "
        f"make a key pair with `aotpack keygen`",
    )


def _refused_at_once(capsys, fifo, *args: str) -> tuple[int, list[str]]:
    """Run the CLI where a FIFO would block a plain open; the hang guard is far above need."""
    result: list = []
    worker = threading.Thread(target=lambda: result.append(cli(capsys, *args)), daemon=True)
    worker.start()
    worker.join(120)
    if worker.is_alive():  # unblock it: a writer lets the reader's open return
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail(f"aotpack {' '.join(args)} blocked on the FIFO {fifo}")
    return result[0]


def test_a_fifo_as_a_key_is_refused_at_once(capsys, monkeypatch, unsigned, key, tmp_path):
    fifo = tmp_path / "key.pub"
    os.mkfifo(fifo)
    refusal = (
        f"error: trusted key {fifo}: not a regular file (a FIFO, device or folder); give the key file itself"
    )
    assert _refused_at_once(capsys, fifo, "inspect", str(unsigned), "--trust", str(fifo)) == (1, [refusal])
    monkeypatch.setenv("AOTPACK_TRUST", str(fifo))
    assert _refused_at_once(capsys, fifo, "guards", str(unsigned)) == (1, [refusal])
    monkeypatch.setenv("AOTPACK_TRUST", "")
    assert _refused_at_once(capsys, fifo, "sign", str(unsigned), "--key", str(fifo)) == (
        1,
        [
            f"error: signing key {fifo}: not a regular file (a FIFO, device or folder); give the key file itself"
        ],
    )


def test_a_signature_that_fails_without_trust_is_a_warning(capsys, unsigned, key, tmp_path):
    sign_bundle(unsigned, key)
    entries = read_entries(unsigned.read_bytes())
    m = copy.deepcopy(manifest_of(entries))
    m["name"] = "renamed"
    changed = tmp_path / "changed.tpk"
    changed.write_bytes(write_entries(with_manifest_text(entries, manifest_bytes(m))))
    fp = fingerprint(read_public_key(f"{key}.pub"))
    warning = (
        f"warning: {changed}: its signature by {fp} does not match its manifest: the bundle was changed "
        f"after signing; loading it anyway (no trust list set: --trust / AOTPACK_TRUST)"
    )
    code, lines = cli(capsys, "load", str(changed), "--runs", "1", "--warmup", "0")
    assert (code, lines[0]) == (0, warning)
    assert lines.count(warning) == 1
    code, lines = cli(capsys, "inspect", str(changed))
    assert (code, lines) == (0, [warning])
    assert cli(capsys, "load", str(unsigned), "--runs", "1", "--warmup", "0")[1][0].startswith("loaded ")


def test_damaged_bundles_are_one_corrupt_or_truncated_line(capsys, unsigned, tmp_path):
    archive = unsigned.read_bytes()
    layout = {r.name: r for r in zip_layout(archive)}

    weights = layout[schema.WEIGHTS_PATH]
    data = archive[weights.data_start : weights.data_start + weights.compress_size]
    flipped = tmp_path / "flipped.tpk"
    flipped.write_bytes(crc_patched(archive, schema.WEIGHTS_PATH, data[:-1] + bytes([data[-1] ^ 1])))
    mismatch = f"error: {flipped}: checksum mismatch in 'weights.safetensors' (expected sha256 "
    for verb, exit_code in (
        (["inspect", str(flipped)], 1),
        (["guards", str(flipped)], 1),
        (["inspect", "--json", str(flipped)], 1),
        (["diff", str(unsigned), str(flipped)], 4),
    ):
        code, lines = cli(capsys, *verb)
        assert code == exit_code and len(lines) == 1, lines
        assert lines[0].startswith(mismatch) and lines[0].endswith(f"…): {CORRUPT}")

    truncated = tmp_path / "truncated.tpk"
    truncated.write_bytes(archive[: len(archive) // 2])
    line = f"error: {truncated}: no zip directory at its end: {CORRUPT}"
    assert cli(capsys, "inspect", str(truncated)) == (1, [line])
    assert cli(capsys, "guards", str(truncated)) == (1, [line])

    manifest = layout[schema.MANIFEST_PATH]
    damaged = bytearray(archive)
    middle = manifest.data_start + manifest.compress_size // 2
    damaged[middle : middle + 8] = bytes(b ^ 0xFF for b in damaged[middle : middle + 8])
    (tmp_path / "damaged.tpk").write_bytes(bytes(damaged))
    code, lines = cli(capsys, "inspect", str(tmp_path / "damaged.tpk"))
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith(f"error: {tmp_path / 'damaged.tpk'}: member 'manifest.json' cannot be read (")
    assert lines[0].endswith(f"): {CORRUPT}") and "zlib" not in lines[0] and "Error -3" not in lines[0]

    code, lines = cli(capsys, "inspect", "--verify", str(unsigned))
    assert (code, lines) == (0, [f"verified {unsigned}: every member's sha256, and it loads on the CPU"])


@pytest.mark.parametrize(
    "option, value, expected",
    [
        ("--eos-token-id", str(10**30), "0<=x<=9223372036854775807"),
        ("--pad-token-id", str(10**30), "0<=x<=9223372036854775807"),
        ("--seed", str(2**70), "0<=x<=18446744073709551615"),
        ("--temperature", "1e-45", "0.001<=x<=1000.0"),
    ],
)
def test_generate_option_values_out_of_range_are_usage_errors(capsys, tmp_path, option, value, expected):
    code, lines = cli(
        capsys,
        "generate",
        str(tmp_path / "lm.tpk"),
        "--prompt-ids",
        "1",
        "--max-new-tokens",
        "1",
        option,
        value,
    )
    assert (code, lines) == (
        2,
        [
            f"error: Invalid value for '{option}': {value} is not in the range {expected}. "
            f"(see `aotpack generate --help`)"
        ],
    )


def test_an_unusable_output_folder_is_an_error_line(capsys, tmp_path):
    model = tmp_path / "model.py"
    model.write_text("")
    missing = tmp_path / "missing" / "b.tpk"
    assert cli(capsys, "build", str(model), "-o", str(missing)) == (
        1,
        [f"error: cannot write {missing}: the folder {missing.parent} does not exist; create it first"],
    )
    (tmp_path / "file").write_text("")
    inside = tmp_path / "file" / "b.tpk"
    assert cli(capsys, "build", str(model), "-o", str(inside)) == (
        1,
        [f"error: cannot write {inside}: {inside.parent} is not a folder"],
    )
