"""Serving across processes: the ranks of a tensor-parallel group, how they start, meet, split
the CPUs and stop together (fail-stop), and the vocabulary-parallel round across them."""
