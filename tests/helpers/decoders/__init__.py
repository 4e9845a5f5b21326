"""Independently styled single-device decoders used to test AutoSP's generality."""
