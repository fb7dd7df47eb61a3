"""EAGLE-3 draft heads: the head itself (:mod:`.head`, its blocks in :mod:`.blocks`, its shape
in :mod:`.shape`, several sequences in one pass in :mod:`.passes`), its file format (:mod:`.file`),
the Hugging Face checkpoint it exports to (:mod:`.hf`), the published checkpoints it reads
(:mod:`.published`) and how it reads the target (:mod:`.target`). Knows nothing about the engine's
loop: the EAGLE drafter (:mod:`verispec.proposers.eagle`) drives it."""
