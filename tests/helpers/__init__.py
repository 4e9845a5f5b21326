"""Helpers shared by the tests: process launch (:mod:`.dist`), AutoSP parity cases
(:mod:`.autosp_cases`), independently written decoders (:mod:`.decoders`), data fixtures
(:mod:`.data`)."""
