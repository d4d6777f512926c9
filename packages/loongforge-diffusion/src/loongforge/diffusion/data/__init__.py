"""Data: video/image decoding, the VAE and text encoders, latent shards, the built-in synthetic set."""
