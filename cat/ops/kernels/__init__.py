"""Circulant attention as one kernel each way (Triton): :mod:`.forward`, :mod:`.backward`, the DFT tiles they share
(:mod:`.tiles`), the operators that launch them (:mod:`.launch`) and their first-use check (:mod:`.check`). Nothing
here imports Triton until a kernel is launched or compiled: ``import cat`` works where Triton is not installed."""
