"""Stateless tensor functions shared by megalm.models and megalm.parallel: masked means and the fused
cross-entropy, attention's unfused kernel and dropout from a given draw, the embedding lookup, the
auxiliary losses' gradient of a mixture's routers. Process groups come in as arguments."""
