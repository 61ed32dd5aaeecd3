"""Generation: options, the sampler, the per-sequence core and the runner's loops, speculative decoding, scoring,
and the answers the API returns."""
