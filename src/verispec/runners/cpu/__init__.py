"""The batch-invariant CPU runner family: one runner (:mod:`.runner`, the KV cache and the
:class:`verispec.runners.Runner` capabilities) driving one decoder pass (:mod:`.decoder`) over a
model's row-local ops (:mod:`.decoder_ops`' protocol): the int8 runner's in torch (:mod:`.int8`,
weights in :mod:`.int8_weights`, matrix products in :mod:`.int8_ops`) and the GGUF runner's on the
compiled kernels (:mod:`.gguf_runner`, the files' own quantized blocks in :mod:`.gguf_blocks` and
:mod:`.gguf_weights`), with what they share: the reduced draft vocabulary, the weight cache, the
page release. Every row of a verify pass is bit-identical to a one-token pass. Knows nothing
about drafting or sampling; the C++ kernels are :mod:`verispec.runners.kernels`."""
