"""Model components: norms and linears (common), RoPE, attention, compressor, indexer, mHC (hyper), MoE."""
