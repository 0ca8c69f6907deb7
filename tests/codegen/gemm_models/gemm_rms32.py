"""``gemm_rms.py`` (RMSNorm prologues, stacked gate/up with SiLU·mul, K = 600) in float32."""

from gemm_rms import make_spec

spec = make_spec("float32")
