"""Training an EAGLE draft head on its own target: the data (:mod:`.data`, :mod:`.corpus`), the
target's reading of it (:mod:`.teacher`, kept on disk by :mod:`.cache`) and the training loop
(:mod:`.loop`). Knows nothing about serving or decoding beyond asking the engine for sequences;
the ``train-head`` command only parses its options and calls in here."""
