"""The runtime: checkpoint loading, the decoder, the MoE layer, the expert cache with its
slow tiers and transfers, generation and perplexity."""
