"""Emitters: everything `lmc build` writes from a plan (rendered files, shards, Neuron graphs, archive)."""
