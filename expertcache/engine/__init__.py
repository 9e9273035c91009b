"""The runtime: checkpoint loading, the decoder, the MoE layer, the expert cache with its
slow tiers and transfers, generation and perplexity."""

from ..address_space import check_address_space

check_address_space()  # before numba's first import, where OpenBLAS spun for ever under a small ulimit -v
