"""The math the codecs apply, pure numpy and no I/O: deltas, half-precision rounding, top-k
sparsification, QSGD, PowerSGD's low rank and sparse random projections (also used by
:mod:`gradpipe.training` and the codec evaluation)."""
