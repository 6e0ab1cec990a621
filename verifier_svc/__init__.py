"""The verifier: the target model, its paged KV cache and the one step loop."""
