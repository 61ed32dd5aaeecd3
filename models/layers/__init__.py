"""The layer maths every architecture shares: the decoder skeleton and its config, attention and MLP layers, MoE
routing, Mamba-2, the compiled decode step and its plan, and the sharding of a model over ranks."""
