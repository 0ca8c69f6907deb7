"""Build, on the build box, the library-free bundles that GPU tests take from
``$AOTPACK_GPU_BUNDLES`` where they are present: the unit models of
``tests/runtime/test_gpu_symbolic_maps.py`` (``symbolic-maps-CASE.tpk``) and zoo models
(``zoo-NAME-lf.tpk``, ``tests/runtime/test_gpu_zoo.py``), and real models at declared image
sizes (``lf-NAME.tpk``, ``tests/realmodels/test_image_sizes.py``'s library-free ones,
``tests/runtime/test_gpu_prebuilt.py``). That is the path users take (a bundle
built with this box's torch and transformers, served where older ones are installed), and it
keeps a model whose trace the serving box's versions refuse (torch 2.11's export guards a
ceil-mode pool's sizes; transformers 5.17's SEW tests a data-dependent length in its attention)
on the GPU test's path. The device session carries the folder (``carry: [".bundles"]``).

    python bench/gpu_test_bundles.py --out .bundles --zoo sew,deberta-v2 --image-sizes dinov2,detr
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".bundles")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--cases", default="", help="symbolic-map cases (default: every one)")
    ap.add_argument("--zoo", default="", help="zoo models, comma-separated")
    ap.add_argument("--image-sizes", default="", help="library-free image-size models, comma-separated")
    args = ap.parse_args()
    from aot.codegen import generate
    from aot.packager import pack
    from aot.tracer import load_model_file, trace
    from tests.runtime.test_gpu_symbolic_maps import CASES, bundle_name
    from tests.runtime.test_gpu_zoo import zoo_bundle_name

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = [c for c in args.cases.split(",") if c] or list(CASES)
    specs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in cases:
            path = Path(tmp) / f"{name}.py"
            path.write_text(CASES[name][0])
            specs.append((bundle_name(name), load_model_file(path)))
        if args.zoo:
            from tests.realmodels.zoo import ZOO

            specs += [(zoo_bundle_name(n), ZOO[n]()) for n in args.zoo.split(",") if n]
        if args.image_sizes:
            import tests.realmodels.test_image_sizes as images

            for n in args.image_sizes.split(","):
                library, made, _ = images.LIBRARY_FREE[n]
                images.require(library)
                specs.append((f"lf-{n}.tpk", eval(made, vars(images))))  # the test's own expression
        for file, spec in specs:
            start = time.perf_counter()
            compiled = generate(trace(spec), (args.arch,), gemm_candidates=True, library_free=True)
            pack(compiled, out / file)
            print(f"{out / file}: {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
