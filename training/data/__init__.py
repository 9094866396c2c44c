"""The input pipeline: datasets keyed by sample, the elastic sampler, decoding and transforms,
the shared batch slots, and ImageNet preparation."""
