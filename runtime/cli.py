"""``aotpack-rt``: load a bundle on the CUDA driver alone, run it, time it.

    aotpack-rt load BUNDLE [--sizes batch=1,seq=128 | --inputs IN.safetensors] [--save-outputs OUT.safetensors]
                           [--iters N] [--json] [--trust KEY.pub]...
    aotpack-rt check BUNDLE [--trust KEY.pub]...      # every check that needs no GPU
    aotpack-rt generate BUNDLE --prompt-ids 1,2,3 --max-new-tokens N [--eos ID] [--json]

Inputs are zeros of the guarded dtypes at ``--sizes`` (each symbol's smallest bucket, else its
smallest admitted size, where not given), or the tensors of a safetensors file named by the
bundle's inputs (``--inputs``, read without numpy); ``--save-outputs`` writes the first call's
outputs as safetensors (``output_0``, ...), as ``aotpack load`` does. Errors print one line
starting ``error:`` and exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from aot.errors import AotError, GuardError

STARTED = time.perf_counter()


def _sizes(text: str) -> dict[str, int]:
    out = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if not value.strip().isdigit():
            raise AotError(
                f"--sizes {text!r}: expected name=int pairs separated by commas, e.g. batch=1,seq=128"
            )
        out[name.strip()] = int(value)
    return out


def _inputs(runner, sizes: dict[str, int]) -> dict:
    """Zeros of each input's dtype and shape at ``sizes``, made on the device: numpy is not
    imported for them (~0.1 s of the start)."""
    from aot.admissible import first_admissible

    entry = runner.checked.entries[0]
    buckets = {b.symbol: b.sizes for b in entry.buckets}
    for name, g in entry.guards.symbols.items():
        if name not in sizes:
            sizes[name] = (
                buckets[name][0] if buckets.get(name) else first_admissible(g.min, g.modulus, g.residues)
            )
    return {
        name: runner.zeros(dtype, [d if type(d) is int else sizes[d] for d in dims])
        for name, _, dtype, dims in entry.guards.inputs
    }


def _save_outputs(out, path: str) -> list[str]:
    """The call's outputs (``output_0``, ... in the model's order) as a safetensors file, written
    without numpy; their names."""
    import struct

    from aot.dtypes import SAFETENSORS_CODE

    arrays = out if isinstance(out, (tuple, list)) else [out]
    header, blobs, at = {}, [], 0
    for i, a in enumerate(arrays):
        data = a.tobytes()
        header[f"output_{i}"] = {
            "dtype": SAFETENSORS_CODE[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [at, at + len(data)],
        }
        blobs.append(data)
        at += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for data in blobs:
            f.write(data)
    return list(header)


def _ids(text: str, what: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.lstrip("-").isdigit() for p in parts):
        raise AotError(f"{what} {text!r}: expected token ids separated by commas, e.g. 1,2,3")
    return [int(p) for p in parts]


def _generate(args) -> dict:
    from aot.runtime import load

    prompt = _ids(args.prompt_ids, "--prompt-ids")
    eos = _ids(args.eos, "--eos") if args.eos else None
    if args.max_new_tokens < 1:
        raise AotError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.steps_per_launch is not None and args.steps_per_launch < 1:
        raise AotError(f"--steps-per-launch must be at least 1, got {args.steps_per_launch}")
    t0 = time.perf_counter()
    runner = load(args.bundle, args.trust or None, device=args.device)
    loaded = time.perf_counter()
    tokens = runner.generate(
        prompt, args.max_new_tokens, eos_token_id=eos, steps_per_launch=args.steps_per_launch
    )
    done = time.perf_counter()
    return {
        "bundle": args.bundle,
        "prompt_ids": prompt,
        "tokens": tokens,
        "import_s": round(t0 - STARTED, 4),
        "load_s": round(loaded - t0, 4),
        "generate_s": round(done - loaded, 4),
    }


def _load(args) -> dict:
    from aot.runtime import check, load

    if args.command == "generate":
        return _generate(args)

    if args.command == "check":
        checked = check(args.bundle, args.trust or None)
        return {"bundle": args.bundle, "programs": [e.name for e in checked.entries], "library_free": True}
    t0 = time.perf_counter()
    runner = load(args.bundle, args.trust or None, device=args.device)
    loaded = time.perf_counter()
    free0, total = runner.gpu.memory()
    if args.inputs and args.sizes:
        raise GuardError("--inputs and --sizes both choose the inputs; give one")
    if args.inputs:
        inputs = runner.inputs_from(args.inputs, f"--inputs {args.inputs}")
    else:
        inputs = _inputs(runner, _sizes(args.sizes))
    out = runner.run((), inputs)
    first = out if not isinstance(out, (tuple, list)) else out[0]
    first.tobytes()  # on the host: the answer is there
    answered = time.perf_counter()
    saved = _save_outputs(out, args.save_outputs) if args.save_outputs else None
    times = []
    for _ in range(args.iters):
        t = time.perf_counter()
        runner.run((), inputs)
        runner.gpu.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    free, _ = runner.gpu.memory()
    return {
        "bundle": args.bundle,
        "device": runner.gpu.name,
        "driver": runner.gpu.driver_version,
        "arch": runner.arch,
        "sizes": {k: v for k, v in _sizes(args.sizes).items()} or "defaults",
        "import_s": round(t0 - STARTED, 4),
        "load_s": round(loaded - t0, 4),
        "first_result_s": round(answered - STARTED, 4),
        "median_ms": round(1e3 * times[len(times) // 2], 4) if times else None,
        "weights_mib": round(runner.weights_bytes / 2**20, 1),
        "arena_mib": round(runner.arena_bytes / 2**20, 1),
        "device_used_mib": round((total - free) / 2**20, 1),
        "device_used_before_first_call_mib": round((total - free0) / 2**20, 1),
        **({"inputs": args.inputs} if args.inputs else {}),
        **({"saved_outputs": {args.save_outputs: saved}} if saved else {}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aotpack-rt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("load", "check", "generate"):
        p = sub.add_parser(name)
        p.add_argument("bundle")
        p.add_argument("--trust", action="append", help="a trusted public key (repeatable)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "load":
            p.add_argument("--sizes", default="", help="symbol sizes, e.g. batch=1,seq=128")
            p.add_argument("--inputs", help="safetensors file with one tensor per input name")
            p.add_argument("--save-outputs", help="write the first call's outputs to this safetensors file")
            p.add_argument("--iters", type=int, default=0, help="timed calls after the first")
            p.add_argument("--device", type=int, default=0)
        if name == "generate":
            p.add_argument("--prompt-ids", required=True, help="the prompt's token ids, e.g. 1,2,3")
            p.add_argument("--max-new-tokens", type=int, required=True)
            p.add_argument("--eos", default="", help="end-of-sequence token id(s), e.g. 2 or 2,32000")
            p.add_argument(
                "--steps-per-launch",
                type=int,
                help="decode calls per block, the tokens read back once per block (default 8 where the "
                "bundle has its greedy kernel, else 1); 1: every call on its own",
            )
            p.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command != "check":
        from aot.runtime import start_driver

        start_driver(args.device)  # beside the runtime's imports and the bundle's checks
    try:
        report = _load(args)
    except AotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {args.bundle}: {e.strerror or e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        for k, v in report.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
