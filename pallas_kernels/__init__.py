"""Pallas GPU attention kernels, each beside a plain-jnp reference and behind one function."""
