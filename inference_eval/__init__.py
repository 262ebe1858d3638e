"""The inference engine (target model, KV cache, speculative decoding loops) and acceptance evaluation."""
