"""On-device sampling inside the jitted step: the sampler and its stages."""
