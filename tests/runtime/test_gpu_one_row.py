"""On a GPU: a library-free bundle's one-row bucket runs the default table's GEMV forms under both
loaders, the runtime without torch and the torch loader, with the same plan at every bucket and
outputs equal bit for bit (the same cubins run), each within float16's tolerance of eager PyTorch;
the logits are computed after the runtime's graph, so its arena holds none of them. The CPU
tests pin the same plans and allocations (``test_one_row_forms.py``)."""

from __future__ import annotations

import pytest

from tests.runtime.test_gpu import assert_same_plan
from tests.runtime.test_one_row_forms import HERE, build_library_free, kernel_names

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return build_library_free(HERE / "lm_head.py", tmp_path_factory.mktemp("one_row_gpu") / "head.tpk")


@pytest.mark.parametrize("tail", [False, True])
def test_both_loaders_run_the_one_row_forms_and_agree_at_every_bucket(head, tail, monkeypatch):
    import torch

    import aot.runtime
    from aot.dtypes import TOLERANCE
    from aot.loader import load
    from aot.runtime import runner as rt_runner
    from aot.tracer import example_inputs, instantiate, load_model_file

    if tail:  # the head's logits after the graph, into the output's memory
        monkeypatch.setattr(rt_runner, "TAIL_MIN_BYTES", 1)
    rt = aot.runtime.load(head)
    ref = load(head, device="cuda")
    spec = load_model_file(HERE / "lm_head.py")
    module = instantiate(spec)
    tol = TOLERANCE["float16"]
    for batch in (1, 8, 5, 1):
        x = example_inputs(spec, {"batch": batch}, seed=batch)["x"]
        want = ref(x=x.cuda())
        got = torch.from_dlpack(rt(x=x.cuda()))
        assert torch.equal(got, want), batch
        assert_same_plan(rt, ref, {"batch": batch})
        with torch.no_grad():
            eager = module(x).float()
        torch.testing.assert_close(got.float().cpu(), eager, atol=tol.atol, rtol=tol.rtol)
    (entry,) = rt.checked.entries
    one_row = rt._prepared[("general", ("batch", 1))]
    assert len(kernel_names(entry.program, one_row.steps)) == 2  # the GEMVs, the LayerNorm in the head's
    offsets = rt._prepared[("general", ("batch", 8))].layout.offsets
    assert any(b.endswith("_padded") for b in offsets) is not tail  # the head's padded product
