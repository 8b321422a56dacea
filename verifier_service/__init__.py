"""The verifier server: owns the target model and its paged KV cache, batches every draft stream's proposals
into one forward pass per step and decides every emitted token by rejection sampling."""
