"""The model runtime shared by the verifier and the model drafters: HF checkpoints, the paged KV
cache, attention backends (plan per batch, run per layer), batch building and sampling."""
