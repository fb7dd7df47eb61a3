"""The batch-invariant CPU runner family: the int8 runner (:mod:`.int8`, weights in
:mod:`.int8_weights`, operators in :mod:`.int8_ops`) and the GGUF runner built on it
(:mod:`.gguf_runner`, the files' own quantized blocks in :mod:`.gguf_blocks` and
:mod:`.gguf_weights`), with what they share: the reduced draft vocabulary, the weight cache, the
page release. Every row of a verify pass is bit-identical to a one-token pass. Knows nothing
about drafting or sampling; the C++ kernels are :mod:`verispec.runners.kernels`."""
