"""Mixture-of-experts kernels: a decode path that reads only the routed experts' weights."""
