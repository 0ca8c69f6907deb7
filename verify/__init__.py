"""Verification: does a bundle compute what its model computes?

``interpret``: every kernel the codegen emitted, run on CPU in Triton's interpreter against its
reference ATen steps (CI runs this for every kernel). ``device``: ``aotpack verify`` on a GPU,
every kernel against its reference and every program against the CPU path at the bundle's buckets.
Both sit above the stages: they load bundles and model files, and no stage imports them.
"""
